"""GRPO-RoC: properties of the down-sampling (hypothesis), its statistics over many draws,
penalties from tool-call records, advantages, and scoring a whole group."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.reward.roc import (
    DEFAULT_PENALTY_FLOOR,
    NO_TOOL_CALL_P_ERR,
    Candidate,
    RocConfig,
    advantages,
    group_rng,
    needs_redispatch,
    penalties,
    positive_count,
    score_group,
    select,
)
from shared.events import ToolCallRecord, Trajectory, TrajectoryGroup

# p_total values as they occur: fractions of tool calls and turns, 0.5 for no calls, up to 2
penalty_values = st.one_of(
    st.just(0.0),
    st.sampled_from([0.5, 1.0, 1.5, 2.0]),
    st.floats(min_value=0.0, max_value=2.0, allow_nan=False),
)


@st.composite
def groups(draw):
    n = draw(st.integers(min_value=1, max_value=40))
    outcomes = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    pens = draw(st.lists(penalty_values, min_size=n, max_size=n))
    cands = [Candidate(i, outcomes[i], pens[i]) for i in range(n)]
    group_size = draw(st.integers(min_value=1, max_value=24))
    group_id = draw(st.text(min_size=1, max_size=12))
    return cands, group_size, group_id


def release_min(group_size: int) -> int:
    """The release's minimum per class (2), as far as a small hypothesis group allows it."""
    return min(2, group_size // 2)


@settings(max_examples=300, deadline=None)
@given(groups(), st.sampled_from(["roc", "grpo"]))
def test_keeps_exactly_g_without_duplicates(data, mode):
    cands, g, gid = data
    sel = select(cands, g, mode, gid)
    assert len(sel.kept) == min(g, len(cands))
    assert len(set(sel.kept)) == len(sel.kept)
    assert set(sel.kept) <= {c.index for c in cands}
    kept_pos = sum(1 for i in sel.kept if cands[i].correct)
    assert kept_pos == sel.k_pos and len(sel.kept) - kept_pos == sel.k_neg


@settings(max_examples=300, deadline=None)
@given(groups())
def test_keeps_the_positive_negative_proportions(data):
    cands, g, gid = data
    sel = select(cands, g, "roc", gid)
    n_pos = sum(c.correct for c in cands)
    n = len(cands)
    if n <= g:
        assert sel.k_pos == n_pos
        return
    # within rounding of the exact share, and a mixed group stays mixed
    assert abs(sel.k_pos - g * n_pos / n) < 1
    if 0 < n_pos < n and g >= 2:
        assert 1 <= sel.k_pos <= g - 1


@settings(max_examples=200, deadline=None)
@given(groups(), st.sampled_from(["roc", "deterministic", "grpo"]))
def test_selection_is_reproducible_from_the_group_id(data, mode):
    cands, g, gid = data
    m = release_min(g)
    assert select(cands, g, mode, gid, min_per_class=m) == select(list(cands), g, mode, gid, min_per_class=m)


@settings(max_examples=300, deadline=None)
@given(groups())
def test_deterministic_never_keeps_a_positive_over_a_strictly_cleaner_one(data):
    cands, g, gid = data
    kept = set(select(cands, g, "deterministic", gid, min_per_class=release_min(g)).kept)
    pos = [c for c in cands if c.correct]
    for a in pos:
        for b in pos:
            if a.index in kept and b.index not in kept:
                assert not (b.p_total < a.p_total)


def test_rounding_of_an_odd_split_is_unbiased_and_seeded():
    # 5 positives in 32 → 2.5 expected; over many groups about half keep 3
    counts = Counter(positive_count(5, 27, 16, group_rng(f"g{i}")) for i in range(4000))
    assert set(counts) == {2, 3}
    assert abs(counts[3] / 4000 - 0.5) < 0.05
    assert positive_count(5, 27, 16, group_rng("same")) == positive_count(5, 27, 16, group_rng("same"))


def test_a_single_success_is_never_dropped():
    cands = [Candidate(i, i == 7, 0.5) for i in range(32)]
    for i in range(200):
        sel = select(cands, 16, "roc", f"g{i}")
        assert 7 in sel.kept and sel.k_pos == 1


def _chi_square(observed: list[int], expected: list[float]) -> float:
    return sum((o - e) ** 2 / e for o, e in zip(observed, expected))


def test_negatives_are_sampled_uniformly():
    # 4 positives, 12 negatives, keep 8 → 2 pos, 6 neg: each negative kept with probability 1/2
    cands = [Candidate(i, i < 4, 0.3) for i in range(16)]
    draws = 4000
    hits = Counter()
    for d in range(draws):
        for i in select(cands, 8, "roc", f"grp-{d}").kept:
            if i >= 4:
                hits[i] += 1
    observed = [hits[i] for i in range(4, 16)]
    chi2 = _chi_square(observed, [draws * 6 / 12] * 12)
    assert chi2 < 31.3, observed  # 11 degrees of freedom, p = 0.001


def test_positives_are_chosen_in_proportion_to_inverse_penalty():
    # keep 1 positive of 4: each chosen with probability (1/p) / Σ(1/p)
    p_totals = [0.1, 0.25, 0.5, 1.0]
    draws = 6000
    chosen = Counter()
    # 4 positives among 16, keep 4 → exactly one positive kept, so its inclusion probability is
    # the first draw's, which must be linear in the weight
    cands = [Candidate(i, True, p) for i, p in enumerate(p_totals)] + [
        Candidate(4 + i, False, 1.0) for i in range(12)
    ]
    for d in range(draws):
        sel = select(cands, 4, "roc", f"grp-{d}")
        assert sel.k_pos == 1
        (pos,) = [i for i in sel.kept if i < 4]
        chosen[pos] += 1
    weights = [1 / p for p in p_totals]
    expected = [draws * w / sum(weights) for w in weights]
    observed = [chosen[i] for i in range(4)]
    assert _chi_square(observed, expected) < 16.3, (observed, expected)  # 3 dof, p = 0.001


def test_clean_traces_use_the_penalty_floor_and_stay_finite():
    cands = [Candidate(0, True, 0.0), Candidate(1, True, 0.5)] + [Candidate(2 + i, False, 1.0) for i in range(6)]
    draws = 3000
    clean = sum(1 for d in range(draws) if 0 in select(cands, 4, "roc", f"g{d}").kept)
    w_clean, w_other = 1 / DEFAULT_PENALTY_FLOOR, 1 / 0.5
    assert abs(clean / draws - w_clean / (w_clean + w_other)) < 0.02


def test_grpo_mode_ignores_correctness():
    cands = [Candidate(i, i < 16, 0.0 if i < 16 else 1.0) for i in range(32)]
    kept_pos = Counter(select(cands, 16, "grpo", f"g{d}").k_pos for d in range(500))
    assert len(kept_pos) > 3  # varies around 8, not fixed by proportions


def test_bad_arguments_fail_loudly():
    cands = [Candidate(0, True, 0.0)]
    with pytest.raises(ValueError):
        select(cands, 16, "paper", "g")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        select(cands, 0, "roc", "g")
    with pytest.raises(ValueError):
        select(cands, 1, "roc", "g", penalty_floor=0)
    with pytest.raises(ValueError, match="does not fit"):
        select(cands, 3, "deterministic", "g", min_per_class=2)


# --------------------------------------------------------------------------- release parity


class ReleaseAssertion(AssertionError):
    pass


def release_reference(rewards: list[float], pens: list[float], n_keep: int, m: int) -> list[int] | None:
    """The public release's down-sampling of ONE group, transcribed for this test from
    verl recipe/rstar2_agent/src/down_sample/roc.py (resample_of_correct): the kept indices,
    or None when the group is skipped. Raises ReleaseAssertion where the release's assert fails."""
    n = len(rewards)
    if n < n_keep:
        return None
    if n == n_keep:
        return list(range(n))
    zero = sorted([(i, w) for i, (r, w) in enumerate(zip(rewards, pens)) if r <= 0], key=lambda x: x[1])
    non_zero = sorted([(i, w) for i, (r, w) in enumerate(zip(rewards, pens)) if r > 0], key=lambda x: x[1])
    zero_num = round(len(zero) * n_keep / n)
    non_zero_num = round(len(non_zero) * n_keep / n)
    if zero_num < m and non_zero_num < m:
        return list(range(n))
    if zero_num <= min(m, len(zero)):
        zero_num = min(m, len(zero))
        non_zero_num = n_keep - zero_num
    if non_zero_num <= min(m, len(non_zero)):
        non_zero_num = min(m, len(non_zero))
        zero_num = n_keep - non_zero_num
    choices = [i for i, _ in non_zero[:non_zero_num]] + [i for i, _ in zero[:zero_num]]
    if len(choices) != n_keep:
        raise ReleaseAssertion(f"{n_keep=} != {len(choices)}")
    return sorted(choices)


@settings(max_examples=500, deadline=None)
@given(groups())
def test_deterministic_is_the_release_selection(data):
    cands, g, gid = data
    m = release_min(g)
    sel = select(cands, g, "deterministic", gid, min_per_class=m)
    try:
        expected = release_reference([1.0 if c.correct else 0.0 for c in cands], [c.p_total for c in cands], g, m)
    except ReleaseAssertion:
        # the one documented deviation: the release fails, the negatives take the remainder
        assert len(sel.kept) == g
        return
    assert sel.kept == (expected or [])


def _hand_made(n_pos: int, n: int) -> list[Candidate]:
    """Positives first; penalties descending with the index, so 'cleanest' means 'last'."""
    return [Candidate(i, i < n_pos, (n - i) / 100) for i in range(n)]


@pytest.mark.parametrize(
    ("n_pos", "n", "kept_pos", "kept_neg"),
    [
        # 1 of 32: round(0.5) = 0 positives → raised to the one there is; 15 negatives
        (1, 32, [0], list(range(17, 32))),
        # 3 of 32: round(1.5) = 2 ≤ 2 → 2 positives (the two cleanest), 14 negatives
        (3, 32, [1, 2], list(range(18, 32))),
        # 5 of 32: round(2.5) = 2 (half to even), 14 negatives
        (5, 32, [3, 4], list(range(18, 32))),
        # 7 of 32: round(3.5) = 4, round(12.5) = 12
        (7, 32, [3, 4, 5, 6], list(range(20, 32))),
        # 30 of 32: negatives round(1.0) = 1 → raised to 2, positives 14
        (30, 32, list(range(16, 30)), [30, 31]),
        # all correct: 16 cleanest positives
        (32, 32, list(range(16, 32)), []),
        # exactly G: kept whole
        (4, 16, list(range(4)), list(range(4, 16))),
        # fewer than G: skipped
        (4, 15, [], []),
    ],
)
def test_deterministic_matches_the_release_on_hand_made_groups(n_pos, n, kept_pos, kept_neg):
    sel = select(_hand_made(n_pos, n), 16, "deterministic", "g")
    assert sel.kept == kept_pos + kept_neg
    assert (sel.k_pos, sel.k_neg) == (len(kept_pos), len(kept_neg))


def test_deterministic_sorts_negatives_by_penalty_too():
    cands = [Candidate(0, True, 0.0), Candidate(1, True, 0.0)] + [Candidate(2 + i, False, 1.0 - i / 10) for i in range(8)]
    # 2 positives of 10, G = 4: round(0.8) = 1 ≤ 2 → 2 positives, 2 negatives: the two cleanest (8, 9)
    assert select(cands, 4, "deterministic", "g").kept == [0, 1, 8, 9]


# --------------------------------------------------------------------------- penalties


def traj(statuses=(), text="<answer>\\boxed{1}</answer>", turns=1, versions=None) -> Trajectory:
    n = 3
    return Trajectory(
        traj_id="t",
        prompt_token_ids=[1, 2],
        response_token_ids=[5] * n,
        loss_mask=[1] * n,
        logprobs=[-0.5] * n,
        token_versions=versions or [0] * n,
        turns=turns,
        tool_calls=[ToolCallRecord(code="print(1)", status=s, duration_ms=1.0) for s in statuses],
        finish_reason="answer",
        response_text=text,
    )


def test_p_err_counts_error_timeout_and_parse_error():
    p = penalties(traj(["ok", "error", "timeout", "parse_error"], turns=5))
    assert p.p_err == pytest.approx(0.75)
    assert penalties(traj(["ok", "ok"], turns=3)).p_err == 0.0


def test_no_tool_call_gives_half():
    assert penalties(traj([])).p_err == NO_TOOL_CALL_P_ERR == 0.5


def test_p_format():
    assert penalties(traj(text="no answer at all")).p_format == 1.0
    assert penalties(traj(text="<answer>\\boxed{1}</answer>", turns=3)).p_format == 0.0
    two = "<answer>\\boxed{1}</answer><answer>\\boxed{2}</answer>"
    assert penalties(traj(text=two, turns=4)).p_format == pytest.approx(0.25)
    assert penalties(traj(text="<answer>" * 9, turns=2)).p_format == 1.0
    # an <answer> printed by the tool is not the model's
    tool_out = "<tool_response>\n<answer>\n</tool_response>\n<answer>\\boxed{1}</answer>"
    assert penalties(traj(["ok"], text=tool_out, turns=2)).p_format == 0.0


# --------------------------------------------------------------------------- advantages


def test_advantages_are_standardised():
    adv = advantages([1.0, 0.0, 0.0, 1.0])
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)
    adv = advantages([1.0, 0.0, 0.0, 0.0])
    mean, std = 0.25, math.sqrt(0.1875)
    assert adv == pytest.approx([(1 - mean) / std, -mean / std, -mean / std, -mean / std], rel=1e-5)
    assert sum(advantages([1.0, 0.0, 1.0, 0.0, 0.0])) == pytest.approx(0.0, abs=1e-9)
    assert advantages([1.0, 1.0]) == [0.0, 0.0]


