"""Step assembly: which scored groups a training step gets, and when (pure, no I/O).

A state machine in the style of prime-rl's orchestrator: it owns no clients and no tasks; the
runtime feeds it every :class:`~shared.events.ScoredGroup` it consumes and asks it for steps.

Rules, applied to each offered group in this order:

1. *wrong run* — a group of another run is skipped (when the learner's run is known);
2. *duplicate* — a group whose ``group_id`` was already trained on (the consumed set, persisted
   with every checkpoint) or is already buffered is skipped: redeliveries after a crash and
   re-dispatched tasks are never trained twice;
3. *stale* — a group with ``min_policy_version < version − η`` (its oldest token came from a
   policy more than η versions behind the one being trained) is dropped and counted;
4. *run complete* — once the version reached ``final_version`` (the run's last step) nothing
   more is trained; with η > 0 the orchestrator admits up to η·B groups beyond the last step
   (so the last steps need not wait for stragglers), and they end here;
5. *no signal* — (optional) a group whose kept advantages are all 0 carries no gradient and is
   skipped, so it does not dilute the token-mean of the step;
6. otherwise it is buffered; once B groups are buffered a step is ready.

A step is ``peek()``-ed, trained, checkpointed, and only then ``complete()``-d: the consumed set
grows and the buffer empties only after the checkpoint exists, so a failed step can be
retried with the same groups.

Before any rule, :func:`defects` checks that a schema-valid group can be trained at all (token
ids inside the model's vocabulary, finite log-probs and advantages, no token from a version the
learner has not published); a group with defects is refused (the runtime dead-letters it alone)
instead of failing every step of the batch it would join.

Stage transitions: the step's stage is the highest stage of its groups; when it reaches 3 from
a lower stage (the curriculum's hard-problem stage) the optimizer must be reset
(:meth:`StepAssembler.needs_optimizer_reset`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from shared.events import ScoredGroup

# Curriculum stage whose start resets the optimizer (rStar2-Agent, stage 3: hard problems only).
OPTIMIZER_RESET_STAGE = 3


def defects(group: ScoredGroup, *, vocab_size: int, version: int, limit: int = 5) -> list[str]:
    """Why a (schema-valid) group cannot be trained: at most ``limit`` reasons, [] when none."""
    out: list[str] = []
    for st in group.selected:
        t = st.trajectory
        where = f"trajectory {t.traj_id}"
        for name, ids in (("prompt", t.prompt_token_ids), ("response", t.response_token_ids)):
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                out.append(f"{where}: {len(bad)} {name} token id(s) outside the vocabulary of {vocab_size} "
                           f"(first {bad[0]})")
        if not all(math.isfinite(x) for x in t.logprobs):
            out.append(f"{where}: non-finite behaviour log-probs")
        if not math.isfinite(st.advantage):
            out.append(f"{where}: non-finite advantage {st.advantage}")
        future = [v for v in t.token_versions if v > version]
        if future:
            out.append(f"{where}: tokens of policy version {max(future)}, newer than the learner's {version}")
        if len(out) >= limit:
            break
    return out[:limit]


class Decision(str, enum.Enum):
    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    STALE = "stale"
    NO_SIGNAL = "no_signal"
    WRONG_RUN = "wrong_run"
    RUN_COMPLETE = "run_complete"


@dataclass
class StepAssembler:
    groups_per_step: int
    max_staleness: int
    version: int = 0
    run_id: str = ""
    stage: int | None = None  # stage of the last trained step (None: nothing trained yet)
    consumed: set[str] = field(default_factory=set)
    skip_zero_advantage: bool = True
    buffer: list[ScoredGroup] = field(default_factory=list)
    dropped_stale: int = 0  # since the last completed step
    final_version: int | None = None  # the run's last step: no step beyond it (None: no limit)
    counts: dict[str, int] = field(default_factory=lambda: {d.value: 0 for d in Decision})

    def __post_init__(self) -> None:
        if self.groups_per_step < 1:
            raise ValueError("groups_per_step must be ≥ 1")
        if self.max_staleness < 0:
            raise ValueError("max_staleness must be ≥ 0")

    def staleness_floor(self) -> int:
        """Oldest policy version a group may start from."""
        return self.version - self.max_staleness

    def offer(self, group: ScoredGroup) -> Decision:
        decision = self._decide(group)
        self.counts[decision.value] += 1
        if decision is Decision.ACCEPTED:
            if not self.run_id:
                self.run_id = group.run_id
            self.buffer.append(group)
        elif decision is Decision.STALE:
            self.dropped_stale += 1
        return decision

    def _decide(self, group: ScoredGroup) -> Decision:
        if self.run_id and group.run_id != self.run_id:
            return Decision.WRONG_RUN
        if not self.run_id and self.buffer and group.run_id != self.buffer[0].run_id:
            return Decision.WRONG_RUN
        if group.group_id in self.consumed or any(g.group_id == group.group_id for g in self.buffer):
            return Decision.DUPLICATE
        if self.complete_run():
            return Decision.RUN_COMPLETE
        if group.min_policy_version < self.staleness_floor():
            return Decision.STALE
        if self.skip_zero_advantage and all(t.advantage == 0.0 for t in group.selected):
            return Decision.NO_SIGNAL
        return Decision.ACCEPTED

    def complete_run(self) -> bool:
        return self.final_version is not None and self.version >= self.final_version

    def ready(self) -> bool:
        return len(self.buffer) >= self.groups_per_step and not self.complete_run()

    def peek(self) -> list[ScoredGroup]:
        """The next step's groups (the first B buffered), left in the buffer until complete()."""
        if not self.ready():
            raise RuntimeError(f"{len(self.buffer)} of {self.groups_per_step} groups buffered: no step ready")
        return self.buffer[: self.groups_per_step]

    @staticmethod
    def step_stage(groups: list[ScoredGroup]) -> int:
        return max(g.stage for g in groups)

    def needs_optimizer_reset(self, groups: list[ScoredGroup]) -> bool:
        new = self.step_stage(groups)
        return self.stage is not None and self.stage < OPTIMIZER_RESET_STAGE <= new

    def complete(self, groups: list[ScoredGroup], new_version: int) -> list[tuple[str, Decision]]:
        """The step on ``groups`` is checkpointed as ``new_version``: remember them, unbuffer them.
        Returns the buffered groups given up now, with why: the new version made them stale,
        or it was the run's last."""
        ids = {g.group_id for g in groups}
        self.consumed |= ids
        self.buffer = [g for g in self.buffer if g.group_id not in ids]
        self.stage = self.step_stage(groups)
        self.version = new_version
        self.dropped_stale = 0
        # Buffered groups may have become stale under the new version.
        keep, given_up = [], []
        for g in self.buffer:
            if self.complete_run():
                given_up.append((g.group_id, Decision.RUN_COMPLETE))
            elif g.min_policy_version < self.staleness_floor():
                self.dropped_stale += 1
                given_up.append((g.group_id, Decision.STALE))
            else:
                keep.append(g)
        for _, why in given_up:
            self.counts[why.value] += 1
        self.buffer = keep
        return given_up

    def discard(self, groups: list[ScoredGroup]) -> None:
        """Give up on these buffered groups without training (e.g. a non-finite gradient):
        they count as consumed so a redelivery does not bring the same failure back."""
        ids = {g.group_id for g in groups}
        self.consumed |= ids
        self.buffer = [g for g in self.buffer if g.group_id not in ids]


