"""Run control: admission with bounded staleness, task leases and re-dispatch, curriculum stages,
the stage-3 hard-problem filter. Pure: a snapshot of the run goes in, decisions come out; the
runtime reads the snapshot from PostgreSQL and carries the decisions out over Kafka.

Admission (bounded staleness)
    The learner takes B groups per step and publishes policy version v after step v. Every
    group admitted for rollout will reach the learner unless it is dropped on the way (the
    reward drops groups with no signal; the learner drops groups that are too stale). With
    ``live = dispatched − dropped`` groups that will be trained, the orchestrator admits a new
    task only while::

        live < min(η + v + 1, S + η) · B      (S = the run's total learner steps)

    Group number k (in admission order) is then admitted while the version is at least
    ``⌊k/B⌋ − η``, and is trained at step ``⌊k/B⌋``: its tokens are at most η versions older
    than the weights that train on them. η = 0 is synchronous training (rollouts of step v+1
    start only once version v exists); a larger η overlaps rollout with training without
    discarding finished work. Each task carries ``min_policy_version = v`` so a rollout
    instance that lags behind waits for the weights it was admitted under.

Leases
    Every dispatched task has a deadline. A task whose group has not been scored by then is
    re-dispatched under the same task id (= group id) with ``attempt + 1``; when both copies
    finish, the reward and the learner keep only the first by group id. A task whose current
    attempt the reward judged lost to infrastructure faults (too many rollouts ended
    ``tool_failure``: status ``redispatch``) is re-dispatched at once, deadline or not. After
    ``max_attempts`` dispatches a task is given up and counted as dropped (so admission does
    not wait for it forever).

Curriculum
    Stages run for a number of learner steps each. A new task belongs to the stage of the step
    that will train it: with ``live`` groups already admitted it becomes group number ``live``
    and is trained at step ``⌊live/B⌋`` (up to groups dropped on the way). So with η > 0 the
    first tasks of a stage are sent up to η steps before the learner reaches it, with that
    stage's settings, and the learner's stage-3 optimizer reset falls on the first step whose
    groups are stage-3 groups.

Hard-only stages (the paper's stage 3: "problems the current policy solves 8/8 are dropped")
    When the first task of a hard-only stage is due, the stage is not entered yet: it is
    *probed*. Each candidate problem (every training problem, or a seeded sample of
    ``max_problems``) is sent once as a ``probe`` task of ``samples`` (k) rollouts with the
    stage's budgets, under the policy version of that moment; probe tasks are leased and
    re-dispatched like any task but do not count in admission and are never trained on (the
    reward records their verdicts only). No task of the stage is admitted while the probe
    runs. It ends when every candidate's probe is back or after ``timeout_s``; then the
    problems solved k/k (all k rollouts that count correct) are dropped, the rest — including
    any whose probe did not come back — feed the stage. A probe that dropped every candidate
    keeps them all (nothing is "hard"; training goes on).

Learner presence
    Admission and re-dispatch go on only while a learner can train the run: a learner instance
    whose last heartbeat is at most ``learner_timeout_s`` old and that trains this run (or has
    not chosen one yet). A run whose learner is gone (killed with its command, crashed) would
    otherwise keep ~(η + 1)·B groups in flight on the rollout instances, beside the runs being
    trained; it is paused, not failed, so a restarted learner picks it up where it stopped.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache


@dataclass(frozen=True)
class Progress:
    version: int  # latest policy version published by the learner (0 = the initial model)
    steps_done: int  # learner steps recorded
    dispatched: int  # distinct tasks ever dispatched in this run
    dropped: int  # groups that will never be trained (reward-dropped, stale, given up)


@dataclass(frozen=True)
class Lease:
    task_id: str
    deadline: datetime
    attempts: int


def admission_budget(p: Progress, *, batch_groups: int, max_staleness: int, total_steps: int | None = None) -> int:
    """How many new tasks may be dispatched now (never negative). With ``total_steps`` = S, at
    most (S + η)·B groups are ever live: the staleness ceiling reaches that at the last step,
    and nothing is admitted after it. The η·B beyond the last step's groups let the last steps
    take whichever groups finish first instead of waiting for stragglers (groups finish out of
    order); the learner stops at step S, so they are rolled out but not trained."""
    live = p.dispatched - p.dropped
    ceiling = max_staleness + p.version + 1
    if total_steps is not None:
        ceiling = min(ceiling, total_steps + max_staleness)
    return max(0, ceiling * batch_groups - live)


def staleness_bound_holds(admitted_at_version: Sequence[int], *, batch_groups: int, max_staleness: int) -> bool:
    """Check of the invariant for a history: group k (in admission order) admitted at version
    ``admitted_at_version[k]`` is trained at step ⌊k/B⌋ with staleness ≤ η."""
    return all(k // batch_groups - v <= max_staleness for k, v in enumerate(admitted_at_version))


@dataclass(frozen=True)
class LeaseDecision:
    redispatch: list[Lease]  # send again with attempt + 1
    give_up: list[Lease]  # exhausted: mark failed, count as dropped


def expired_leases(leases: Sequence[Lease], now: datetime, *, max_attempts: int,
                   faulted: frozenset[str] = frozenset()) -> LeaseDecision:
    """Leases past their deadline, and those in ``faulted`` (task ids whose current attempt was
    lost to infrastructure faults), split into re-dispatch and give-up."""
    redispatch, give_up = [], []
    for lease in leases:
        if lease.deadline > now and lease.task_id not in faulted:
            continue
        (redispatch if lease.attempts < max_attempts else give_up).append(lease)
    return LeaseDecision(redispatch, give_up)


def new_deadline(now: datetime, timeout_s: float) -> datetime:
    return now + timedelta(seconds=timeout_s)


@dataclass(frozen=True)
class StagePosition:
    index: int  # index into the run's stages; == len(stages) when the run is finished
    finished: bool


def stage_position(steps_done: int, stage_steps: Sequence[int]) -> StagePosition:
    """Which stage the step after ``steps_done`` steps belongs to (finished: past the last)."""
    end = 0
    for i, steps in enumerate(stage_steps):
        end += steps
        if steps_done < end:
            return StagePosition(i, False)
    return StagePosition(len(stage_steps), True)


def stage_of_new_task(live: int, *, batch_groups: int, stage_steps: Sequence[int]) -> int:
    """Index of the stage of a task admitted when ``live`` groups are live: the stage of the
    step that trains it (see "Curriculum"); the last stage for the groups beyond the last step."""
    position = stage_position(live // batch_groups, stage_steps)
    return min(position.index, len(stage_steps) - 1)


@dataclass(frozen=True)
class LearnerBeat:
    run_id: str  # the run the learner trains; "" while it has not chosen one (still loading, or adopting)
    last_heartbeat: datetime


def learner_present(beats: Sequence[LearnerBeat], run_id: str, now: datetime, *, timeout_s: float) -> bool:
    """Whether some live learner (heartbeat within ``timeout_s``) trains ``run_id`` or has not
    chosen a run yet (see "Learner presence")."""
    horizon = now - timedelta(seconds=timeout_s)
    return any(b.last_heartbeat >= horizon and b.run_id in ("", run_id) for b in beats)


def probe_candidates(problem_ids: Sequence[str], *, max_problems: int, seed: int) -> list[str]:
    """The problems a hard-only stage probes: all (max_problems 0), or a seeded sample, in order."""
    if max_problems <= 0 or max_problems >= len(problem_ids):
        return list(problem_ids)
    chosen = set(random.Random(f"probe:{seed}").sample(range(len(problem_ids)), max_problems))
    return [pid for i, pid in enumerate(problem_ids) if i in chosen]


@dataclass(frozen=True)
class ProbeResult:
    problem_id: str
    n: int  # rollouts that count (tool_failure ones left out)
    n_correct: int


@dataclass(frozen=True)
class ProbeOutcome:
    kept: list[str]  # feed the stage, in candidate order
    solved: list[str]  # solved k/k: dropped
    missing: int  # candidates whose probe never came back (kept)
    all_solved: bool  # every probed candidate was solved: all kept instead


def probe_finished(candidates: Sequence[str], settled: set[str], *, started: datetime, now: datetime,
                   timeout_s: float) -> bool:
    """Whether a probe is over: every candidate settled (its result back, or its probe task given
    up), or the timeout passed."""
    return all(pid in settled for pid in candidates) or now >= started + timedelta(seconds=timeout_s)


def probe_outcome(candidates: Sequence[str], results: Sequence[ProbeResult], *, samples: int) -> ProbeOutcome:
    """Which candidates a hard-only stage trains on (see "Hard-only stages")."""
    by_id = {r.problem_id: r for r in results}
    solved = [pid for pid in candidates
              if (r := by_id.get(pid)) is not None and r.n >= samples and r.n_correct == r.n]
    dropped = set(solved)
    kept = [pid for pid in candidates if pid not in dropped]
    missing = sum(1 for pid in candidates if pid not in by_id)
    if not kept:
        return ProbeOutcome(list(candidates), solved, missing, True)
    return ProbeOutcome(kept, solved, missing, False)


def problem_at(index: int, problem_ids: Sequence[str], seed: int) -> str:
    """The problem of the index-th task: epochs over a seeded permutation, so the feed is a
    function of (seed, index) and survives a restart of the orchestrator."""
    n = len(problem_ids)
    if n == 0:
        raise ValueError("no problems to feed")
    epoch, pos = divmod(index, n)
    return problem_ids[_permutation(seed, epoch, n)[pos]]


@lru_cache(maxsize=16)
def _permutation(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return tuple(order)
