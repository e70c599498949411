"""Learner settings (``RSTAR_LEARNER_<FIELD>`` env vars, a ``learner:`` YAML section, or flat
keys; common fields from ``RSTAR_*``, see :mod:`shared.settings`)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from services.learner.logprobs import DEFAULT_CHUNK_TOKENS
from services.learner.loss import DEFAULT_CLIP_EPS_HIGH, DEFAULT_CLIP_EPS_LOW, DEFAULT_IS_CAP, LossConfig
from services.learner.trainer import TrainerConfig
from shared.settings import ServiceSettings, service_config


class Settings(ServiceSettings):
    model_config = service_config("LEARNER")
    service_name: ClassVar[str] = "learner"

    model_dir: Path | None = Field(
        None, description="initial HF model directory (config.json, tokenizer, safetensors): version 0 of the policy"
    )
    checkpoint_dir: Path | None = Field(
        None, description="where checkpoints are written (default <state_dir>/learner/checkpoints)"
    )
    run_id: str = Field("", description="the run this learner trains ('' = adopt the run of the first scored group)")
    groups_per_step: int = Field(8, ge=1, description="B: scored groups per training step (one new policy version each)")
    max_staleness: int = Field(
        2, ge=0, description="η: a group whose oldest token is older than current version − η is dropped"
    )
    lr: float = Field(1e-6, gt=0, description="AdamW peak learning rate")
    warmup_steps: int = Field(20, ge=0, description="linear warm-up steps (restarted on an optimizer reset)")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW ε (the denominator's floor: a larger ε damps the full-size "
                            "steps a fresh optimizer takes on parameters whose gradients are tiny)")
    clip_eps_low: float = Field(DEFAULT_CLIP_EPS_LOW, ge=0, lt=1, description="PPO clip ε_low (ratio ≥ 1 − ε_low)")
    clip_eps_high: float = Field(DEFAULT_CLIP_EPS_HIGH, ge=0, description="PPO clip ε_high (clip-higher: ratio ≤ 1 + ε_high)")
    objective: Literal["decoupled", "tis"] = Field(
        "decoupled", description="off-policy correction: decoupled PPO (proximal policy) or plain truncated IS"
    )
    is_cap: float = Field(DEFAULT_IS_CAP, gt=0, description="truncation of the behaviour importance weight")
    negative_advantage_scale: float = Field(
        1.0, ge=0, le=1, description="multiplies negative advantages in the loss (1: the paper's GRPO; < 1 damps the "
        "push-down of failed samples, see services/learner/loss.py)"
    )
    updates_per_step: int = Field(1, ge=1, description="optimizer updates (mini-batches) per step")
    sampling_temperature: float = Field(1.0, gt=0, description="the rollouts' sampling temperature: the learner divides "
                                        "the logits by it, so its log-probs are the sampling policy's (the rollout "
                                        "returns vLLM's processed, temperature-scaled log-probs)")
    micro_batch_tokens: int = Field(8192, ge=1, description="token budget of one micro-batch (gradient accumulation)")
    row_tokens: int = Field(0, ge=0, description="pack into rows of this many tokens (0: as long as the step's longest sequence)")
    logits_chunk_tokens: int = Field(DEFAULT_CHUNK_TOKENS, ge=1, description="tokens per chunk of output-layer logits")
    grad_clip: float = Field(1.0, gt=0, description="max global gradient norm")
    gradient_checkpointing: bool = Field(False, description="recompute activations in the backward (long sequences)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: the GPU (CUDA or ROCm) if any, else CPU")
    torch_threads: int = Field(0, ge=0, description="torch intra-op threads on CPU (0: torch's default)")
    keep_last: int = Field(3, ge=1, description="checkpoints kept on disk (older ones are deleted)")
    skip_zero_advantage_groups: bool = Field(True, description="skip groups whose advantages are all 0 (no gradient)")
    overlong_filter: bool = Field(False, description="mask responses cut at the token budget (finish max_tokens) out "
                                  "of the loss, as DAPO's overlong filtering; off (the release's recipe): they are trained on with reward 0")
    max_steps: int = Field(0, ge=0, description="the run's last step: no training beyond it, later groups are skipped "
                           "as run_complete (0: no limit)")
    consumer_group: str = Field("learner", description="Kafka consumer group on rstar.scored")
    dist_timeout_s: float = Field(
        600.0, gt=0, description="multi-device (torchrun): longest wait of a rank in one collective; a rank whose "
        "peers died stops after this long (rank 0 pings idle followers every quarter of it)"
    )

    def resolved_checkpoint_dir(self) -> Path:
        return self.checkpoint_dir or (Path(self.state_dir) / "learner" / "checkpoints")

    def trainer_config(self) -> TrainerConfig:
        return TrainerConfig(
            lr=self.lr,
            warmup_steps=self.warmup_steps,
            weight_decay=self.weight_decay,
            eps=self.adam_eps,
            grad_clip=self.grad_clip,
            micro_batch_tokens=self.micro_batch_tokens,
            row_tokens=self.row_tokens,
            logits_chunk_tokens=self.logits_chunk_tokens,
            updates_per_step=self.updates_per_step,
            temperature=self.sampling_temperature,
            gradient_checkpointing=self.gradient_checkpointing,
            loss=LossConfig(
                clip_eps_low=self.clip_eps_low,
                clip_eps_high=self.clip_eps_high,
                objective=self.objective,
                is_cap=self.is_cap,
                negative_advantage_scale=self.negative_advantage_scale,
            ),
        )
