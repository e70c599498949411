"""Stage-0 SFT traces: tool-using solutions of generated problems, in the rollout's format.

A trace is one assistant message in the format of ``shared/chat_format.py``::

    {reasoning}\\n<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>
    \\n<tool_response>\\n{REAL output of that code}\\n</tool_response>\\n
    [{reasoning about the error}\\n<tool_call>...fixed code...</tool_call>\\n<tool_response>...]
    <answer>The answer is \\boxed{N}</answer><|im_end|>

The code is written from the problem's ``kind`` / ``params`` (``shared/datasets/generated.py``)
in one of a few equivalent styles, and is *run* at generation time (in-process ``exec``: the
code is our own, trusted and fast; errors are reported exactly as the tool executor reports
them and stdout/stderr joined as the rollout joins them, see ``run_code``) so every
``<tool_response>`` holds what the program really printed; the trace fails loudly if the printed value is not the problem's answer. About
``BUGGY_FRACTION`` of traces start with a buggy call (an undefined name, a missing import, a
function that does not exist, a type error) whose real traceback is shown and which the next
call fixes: the model sees how to recover from tool errors. Each buggy call is executed and
must fail; each fixed call must succeed (checked, not assumed).

Tokenisation — segment by segment, exactly like the rollout
---------------------------------------------------------
The rollout builds a response from separately tokenised pieces: the tokens the model samples
up to and including the stop token ``</tool_call>``, then the tool response
(``chat_format.format_tool_response(output)``, i.e. ``"\\n<tool_response>\\n...\\n</tool_response>\\n"``)
tokenised ON ITS OWN and appended with loss_mask 0, then the next sampled tokens, and so on
until ``<|im_end|>``. A trace is therefore tokenised the same way: the prompt
(``render_prompt(problem)``) alone, then each model segment and each tool segment alone,
without special-token insertion, and concatenated. Tokenising the whole text at once could
merge bytes across a segment boundary and produce ids the rollout never sees. The mask is 1 on
every model-segment token (including ``</tool_call>`` and the final ``<|im_end|>``) and 0 on
every tool-segment token, so decoding the mask-1 tokens gives exactly the model-written text.

Copy drills
-----------
Solving a problem takes two exact digit-by-digit copies: the problem's numbers into the code and
the printed result into ``\\boxed{}``. A tiny model learns copying slowly from whole traces
(a copied digit is about one loss token in eight): after 12 minutes on two cores it still wrote
the first digit and then repeated it ("1111222" for "6481728"), scoring 0 on held-out problems.
:func:`make_copy_drill` adds short examples whose loss tokens are almost all copied digits —
``Repeat 48213 * 731 + 2290`` answered by ``<answer>The answer is \\boxed{48213 * 731 + 2290}</answer>`` —
without the system prompt (3x cheaper; they teach a skill, not the format). With them the
copy circuit forms within the bootstrap budget (docs/data.md has the measurements).

Rows written by :func:`write_traces_jsonl`: ``{"problem_id", "prompt_token_ids",
"response_token_ids", "loss_mask"}`` — ``services/learner`` packs them as ``TrainSequence``.
"""

from __future__ import annotations

import contextlib
import io
import json
import linecache
import random
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared import chat_format as cf

from shared.datasets.problem import Problem

# Fraction of traces whose first tool call is buggy and fixed by the second (as in the
# platform experiment: enough to teach recovery, few enough not to teach sloppy first calls).
BUGGY_FRACTION = 0.2


# --------------------------------------------------------------------------- running code


@dataclass(frozen=True)
class CodeRun:
    ok: bool
    output: str  # what the tool response shows (see ``tool_output_text``)


# The file name the tool executor compiles cells under (services/tool_executor/zygote.py), so
# tracebacks in traces read exactly like the ones the policy sees during RL.
CELL_FILENAME = "<cell>"


