"""GRPO-RoC: penalties, Resample-on-Correct down-sampling 2G → G, and advantages (pure).

This is the reward service's algorithm, after rStar2-Agent (arXiv 2508.20722, §3.2). The reward
is answer correctness only (1 or 0); what RoC changes is *which* rollouts the learner sees.

1. Penalties per trajectory, from the structured tool-call records (never regexes on text):

   * ``p_err = failed tool calls / tool calls`` where ``error``, ``timeout`` and ``parse_error``
     are failures; a trajectory without any tool call gets :data:`NO_TOOL_CALL_P_ERR` (0.5):
     not using the tool is neither clean nor broken.
   * ``p_format = 1`` when the model wrote no ``<answer>`` tag, else
     ``min(1, (answer tags - 1) / turns)``: one answer is clean, repeated answers are penalised
     relative to the length of the conversation. Tags are counted in the text the model wrote
     (tool code and tool output removed), so a program printing ``<answer>`` costs nothing.
   * ``p_total = p_err + p_format`` (0 … 2).

2. Down-sampling a group of n (= 2G) rollouts to G, in one of three modes:

   * ``roc`` (the paper): keep the group's positive/negative proportions —
     ``k_pos = G · n_pos / n`` rounded stochastically (floor, +1 with probability equal to the
     fraction, so a 5/27 split of 32 keeps 2 or 3 positives with expectation 2.5), and at least
     one of each kind when the group is mixed (a group with one success in 32 is the most
     informative one there is; rounding it to zero positives would erase its signal).
     Negatives: uniform sample without replacement (keeps diverse failure modes).
     Positives: sequential sampling without replacement, each draw choosing a remaining positive
     with probability ∝ ``1 / max(p_total, penalty_floor)``. A group of at most G rollouts is
     kept whole.
   * ``deterministic`` (the public release, ``recipe/rstar2_agent/src/down_sample/roc.py`` in
     verl, run with ``min_*_reward_trace_num=2``), step for step:

     - a group of fewer than G rollouts is skipped (nothing of it is trained); exactly G are
       kept whole;
     - ``k_neg = round(n_neg · G / n)``, ``k_pos = round(n_pos · G / n)`` with Python's
       round-half-to-even;
     - ``k_neg ≤ min(m, n_neg)`` (m = ``min_per_class``, 2) → ``k_neg = min(m, n_neg)``, ``k_pos = G − k_neg``; then the
       same test for the positives (it wins when both apply);
     - positives AND negatives are each sorted by ``p_total`` ascending (ties by position) and
       the first ``k_pos`` / ``k_neg`` kept.

     The release also keeps a whole group when both rounded counts are below m; with 2·m ≤ G
     (which it asserts, and the settings check) that cannot happen, so it is not here. One
     deviation: where the release's counts do not add up to G (ties of round-half-to-even with
     an odd G, both counts above m) it fails an assertion; here the negatives take the
     remainder.
   * ``grpo`` (ablation baseline): a uniform sample of G from the n, ignoring correctness.

   Every random choice comes from a generator seeded with ``sha256(f"{seed}:{group_id}")``, so
   replaying a group (a redelivery, a crash between DB write and publish,
   ``rstar replay rescore``) reproduces the same selection.

3. Advantages over the kept G: ``A_i = (r_i - mean(r)) / (std(r) + eps)`` with the standard
   deviation's ``ddof`` a setting: 0 (population, the default: the paper writes std of the
   group's rewards) or 1 (the sample std of ``torch.std``, as verl's GRPO estimator and so the
   release compute it). A kept set whose rewards are all equal carries no gradient: its
   advantages are all 0 and it is flagged ``all_equal`` (the runtime drops such groups when
   configured to).

4. Infrastructure faults. A trajectory that ended ``tool_failure`` (the tool executor was
   unreachable: not the model's fault) is neither a failure nor a success of the policy: it is
   left out of the candidates, of the pass rate and of the advantages, and counted
   (``RocStats.n_tool_failure``). A group that lost more than ``max_tool_failure_fraction`` of
   its rollouts is not scored at all (:func:`needs_redispatch`): the reward records it for the
   orchestrator to roll out again, so an executor outage is neither trained on nor wasted.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass
from typing import Literal, Sequence

from services.reward.answers import model_written_text
from shared.formats.tags import count_answer_tags
from shared.events import RocStats, ScoredGroup, ScoredTrajectory, Trajectory, TrajectoryGroup

RocMode = Literal["roc", "deterministic", "grpo"]
ROC_MODES: tuple[str, ...] = ("roc", "deterministic", "grpo")

# p_err of a trajectory that never called the tool (the paper's value).
NO_TOOL_CALL_P_ERR = 0.5
# Tool-call outcomes that count as failures for p_err.
FAILED_TOOL_STATUSES = frozenset({"error", "timeout", "parse_error"})
# Positive sampling weight is 1 / max(p_total, DEFAULT_PENALTY_FLOOR). A perfectly clean trace
# (p_total = 0) thus weighs 100, against at most 1/(1/15) = 15 for the next cleanest kinds
# (one extra answer tag in 15 turns, one failed call in 15) and 2 for a trace without tool calls:
# clean traces are strongly preferred while every weight stays finite and every positive keeps
# a non-zero chance. Any p_total ≥ the floor is weighted exactly 1/p_total.
DEFAULT_PENALTY_FLOOR = 0.01
# ε of the advantage normalisation.
DEFAULT_ADV_EPS = 1e-6
# ``deterministic`` mode: the fewest rollouts of each class kept (the release's
# ``min_zero_reward_trace_num`` / ``min_non_zero_reward_trace_num``, both 2 in its Qwen3-14B run).
DEFAULT_MIN_PER_CLASS = 2
# Standard deviation's ddof in the advantage: 0 = population (the paper's formula), 1 = sample
# (torch.std, as verl and so the release compute it).
DEFAULT_STD_DDOF = 0
# A group that lost more than this share of its rollouts to ``tool_failure`` is rolled out again.
# Up to a quarter lost still leaves 1.5·G candidates of 2G for RoC to choose G from; beyond it
# the pass rate rests on few samples and an executor outage is likely under way.
DEFAULT_MAX_TOOL_FAILURE_FRACTION = 0.25
# Finish reason of a trajectory cut short by the infrastructure (see 4. in the docstring).
INFRA_FINISH_REASON = "tool_failure"


@dataclass(frozen=True)
class Penalties:
    n_tool_calls: int
    n_failed_tool_calls: int
    answer_tags: int
    p_err: float
    p_format: float

    @property
    def p_total(self) -> float:
        return self.p_err + self.p_format


def penalties(traj: Trajectory) -> Penalties:
    n_calls = len(traj.tool_calls)
    n_failed = sum(1 for call in traj.tool_calls if call.status in FAILED_TOOL_STATUSES)
    p_err = n_failed / n_calls if n_calls else NO_TOOL_CALL_P_ERR
    tags = count_answer_tags(model_written_text(traj.response_text))
    # turns ≥ 1 whenever the model wrote anything; guard a malformed 0 against division by zero
    p_format = 1.0 if tags == 0 else min(1.0, (tags - 1) / max(traj.turns, 1))
    return Penalties(n_calls, n_failed, tags, p_err, p_format)


@dataclass(frozen=True)
class Candidate:
    """One rollout as RoC sees it: its position in the group, its outcome, its penalty."""

    index: int
    correct: bool
    p_total: float


@dataclass(frozen=True)
class Selection:
    kept: list[int]  # indices into the group, ascending
    k_pos: int
    k_neg: int
    n_pos: int
    n_neg: int


def group_rng(group_id: str, seed: int = 0) -> random.Random:
    digest = hashlib.sha256(f"{seed}:{group_id}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def positive_count(n_pos: int, n_neg: int, group_size: int, rng: random.Random) -> int:
    """How many positives RoC keeps from n_pos + n_neg (> group_size) rollouts."""
    n = n_pos + n_neg
    exact = group_size * n_pos / n
    k_pos = math.floor(exact)
    if rng.random() < exact - k_pos:
        k_pos += 1
    if n_pos and n_neg and group_size >= 2:
        k_pos = min(max(k_pos, 1), group_size - 1)
    # never more than exist of either kind
    return max(min(k_pos, n_pos), group_size - n_neg)


def weighted_sample_without_replacement(
    items: Sequence[Candidate], weights: Sequence[float], k: int, rng: random.Random
) -> list[Candidate]:
    """k successive draws, each ∝ weight among the items not yet drawn."""
    pool = list(zip(items, weights))
    chosen: list[Candidate] = []
    for _ in range(k):
        total = sum(w for _, w in pool)
        target = rng.random() * total
        acc = 0.0
        pick = len(pool) - 1  # float round-off at the very end falls on the last item
        for i, (_, w) in enumerate(pool):
            acc += w
            if target < acc:
                pick = i
                break
        chosen.append(pool.pop(pick)[0])
    return chosen


def select(
    candidates: Sequence[Candidate],
    group_size: int,
    mode: RocMode,
    group_id: str,
    *,
    seed: int = 0,
    penalty_floor: float = DEFAULT_PENALTY_FLOOR,
    min_per_class: int = DEFAULT_MIN_PER_CLASS,
) -> Selection:
    """Choose which rollouts of a group the learner trains on (see the module docstring)."""
    if mode not in ROC_MODES:
        raise ValueError(f"unknown roc mode {mode!r}; one of {ROC_MODES}")
    if group_size < 1:
        raise ValueError("group_size must be ≥ 1")
    if penalty_floor <= 0:
        raise ValueError("penalty_floor must be > 0 (it keeps the weights finite)")
    if mode == "deterministic" and 2 * min_per_class > group_size:
        raise ValueError(f"min_per_class {min_per_class} of each class does not fit a group of {group_size}")
    pos = [c for c in candidates if c.correct]
    neg = [c for c in candidates if not c.correct]
    if mode == "deterministic":
        return release_selection(pos, neg, group_size, min_per_class=min_per_class)
    if len(candidates) <= group_size:
        kept = sorted(c.index for c in candidates)
        return Selection(kept, len(pos), len(neg), len(pos), len(neg))
    rng = group_rng(group_id, seed)
    if mode == "grpo":
        chosen = rng.sample(list(candidates), group_size)
        kept = sorted(c.index for c in chosen)
        k_pos = sum(1 for c in chosen if c.correct)
        return Selection(kept, k_pos, group_size - k_pos, len(pos), len(neg))
    k_pos = positive_count(len(pos), len(neg), group_size, rng)
    k_neg = group_size - k_pos
    kept_neg = rng.sample(neg, k_neg)
    weights = [1.0 / max(c.p_total, penalty_floor) for c in pos]
    kept_pos = weighted_sample_without_replacement(pos, weights, k_pos, rng)
    kept = sorted(c.index for c in kept_pos + kept_neg)
    return Selection(kept, k_pos, k_neg, len(pos), len(neg))


def release_counts(n_pos: int, n_neg: int, group_size: int, *, min_per_class: int) -> tuple[int, int]:
    """(k_pos, k_neg) of the release's down-sampling of n_pos + n_neg (> group_size) rollouts."""
    n = n_pos + n_neg
    k_neg = round(n_neg * group_size / n)  # round half to even, as the release (Python's round)
    k_pos = round(n_pos * group_size / n)
    if k_neg <= min(min_per_class, n_neg):
        k_neg = min(min_per_class, n_neg)
        k_pos = group_size - k_neg
    if k_pos <= min(min_per_class, n_pos):
        k_pos = min(min_per_class, n_pos)
        k_neg = group_size - k_pos
    if k_pos + k_neg != group_size:
        # the release asserts here (ties with an odd G); the negatives take the remainder
        k_neg = group_size - k_pos
    return k_pos, k_neg


