"""Gold answers (cleaning, integer canonicalisation, kinds) and bare problem texts (the known
answer instructions stripped; the de-duplication key)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.datasets import (
    INSTRUCTION_PHRASES,
    answer_kind,
    canonical_integer,
    clean_answer,
    normalise_problem,
    parse_integer_answer,
    strip_instructions,
)

# --------------------------------------------------------------------------- cleaning


@pytest.mark.parametrize("value,expected", [
    (34, "34"), ("34", "34"), (" 034 ", "34"), ("-0", "0"), ("+7", "7"), (34.0, "34"), ("1,000", "1000"),
    ("$5$", "5"), ("\\boxed{12}", "12"), ("$\\boxed{ 12 }$", "12"), ("\\(7\\)", "7"), ("$$-3$$", "-3"),
    ("5.", "5"), (["84"], "84"), (0.75, "0.75"),
    ("\\frac{3}{4}", "\\frac{3}{4}"), ("$\\frac{3}{4}$", "\\frac{3}{4}"), ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
    ("2\\sqrt{2}", "2\\sqrt{2}"), ("(1,2)", "(1,2)"), ("[0, 1)", "[0, 1)"), ("x^2 + 1", "x^2 + 1"),
    ("\\boxed{1}+\\boxed{2}", "\\boxed{1}+\\boxed{2}"),  # not one box around the whole answer: verbatim
])
def test_answers_are_cleaned(value, expected):
    assert clean_answer(value) == expected


@pytest.mark.parametrize("value,reason", [
    (None, "missing"), ("", "empty"), ("   ", "empty"), ("$ $", "empty"), ("\\boxed{}", "empty"),
    (True, "a boolean (True), not an answer"), ([], "an empty list, no answer"),
    (["1", "2"], "a list of 2 answers (one expected)"), (float("inf"), "not a finite number (inf)"),
    ({"a": 1}, "a dict, not an answer (a string or a number expected)"),
])
def test_bad_answers_are_refused_with_the_reason(value, reason):
    with pytest.raises(ValueError) as info:
        clean_answer(value)
    assert str(info.value) == reason


@pytest.mark.parametrize("answer,kind", [
    ("34", "integer"), ("-7", "integer"), ("0.75", "decimal"), ("-.5", "decimal"),
    ("\\frac{3}{4}", "fraction"), ("\\dfrac{3}{4}", "fraction"), ("-3/4", "fraction"), ("\\frac34", "fraction"),
    ("2\\sqrt{2}", "radical"), ("\\frac{1+\\sqrt{5}}{2}", "radical"), ("\\sqrt[3]{2}", "radical"),
    ("(1,2)", "tuple"), ("(1, 2, 3)", "tuple"), ("\\{1, 2\\}", "tuple"), ("1, 2, 3", "tuple"), ("(\\frac{1}{2}, 3)", "tuple"),
    ("[0, 1)", "interval"), ("(0, 1]", "interval"), ("[0,1]", "interval"), ("(-\\infty, 2]", "interval"),
    ("(0,1) \\cup (2,3)", "interval"), ("\\left[0, 1\\right)", "interval"),
    ("\\pi", "expression"), ("x^2+1", "expression"), ("\\text{yes}", "expression"), ("(1)(2)", "expression"),
])
def test_answer_kinds(answer, kind):
    assert answer_kind(answer) == kind


@pytest.mark.parametrize("value,expected", [(5, "5"), ("-12", "-12"), ("+7", "7"), ("007", "7"), (3.0, "3")])
def test_strict_integer_answers_are_canonicalised(value, expected):
    assert parse_integer_answer(value) == expected


@pytest.mark.parametrize("value", ["1e3", "1/2", "", "١٢", "12a", 2.5, None, [1]])
def test_strict_parser_rejects_non_integers(value):
    with pytest.raises(ValueError):
        parse_integer_answer(value)


# --------------------------------------------------------------------------- problem texts


def test_dapo_instruction_is_stripped_from_both_ends():
    text = ("Solve the following math problem step by step. The last line of your response should be of the form "
            "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
            "Find $x$ if $2x = 10$.\n\nRemember to put your answer on its own line after \"Answer:\".")
    assert strip_instructions(text) == "Find $x$ if $2x = 10$."


@pytest.mark.parametrize("phrase,where", INSTRUCTION_PHRASES)
def test_every_listed_instruction_is_stripped_where_it_stands(phrase, where):
    problem = "What is $6 \\times 7$?"
    if where in ("prefix", "either"):
        assert strip_instructions(f"{phrase}\n{problem}") == problem
        # Whitespace and case may differ; a final period may be missing.
        assert strip_instructions(f"  {phrase.upper().replace(' ', chr(10))}  {problem}") == problem
    if where in ("suffix", "either"):
        assert strip_instructions(f"{problem} {phrase}") == problem
        assert strip_instructions(f"{problem}\n\n{phrase.rstrip('.')}") == problem


def test_instructions_inside_a_problem_are_kept():
    text = "A teacher says: Let's think step by step and output the final answer within \\boxed{}. Then what is 2+2?"
    assert strip_instructions(text) == text
    assert strip_instructions("  Just a problem.  ") == "Just a problem."


def test_a_suffix_only_phrase_is_not_removed_from_the_start():
    text = 'Remember to put your answer on its own line after "Answer:". What is 1+1?'
    assert strip_instructions(text) == text


def test_normalised_problem_ignores_case_and_spacing():
    assert normalise_problem("  Find  the AREA\nof $ABC$. ") == normalise_problem("find the area of $abc$.")
    assert normalise_problem("Find x.") != normalise_problem("Find y.")