def run_code(code: str) -> CodeRun:
    """Run trusted generated code in-process, reporting like the tool executor does.

    Mirrors ``services/tool_executor/zygote.py``: the cell is compiled as ``<cell>`` with its
    source registered in ``linecache`` (tracebacks show the failing line), errors are printed
    by ``traceback.print_exception`` starting at the cell's frame, stdout and stderr are kept
    apart and joined by :func:`tool_output_text`.
    """
    out, err = io.StringIO(), io.StringIO()
    namespace: dict[str, Any] = {"__name__": "__main__"}
    linecache.cache[CELL_FILENAME] = (len(code), None, code.splitlines(True), CELL_FILENAME)
    ok = True
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, CELL_FILENAME, "exec"), namespace)  # noqa: S102 — trusted code written by this module
    except Exception as exc:  # noqa: BLE001 — any error is the tool output
        ok = False
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # start at the cell's frame
        traceback.print_exception(type(exc), exc, tb, file=err)
    return CodeRun(ok, tool_output_text(out.getvalue(), err.getvalue()))


# The rollout composes tool responses with the same function (shared.chat_format).
tool_output_text = cf.tool_output_text


# --------------------------------------------------------------------------- code per kind
#
# For each kind: correct programs (equivalent styles, one picked at random) and buggy first
# attempts. A buggy attempt comes with the sentence the model writes after seeing the error
# and the fixed program.


def _correct_codes(kind: str, p: dict[str, int]) -> list[str]:
    if kind == "arith":
        op = "+" if p["sign"] > 0 else "-"
        return [
            f"print({p['a']} * {p['b']} {op} {p['c']})",
            f"a = {p['a']}\nb = {p['b']}\nc = {p['c']}\nprint(a * b {op} c)",
        ]
    if kind == "modpow":
        return [
            f"print(pow({p['a']}, {p['k']}, {p['m']}))",
            f"a, k, m = {p['a']}, {p['k']}, {p['m']}\nprint(pow(a, k, m))",
        ]
    if kind == "digit_sum_power":
        return [
            f"print(sum(int(d) for d in str({p['a']} ** {p['k']})))",
            f"n = {p['a']} ** {p['k']}\nprint(sum(map(int, str(n))))",
        ]
    if kind == "gcd":
        return [
            f"import math\nprint(math.gcd({p['a']}, {p['b']}))",
            f"a, b = {p['a']}, {p['b']}\nwhile b:\n    a, b = b, a % b\nprint(a)",
        ]
    if kind == "lcm":
        return [
            f"import math\nprint(math.lcm({p['a']}, {p['b']}))",
            f"import math\na, b = {p['a']}, {p['b']}\nprint(a * b // math.gcd(a, b))",
        ]
    if kind == "primes_below":
        return [
            f"n = {p['n']}\nsieve = [True] * n\nsieve[0] = sieve[1] = False\n"
            "for i in range(2, int(n ** 0.5) + 1):\n    if sieve[i]:\n"
            "        sieve[i * i::i] = [False] * len(range(i * i, n, i))\nprint(sum(sieve))",
        ]
    if kind == "binomial":
        return [
            f"import math\nprint(math.comb({p['n']}, {p['k']}))",
            f"from math import comb\nprint(comb({p['n']}, {p['k']}))",
        ]
    raise ValueError(f"no solution code for problem kind {kind!r}")


