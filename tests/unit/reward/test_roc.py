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


@settings(max_examples=300, deadline=None)
@given(groups(), st.sampled_from(["roc", "deterministic", "grpo"]))
def test_keeps_exactly_g_without_duplicates(data, mode):
    cands, g, gid = data
    sel = select(cands, g, mode, gid)
    assert len(sel.kept) == min(g, len(cands))
    assert len(set(sel.kept)) == len(sel.kept)
    assert set(sel.kept) <= {c.index for c in cands}
    kept_pos = sum(1 for i in sel.kept if cands[i].correct)
    assert kept_pos == sel.k_pos and len(sel.kept) - kept_pos == sel.k_neg


@settings(max_examples=300, deadline=None)
@given(groups(), st.sampled_from(["roc", "deterministic"]))
def test_keeps_the_positive_negative_proportions(data, mode):
    cands, g, gid = data
    sel = select(cands, g, mode, gid)
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
    assert select(cands, g, mode, gid) == select(list(cands), g, mode, gid)


@settings(max_examples=300, deadline=None)
@given(groups())
def test_deterministic_never_keeps_a_positive_over_a_strictly_cleaner_one(data):
    cands, g, gid = data
    kept = set(select(cands, g, "deterministic", gid).kept)
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


def test_score_group_rejects_misaligned_verdicts():
    with pytest.raises(ValueError):
        score_group(make_group([True, False]), [True], RocConfig())
