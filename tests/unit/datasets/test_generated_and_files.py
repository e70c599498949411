"""The seeded problem generator (problem-set file loading: test_files.py)."""

from __future__ import annotations

from collections import Counter

import pytest
import sympy

from shared.datasets import Problem
from shared.datasets.generated import (
    EVAL_BUCKETS,
    KINDS,
    canonical_key,
    count_primes_below,
    generate_problems,
    is_eval_key,
    make_splits,
    problem_stream,
)

# --------------------------------------------------------------------------- generation


def _recompute(p: Problem) -> int:
    """An independent computation of each kind's answer (sympy, not the generator's code)."""
    q = p.params
    if p.kind == "arith":
        return q["a"] * q["b"] + q["sign"] * q["c"]
    if p.kind == "modpow":
        return int(sympy.Integer(q["a"]) ** q["k"] % q["m"])
    if p.kind == "digit_sum_power":
        return sum(sympy.ntheory.digits(q["a"] ** q["k"])[1:])
    if p.kind == "gcd":
        return int(sympy.gcd(q["a"], q["b"]))
    if p.kind == "lcm":
        return int(sympy.lcm(q["a"], q["b"]))
    if p.kind == "primes_below":
        return int(sympy.primepi(q["n"] - 1))
    if p.kind == "binomial":
        return int(sympy.binomial(q["n"], q["k"]))
    raise AssertionError(p.kind)


def test_every_generated_answer_is_correct():
    problems = generate_problems(400, seed=11) + generate_problems(100, seed=11, split="eval")
    assert set(Counter(p.kind for p in problems)) == set(KINDS)
    for p in problems:
        assert p.answer == str(_recompute(p)), p
        assert p.answer.lstrip("-").isdigit()
        # The numbers the solver needs are in the prompt text.
        for name, value in p.params.items():
            if name != "sign":
                assert str(value) in p.prompt, (p, name)


def test_copied_numbers_have_every_digit_count_of_their_range_about_equally_often():
    """The arithmetic operands span short to long copies (3, 4 and 5 digits for ``a``), not
    ~90 % five-digit numbers as a draw uniform by value gives."""
    problems = generate_problems(3000, seed=3, kinds=["arith"])
    for name, lo, hi in [("a", 100, 99_999), ("b", 10, 9_999), ("c", 1, 99_999)]:
        values = [p.params[name] for p in problems]
        assert lo <= min(values) and max(values) <= hi
        lengths = Counter(len(str(v)) for v in values)
        assert set(lengths) == set(range(len(str(lo)), len(str(hi)) + 1)), (name, lengths)
        share = 1 / len(lengths)
        for n, count in lengths.items():
            assert abs(count / len(values) - share) < 0.05, (name, n, lengths)


def test_no_modular_power_exponent_takes_a_whole_digit_count_share():
    """A range whose top is a lone longer number (10..100_000) gives that one value the share of
    a whole digit count (a fifth of the problems); the exponents must stay varied."""
    problems = generate_problems(2000, seed=5, kinds=["modpow"])
    (value, count), = Counter(p.params["k"] for p in problems).most_common(1)
    assert count / len(problems) < 0.02, (value, count)


def test_count_primes_below_matches_sympy():
    assert count_primes_below(0) == 0
    for n in [1, 2, 3, 4, 10, 11, 100, 7919, 7920, 100_000]:
        assert count_primes_below(n) == sympy.primepi(n - 1), n


def test_generation_is_deterministic():
    a = generate_problems(200, seed=5)
    b = generate_problems(200, seed=5)
    assert [(p.problem_id, p.prompt, p.answer) for p in a] == [(p.problem_id, p.prompt, p.answer) for p in b]
    c = generate_problems(200, seed=6)
    assert [p.problem_id for p in a] != [p.problem_id for p in c]


def test_splits_are_disjoint_and_deterministic():
    train, evals = make_splits(1500, 200, seed=0)
    train_keys = {canonical_key(p.kind, p.params) for p in train}
    eval_keys = {canonical_key(p.kind, p.params) for p in evals}
    assert len(train_keys) == 1500 and len(eval_keys) == 200  # no duplicates inside a split
    assert not train_keys & eval_keys
    assert all(is_eval_key(k) for k in eval_keys) and not any(is_eval_key(k) for k in train_keys)
    # A train stream of another seed never yields an eval problem either.
    other = generate_problems(1500, seed=99)
    assert not {canonical_key(p.kind, p.params) for p in other} & eval_keys
    again_train, again_eval = make_splits(1500, 200, seed=0)
    assert [p.problem_id for p in again_eval] == [p.problem_id for p in evals]
    assert [p.problem_id for p in again_train] == [p.problem_id for p in train]


def test_eval_partition_is_about_one_bucket_in_eight():
    keys = [canonical_key(p.kind, p.params) for p in _unfiltered(4000)]
    frac = sum(map(is_eval_key, keys)) / len(keys)
    assert abs(frac - 1 / EVAL_BUCKETS) < 0.03


def _unfiltered(n):
    import random

    from shared.datasets.generated import make_problem

    rng = random.Random(0)
    return [make_problem(rng.choice(KINDS), rng) for _ in range(n)]


def test_stream_kinds_and_bad_arguments():
    assert {p.kind for p in generate_problems(30, seed=1, kinds=["gcd", "lcm"])} == {"gcd", "lcm"}
    with pytest.raises(ValueError, match="unknown problem kinds"):
        next(problem_stream(0, kinds=["nope"]))
    with pytest.raises(ValueError, match="split"):
        next(problem_stream(0, split="test"))
