"""A run's configuration (the YAML a user gives `rstar train`), validated before anything starts.

Example::

    name: demo
    seed: 0
    model: .rstar/models/tiny-sft          # HF model dir: version 0 of the policy
    dataset: {kind: generated, n_train: 2000, n_eval: 200, seed: 0}
    format: {preset: compact}              # rstar2 (default: the paper's prompt) | boxed | compact
    group_size: 4          # G: trajectories kept per problem
    n_samples: 8           # 2G: trajectories rolled out per problem
    batch_groups: 4        # B: groups per learner step
    max_staleness: 1       # η: 0 = synchronous
    sampling: {temperature: 1.0, top_p: 1.0}
    roc_mode: roc
    stages:
      - {stage: 1, steps: 10, max_tokens: 8192, max_turns: 10}
      - {stage: 2, steps: 10, max_tokens: 12288, max_turns: 10}
      - {stage: 3, steps: 10, max_tokens: 12288, max_turns: 15,   # hard problems only: the policy
         probe: {samples: 8}}                                      # samples each 8 times at entry

The same file also feeds the services' settings (``service_settings``), so the reward keeps G,
the learner steps on B groups and drops beyond η, exactly as the orchestrator admits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from shared.formats.presets import PresetName


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class DatasetConfig(_Strict):
    kind: Literal["generated", "file"] = "generated"
    paths: list[str] = Field(default_factory=list, description="JSONL/JSON/Parquet files (kind: file)")
    eval_paths: list[str] = Field(default_factory=list, description="held-out files for `rstar eval` (kind: file)")
    fields: dict[Literal["prompt", "answer", "id"], str] = Field(
        default_factory=dict,
        description="kind file: explicit dotted paths of prompt, answer (both) and id, e.g. "
                    "{prompt: data.question, answer: reward_model.ground_truth}; empty: detect the schema "
                    "(docs/data.md, Problem-set files)")
    on_bad_row: Literal["error", "skip"] = Field("error", description="kind file: fail on bad rows, or skip and count them")
    dedupe: bool = Field(True, description="kind file: drop repeats of a problem (normalised text)")
    n_train: int = Field(2000, gt=0, description="generated training problems")
    n_eval: int = Field(200, gt=0, description="generated held-out problems")
    seed: int = 0

    @model_validator(mode="after")
    def _paths(self) -> "DatasetConfig":
        if self.kind == "file" and not self.paths:
            raise ValueError("dataset.kind 'file' needs dataset.paths")
        if self.fields:
            if self.kind != "file":
                raise ValueError("dataset.fields applies to dataset.kind 'file' only")
            missing = [k for k in ("prompt", "answer") if not self.fields.get(k, "").strip()]
            if missing:
                raise ValueError(f"dataset.fields needs {' and '.join(missing)} (dotted paths) as well")
        return self


class FormatConfig(_Strict):
    preset: PresetName = Field("rstar2", description="prompt preset (shared/formats/presets.py): rstar2 | boxed | compact")



class SamplingConfig(_Strict):
    temperature: float = Field(1.0, gt=0.0, description="> 0: the learner divides its logits by it")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    allow_inexact_logprobs: bool = Field(
        False, description="accept top_p < 1: the learner cannot reproduce a top-p truncation, so its importance "
                           "ratios then compare against a different policy than the one that sampled")

    @model_validator(mode="after")
    def _reproducible(self) -> "SamplingConfig":
        if self.top_p < 1.0 and not self.allow_inexact_logprobs:
            raise ValueError(f"top_p {self.top_p} < 1 cannot be reproduced by the learner (its log-probs would not be "
                             "the sampling policy's); set sampling.allow_inexact_logprobs: true to accept that")
        return self


class ProbeConfig(_Strict):
    """The entry probe of a hard-only stage (services/orchestrator/control.py, "Hard-only
    stages"): the current policy samples each candidate problem ``samples`` times, with the
    stage's token and turn budgets; problems solved every time are dropped."""

    samples: int = Field(8, ge=1, le=64, description="k: rollouts per problem (the paper: 8, \"solved 8/8\")")
    max_problems: int = Field(0, ge=0, description="probe a seeded sample of this many candidates and feed the stage "
                                                   "from it (0: every problem, as the paper)")
    timeout_s: float = Field(3600.0, gt=0, description="longest wait for the probe; problems whose probe has not "
                                                       "come back by then are kept (not known to be solved)")


class StageConfig(_Strict):
    stage: int = Field(ge=1, le=3)
    steps: int = Field(gt=0, description="learner steps spent in this stage")
    max_tokens: int = Field(gt=0, description="token budget of a whole trajectory")
    max_turns: int = Field(gt=0)
    hard_only: bool | None = Field(None, description="feed only problems the policy does not solve every time (default: stage 3)")
    probe: ProbeConfig | None = Field(None, description="hard-only stages: the entry probe (default: ProbeConfig())")

    @model_validator(mode="after")
    def _probe_for_hard_only(self) -> "StageConfig":
        if self.probe is not None and not self.only_hard:
            raise ValueError(f"stage {self.stage}: probe applies to a hard-only stage (set hard_only: true)")
        if self.only_hard and self.probe is None:
            self.probe = ProbeConfig()
        return self

    @property
    def only_hard(self) -> bool:
        return self.stage == 3 if self.hard_only is None else self.hard_only


class RunConfig(_Strict):
    name: str = Field("run", min_length=1, max_length=200)
    seed: int = 0
    model: str = Field(description="HF model directory: version 0 of the policy")
    dataset: DatasetConfig = Field(default_factory=DatasetConfig)
    format: FormatConfig = Field(default_factory=FormatConfig, description="the conversation format's preset")
    group_size: int = Field(16, gt=0, description="G")
    n_samples: int | None = Field(None, description="2G (default 2 x group_size)")
    batch_groups: int = Field(8, gt=0, description="B")
    max_staleness: int = Field(1, ge=0, description="η (0: synchronous)")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    roc_mode: Literal["roc", "deterministic", "grpo"] = "roc"
    lr: float = Field(1e-6, gt=0)
    warmup_steps: int = Field(20, ge=0)
    stages: list[StageConfig] = Field(min_length=1)
    task_timeout_s: float = Field(600.0, gt=0, description="lease: a task not scored by then is re-dispatched")
    max_task_attempts: int = Field(3, ge=1, description="dispatches of one task before it is given up")
    services: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="further settings per service for this run, e.g. {learner: {torch_threads: 1}}; "
                    "merged over (and winning against) the settings the run derives",
    )

    @field_validator("services")
    @classmethod
    def _service_settings_exist(cls, v: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        from services.cli import SERVICES, settings_class

        errors = []
        for name, values in v.items():
            if name not in SERVICES:
                errors.append(f"unknown service {name!r} (one of {', '.join(SERVICES)})")
                continue
            known = settings_class(name).model_fields
            unknown = sorted(set(values) - set(known))
            if unknown:
                errors.append(f"services.{name}: unknown setting(s) {', '.join(unknown)}")
        if errors:
            raise ValueError("; ".join(errors))
        return v

    @field_validator("n_samples")
    @classmethod
    def _n(cls, v: int | None) -> int | None:
        if v is not None and v <= 0:
            raise ValueError("n_samples must be positive")
        return v

    @model_validator(mode="after")
    def _check(self) -> "RunConfig":
        if self.n_samples is None:
            self.n_samples = 2 * self.group_size
        if self.n_samples < self.group_size:
            raise ValueError(f"n_samples ({self.n_samples}) must be >= group_size ({self.group_size})")
        numbers = [s.stage for s in self.stages]
        if numbers != sorted(numbers) or len(set(numbers)) != len(numbers):
            raise ValueError(f"stages must be in increasing order without repeats, got {numbers}")
        return self

    @property
    def total_steps(self) -> int:
        return sum(s.steps for s in self.stages)

    def service_settings(self) -> dict[str, dict[str, Any]]:
        """Sections of a system YAML that make every service follow this run."""
        sections: dict[str, dict[str, Any]] = {
            "reward": {"group_size": self.group_size, "roc_mode": self.roc_mode},
            "learner": {
                "model_dir": self.model,
                "groups_per_step": self.batch_groups,
                "max_staleness": self.max_staleness,
                "max_steps": self.total_steps,
                "lr": self.lr,
                "warmup_steps": self.warmup_steps,
                "sampling_temperature": self.sampling.temperature,
            },
            "rollout": {"model_path": self.model, "prompt_preset": self.format.preset},
        }
        for name, values in self.services.items():
            sections.setdefault(name, {}).update(values)
        return sections


class RunConfigError(ValueError):
    """A configuration a run cannot start with; the message says every reason."""


def load_run_config(path: str | Path) -> RunConfig:
    path = Path(path)
    if not path.is_file():
        raise RunConfigError(f"run config {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise RunConfigError(f"run config {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise RunConfigError(f"run config {path} must be a mapping")
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as exc:
        reasons = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors())
        raise RunConfigError(f"run config {path}: {reasons}") from exc
    from shared.formats import ModelDirError, load_format

    try:  # the whole model check (config, tokenizer, template, what the preset needs) takes ~1 s
        load_format(cfg.model, cfg.format.preset)
    except ModelDirError as exc:
        raise RunConfigError(f"run config {path}: {exc}") from exc
    return cfg
