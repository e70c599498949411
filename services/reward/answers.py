"""Answer extraction and checking (pure: no I/O, no pools, no clocks).

Extraction
    The policy answers as ``<answer>... \\boxed{N} ...</answer>`` (see :mod:`shared.formats.tags`).
    :func:`extract_answer` returns the content of the *last* ``\\boxed{...}`` inside the answer
    blocks; with :data:`ANSWER_TAG_THEN_LAST_BOXED` (the default source) a response without a
    boxed answer inside ``<answer>`` falls back to the last ``\\boxed{}`` of the whole response,
    with :data:`LAST_BOXED` only the last ``\\boxed{}`` of the response counts. Text the model did
    not write as its answer is never searched: ``<tool_call>`` code and ``<tool_response>`` output
    are cut out first (a program may well print ``\\boxed{...}``). Braces are matched with a
    counter that skips the escaped ``\\{``/``\\}`` of set notation, so nested braces
    (``\\boxed{\\frac{1}{\\sqrt{2}}}``) come out whole; an unclosed ``\\boxed{`` is no answer.
    ``\\fbox{}`` and the brace-less ``\\boxed 5`` are accepted as well.

Checking
    :func:`integer_verdict` is the fast path: when both sides are integer literals after removing
    LaTeX spacing (``\\,`` ``\\!`` ``\\ `` ``~``), dollar signs, a trailing period and thousands
    separators (``1,000`` ``1{,}000`` ``1\\,000`` ``1 000``), the answer is decided by comparing
    canonical digit strings — exact for integers of any size (Python's int() refuses more than
    4300 digits, sympy goes through it) and ``-0 == 0``. Anything else goes to
    :func:`symbolic_equal` (math-verify: fractions vs decimals, ``\\dfrac``, powers, sets,
    intervals, equations ``x=5`` vs ``5``, units text), which can hang on adversarial input and
    therefore runs in a worker process with a hard timeout (:mod:`services.reward.checker`).
    A side that is an integer literal is handed to math-verify in its canonical form, because
    math-verify reads ``1 000`` as the product ``1*0``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from shared.datasets.answers import canonical_integer
from shared.datasets.answers import matching_brace as _matching_brace
from shared.formats.tags import (
    ANSWER_END,
    ANSWER_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    TOOL_RESPONSE_END,
    TOOL_RESPONSE_START,
)

AnswerSource = Literal["answer_tag_then_last_boxed", "last_boxed"]
ANSWER_TAG_THEN_LAST_BOXED: AnswerSource = "answer_tag_then_last_boxed"
LAST_BOXED: AnswerSource = "last_boxed"

# A non-integer answer longer than this is a runaway generation, not a math answer; checking it
# symbolically only risks a hang, so it counts as incorrect (integers of any length are compared
# exactly by the fast path).
MAX_SYMBOLIC_ANSWER_CHARS = 1000

_BOX_COMMANDS = ("\\boxed", "\\fbox")


@dataclass(frozen=True)
class ExtractedAnswer:
    text: str
    # "answer_tag": the last \boxed{} inside <answer>; "last_boxed": the response's last \boxed{}.
    source: Literal["answer_tag", "last_boxed"]


# --------------------------------------------------------------------------- extraction


def _cut_blocks(text: str, start: str, end: str) -> str:
    """Remove every ``start ... end`` block (an unclosed one runs to the end of the text)."""
    out: list[str] = []
    pos = 0
    while True:
        i = text.find(start, pos)
        if i < 0:
            out.append(text[pos:])
            return "".join(out)
        out.append(text[pos:i])
        j = text.find(end, i + len(start))
        if j < 0:
            return "".join(out)
        pos = j + len(end)


def model_written_text(response_text: str) -> str:
    """The response without tool-call code and tool output: only what the model wrote as prose."""
    text = _cut_blocks(response_text, TOOL_RESPONSE_START, TOOL_RESPONSE_END)
    return _cut_blocks(text, TOOL_CALL_START, TOOL_CALL_END)


def find_boxed(text: str) -> list[str]:
    """Contents of every well-formed ``\\boxed{...}`` / ``\\fbox{...}`` / ``\\boxed N`` in order."""
    found: list[tuple[int, str]] = []
    for cmd in _BOX_COMMANDS:
        pos = 0
        while True:
            i = text.find(cmd, pos)
            if i < 0:
                break
            j = i + len(cmd)
            pos = j
            if j < len(text) and (text[j].isalpha()):
                continue  # another command that merely starts with \boxed (e.g. \boxedx)
            k = j
            while k < len(text) and text[k] in " \t":
                k += 1
            if k < len(text) and text[k] == "{":
                end = _matching_brace(text, k)
                if end < 0:
                    continue  # unclosed: not an answer
                found.append((i, text[k + 1 : end]))
                pos = end + 1
            elif k > j:  # "\boxed 5": the brace-less form takes one token
                m = re.match(r"[^\s$}<]+", text[k:])
                if m:
                    found.append((i, m.group(0)))
                    pos = k + m.end()
    found.sort(key=lambda item: item[0])
    return [content for _, content in found]


def answer_blocks(text: str) -> list[str]:
    """Contents of the ``<answer>`` blocks; an unclosed last one runs to the end of the text
    (generation may stop on the token budget right after the boxed answer)."""
    blocks: list[str] = []
    pos = 0
    while True:
        i = text.find(ANSWER_START, pos)
        if i < 0:
            return blocks
        j = text.find(ANSWER_END, i + len(ANSWER_START))
        if j < 0:
            blocks.append(text[i + len(ANSWER_START) :])
            return blocks
        blocks.append(text[i + len(ANSWER_START) : j])
        pos = j + len(ANSWER_END)


def extract_answer(response_text: str, source: AnswerSource = ANSWER_TAG_THEN_LAST_BOXED) -> ExtractedAnswer | None:
    """The model's final answer, or None when it gave none (see the module docstring)."""
    if source not in (ANSWER_TAG_THEN_LAST_BOXED, LAST_BOXED):
        raise ValueError(f"unknown answer source {source!r}")
    text = model_written_text(response_text)
    found: ExtractedAnswer | None = None
    if source == ANSWER_TAG_THEN_LAST_BOXED:
        for block in reversed(answer_blocks(text)):
            boxed = [b for b in find_boxed(block) if b.strip()]
            if boxed:
                found = ExtractedAnswer(boxed[-1].strip(), "answer_tag")
                break
    if found is None:
        boxed = [b for b in find_boxed(text) if b.strip()]
        if boxed:
            found = ExtractedAnswer(boxed[-1].strip(), "last_boxed")
    return found