def test_advantages_with_the_sample_std():
    # verl's GRPO estimator: torch.std (ddof = 1): std of [1, 0, 0, 0] is sqrt(0.25)
    adv = advantages([1.0, 0.0, 0.0, 0.0], ddof=1)
    assert adv == pytest.approx([0.75 / 0.5, -0.5, -0.5, -0.5], rel=1e-5)
    assert advantages([1.0], ddof=1) == [0.0]  # one sample: no spread, no division by zero
    with pytest.raises(ValueError):
        advantages([1.0, 0.0], ddof=2)


# --------------------------------------------------------------------------- whole group


def make_group(correct_pattern: list[bool], gid: str = "grp-1") -> TrajectoryGroup:
    trajs = []
    for i in range(len(correct_pattern)):
        statuses = ["ok"] if i % 3 else ["ok", "error"]
        t = traj(statuses, turns=2, versions=[i % 4] * 3)
        trajs.append(t.model_copy(update={"traj_id": f"t{i}"}))
    return TrajectoryGroup(group_id=gid, run_id="run", stage=1, problem_id="p", answer="1", trajectories=trajs)


def test_score_group_end_to_end():
    pattern = [i % 4 == 0 for i in range(32)]  # 8 correct of 32
    group = make_group(pattern)
    scored = score_group(group, pattern, RocConfig(group_size=16))
    assert len(scored.selected) == 16
    assert scored.pass_rate == 0.25 and scored.n_total == 32 and scored.roc_mode == "roc"
    assert scored.roc.n_pos == 8 and scored.roc.n_neg == 24
    assert scored.roc.n_kept_pos == 4 and scored.roc.n_kept_neg == 12
    assert not scored.all_equal
    rewards = [s.reward for s in scored.selected]
    assert sorted(set(rewards)) == [0.0, 1.0]
    assert sum(s.advantage for s in scored.selected) == pytest.approx(0.0, abs=1e-6)
    assert all((s.advantage > 0) == s.correct for s in scored.selected)
    assert scored.min_policy_version >= 0 and scored.max_policy_version <= 3
    # replay gives the same selection
    again = score_group(group, pattern, RocConfig(group_size=16))
    assert [s.trajectory.traj_id for s in again.selected] == [s.trajectory.traj_id for s in scored.selected]


