"""Gold answers of loaded problem sets: cleaning, integer canonicalisation and answer kinds.

Pure string code (no sympy, no math-verify): the reward service grades answers
(``services/reward/answers.py``: the exact integer fast path, math-verify for everything else);
this module only decides what string a dataset's answer is stored as.

* :func:`clean_answer` — the stored gold answer: whitespace stripped, a surrounding ``$...$``,
  ``$$...$$``, ``\\(...\\)``, ``\\[...\\]`` or ``\\boxed{...}`` / ``\\fbox{...}`` removed; an
  integer-valued answer becomes its canonical decimal string (``"1,000"`` → ``"1000"``,
  ``"007"`` → ``"7"``, ``34.0`` → ``"34"``); any other answer (fractions, radicals, tuples,
  intervals, expressions) is kept verbatim. Missing, empty and non-scalar answers raise
  ``ValueError`` with the reason.
* :func:`canonical_integer` — the integer fast path's canonical form; the reward service's
  exact integer check (``services/reward/answers.py``) uses this same function.
* :func:`answer_kind` — integer, decimal, fraction, radical, tuple, interval or expression:
  what ``rstar data inspect`` counts.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

# --------------------------------------------------------------------------- integers
#
# canonical_integer and matching_brace serve both the dataset loader (how a gold answer is stored)
# and the reward service (the exact integer verdict, \boxed{} extraction).

_SPACING = re.compile(r"\\[,!;:> ]|~|\\quad|\\qquad|\\text\{\s*\}")
_WRAPPERS = (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("{", "}"))
_PLAIN_INT = re.compile(r"[+-]?\d+")
_THOUSANDS_COMMA = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+")
_THOUSANDS_SPACE = re.compile(r"[+-]?\d{1,3}(?: \d{3})+")


def matching_brace(text: str, open_pos: int) -> int:
    """Index of the ``}`` closing the ``{`` at ``open_pos``, or -1. ``\\{`` and ``\\}`` are literals."""
    depth = 0
    i = open_pos
    n = len(text)
    while i < n:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return -1


def canonical_integer(text: str) -> str | None:
    """``"-1,000"`` → ``"-1000"``, ``"007"`` → ``"7"``, ``"-0"`` → ``"0"``; None for a non-integer."""
    s = text.strip()
    changed = True
    while changed:
        changed = False
        for left, right in _WRAPPERS:
            if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
                inner = s[len(left) : len(s) - len(right)]
                if left != "{" or matching_brace(s, 0) == len(s) - 1:
                    s, changed = inner.strip(), True
        if s.endswith("."):
            s, changed = s[:-1].rstrip(), True
    s = s.replace("{,}", ",")
    s = _SPACING.sub(" ", s)
    s = re.sub(r"\s+", " ", s).strip()
    s = re.sub(r"^([+-]) ", r"\1", s)
    if _PLAIN_INT.fullmatch(s):
        digits = s
    elif _THOUSANDS_COMMA.fullmatch(s):
        digits = s.replace(",", "")
    elif _THOUSANDS_SPACE.fullmatch(s):
        digits = s.replace(" ", "")
    else:
        return None
    sign = "-" if digits.startswith("-") else ""
    body = digits.lstrip("+-").lstrip("0") or "0"
    return body if body == "0" else sign + body


def parse_integer_answer(value: Any) -> str:
    """The canonical decimal string of an integer answer; raises ValueError with the reason.

    Strict (the generated problems' contract): loaded datasets use :func:`clean_answer`, which
    also accepts non-integer answers."""
    if isinstance(value, bool):
        raise ValueError(f"answer must be an integer, got boolean {value!r}")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
        raise ValueError(f"answer must be an integer, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        body = text[1:] if text[:1] in ("+", "-") else text
        if body.isascii() and body.isdigit():
            return str(int(text))
        raise ValueError(f"answer must be an integer, got {value!r}")
    if value is None:
        raise ValueError("missing 'answer'")
    raise ValueError(f"answer must be an integer, got {type(value).__name__}")


# --------------------------------------------------------------------------- cleaning

_MATH_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _unwrap_once(s: str) -> str | None:
    """``s`` without one surrounding math delimiter or box command, or None when it has none."""
    for left, right in _MATH_DELIMITERS:
        if len(s) > len(left) + len(right) and s.startswith(left) and s.endswith(right):
            return s[len(left) : len(s) - len(right)].strip()
    for cmd in _BOX_COMMANDS:
        if s.startswith(cmd):
            k = len(cmd)
            while k < len(s) and s[k] == " ":
                k += 1
            if k < len(s) and s[k] == "{" and matching_brace(s, k) == len(s) - 1:
                return s[k + 1 : -1].strip()
    return None


def unwrap_answer(text: str) -> str:
    """``text`` stripped of whitespace and of surrounding ``$..$`` / ``\\boxed{..}`` (nested too)."""
    s = text.strip()
    while (inner := _unwrap_once(s)) is not None:
        s = inner
    return s


def clean_answer(value: Any) -> str:
    """The gold answer as stored (see the module docstring); ValueError(reason) for a bad one."""
    if value is None:
        raise ValueError("missing")
    if isinstance(value, bool):
        raise ValueError(f"a boolean ({value!r}), not an answer")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"not a finite number ({value!r})")
        if value.is_integer() and abs(value) < 2**53:
            return str(int(value))
        return repr(value)
    if isinstance(value, (list, tuple)):
        # verl datasets sometimes store ground truths as a list of accepted answers.
        if len(value) == 1:
            return clean_answer(value[0])
        if not value:
            raise ValueError("an empty list, no answer")
        raise ValueError(f"a list of {len(value)} answers (one expected)")
    if not isinstance(value, str):
        raise ValueError(f"a {type(value).__name__}, not an answer (a string or a number expected)")
    return _clean_text(value)


@functools.lru_cache(maxsize=1 << 15)  # datasets repeat answers (and DAPO-Math-17k whole rows)
def _clean_text(value: str) -> str:
    s = unwrap_answer(value)
    if not s:
        raise ValueError("empty")
    integer = canonical_integer(s)
    return integer if integer is not None else s


# --------------------------------------------------------------------------- kinds

ANSWER_KINDS = ("integer", "decimal", "fraction", "radical", "tuple", "interval", "expression")

_DECIMAL = re.compile(r"[+-]?(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?")
_NUMBER = r"[+-]?\d+(?:\.\d+)?"
_FRACTION = re.compile(rf"[+-]?(?:\\[dt]?frac\{{\s*{_NUMBER}\s*\}}\{{\s*{_NUMBER}\s*\}}|\\[dt]?frac\d\d|{_NUMBER}\s*/\s*{_NUMBER})")
_RADICAL = re.compile(r"\\sqrt|√|\\root")
_INTERVAL_HINT = re.compile(r"\\cup|\\infty|∞")


def _top_level_commas(inner: str) -> int:
    """Commas of ``inner`` outside any brackets or braces."""
    depth = 0
    count = 0
    for c in inner:
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            count += 1
    return count


def answer_kind(answer: str) -> str:
    """One of :data:`ANSWER_KINDS` for a cleaned answer (heuristic, for reports only).

    integer ``34`` · decimal ``0.75`` · fraction ``\\frac{3}{4}``, ``-3/4`` · radical
    ``2\\sqrt{2}``, ``\\frac{1+\\sqrt5}{2}`` · tuple ``(1,2)``, ``\\{1, 2\\}``, ``1, 2, 3`` ·
    interval ``[0, 1)``, ``[0, 1]``, ``(-\\infty, 2]``, ``(0,1) \\cup (2,3)`` · expression
    (anything else: ``\\pi``, ``x^2+1``, ``\\text{yes}``)."""
    s = unwrap_answer(answer)
    s = s.replace("\\left", "").replace("\\right", "").strip()
    if canonical_integer(s) is not None:
        return "integer"
    if _DECIMAL.fullmatch(s):
        return "decimal"
    if _INTERVAL_HINT.search(s) and s[:1] in "([" and s[-1:] in ")]":
        return "interval"
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _matching_bracket_span(s):
        commas = _top_level_commas(s[1:-1])
        if commas >= 1:
            mixed = (s[0], s[-1]) in (("[", ")"), ("(", "]"))
            if mixed or (s[0] == "[" and commas == 1):
                return "interval"
            return "tuple"
    if s.startswith("\\{") and s.endswith("\\}"):
        return "tuple"
    if _top_level_commas(s) >= 1 and canonical_integer(s) is None:
        return "tuple"
    if _RADICAL.search(s):
        return "radical"
    if _FRACTION.fullmatch(s):
        return "fraction"
    return "expression"


def _matching_bracket_span(s: str) -> bool:
    """Whether the opening bracket of ``s`` closes only at its last character."""
    depth = 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0 and i != len(s) - 1:
                return False
    return depth == 0