def _buggy_codes(kind: str, p: dict[str, int]) -> list[tuple[str, str, str]]:
    """(buggy code, what the model says after the error, the fixed code) triples."""
    typo = "I misspelled a variable name; let me fix it."
    no_import = "I forgot to import math."

    def misspelled(expr: str) -> tuple[str, str, str]:
        return f"result = {expr}\nprint(reslt)", typo, f"result = {expr}\nprint(result)"

    def missing_import(call: str) -> tuple[str, str, str]:
        return f"print({call})", no_import, f"import math\nprint({call})"

    def wrong_name(bad: str, good: str, args: str, note: str) -> tuple[str, str, str]:
        return f"import math\nprint(math.{bad}({args}))", note, f"import math\nprint(math.{good}({args}))"

    if kind == "arith":
        op = "+" if p["sign"] > 0 else "-"
        expr = f"{p['a']} * {p['b']} {op} {p['c']}"
        return [
            (f"print(a * b {op} c)", "I forgot to define the variables; let me define them.",
             f"a = {p['a']}\nb = {p['b']}\nc = {p['c']}\nprint(a * b {op} c)"),
            misspelled(expr),
        ]
    if kind == "modpow":
        args = f"{p['a']}, {p['k']}, {p['m']}"
        return [
            (f"import math\nprint(math.powmod({args}))",
             "math has no powmod; the built-in pow takes a modulus.", f"print(pow({args}))"),
            misspelled(f"pow({args})"),
        ]
    if kind == "digit_sum_power":
        power = f"{p['a']} ** {p['k']}"
        return [
            (f"print(sum(str({power})))", "I must convert each digit to int before summing.",
             f"print(sum(int(d) for d in str({power})))"),
            (f"n = {power}\nprint(sum(map(int, str(m))))", typo, f"n = {power}\nprint(sum(map(int, str(n))))"),
        ]
    if kind == "gcd":
        args = f"{p['a']}, {p['b']}"
        return [missing_import(f"math.gcd({args})"),
                wrong_name("gdc", "gcd", args, "The function is math.gcd; let me fix the name.")]
    if kind == "lcm":
        args = f"{p['a']}, {p['b']}"
        return [missing_import(f"math.lcm({args})"),
                wrong_name("lcd", "lcm", args, "The function is math.lcm; let me fix the name.")]
    if kind == "primes_below":
        return [(f"import math\nprint(math.primepi({p['n']}))", "math has no primepi; let me count with a sieve.",
                 _correct_codes(kind, p)[0])]
    if kind == "binomial":
        args = f"{p['n']}, {p['k']}"
        return [missing_import(f"math.comb({args})"),
                wrong_name("choose", "comb", args, "The function is math.comb; let me fix the name.")]
    raise ValueError(f"no buggy code for problem kind {kind!r}")


_OPENERS: dict[str, tuple[str, ...]] = {
    "arith": ("I will compute this with Python.", "Let me evaluate the expression exactly."),
    "modpow": ("Python's pow with a modulus computes this directly.", "Let me compute the modular power."),
    "digit_sum_power": ("The power is large, so I will compute it with Python.", "Let me compute the power and sum its digits."),
    "gcd": ("Let me compute the greatest common divisor.", "I will use Python to find the gcd."),
    "lcm": ("Let me compute the least common multiple.", "I will use Python to find the lcm."),
    "primes_below": ("I will count the primes with a sieve.", "Let me count them with Python."),
    "binomial": ("Let me compute the binomial coefficient.", "I will use Python to count the combinations."),
}


# --------------------------------------------------------------------------- traces


@dataclass(frozen=True)
class Segment:
    text: str
    from_model: bool  # True: written by the model (loss 1); False: tool response (loss 0)


@dataclass(frozen=True)
class Trace:
    problem: Problem
    segments: tuple[Segment, ...]
    buggy_first_call: bool
    codes: tuple[str, ...]  # every tool call's code, in order
    system: str | None = cf.SYSTEM_PROMPT  # the prompt's system turn (None for copy drills)

    @property
    def response_text(self) -> str:
        return "".join(s.text for s in self.segments)

    @property
    def model_text(self) -> str:
        return "".join(s.text for s in self.segments if s.from_model)


class TraceError(RuntimeError):
    """Generated code did not behave as the trace requires (a bug in the generator)."""


