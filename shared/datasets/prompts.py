"""The bare problem text of a dataset's prompt, and the key problems are de-duplicated by.

Datasets prepared for other trainers wrap each problem in *their* answer instruction (DAPO:
"... of the form Answer: $Answer ..." before it and "Remember to put your answer on its own
line after "Answer:"." after it; verl's examples: "Let's think step by step and output the
final answer within \\boxed{}."). This pipeline's conversation format adds the instruction of
the run's prompt preset (``shared/formats/presets.py``, ``format: {preset: ...}`` in the run
config), so a loaded problem keeps only the problem: :func:`strip_instructions` removes every phrase of
:data:`INSTRUCTION_PHRASES` found at the start or the end of the text, repeatedly.

The list below is the one place these instructions are known. Matching is case-insensitive and
any run of whitespace in a phrase matches any run of whitespace in the text; a phrase is only
removed where it stands at the start (``"prefix"``), at the end (``"suffix"``) or at either end
(``"either"``), never from the middle of a problem.
"""

from __future__ import annotations

import functools
import re
from typing import Literal

Where = Literal["prefix", "suffix", "either"]

# (phrase, where it stands). Add a dataset's instruction here, with where it was seen.
INSTRUCTION_PHRASES: tuple[tuple[str, Where], ...] = (
    # DAPO-Math-17k (BytedTsinghua-SIA), as shipped in verl's parquet.
    ("Solve the following math problem step by step. The last line of your response should be of the form "
     "Answer: $Answer (without quotes) where $Answer is the answer to the problem.", "prefix"),
    ('Remember to put your answer on its own line after "Answer:".', "suffix"),
    # verl's examples/data_preprocess (math, DeepScaleR, ...) and gsm8k.
    ("Let's think step by step and output the final answer within \\boxed{}.", "either"),
    ('Let\'s think step by step and output the final answer after "####".', "either"),
    # Qwen2.5-Math / DeepSeek-R1 evaluation prompts and the many sets built with them.
    ("Please reason step by step, and put your final answer within \\boxed{}.", "either"),
    ("Put your final answer within \\boxed{}.", "either"),
    # NuminaMath-style and OpenMathReasoning-style instructions.
    ("Return your final response as 'Final Answer: \\boxed{<answer>}', where <answer> is the number or "
     "mathematical expression of the solution.", "either"),
    ("Solve the following math problem. Make sure to put the answer (and only answer) inside \\boxed{}.", "prefix"),
)


def _phrase_regex(phrase: str) -> str:
    words = phrase.split()
    body = r"\s+".join(re.escape(w) for w in words)
    # A final period is optional (some copies drop it).
    return body[: -len(re.escape("."))] + r"\.?" if phrase.endswith(".") else body


def _compile() -> tuple[re.Pattern[str], ...]:
    patterns = []
    for phrase, where in INSTRUCTION_PHRASES:
        body = _phrase_regex(phrase)
        if where in ("prefix", "either"):
            patterns.append(re.compile(rf"\A\s*{body}", re.IGNORECASE))
        if where in ("suffix", "either"):
            patterns.append(re.compile(rf"{body}\s*\Z", re.IGNORECASE))
    return tuple(patterns)


_PATTERNS = _compile()


@functools.lru_cache(maxsize=1 << 15)  # DAPO-Math-17k repeats each prompt ~100 times
def strip_instructions(text: str) -> str:
    """``text`` without the known answer instructions at its ends, whitespace-stripped."""
    s = text.strip()
    changed = True
    while changed:
        changed = False
        for pattern in _PATTERNS:
            new = pattern.sub("", s, count=1).strip()
            if new != s:
                s, changed = new, True
    return s


def normalise_problem(text: str) -> str:
    """The de-duplication key: case-folded, every run of whitespace one space, stripped."""
    return " ".join(text.casefold().split())
