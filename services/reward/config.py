"""Reward service settings (``RSTAR_REWARD_<FIELD>`` env vars, a ``reward:`` YAML section, or
flat keys; common fields from ``RSTAR_*``, see :mod:`shared.settings`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from services.reward.roc import (
    DEFAULT_ADV_EPS,
    DEFAULT_MAX_TOOL_FAILURE_FRACTION,
    DEFAULT_MIN_PER_CLASS,
    DEFAULT_PENALTY_FLOOR,
    DEFAULT_STD_DDOF,
    RocConfig,
)
from shared.settings import ServiceSettings, service_config


class Settings(ServiceSettings):
    model_config = service_config("REWARD")
    service_name: ClassVar[str] = "reward"

    group_size: int = Field(16, ge=1, description="G: trajectories kept per group (of the 2G rolled out)")
    roc_mode: Literal["roc", "deterministic", "grpo"] = Field(
        "roc",
        description="roc: the paper's sampling; deterministic: the release's lowest-penalty-first; "
        "grpo: uniform G of 2G (ablation)",
    )
    drop_all_equal: bool = Field(True, description="do not publish groups whose kept rewards are all equal (no gradient)")
    answer_source: Literal["answer_tag_then_last_boxed", "last_boxed"] = Field(
        "answer_tag_then_last_boxed",
        description="where the answer is read: the last \\boxed{} in <answer> (else the response's last "
        "\\boxed{}), or only the response's last \\boxed{}",
    )
    check_timeout_s: float = Field(5.0, gt=0, description="hard timeout of one symbolic answer check (counts as incorrect)")
    check_workers: int = Field(2, ge=1, description="processes in the answer-checking pool")
    adv_eps: float = Field(DEFAULT_ADV_EPS, gt=0, description="ε in (r - mean) / (std + ε)")
    penalty_floor: float = Field(
        DEFAULT_PENALTY_FLOOR, gt=0, description="positives are weighted 1 / max(p_total, floor); keeps p_total = 0 finite"
    )
    min_per_class: int = Field(
        DEFAULT_MIN_PER_CLASS, ge=0, description="deterministic mode: fewest positives and negatives kept (the release: 2)"
    )
    std_ddof: Literal[0, 1] = Field(
        DEFAULT_STD_DDOF, description="advantage std: 0 = population (the paper's formula), 1 = sample (verl / the release)"
    )
    max_tool_failure_fraction: float = Field(
        DEFAULT_MAX_TOOL_FAILURE_FRACTION, ge=0, le=1,
        description="a group with more of its rollouts ended tool_failure (executor unreachable) is not trained "
        "but rolled out again; fewer are left out of RoC and advantages",
    )
    roc_seed: int = Field(0, description="mixed with the group id to seed the selection (change it for a new draw)")
    consumer_group: str = Field("reward", description="Kafka consumer group on rstar.trajectories")
    concurrency: int = Field(
        4, ge=1, description="groups handled at once per replica (overlaps checking with Kafka/DB round trips)"
    )

    @model_validator(mode="after")
    def _minimum_fits(self) -> "Settings":
        if self.roc_mode == "deterministic" and 2 * self.min_per_class > self.group_size:
            raise ValueError(f"deterministic mode keeps at least min_per_class={self.min_per_class} of each class: "
                             f"that needs group_size >= {2 * self.min_per_class}, got {self.group_size}")
        return self

    def roc_config(self) -> RocConfig:
        return RocConfig(
            group_size=self.group_size,
            mode=self.roc_mode,
            seed=self.roc_seed,
            penalty_floor=self.penalty_floor,
            adv_eps=self.adv_eps,
            min_per_class=self.min_per_class,
            std_ddof=self.std_ddof,
            max_tool_failure_fraction=self.max_tool_failure_fraction,
        )
