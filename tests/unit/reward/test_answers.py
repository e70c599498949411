"""Answer extraction and checking: a table of equal / not-equal cases through the real
math-verify (no mocks), plus the extraction rules."""

from __future__ import annotations

import pytest

from services.reward.answers import (
    LAST_BOXED,
    canonical_integer,
    check_inline,
    extract_answer,
    find_boxed,
    integer_verdict,
)


def resp(boxed: str) -> str:
    return f"Let me think.<answer>The answer is \\boxed{{{boxed}}}</answer><|im_end|>"


HUGE = "9" * 5000  # beyond Python's 4300-digit int() limit

# (response text, ground truth, expected verdict)
CASES: list[tuple[str, str, bool]] = [
    # fractions, decimals, \frac / \dfrac
    (resp("1/2"), "0.5", True),
    (resp("0.5"), "1/2", True),
    (resp("\\frac{1}{2}"), "0.5", True),
    (resp("\\dfrac{1}{2}"), "\\frac{1}{2}", True),
    (resp("\\frac12"), "1/2", True),
    (resp("\\tfrac{3}{4}"), "0.75", True),
    (resp("\\frac{2}{4}"), "\\frac{1}{2}", True),
    (resp("\\frac{1}{3}"), "0.5", False),
    (resp("0.51"), "1/2", False),
    # thousands separators and spacing
    (resp("1,000"), "1000", True),
    (resp("1000"), "1,000", True),
    (resp("1{,}000"), "1000", True),
    (resp("1\\,000"), "1000", True),
    (resp("1\\!000"), "1000", True),
    (resp("1 000 000"), "1000000", True),
    (resp("1,000,001"), "1000000", False),
    # signs and zero
    (resp("-0"), "0", True),
    (resp("0"), "-0", True),
    (resp("-7"), "7", False),
    (resp("+7"), "7", True),
    (resp("007"), "7", True),
    # nested braces and LaTeX
    (resp("\\frac{\\sqrt{2}}{2}"), "\\frac{1}{\\sqrt{2}}", True),
    (resp("{{42}}"), "42", True),
    (resp("2^{10}"), "1024", True),
    (resp("\\{1,2\\}"), "\\{2,1\\}", True),
    (resp("\\sqrt{8}"), "2\\sqrt{2}", True),
    (resp("\\pi"), "3.14", False),
    (resp("x = 5"), "5", True),
    (resp("5 \\text{ apples}"), "5", True),
    (resp("$12$"), "12", True),
    (resp("12."), "12", True),
    # several boxed: the last one inside <answer> counts
    ("\\boxed{3} is wrong <answer>\\boxed{4}</answer>", "4", True),
    ("<answer>\\boxed{3} no wait \\boxed{4}</answer>", "4", True),
    ("<answer>\\boxed{4}</answer> later \\boxed{3}", "4", True),
    ("<answer>\\boxed{3}</answer><answer>\\boxed{4}</answer>", "3", False),
    # no boxed / fallback to the last boxed outside the answer tag
    ("<answer>42</answer>", "42", False),
    ("The answer is 42.", "42", False),
    ("So it is \\boxed{42}.", "42", True),
    ("First \\boxed{41}, finally \\boxed{42}", "42", True),
    ("<answer>\\boxed{}</answer>", "0", False),
    ("<answer>\\boxed{42</answer>", "42", False),
    # boxed inside tool code / tool output is not the model's answer
    ('<tool_call>{"name": "python", "arguments": {"code": "print(\'\\\\boxed{42}\')"}}</tool_call>'
     "<tool_response>\n\\boxed{42}\n</tool_response>", "42", False),
    # text around the number
    ("<answer>Therefore Alice has $\\boxed{17}$ apples in total.</answer>", "17", True),
    (resp("17 \\text{ cm}"), "17", True),
    # wrong but close
    (resp("1000001"), "1000000", False),
    (resp("3.0000001"), "3", False),
    (resp("99"), "100", False),
    (resp("0.3333"), "1/3", False),
    # huge integers
    (resp("123456789012345678901234567890"), "123456789012345678901234567890", True),
    (resp("123456789012345678901234567891"), "123456789012345678901234567890", False),
    (resp(HUGE), HUGE, True),
    (resp(HUGE[:-1] + "8"), HUGE, False),
    (resp("2^{100}"), "1267650600228229401496703205376", True),
]


def test_table_is_large_enough():
    assert len(CASES) >= 40
    assert sum(1 for *_, ok in CASES if ok) >= 15 and sum(1 for *_, ok in CASES if not ok) >= 15


@pytest.mark.parametrize("response,gold,expected", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_answer_table(response: str, gold: str, expected: bool):
    extracted = extract_answer(response)
    verdict = False if extracted is None else check_inline(extracted.text, gold)
    assert verdict is expected, (extracted, gold)


def test_answer_tag_wins_over_later_boxed_and_reports_its_source():
    found = extract_answer("<answer>\\boxed{4}</answer> then \\boxed{3}")
    assert found is not None and found.text == "4" and found.source == "answer_tag"
    found = extract_answer("no tag \\boxed{3}")
    assert found is not None and found.source == "last_boxed"


def test_last_boxed_source_ignores_answer_tag():
    found = extract_answer("<answer>\\boxed{4}</answer> then \\boxed{3}", LAST_BOXED)
    assert found is not None and found.text == "3"


def test_unknown_source_is_an_error():
    with pytest.raises(ValueError):
        extract_answer("x", "first_boxed")  # type: ignore[arg-type]


def test_find_boxed_matches_nested_and_escaped_braces():
    assert find_boxed("\\boxed{\\frac{a}{\\sqrt{b}}} and \\fbox{\\{1\\}} and \\boxed 7$") == [
        "\\frac{a}{\\sqrt{b}}",
        "\\{1\\}",
        "7",
    ]
    assert find_boxed("\\boxed{unclosed {") == []


def test_unclosed_answer_tag_runs_to_the_end():
    found = extract_answer("<answer>The answer is \\boxed{12}")
    assert found is not None and found.text == "12" and found.source == "answer_tag"


def test_runaway_answer_is_not_checked_symbolically():
    runaway = "1+" * 2000 + "1"
    assert extract_answer(resp(runaway)) is not None
    assert check_inline(runaway, runaway) is False


@pytest.mark.parametrize(
    "text,canonical",
    [("1,000", "1000"), ("-0", "0"), ("+0012", "12"), ("$-3$", "-3"), ("1{,}234{,}567", "1234567"),
     ("\\(5\\)", "5"), ("12.", "12"), ("1,2", None), ("1.5", None), ("12,34", None), ("x", None), ("", None)],
)
def test_canonical_integer(text: str, canonical: str | None):
    assert canonical_integer(text) == canonical


def test_integer_fast_path_leaves_non_integers_to_math_verify():
    assert integer_verdict("1/2", "0.5") is None
    assert integer_verdict("10", "1e1") is None
    assert integer_verdict("1,000", "1000") is True
