"""One group from trajectories to a ScoredGroup: validate, extract and check answers (in the
checker's worker pool), then GRPO-RoC (:mod:`services.reward.roc`). Shared by the live service
and ``rstar replay rescore``; no Kafka and no database here."""

from __future__ import annotations

import time
from collections import Counter as Tally
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Histogram

from services.reward.answers import AnswerSource, extract_answer
from services.reward.checker import AnswerChecker, Verdict
from services.reward.roc import (
    DEFAULT_MAX_TOOL_FAILURE_FRACTION,
    DEFAULT_MIN_PER_CLASS,
    DEFAULT_STD_DDOF,
    RocConfig,
    needs_redispatch,
    score_group,
)
from shared.events import ScoredGroup, TrajectoryGroup

CHECKS = Counter(
    "rstar_reward_answer_checks_total",
    "Answer checks by outcome (integer, symbolic, no_answer, too_long, timeout, error); timeouts count as incorrect",
    ["outcome"],
)
CHECK_TIMEOUTS = Counter("rstar_reward_answer_check_timeouts_total", "Symbolic answer checks killed by the timeout")
CHECK_SECONDS = Histogram(
    "rstar_reward_group_check_seconds", "Wall time to check all answers of one group",
    buckets=(0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)


class MalformedGroup(ValueError):
    """A group that decodes but cannot be scored: it belongs in the dead-letter topic."""


def validate_group(group: TrajectoryGroup) -> None:
    if not group.answer.strip():
        raise MalformedGroup(f"group {group.group_id} has no ground-truth answer")
    if not group.group_id.strip():
        raise MalformedGroup("group has an empty group_id")
    ids = [t.traj_id for t in group.trajectories]
    dup = [i for i, n in Tally(ids).items() if n > 1]
    if dup:
        raise MalformedGroup(f"group {group.group_id} repeats trajectory ids {dup[:5]}")


@dataclass
class ScoringResult:
    group: TrajectoryGroup
    scored: ScoredGroup
    answers: list[str | None]
    verdicts: list[Verdict]
    check_seconds: float
    outcomes: dict[str, int] = field(default_factory=dict)
    redispatch: bool = False  # too many rollouts ended tool_failure: roll the task out again

    @property
    def correct(self) -> list[bool]:
        return [v.correct for v in self.verdicts]

    def audit(self, roc: RocConfig, answer_source: str) -> dict[str, Any]:
        """What a later redelivery needs to republish the very same selection without re-checking
        (a check that timed out once might not time out again), plus the RoC statistics."""
        return {
            **self.scored.roc.model_dump(),
            "traj_ids": [t.traj_id for t in self.group.trajectories],
            "verdicts": self.correct,
            "selected_traj_ids": [s.trajectory.traj_id for s in self.scored.selected],
            "check_outcomes": self.outcomes,
            "group_size": roc.group_size,
            "seed": roc.seed,
            "penalty_floor": roc.penalty_floor,
            "adv_eps": roc.adv_eps,
            "min_per_class": roc.min_per_class,
            "std_ddof": roc.std_ddof,
            "max_tool_failure_fraction": roc.max_tool_failure_fraction,
            "attempt": self.group.attempt,
            "answer_source": answer_source,
        }


async def score_trajectory_group(
    group: TrajectoryGroup, checker: AnswerChecker, roc: RocConfig, answer_source: AnswerSource
) -> ScoringResult:
    validate_group(group)
    answers = []
    for traj in group.trajectories:
        found = extract_answer(traj.response_text, answer_source)
        answers.append(found.text if found is not None else None)
    t0 = time.perf_counter()
    verdicts = await checker.check_group(answers, group.answer)
    elapsed = time.perf_counter() - t0
    CHECK_SECONDS.observe(elapsed)
    outcomes = dict(Tally(v.outcome for v in verdicts))
    for outcome, n in outcomes.items():
        CHECKS.labels(outcome).inc(n)
    if outcomes.get("timeout"):
        CHECK_TIMEOUTS.inc(outcomes["timeout"])
    scored = score_group(group, [v.correct for v in verdicts], roc)
    redispatch = needs_redispatch(scored.roc.n_tool_failure, len(group.trajectories), roc.max_tool_failure_fraction)
    return ScoringResult(group, scored, answers, verdicts, elapsed, outcomes, redispatch)


def rescore_from_audit(group: TrajectoryGroup, audit: dict[str, Any], roc_mode: str) -> ScoredGroup | None:
    """Rebuild the selection recorded in ``audit`` for the same group, or None when this message
    is not the group that was recorded (another attempt of the task with the same group id)."""
    if audit.get("traj_ids") != [t.traj_id for t in group.trajectories]:
        return None
    roc = RocConfig(
        group_size=int(audit["group_size"]),
        mode=roc_mode,  # type: ignore[arg-type]
        seed=int(audit["seed"]),
        penalty_floor=float(audit["penalty_floor"]),
        adv_eps=float(audit["adv_eps"]),
        # recorded since the release-parity settings exist; older rows used the defaults
        min_per_class=int(audit.get("min_per_class", DEFAULT_MIN_PER_CLASS)),
        std_ddof=int(audit.get("std_ddof", DEFAULT_STD_DDOF)),
        max_tool_failure_fraction=float(audit.get("max_tool_failure_fraction", DEFAULT_MAX_TOOL_FAILURE_FRACTION)),
    )
    scored = score_group(group, [bool(v) for v in audit["verdicts"]], roc)
    if [s.trajectory.traj_id for s in scored.selected] != audit.get("selected_traj_ids"):
        raise RuntimeError(f"group {group.group_id}: rebuilding the recorded selection gave a different one")
    return scored
