"""The training step: packed micro-batches, gradient accumulation, AdamW with warm-up.

No I/O except loading a model directory; the runtime decides what to train on and where the
result goes. One call of :meth:`PolicyTrainer.train_step` is one GRPO step on a batch of
:class:`~services.learner.packing.TrainSequence`:

1. The batch is split into ``updates_per_step`` mini-batches (one optimizer update each;
   default 1, as in rStar2-Agent), each packed into micro-batches of at most
   ``micro_batch_tokens`` tokens (:mod:`services.learner.packing`).
2. Decoupled objective with more than one update: a no-grad pass over every micro-batch records
   the proximal log-probabilities (the weights before the step). With a single update the
   proximal policy *is* the current weights at gradient time, so the detached log-probabilities
   of the training forward are used and the extra pass is skipped (same numbers, one pass
   fewer); ``force_proximal_pass`` runs it anyway (benchmarks).
3. For each micro-batch: the decoder runs on the packed rows (bf16 autocast on GPUs, fp32 on
   CPU), the output layer runs on the loss tokens only, in chunks
   (:mod:`services.learner.logprobs`), the loss (:mod:`services.learner.loss`) is divided by
   the mini-batch's total loss-token count (token-mean) and back-propagated — accumulated
   gradients equal those of one large batch.
4. Gradient-norm clipping, AdamW step; the LR schedule advances once per train step: linear
   warm-up over ``warmup_steps`` then constant (RL) or cosine decay to
   ``min_lr_ratio · lr`` over ``total_steps`` (SFT).
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from services.learner.logprobs import DEFAULT_CHUNK_TOKENS, chunked_token_logprobs
from services.learner.loss import LossConfig, LossStats, policy_loss, sft_loss
from services.learner.packing import MicroBatch, TrainSequence, pack

if TYPE_CHECKING:
    from services.learner.distributed import DataParallel

Schedule = Literal["constant", "cosine"]


@dataclass(frozen=True)
class TrainerConfig:
    lr: float = 1e-6
    warmup_steps: int = 20
    schedule: Schedule = "constant"
    total_steps: int = 0  # cosine only
    min_lr_ratio: float = 0.1  # cosine floor
    # AdamW β/ε of PyTorch's defaults; weight decay 0.01 as verl's actor optimizer.
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    micro_batch_tokens: int = 8192
    row_tokens: int = 0
    logits_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    updates_per_step: int = 1
    force_proximal_pass: bool = False
    temperature: float = 1.0  # the rollouts' sampling temperature (see LogprobModel)
    gradient_checkpointing: bool = False
    loss: LossConfig = field(default_factory=LossConfig)

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.warmup_steps < 0 or self.grad_clip <= 0:
            raise ValueError("lr and grad_clip must be > 0, warmup_steps ≥ 0")
        if self.updates_per_step < 1:
            raise ValueError("updates_per_step must be ≥ 1")
        if not self.temperature > 0:
            raise ValueError("temperature must be > 0 (RL samples; greedy decoding has no policy gradient)")
        if self.schedule == "cosine" and self.total_steps <= 0:
            raise ValueError("the cosine schedule needs total_steps > 0")


def resolve_device(name: str) -> torch.device:
    """``auto``: the first GPU (CUDA or ROCm — both appear as ``cuda`` in torch), else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch sees no GPU")
    return dev


