"""The checking pool: real worker processes, a real hang killed by the timeout."""

from __future__ import annotations

import pytest

from services.reward.checker import AnswerChecker

# expanding this power makes sympy grind for far longer than the timeout below
HANGING = ("(x+1)^{200000}", "x^{200000}+1")


@pytest.fixture(scope="module")
def checker():
    with AnswerChecker(workers=1, timeout_s=1.0) as c:
        yield c


async def test_integer_and_symbolic_paths(checker):
    verdicts = await checker.check_group(["1,000", "\\frac{1}{2}", None, "0.5", "1,000"], "1000")
    assert [v.outcome for v in verdicts] == ["integer", "symbolic", "no_answer", "symbolic", "integer"]
    assert [v.correct for v in verdicts] == [True, False, False, False, True]
    half = await checker.check("\\dfrac{1}{2}", "0.5")
    assert half.correct and half.outcome == "symbolic"


async def test_timeout_counts_as_incorrect_and_the_pool_recovers(checker):
    verdict = await checker.check(*HANGING)
    assert verdict.outcome == "timeout" and not verdict.correct
    after = await checker.check("\\sqrt{4}", "2")
    assert after.correct and after.outcome == "symbolic"


async def test_overlong_answer_is_not_checked(checker):
    verdict = await checker.check("x+" * 600 + "1", "1")
    assert verdict.outcome == "too_long" and not verdict.correct
