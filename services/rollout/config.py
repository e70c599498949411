"""Settings of the rollout service (env: ``RSTAR_ROLLOUT_<FIELD>``, or YAML section ``rollout:``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator

from shared.formats.presets import DEFAULT_PRESET, PRESETS, PresetName
from shared.formats.tags import DEFAULT_TOOL_RESPONSE_CHARS
from pydantic_settings import NoDecode

from shared.settings import ServiceSettings, service_config


class Settings(ServiceSettings):
    model_config = service_config("ROLLOUT")
    service_name: ClassVar[str] = "rollout"

    # --- engines -------------------------------------------------------------------------
    model_path: Path = Field(Path(".rstar/models/tiny"), description="HF model directory of policy version 0 (config, tokenizer, safetensors)")
    prompt_preset: PresetName = Field(DEFAULT_PRESET, description=f"conversation preset ({', '.join(PRESETS)}): system prompt, user wording, tool, tool-result text; rendered by the model's chat template")
    initial_version: int = Field(0, ge=0, description="policy version the model_path weights are")
    run_id: str = Field("", description="load only this run's weight versions ('' = any run's: one run at a time on the topic)")
    num_engines: int = Field(1, ge=1, description="vLLM engines in this process (each its own engine-core process)")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per engine (GPU installs)")
    kv_cache_gib: float = Field(1.0, gt=0, description="KV cache per engine in GiB (VLLM_CPU_KVCACHE_SPACE on CPU, when set, wins)")
    dtype: str = Field("float32", description="float32 on CPU (bf16 is slower without AVX512-BF16); bfloat16 on GPUs")
    block_size: int = Field(32, ge=1, description="KV block size; 32 on CPU so multi-turn prefixes are reused (the CPU default 128 caches only full blocks)")
    max_model_len: int = Field(4096, ge=64, description="context limit: prompt + all turns")
    max_num_seqs: int = Field(256, ge=1, description="vLLM's cap on concurrently running sequences per engine")
    enforce_eager: bool = Field(False, description="skip graph capture / torch.compile (faster start, slower steps)")
    seed: int = Field(0, description="engine sampling seed")

    # --- tools ---------------------------------------------------------------------------
    tool_executor_urls: Annotated[list[str], NoDecode] = Field(default_factory=lambda: ["http://127.0.0.1:8102"], description="tool executor replicas")
    tool_timeout_s: float = Field(10.0, gt=0, description="time limit of one tool call")
    tool_max_attempts: int = Field(4, ge=1, description="client attempts when the executor cannot be reached")
    tool_response_max_chars: int = Field(DEFAULT_TOOL_RESPONSE_CHARS, ge=32, description="tool output shown to the model (middle elided)")

    # --- scheduling ----------------------------------------------------------------------
    scheduler_mode: Literal["dynamic", "static"] = Field("dynamic", description="cache-aware dynamic admission, or the static equal-share baseline")
    reserve_quantile: float | None = Field(0.8, gt=0, lt=1, description="adaptive reservations at this quantile of finished lengths (see scheduler.py); None: reserve each rollout's full budget (guaranteed overflow-free)")
    max_concurrent_tasks: int = Field(16, ge=1, description="tasks (groups of n_samples rollouts) processed at once")
    stats_interval_s: float = Field(0.5, gt=0, description="how often engine KV statistics are read into the scheduler and metrics")


    @field_validator("tool_executor_urls", mode="before")
    @classmethod
    def _split_urls(cls, value):
        if isinstance(value, str):
            return [u.strip() for u in value.split(",") if u.strip()]
        return value