def load_model(model_dir: str | Path, device: torch.device, *, attn_implementation: str = "sdpa") -> torch.nn.Module:
    """An HF causal LM in fp32 (master weights; autocast gives bf16 compute on GPUs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation=attn_implementation
    )
    model.config.use_cache = False
    return model.to(device)


def lr_factor(step: int, cfg: TrainerConfig) -> float:
    """Multiplier of ``cfg.lr`` for the ``step``-th update (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(cfg.total_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class LogprobModel(torch.nn.Module):
    """The policy as the trainer uses it: packed rows in, log-probabilities of the loss tokens out.

    A module (rather than a method) so that FSDP2 can wrap it as the root: the output layer's
    weight, used outside the HF model's own forward by the chunked log-prob function, is then
    gathered by the root's pre-forward hook like every other root parameter.
    """

    def __init__(self, model: torch.nn.Module, chunk_tokens: int, autocast_dtype: torch.dtype | None,
                 temperature: float = 1.0):
        super().__init__()
        self.model = model
        self.chunk_tokens = chunk_tokens
        # The rollouts sample from softmax(z / T): the policy whose log-probs the loss needs (and
        # whose log-probs vLLM returns in processed_logprobs mode). Dividing the hidden states by T
        # divides the logits by T exactly, and autograd carries the 1/T into both gradients.
        self.temperature = temperature
        self.autocast_dtype = autocast_dtype
        head = model.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise ValueError("output layers with a bias are not supported")

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, pred_index: torch.Tensor,
                targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = (torch.autocast(device_type=input_ids.device.type, dtype=self.autocast_dtype)
               if self.autocast_dtype is not None else nullcontext())
        with ctx:
            hidden = self.model.get_decoder()(input_ids=input_ids, position_ids=position_ids,
                                              use_cache=False).last_hidden_state
        flat = hidden.reshape(-1, hidden.shape[-1]).index_select(0, pred_index)
        if self.temperature != 1.0:
            flat = flat / self.temperature
        return chunked_token_logprobs(flat, self.model.get_output_embeddings().weight, targets, self.chunk_tokens)


def _as_tensor(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """numpy arrays (the packer's output) without a per-element copy; lists too."""
    arr = np.asarray(values)
    t = torch.from_numpy(arr) if arr.dtype != object else torch.tensor(values)
    return t.to(device=device, dtype=dtype, non_blocking=True)


def _empty_micro_batch(pad_id: int) -> MicroBatch:
    return MicroBatch(input_ids=[[pad_id]], position_ids=[[0]])


def _with_one_token(mb: MicroBatch) -> MicroBatch:
    """A micro-batch with a single (ignored) prediction so the output layer joins the graph."""
    return MicroBatch(input_ids=mb.input_ids, position_ids=mb.position_ids, pred_index=[0], targets=[mb.input_ids[0][0]],
                      behaviour=[0.0], advantages=[0.0], seq_of_token=[-1], n_tokens=0)


@dataclass
class StepResult:
    metrics: dict[str, float]
    per_sequence_loss_tokens: list[int]


class PolicyTrainer:
    """Owns the model, the optimizer and the LR schedule; trains on batches of sequences."""

    def __init__(self, model: torch.nn.Module, cfg: TrainerConfig, *, pad_id: int = 0,
                 dist: "DataParallel | None" = None) -> None:
        self.model = model
        self.cfg = cfg
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        self.autocast_dtype = torch.bfloat16 if self.device.type == "cuda" else None
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        self.net = LogprobModel(model, cfg.logits_chunk_tokens, self.autocast_dtype, cfg.temperature)
        self.dist = dist
        if dist is not None:
            dist.shard(self.net)
        self.steps_done = 0
        self.optimizer_resets = 0
        self._build_optimizer()

    # ------------------------------------------------------------------ optimizer
    def _build_optimizer(self) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        kwargs: dict[str, Any] = dict(lr=self.cfg.lr, betas=self.cfg.betas, eps=self.cfg.eps,
                                      weight_decay=self.cfg.weight_decay)
        if self.device.type == "cuda":
            kwargs["fused"] = True
        self.optimizer = torch.optim.AdamW(params, **kwargs)
        self._sched_offset = self.steps_done
        self._apply_lr()

    def reset_optimizer(self) -> None:
        """Forget the AdamW moments and restart the warm-up (curriculum stage 3)."""
        self._build_optimizer()
        self.optimizer_resets += 1

    def current_lr(self) -> float:
        return self.cfg.lr * lr_factor(self.steps_done - self._sched_offset, self.cfg)

    def set_lr(self, lr: float) -> None:
        """Set the LR of the next update directly (callers with their own schedule, e.g. SFT on a
        time budget); the built-in schedule takes over again after the update."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _apply_lr(self) -> None:
        lr = self.current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Optimizer state keyed by parameter name and unsharded, plus the schedule position.

        The same layout on one device and under FSDP2, so a checkpoint resumes on any number of
        devices. Under FSDP2 this is a collective: every rank must call it; rank 0 gets the full
        state (on the CPU), the others an empty ``optimizer`` entry.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = get_optimizer_state_dict(self.model, self.optimizer,
                                             options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return {
            "optimizer": optimizer,
            "steps_done": self.steps_done,
            "sched_offset": self._sched_offset,
            "optimizer_resets": self.optimizer_resets,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; under FSDP2 every rank passes the full state and
        keeps its own shard of it."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        optimizer = state["optimizer"]
        if any(isinstance(k, int) for k in optimizer.get("state", {})):
            # Checkpoints written before the by-name layout: positional, single device only.
            if self.dist is not None:
                raise ValueError("this checkpoint's optimizer state is positional (written by an older learner "
                                 "on one device); resume it on one device once, then scale out")
            self.optimizer.load_state_dict(optimizer)
        else:
            set_optimizer_state_dict(self.model, self.optimizer, optimizer,
                                     options=StateDictOptions(full_state_dict=True))
        self.steps_done = int(state["steps_done"])
        self._sched_offset = int(state["sched_offset"])
        self.optimizer_resets = int(state.get("optimizer_resets", 0))
        self._apply_lr()

    # ------------------------------------------------------------------ forward
    def forward_logprobs(self, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(log π(target) per loss token, entropy per loss token) for one micro-batch."""
        ids = _as_tensor(mb.input_ids, torch.long, self.device)
        pos = _as_tensor(mb.position_ids, torch.long, self.device)
        index = _as_tensor(mb.pred_index, torch.long, self.device)
        targets = _as_tensor(mb.targets, torch.long, self.device)
        return self.net(ids, pos, index, targets)

    def _split_updates(self, sequences: list[TrainSequence]) -> list[list[TrainSequence]]:
        # Under data parallelism every rank must run the same number of updates.
        k = self.cfg.updates_per_step if self.dist is not None else min(self.cfg.updates_per_step, len(sequences))
        return [sequences[i::k] for i in range(k)]

    def row_tokens(self, sequences: list[TrainSequence]) -> int:
        """Packed row length: ``cfg.row_tokens``, or (0) the longest of these sequences.

        The attention is sdpa with a block-diagonal mask (:func:`load_model`), whose cost grows with
        the square of the *row* length whatever the sequences in it: one row per 8K-token
        micro-batch made attention ~25x the rest of the tiny model's work on ~900-token
        trajectories. Rows as long as the longest sequence keep every sequence whole and pay only
        for the attention the sequences need.
        """
        return self.cfg.row_tokens or max((len(s) for s in sequences), default=0)

    def _plan(self, sequences: list[TrainSequence], *, rl: bool) -> list[tuple[list[MicroBatch], float, float]]:
        """Per update: (micro-batches, token-mean denominator, loss scale).

        ``rl``: leave out the sequences that carry no policy gradient (an SFT step runs them all).

        Single device: the update's own loss-token count, scale 1. Data parallel: the global
        count, scale = world size (FSDP averages gradients), and as many micro-batches on every
        rank (empty ones with no loss tokens pad the shorter ranks: each forward is a collective).
        """
        plan = []
        for batch in self._split_updates(sequences):
            # The denominator counts every loss token of the update; only sequences with a
            # gradient are run (LossConfig.carries_gradient), which is exact and, with
            # negative_advantage_scale 0, skips the failed samples (a quarter to a half of a demo batch).
            local = float(sum(s.n_loss_tokens for s in batch))
            active = [s for s in batch if not rl or self.cfg.loss.carries_gradient(s.advantage)]
            mbs = pack(active, self.cfg.micro_batch_tokens, self.pad_id, self.row_tokens(active)) if active else []
            if self.dist is None:
                plan.append((mbs, local, 1.0))
                continue
            n = self.dist.max_int(len(mbs))
            mbs += [_empty_micro_batch(self.pad_id) for _ in range(n - len(mbs))]
            plan.append((mbs, self.dist.sum(local), float(self.dist.world_size)))
        return plan

    def _reduce(self, values: list[float]) -> list[float]:
        return values if self.dist is None else [self.dist.sum(v) for v in values]

    # ------------------------------------------------------------------ steps
    def train_step(self, sequences: list[TrainSequence]) -> StepResult:
        """One GRPO step on these sequences (each carries its advantage and behaviour logprobs).

        Under data parallelism, ``sequences`` are this rank's share of the step.
        """
        if not sequences and self.dist is None:
            raise ValueError("train_step needs at least one sequence")
        if any(s.behaviour_logprobs is None for s in sequences):
            raise ValueError("RL sequences need behaviour logprobs")
        t0 = time.perf_counter()
        loss_cfg = self.cfg.loss
        updates = self._plan(sequences, rl=True)
        need_pass = loss_cfg.needs_proximal and (len(updates) > 1 or self.cfg.force_proximal_pass)
        prox: dict[int, torch.Tensor] = {}
        if need_pass:
            with torch.no_grad():
                for mb in (mb for u, _, _ in updates for mb in u):
                    prox[id(mb)] = self.forward_logprobs(mb)[0]
        t_prox = time.perf_counter() - t0

        stats = LossStats()
        entropy_sum = 0.0
        grad_norms: list[float] = []
        tokens = 0
        for micro_batches, total_loss_tokens, scale in updates:
            self.optimizer.zero_grad(set_to_none=True)
            for mb in micro_batches:
                tokens += mb.n_tokens
                if mb.n_loss_tokens == 0:
                    if self.dist is not None:  # take part in the collectives with a zero loss
                        (self.forward_logprobs(_with_one_token(mb))[0].sum() * 0.0).backward()
                    continue
                logp, entropy = self.forward_logprobs(mb)
                behav = _as_tensor(mb.behaviour, torch.float32, self.device)
                adv = _as_tensor(mb.advantages, torch.float32, self.device)
                mask = torch.ones_like(adv)
                logp_prox = prox.get(id(mb), logp.detach()) if loss_cfg.needs_proximal else None
                loss, mb_stats = policy_loss(logp, logp_prox, behav, adv, mask, config=loss_cfg,
                                             num_tokens=max(total_loss_tokens, 1.0))
                (loss * scale).backward()
                stats.add(mb_stats)
                entropy_sum += float(entropy.sum().item())
            grad_norms.append(self._clip_and_step())
        self.steps_done += 1
        self._apply_lr()
        if self.dist is not None:
            (stats.tokens, stats.loss_sum, stats.clip_low, stats.clip_high, stats.is_weight_sum, stats.is_truncated,
             stats.kl_behav_sum, stats.ratio_sum, entropy_sum, tokens_all) = self._reduce(
                [stats.tokens, stats.loss_sum, stats.clip_low, stats.clip_high, stats.is_weight_sum,
                 stats.is_truncated, stats.kl_behav_sum, stats.ratio_sum, entropy_sum, float(tokens)])
            tokens = int(tokens_all)
        elapsed = time.perf_counter() - t0
        metrics = stats.means()
        metrics.update(
            entropy=entropy_sum / max(stats.tokens, 1.0),
            grad_norm=max(grad_norms),
            loss_tokens=stats.tokens,
            tokens=float(tokens),
            seconds=elapsed,
            proximal_pass_seconds=t_prox if need_pass else 0.0,
            tokens_per_s=tokens / elapsed if elapsed > 0 else 0.0,
            lr=self.optimizer.param_groups[0]["lr"],
            updates=float(len(updates)),
            micro_batches=float(sum(len(u) for u, _, _ in updates)),
            skipped_sequences=float(sum(not loss_cfg.carries_gradient(s.advantage) for s in sequences)),
        )
        return StepResult(metrics=metrics, per_sequence_loss_tokens=[s.n_loss_tokens for s in sequences])

    def sft_step(self, sequences: list[TrainSequence]) -> dict[str, float]:
        """One supervised step: token-mean NLL on the loss-masked tokens."""
        t0 = time.perf_counter()
        saved = self.cfg
        # SFT is always one update per step, whatever the RL setting says.
        if self.cfg.updates_per_step != 1:
            self.cfg = dataclasses.replace(self.cfg, updates_per_step=1)
        try:
            ((micro_batches, total, scale),) = self._plan(sequences, rl=False)
        finally:
            self.cfg = saved
        if total == 0:
            raise ValueError("SFT batch has no loss tokens")
        self.optimizer.zero_grad(set_to_none=True)
        nll_sum = 0.0
        tokens = 0
        for mb in micro_batches:
            tokens += mb.n_tokens
            if mb.n_loss_tokens == 0:
                if self.dist is not None:
                    (self.forward_logprobs(_with_one_token(mb))[0].sum() * 0.0).backward()
                continue
            logp, _ = self.forward_logprobs(mb)
            loss, nll = sft_loss(logp, torch.ones_like(logp), num_tokens=total)
            (loss * scale).backward()
            nll_sum += nll
        grad_norm = self._clip_and_step()
        lr = self.optimizer.param_groups[0]["lr"]
        self.steps_done += 1
        self._apply_lr()
        if self.dist is not None:
            nll_sum, tokens_f = self._reduce([nll_sum, float(tokens)])
            tokens = int(tokens_f)
        elapsed = time.perf_counter() - t0
        return {"loss": nll_sum / total, "grad_norm": grad_norm, "tokens": float(tokens), "loss_tokens": float(total),
                "seconds": elapsed, "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0, "lr": lr}

    def _clip_and_step(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        if hasattr(norm, "full_tensor"):  # a DTensor under FSDP2
            norm = norm.full_tensor()
        norm_f = float(norm.item())
        if not math.isfinite(norm_f):
            # A non-finite gradient would poison the AdamW moments for good: skip the update.
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm {norm_f}; update skipped")
        self.optimizer.step()
        return norm_f

    @torch.no_grad()
    def sequence_logprobs(self, sequences: list[TrainSequence]) -> list[list[float]]:
        """Current-policy logprob of every loss token of each sequence (tests, diagnostics)."""
        out: list[list[float]] = [[] for _ in sequences]
        for mb in pack(sequences, self.cfg.micro_batch_tokens, self.pad_id, self.row_tokens(sequences)):
            if mb.n_loss_tokens == 0:
                continue
            logp, _ = self.forward_logprobs(mb)
            for s, v in zip(np.asarray(mb.seq_of_token).tolist(), logp.tolist()):
                out[s].append(v)
        return out