def release_selection(
    pos: Sequence[Candidate], neg: Sequence[Candidate], group_size: int, *, min_per_class: int
) -> Selection:
    """The ``deterministic`` mode (module docstring, 2.): the public release's selection."""
    n = len(pos) + len(neg)
    if n < group_size:
        return Selection([], 0, 0, len(pos), len(neg))  # skipped: the release trains none of it
    if n == group_size:
        return Selection(sorted(c.index for c in [*pos, *neg]), len(pos), len(neg), len(pos), len(neg))
    k_pos, k_neg = release_counts(len(pos), len(neg), group_size, min_per_class=min_per_class)

    def cleanest(items: Sequence[Candidate], k: int) -> list[Candidate]:
        return sorted(items, key=lambda c: (c.p_total, c.index))[:k]

    kept_pos, kept_neg = cleanest(pos, k_pos), cleanest(neg, k_neg)
    kept = sorted(c.index for c in kept_pos + kept_neg)
    return Selection(kept, len(kept_pos), len(kept_neg), len(pos), len(neg))


def advantages(rewards: Sequence[float], eps: float = DEFAULT_ADV_EPS, ddof: int = DEFAULT_STD_DDOF) -> list[float]:
    if ddof not in (0, 1):
        raise ValueError(f"ddof must be 0 or 1, got {ddof}")
    if not rewards:
        return []
    mean = sum(rewards) / len(rewards)
    dof = len(rewards) - ddof
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / dof) if dof > 0 else 0.0
    return [(r - mean) / (std + eps) for r in rewards]