# --------------------------------------------------------------------------- integer fast path

def integer_verdict(predicted: str, gold: str) -> bool | None:
    """True/False when both sides are integer literals (decided exactly), else None."""
    p = canonical_integer(predicted)
    g = canonical_integer(gold)
    if p is None or g is None:
        return None
    return p == g


# --------------------------------------------------------------------------- symbolic check


def _as_boxed(text: str) -> str:
    integer = canonical_integer(text)
    body = integer if integer is not None else text
    return body if "\\boxed" in body else f"\\boxed{{{body}}}"


def too_long_for_symbolic(predicted: str) -> bool:
    return len(predicted) > MAX_SYMBOLIC_ANSWER_CHARS


def symbolic_equal(predicted: str, gold: str) -> bool:
    """math-verify's equivalence of two answers (CPU-bound, may hang: call it in a worker with a
    hard timeout). Its own signal-based timeouts are off; the caller owns the timeout."""
    if too_long_for_symbolic(predicted):
        return False
    from math_verify import parse, verify  # heavy import (sympy): paid once per worker process

    gold_parsed = parse(_as_boxed(gold), parsing_timeout=None)
    pred_parsed = parse(_as_boxed(predicted), parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def check_inline(predicted: str, gold: str) -> bool:
    """Both paths in this process, without a timeout: for tests and offline tools only."""
    fast = integer_verdict(predicted, gold)
    return fast if fast is not None else symbolic_equal(predicted, gold)