def test_score_group_all_equal_is_flagged_with_zero_advantages():
    pattern = [False] * 32
    scored = score_group(make_group(pattern), pattern, RocConfig(group_size=16))
    assert scored.all_equal and all(s.advantage == 0.0 for s in scored.selected)
    assert scored.roc.kept_pos_tool_error_rate is None and scored.roc.kept_pos_format_penalty is None


def test_score_group_roc_stats_compare_kept_and_dropped_positives():
    pattern = [True] * 16 + [False] * 16
    group = make_group(pattern)
    scored = score_group(group, pattern, RocConfig(group_size=16, mode="deterministic"))
    # deterministic keeps the 8 cleanest positives: those with a single ok call (i % 3 != 0)
    assert scored.roc.kept_pos_tool_error_rate == 0.0
    assert scored.roc.dropped_pos_tool_error_rate is not None and scored.roc.dropped_pos_tool_error_rate > 0


def _with_tool_failures(group: TrajectoryGroup, indices: set[int]) -> TrajectoryGroup:
    trajs = [t.model_copy(update={"finish_reason": "tool_failure"}) if i in indices else t
             for i, t in enumerate(group.trajectories)]
    return group.model_copy(update={"trajectories": trajs})


def test_tool_failure_trajectories_get_no_advantage_and_are_counted():
    pattern = [i % 2 == 0 for i in range(32)]
    lost = {0, 1, 2, 3, 5}  # 5 of 32 < a quarter: left out, the group is trained
    group = _with_tool_failures(make_group(pattern), lost)
    for mode in ("roc", "deterministic", "grpo"):
        scored = score_group(group, pattern, RocConfig(group_size=16, mode=mode))
        kept = {s.trajectory.traj_id for s in scored.selected}
        assert not kept & {f"t{i}" for i in lost}, mode
        assert len(scored.selected) == 16
        assert scored.roc.n_tool_failure == 5 and scored.n_total == 27
        # the pass rate and the class counts are over the 27 that count (16 even indices less 0 and 2)
        assert scored.roc.n_pos == 14 and scored.pass_rate == pytest.approx(14 / 27)
    # a correct answer in a tool_failure trajectory is not a positive either
    all_lost = _with_tool_failures(make_group([True] * 4 + [False] * 28), {0, 1, 2, 3})
    scored = score_group(all_lost, [True] * 4 + [False] * 28, RocConfig(group_size=16))
    assert scored.roc.n_pos == 0 and scored.all_equal


def test_a_group_that_lost_too_many_rollouts_is_not_scored():
    pattern = [i % 2 == 0 for i in range(32)]
    cfg = RocConfig(group_size=16)  # up to 8 of 32 (a quarter) may be lost
    at_limit = score_group(_with_tool_failures(make_group(pattern), set(range(8))), pattern, cfg)
    assert len(at_limit.selected) == 16
    over = score_group(_with_tool_failures(make_group(pattern), set(range(9))), pattern, cfg)
    assert over.selected == [] and over.roc.n_tool_failure == 9
    assert needs_redispatch(9, 32, 0.25) and not needs_redispatch(8, 32, 0.25)
    assert needs_redispatch(1, 1, 1.0)  # nothing left at all
    assert not needs_redispatch(0, 32, 0.0)


def test_score_group_rejects_misaligned_verdicts():
    with pytest.raises(ValueError):
        score_group(make_group([True, False]), [True], RocConfig())