def needs_redispatch(n_tool_failure: int, n: int, max_fraction: float) -> bool:
    """Whether a group lost too many of its n rollouts to infrastructure faults to be trained."""
    return n > 0 and (n_tool_failure == n or n_tool_failure > max_fraction * n)


def _tool_error_rate(items: Sequence[Penalties]) -> float | None:
    calls = sum(p.n_tool_calls for p in items)
    return sum(p.n_failed_tool_calls for p in items) / calls if calls else None


def _mean_format(items: Sequence[Penalties]) -> float | None:
    return sum(p.p_format for p in items) / len(items) if items else None


@dataclass(frozen=True)
class RocConfig:
    group_size: int = 16
    mode: RocMode = "roc"
    seed: int = 0
    penalty_floor: float = DEFAULT_PENALTY_FLOOR
    adv_eps: float = DEFAULT_ADV_EPS
    min_per_class: int = DEFAULT_MIN_PER_CLASS
    std_ddof: int = DEFAULT_STD_DDOF
    max_tool_failure_fraction: float = DEFAULT_MAX_TOOL_FAILURE_FRACTION


def score_group(group: TrajectoryGroup, correct: Sequence[bool], config: RocConfig) -> ScoredGroup:
    """Penalties → selection → advantages for one group whose answers have been checked.

    ``correct[i]`` is the verdict for ``group.trajectories[i]``. Trajectories that ended
    ``tool_failure`` are left out (docstring, 4.): ``n_total`` and ``pass_rate`` count the others;
    a group that needs re-dispatch (:func:`needs_redispatch`) gets an empty selection. RoC
    statistics compare the kept positives with the dropped ones: tool-error rate = failed calls /
    calls over the set (None when the set made no call), format penalty = mean p_format (None for
    an empty set).
    """
    trajs = group.trajectories
    if len(correct) != len(trajs):
        raise ValueError(f"{len(correct)} verdicts for {len(trajs)} trajectories")
    pens = [penalties(t) for t in trajs]
    valid = [i for i, t in enumerate(trajs) if t.finish_reason != INFRA_FINISH_REASON]
    n_tool_failure = len(trajs) - len(valid)
    cands = [Candidate(i, bool(correct[i]), pens[i].p_total) for i in valid]
    if needs_redispatch(n_tool_failure, len(trajs), config.max_tool_failure_fraction):
        n_pos = sum(1 for c in cands if c.correct)
        sel = Selection([], 0, 0, n_pos, len(cands) - n_pos)
    else:
        sel = select(cands, config.group_size, config.mode, group.group_id, seed=config.seed,
                     penalty_floor=config.penalty_floor, min_per_class=config.min_per_class)
    rewards = [1.0 if correct[i] else 0.0 for i in sel.kept]
    advs = advantages(rewards, config.adv_eps, config.std_ddof)
    all_equal = len(set(rewards)) <= 1
    if all_equal:
        advs = [0.0] * len(rewards)  # exact zeros, not ±0/(0+eps) noise
    kept_set = set(sel.kept)
    kept_pos = [pens[i] for i in sel.kept if correct[i]]
    dropped_pos = [pens[i] for i in valid if correct[i] and i not in kept_set]
    versions = [v for i in sel.kept for v in trajs[i].token_versions]
    lo, hi = (min(versions), max(versions)) if versions else group.policy_version_range
    selected = [
        ScoredTrajectory(
            trajectory=trajs[i], reward=r, advantage=a, correct=bool(correct[i]),
            p_err=pens[i].p_err, p_format=pens[i].p_format,
        )
        for i, r, a in zip(sel.kept, rewards, advs)
    ]
    return ScoredGroup(
        group_id=group.group_id,
        run_id=group.run_id,
        stage=group.stage,
        problem_id=group.problem_id,
        min_policy_version=lo,
        max_policy_version=hi,
        pass_rate=sel.n_pos / len(valid) if valid else 0.0,
        n_total=len(valid),
        roc_mode=config.mode,
        all_equal=all_equal,
        selected=selected,
        roc=RocStats(
            kept_pos_tool_error_rate=_tool_error_rate(kept_pos),
            dropped_pos_tool_error_rate=_tool_error_rate(dropped_pos),
            kept_pos_format_penalty=_mean_format(kept_pos),
            dropped_pos_format_penalty=_mean_format(dropped_pos),
            n_pos=sel.n_pos,
            n_neg=sel.n_neg,
            n_kept_pos=sel.k_pos,
            n_kept_neg=sel.k_neg,
            n_tool_failure=n_tool_failure,
        ),
    )