def make_trace(problem: Problem, rng: random.Random, *, buggy: bool | None = None) -> Trace:
    """One trace for a generated problem. ``buggy`` None: decided by ``BUGGY_FRACTION``."""
    if problem.kind is None or problem.params is None:
        raise ValueError(f"problem {problem.problem_id} has no generator kind/params; traces need them")
    kind, params = problem.kind, dict(problem.params)
    if buggy is None:
        buggy = rng.random() < BUGGY_FRACTION
    segments: list[Segment] = []
    codes: list[str] = []
    lead = rng.choice(_OPENERS[kind]) + "\n"
    if buggy:
        bad_code, fix_note, code = rng.choice(_buggy_codes(kind, params))
        run = run_code(bad_code)
        if run.ok:
            raise TraceError(f"buggy code for {problem.problem_id} ran without error:\n{bad_code}")
        segments.append(Segment(lead + cf.format_tool_call(bad_code), True))
        segments.append(Segment(cf.format_tool_response(run.output), False))
        codes.append(bad_code)
        lead = fix_note + "\n"
    else:
        code = rng.choice(_correct_codes(kind, params))
    run = run_code(code)
    if not run.ok or run.output.strip() != problem.answer:
        raise TraceError(
            f"solution code for {problem.problem_id} printed {run.output!r}, expected {problem.answer!r}:\n{code}"
        )
    segments.append(Segment(lead + cf.format_tool_call(code), True))
    segments.append(Segment(cf.format_tool_response(run.output), False))
    codes.append(code)
    segments.append(Segment(cf.format_answer(run.output.strip()) + cf.IM_END, True))
    return Trace(problem=problem, segments=tuple(segments), buggy_first_call=buggy, codes=tuple(codes))


def make_traces(problems: Iterable[Problem], *, seed: int) -> list[Trace]:
    rng = random.Random(f"traces:{seed}")
    return [make_trace(p, rng) for p in problems]


def _drill_number(rng: random.Random, min_digits: int, max_digits: int) -> str:
    digits = [rng.choice("0123456789") for _ in range(rng.randint(min_digits, max_digits))]
    if digits[0] == "0" and len(digits) > 1:
        digits[0] = rng.choice("123456789")
    return "".join(digits)


def make_copy_drill(rng: random.Random, index: int) -> Trace:
    """A copy drill (see the module docstring): half single numbers of 3-12 digits, half
    expressions of 2-3 numbers of 1-6 digits (the shape of the code the model writes)."""
    if rng.random() < 0.5:
        text = _drill_number(rng, 3, 12)
    else:
        op = " " + rng.choice("*+-,") + " "
        text = op.join(_drill_number(rng, 1, 6) for _ in range(rng.randint(2, 3)))
    problem = Problem(problem_id=f"drill-{index}", prompt=f"Repeat {text}", answer=text)
    return Trace(problem=problem, segments=(Segment(cf.format_answer(text) + cf.IM_END, True),),
                 buggy_first_call=False, codes=(), system=None)


def make_copy_drills(n: int, *, seed: int) -> list[Trace]:
    rng = random.Random(f"drills:{seed}")
    return [make_copy_drill(rng, i) for i in range(n)]


@dataclass(frozen=True)
class TokenizedTrace:
    problem_id: str
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    loss_mask: list[int]

    def to_row(self) -> dict[str, Any]:
        return {
            "problem_id": self.problem_id,
            "prompt_token_ids": self.prompt_token_ids,
            "response_token_ids": self.response_token_ids,
            "loss_mask": self.loss_mask,
        }


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def tokenize_trace(trace: Trace, tokenizer) -> TokenizedTrace:
    """Token ids and loss mask, built segment by segment (see the module docstring)."""
    prompt_ids = _encode(tokenizer, cf.render_prompt(trace.problem.prompt, system=trace.system))
    response: list[int] = []
    mask: list[int] = []
    for seg in trace.segments:
        ids = _encode(tokenizer, seg.text)
        response.extend(ids)
        mask.extend([1 if seg.from_model else 0] * len(ids))
    return TokenizedTrace(trace.problem.problem_id, prompt_ids, response, mask)


def write_traces_jsonl(traces: Sequence[Trace], tokenizer, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for t in traces:
            fh.write(json.dumps(tokenize_trace(t, tokenizer).to_row()) + "\n")
    return out


def read_traces_jsonl(path: str | Path) -> list[TokenizedTrace]:
    rows = []
    with Path(path).open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            r = json.loads(line)
            if len(r["response_token_ids"]) != len(r["loss_mask"]):
                raise ValueError(f"{path}:{lineno}: loss_mask and response_token_ids differ in length")
            rows.append(TokenizedTrace(r.get("problem_id", ""), r["prompt_token_ids"], r["response_token_ids"], r["loss_mask"]))
    return rows