@dataclass(frozen=True)
class GroupStats:
    """Rollout-side statistics of a step's groups (logged with the step)."""

    staleness_mean: float
    staleness_max: float
    reward_mean: float
    pass_rate_mean: float
    response_len_mean: float
    tool_error_rate_pos: float | None
    n_trajectories: int


def group_stats(groups: list[ScoredGroup], version: int) -> GroupStats:
    """Staleness is measured per model token: ``version − token_version`` at training time."""
    stale: list[int] = []
    rewards: list[float] = []
    lengths: list[int] = []
    pos_calls = pos_errors = 0
    for g in groups:
        for st in g.selected:
            t = st.trajectory
            stale.extend(version - v for v, m in zip(t.token_versions, t.loss_mask) if m)
            rewards.append(st.reward)
            lengths.append(len(t.response_token_ids))
            if st.correct:
                pos_calls += len(t.tool_calls)
                pos_errors += sum(1 for c in t.tool_calls if c.status != "ok")
    n = max(len(rewards), 1)
    return GroupStats(
        staleness_mean=sum(stale) / len(stale) if stale else 0.0,
        staleness_max=float(max(stale)) if stale else 0.0,
        reward_mean=sum(rewards) / n,
        pass_rate_mean=sum(g.pass_rate for g in groups) / max(len(groups), 1),
        response_len_mean=sum(lengths) / n,
        tool_error_rate_pos=pos_errors / pos_calls if pos_calls else None,
        n_trajectories=len(rewards),
    )
