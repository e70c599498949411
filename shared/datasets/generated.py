"""Generated problems: seeded integer-answer problems where running code helps.

``generate_problems`` / ``problem_stream`` / ``make_splits``: multi-digit arithmetic
``a*b±c``, modular powers ``a^k mod m``, digit sums of big powers, gcd / lcm, counting
primes below ``n``, binomial coefficients ``C(n, k)``. Each carries its ``kind`` and
``params`` so the SFT trace generator can write the code that solves it.

Train / eval split: each generated problem has a *canonical key* (kind + parameters; the
wording does not matter) and belongs to the eval partition iff
``sha256(key) mod EVAL_BUCKETS == 0``. Train streams skip eval-partition problems and
eval sets take only them, so the two never overlap — for any seeds and any sizes, also for
the unbounded training stream the bootstrap draws fresh problems from. Within one list
problems are deduplicated by key. Everything is a function of the seed.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from shared.datasets.problem import Problem

# --------------------------------------------------------------------------- generation
#
# Parameter ranges: chosen so that a tool call is the natural way to the answer (products of
# 3–5 digit numbers, powers too big for mental arithmetic) while answers stay short enough
# for a ~1M-parameter model to copy digit by digit (at most ~12 digits except C(n, k)).
#
# Numbers a model must copy are drawn with every digit count of their range equally likely
# (``_digits``), not uniformly by value (which makes ~90 % of them as long as the range allows).
# Copying is what a small model gets wrong, so a kind's problems then range from short to long
# copies: a half-trained model solves some of every kind rather than none of some kinds, and RL
# gets signal (groups neither all right nor all wrong) from every kind. With values uniform, the
# demo's SFT model solved 0–4 % of arithmetic, modular-power, gcd, lcm and binomial rollouts in a
# whole RL run and ~50 % of the two short-copy kinds, so RL could only sharpen those two
# (docs/data.md).


def _digits(rng: random.Random, lo: int, hi: int) -> int:
    """An integer in [lo, hi] whose number of digits is uniform over the counts the range spans
    (then uniform among the numbers of that length in the range)."""
    n = rng.randint(len(str(lo)), len(str(hi)))
    return rng.randint(max(lo, 10 ** (n - 1)), min(hi, 10**n - 1))


def _arith(rng: random.Random) -> tuple[dict[str, int], int]:
    a = _digits(rng, 100, 99_999)
    b = _digits(rng, 10, 9_999)
    c = _digits(rng, 1, 99_999)
    sign = rng.choice((1, -1))
    return {"a": a, "b": b, "c": c, "sign": sign}, a * b + sign * c


def _modpow(rng: random.Random) -> tuple[dict[str, int], int]:
    a = _digits(rng, 2, 999)
    k = _digits(rng, 10, 99_999)  # not 100_000: a lone 6-digit value would get a 5th of draws
    m = _digits(rng, 7, 99_999)
    return {"a": a, "k": k, "m": m}, pow(a, k, m)


def _digit_sum_power(rng: random.Random) -> tuple[dict[str, int], int]:
    a = rng.randint(2, 99)
    k = rng.randint(20, 300)
    return {"a": a, "k": k}, sum(int(d) for d in str(a**k))


def _gcd(rng: random.Random) -> tuple[dict[str, int], int]:
    g = _digits(rng, 2, 999)  # a shared factor so the gcd is rarely 1
    a = g * _digits(rng, 2, 9_999)
    b = g * _digits(rng, 2, 9_999)
    return {"a": a, "b": b}, math.gcd(a, b)


def _lcm(rng: random.Random) -> tuple[dict[str, int], int]:
    g = _digits(rng, 2, 99)
    a = g * _digits(rng, 2, 999)
    b = g * _digits(rng, 2, 999)
    return {"a": a, "b": b}, math.lcm(a, b)


def _primes_below(rng: random.Random) -> tuple[dict[str, int], int]:
    n = _digits(rng, 20, 200_000)
    return {"n": n}, count_primes_below(n)


def _binomial(rng: random.Random) -> tuple[dict[str, int], int]:
    n = rng.randint(8, 40)
    k = rng.randint(2, n // 2)
    return {"n": n, "k": k}, math.comb(n, k)


def count_primes_below(n: int) -> int:
    """Number of primes p < n (sieve of Eratosthenes)."""
    if n < 3:
        return 0
    sieve = bytearray([1]) * n
    sieve[0] = sieve[1] = 0
    for i in range(2, math.isqrt(n - 1) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytes(len(range(i * i, n, i)))
    return sum(sieve)


_TEMPLATES: dict[str, tuple[str, ...]] = {
    "arith": (
        "Compute {a} * {b} {op} {c}.",
        "What is {a} times {b} {opword} {c}?",
        "Calculate the value of {a} * {b} {op} {c}.",
    ),
    "modpow": (
        "Find the remainder when {a}^{k} is divided by {m}.",
        "Compute {a}^{k} mod {m}.",
        "What is {a} raised to the power {k}, modulo {m}?",
    ),
    "digit_sum_power": (
        "What is the sum of the digits of {a}^{k}?",
        "Compute the digit sum of {a} raised to the power {k}.",
    ),
    "gcd": (
        "Find the greatest common divisor of {a} and {b}.",
        "What is gcd({a}, {b})?",
    ),
    "lcm": (
        "Find the least common multiple of {a} and {b}.",
        "What is lcm({a}, {b})?",
    ),
    "primes_below": (
        "How many prime numbers are less than {n}?",
        "Count the primes p with p < {n}.",
    ),
    "binomial": (
        "In how many ways can {k} items be chosen from {n} distinct items?",
        "Compute the binomial coefficient C({n}, {k}).",
    ),
}

GENERATORS: dict[str, Callable[[random.Random], tuple[dict[str, int], int]]] = {
    "arith": _arith,
    "modpow": _modpow,
    "digit_sum_power": _digit_sum_power,
    "gcd": _gcd,
    "lcm": _lcm,
    "primes_below": _primes_below,
    "binomial": _binomial,
}
KINDS: tuple[str, ...] = tuple(GENERATORS)

# One problem in EVAL_BUCKETS (by key hash) belongs to the eval partition.
EVAL_BUCKETS = 8


def canonical_key(kind: str, params: Mapping[str, int]) -> str:
    """What makes two generated problems the same problem (the wording does not count)."""
    return kind + ":" + ",".join(f"{k}={params[k]}" for k in sorted(params))


def is_eval_key(key: str) -> bool:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % EVAL_BUCKETS == 0


def _render(kind: str, params: Mapping[str, int], rng: random.Random) -> str:
    fields = dict(params)
    if kind == "arith":
        fields["op"] = "+" if params["sign"] > 0 else "-"
        fields["opword"] = "plus" if params["sign"] > 0 else "minus"
    return rng.choice(_TEMPLATES[kind]).format(**fields)


def make_problem(kind: str, rng: random.Random) -> Problem:
    params, answer = GENERATORS[kind](rng)
    key = canonical_key(kind, params)
    pid = f"gen-{kind}-" + hashlib.sha256(key.encode()).hexdigest()[:12]
    return Problem(problem_id=pid, prompt=_render(kind, params, rng), answer=str(answer),
                   kind=kind, params=params)


def problem_stream(seed: int, *, split: str = "train", kinds: Iterable[str] | None = None) -> Iterator[Problem]:
    """An endless, deterministic stream of distinct generated problems of one partition.

    ``split`` is ``"train"`` (problems outside the eval partition) or ``"eval"`` (inside it).
    Kinds are drawn uniformly from ``kinds`` (default: all).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    chosen = tuple(kinds) if kinds is not None else KINDS
    unknown = [k for k in chosen if k not in GENERATORS]
    if unknown or not chosen:
        raise ValueError(f"unknown problem kinds {unknown}; known: {list(KINDS)}")
    want_eval = split == "eval"
    # Different streams for the two partitions so an eval set and a train stream with the same
    # seed do not walk the same random sequence (they could not overlap anyway).
    rng = random.Random(f"{seed}:{split}")
    seen: set[str] = set()
    while True:
        problem = make_problem(rng.choice(chosen), rng)
        assert problem.kind is not None and problem.params is not None
        key = canonical_key(problem.kind, problem.params)
        if is_eval_key(key) != want_eval or key in seen:
            continue
        seen.add(key)
        yield problem


def generate_problems(n: int, *, seed: int, split: str = "train", kinds: Iterable[str] | None = None) -> list[Problem]:
    """The first ``n`` problems of :func:`problem_stream`."""
    stream = problem_stream(seed, split=split, kinds=kinds)
    return [next(stream) for _ in range(n)]


def make_splits(n_train: int, n_eval: int, *, seed: int,
                kinds: Iterable[str] | None = None) -> tuple[list[Problem], list[Problem]]:
    """Deterministic, disjoint train and eval sets."""
    kinds = tuple(kinds) if kinds is not None else None
    return (generate_problems(n_train, seed=seed, split="train", kinds=kinds),
            generate_problems(n_eval, seed=seed, split="eval", kinds=kinds))

