"""Evaluation metrics: pass@1 over samples, unbiased pass@k, lengths and format rates."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lab.evaluate_metrics import SampleResult, pass_at_k, summarize


def _s(pid, ok, tokens=10, calls=1, good=1, answered=True):
    return SampleResult(pid, ok, tokens, calls, good, answered)


def test_summary_of_a_small_set():
    samples = [
        _s("a", True, 10), _s("a", False, 20), _s("a", False, 30, calls=2, good=1), _s("a", True, 40),
        _s("b", False, 10, calls=0, good=0, answered=False), _s("b", False, 10), _s("b", False, 10), _s("b", False, 10),
    ]
    m = summarize(samples, ks=(1, 2, 4))
    assert m["problems"] == 2 and m["samples"] == 8
    assert m["pass@1_mean"] == pytest.approx((0.5 + 0.0) / 2)
    assert m["pass@1"] == pytest.approx(m["pass@1_mean"])
    assert m["pass@2"] == pytest.approx((1 - math.comb(2, 2) / math.comb(4, 2)) / 2)
    assert m["pass@4"] == pytest.approx(0.5)
    assert m["mean_response_tokens"] == pytest.approx(140 / 8)
    assert m["tool_call_well_formed_rate"] == pytest.approx(7 / 8)
    assert m["answer_rate"] == pytest.approx(7 / 8)
    assert m["mixed_outcome_fraction"] == pytest.approx(0.5)


def test_no_tool_calls_gives_no_rate():
    assert summarize([_s("a", True, calls=0, good=0)])["tool_call_well_formed_rate"] is None


@given(st.integers(1, 8).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n), st.integers(1, n))))
def test_pass_at_k_equals_enumeration(nck):
    n, c, k = nck
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    exact = sum(any(outcomes[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(exact)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        summarize([])
    with pytest.raises(ValueError, match="pass@4"):
        summarize([_s("a", True), _s("a", False)], ks=(4,))
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        SampleResult("a", True, 5, tool_calls=1, well_formed_tool_calls=2)
