"""Stage-0 SFT traces: tool-using solutions of generated problems, rendered through a model's
conversation format (``shared.formats``: its chat template, the preset's wording).

A trace is a list of *steps* — the model says something, calls the tool, reads a result,
answers — independent of any model::

    say("Python's pow with a modulus computes this directly.")  call("print(pow(7, 222, 1000))")
    result(ok, stdout="49\n")  answer("49")

:func:`render_trace` turns the steps into token ids for one format: the prompt
(``fmt.prompt_ids(problem)``, the template's own rendering), then *model segments* (what was
said plus ``fmt.tool_call_text(code)``; the last one ends with the answer and the template's
end-of-turn token) and *tool segments* (``fmt.tool_response_ids(result)``, exactly what the
rollout appends). The same steps give a Qwen3 trace and a tiny-model trace.

The code is written from the problem's ``kind`` / ``params`` (``shared/datasets/generated.py``)
in one of a few equivalent styles, and is *run* at generation time (in-process ``exec``: the
code is our own, trusted and fast; errors are reported exactly as the tool executor reports
them, see ``run_code``) so every tool result holds what the program really printed; the trace
fails loudly if the printed value is not the problem's answer. About ``BUGGY_FRACTION`` of
traces start with a buggy call (an undefined name, a missing import, a function that does not
exist, a type error) whose real traceback is shown and which the next call fixes: the model
sees how to recover from tool errors. Each buggy call is executed and must fail; each fixed
call must succeed (checked, not assumed).

Tokenisation — segment by segment, exactly like the rollout
---------------------------------------------------------
The rollout builds a response from separately tokenised pieces: the tokens the model samples up
to and including the tool call's closing tag, then the tool segment tokenised ON ITS OWN and
appended with loss_mask 0, then the next sampled tokens, and so on until an end token. A trace
is tokenised the same way: tokenising the whole text at once could merge bytes across a segment
boundary and produce ids the rollout never sees. The mask is 1 on every model-segment token and
0 on every tool-segment token.

Copy drills
-----------
Solving a problem takes two exact digit-by-digit copies: the problem's numbers into the code and
the printed result into ``\\boxed{}``. A tiny model learns copying slowly from whole traces
(a copied digit is about one loss token in eight): after 12 minutes on two cores it still wrote
the first digit and then repeated it ("1111222" for "6481728"), scoring 0 on held-out problems.
:func:`make_copy_drill` adds short examples whose loss tokens are almost all copied digits —
``Repeat 48213 * 731 + 2290`` answered by ``The answer is \\boxed{48213 * 731 + 2290}`` in the
format's answer wording — with a bare prompt (no system turn: 3x cheaper; they teach a skill,
not the format). With them the copy circuit forms within the bootstrap budget (docs/data.md).

Chat-message rows: :func:`steps_from_messages` reads an OpenAI-style conversation (``system`` /
``user`` / ``assistant`` with ``tool_calls`` / ``tool`` messages) into the same steps, so an SFT
set written for any chat model trains through this model's format.

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

from shared.datasets.problem import Problem
from shared.formats import ConversationFormat, ToolResult, parse_call_object
from shared.formats.tags import tool_output_text

# Fraction of traces whose first tool call is buggy and fixed by the second (as in the
# platform experiment: enough to teach recovery, few enough not to teach sloppy first calls).
BUGGY_FRACTION = 0.2


# --------------------------------------------------------------------------- running code


@dataclass(frozen=True)
class CodeRun:
    ok: bool
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        """stdout and stderr as the plain presets show them."""
        return tool_output_text(self.stdout, self.stderr)

    def result(self) -> ToolResult:
        return ToolResult("ok" if self.ok else "error", self.stdout, self.stderr)


# The file name the tool executor compiles cells under (services/tool_executor/zygote.py), so
# tracebacks in traces read exactly like the ones the policy sees during RL.
CELL_FILENAME = "<cell>"


def run_code(code: str) -> CodeRun:
    """Run trusted generated code in-process, reporting like the tool executor does.

    Mirrors ``services/tool_executor/zygote.py``: the cell is compiled as ``<cell>`` with its
    source registered in ``linecache`` (tracebacks show the failing line), errors are printed
    by ``traceback.print_exception`` starting at the cell's frame, stdout and stderr are kept
    apart (a preset decides how they are shown).
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
    return CodeRun(ok, out.getvalue(), err.getvalue())


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
class Step:
    """One step of a trace: ``say`` (model text), ``call`` (model: a tool call's code),
    ``result`` (tool: a ToolResult), ``tool_text`` (tool: a result body given as text, from chat
    data), ``answer`` (model: the final answer value)."""

    kind: str
    text: str = ""
    result: ToolResult | None = None
    stdin: str | None = None


@dataclass(frozen=True)
class Trace:
    problem: Problem
    steps: tuple[Step, ...]
    buggy_first_call: bool = False
    codes: tuple[str, ...] = ()  # every tool call's code, in order
    bare: bool = False  # a bare prompt (no system turn, no preset wording): the copy drills
    chat: bool = False  # from chat data: the prompt is the data's own system and user messages
    system: str | None = None  # chat data's system message

    def segments(self, fmt: ConversationFormat) -> list[tuple[str, bool]]:
        """(text, from_model) segments in ``fmt``; model segments end at a tool call or the end."""
        out: list[tuple[str, bool]] = []
        model = ""
        for step in self.steps:
            if step.kind == "say":
                model += step.text
            elif step.kind == "call":
                model += fmt.tool_call_text(step.text, step.stdin)
            elif step.kind == "answer":
                model += fmt.answer_text(step.text)
            elif step.kind in ("result", "tool_text"):
                if model:
                    out.append((model, True))
                    model = ""
                out.append((fmt.tool_response_text(step.result if step.kind == "result" else step.text), False))
            else:
                raise ValueError(f"unknown trace step {step.kind!r}")
        out.append((model + fmt.end_of_turn_text, True))
        return out

    def response_text(self, fmt: ConversationFormat) -> str:
        return "".join(text for text, _ in self.segments(fmt))

    def model_text(self, fmt: ConversationFormat) -> str:
        return "".join(text for text, from_model in self.segments(fmt) if from_model)


class TraceError(RuntimeError):
    """Generated code did not behave as the trace requires (a bug in the generator)."""


def make_trace(problem: Problem, rng: random.Random, *, buggy: bool | None = None) -> Trace:
    """One trace for a generated problem. ``buggy`` None: decided by ``BUGGY_FRACTION``."""
    if problem.kind is None or problem.params is None:
        raise ValueError(f"problem {problem.problem_id} has no generator kind/params; traces need them")
    kind, params = problem.kind, dict(problem.params)
    if buggy is None:
        buggy = rng.random() < BUGGY_FRACTION
    steps: list[Step] = []
    codes: list[str] = []
    lead = rng.choice(_OPENERS[kind]) + "\n"
    if buggy:
        bad_code, fix_note, code = rng.choice(_buggy_codes(kind, params))
        run = run_code(bad_code)
        if run.ok:
            raise TraceError(f"buggy code for {problem.problem_id} ran without error:\n{bad_code}")
        steps += [Step("say", lead), Step("call", bad_code), Step("result", result=run.result())]
        codes.append(bad_code)
        lead = fix_note + "\n"
    else:
        code = rng.choice(_correct_codes(kind, params))
    run = run_code(code)
    if not run.ok or run.output.strip() != problem.answer:
        raise TraceError(
            f"solution code for {problem.problem_id} printed {run.output!r}, expected {problem.answer!r}:\n{code}"
        )
    steps += [Step("say", lead), Step("call", code), Step("result", result=run.result()),
              Step("answer", run.stdout.strip())]
    codes.append(code)
    return Trace(problem=problem, steps=tuple(steps), buggy_first_call=buggy, codes=tuple(codes))


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
    return Trace(problem=problem, steps=(Step("answer", text),), bare=True)


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


def render_trace(trace: Trace, fmt: ConversationFormat) -> TokenizedTrace:
    """Token ids and loss mask in ``fmt``, built segment by segment (see the module docstring)."""
    if trace.chat:
        prompt_ids = fmt.encode(fmt.chat_prompt_text(trace.problem.prompt, trace.system))
    else:
        prompt_ids = fmt.prompt_ids(trace.problem.prompt, bare=trace.bare)
    response: list[int] = []
    mask: list[int] = []
    for text, from_model in trace.segments(fmt):
        ids = fmt.encode(text)
        response.extend(ids)
        mask.extend([1 if from_model else 0] * len(ids))
    return TokenizedTrace(trace.problem.problem_id, prompt_ids, response, mask)


def write_traces_jsonl(traces: Sequence[Trace], fmt: ConversationFormat, path: str | Path) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for t in traces:
            fh.write(json.dumps(render_trace(t, fmt).to_row()) + "\n")
    return out


# --------------------------------------------------------------------------- chat-message rows


class ChatDataError(ValueError):
    """A chat-message row the trace reader cannot use (the message names the reason)."""


def steps_from_messages(messages: Any, fmt: ConversationFormat, problem_id: str = "") -> Trace:
    """An OpenAI-style conversation as a trace: the system and first user message make the
    prompt (as given: the data's own wording), every later assistant message (its content, then
    its ``tool_calls`` of the format's tool, ``arguments`` a JSON string or object with ``code``)
    and ``tool`` message become steps. The conversation must end with an assistant message."""
    if not isinstance(messages, list) or not messages:
        raise ChatDataError("'messages' must be a non-empty list")
    system = None
    rest = list(messages)
    if isinstance(rest[0], dict) and rest[0].get("role") == "system":
        system = rest.pop(0).get("content")
        if not isinstance(system, str):
            raise ChatDataError("messages[0]: system content must be a string")
    if not rest or not isinstance(rest[0], dict) or rest[0].get("role") != "user" or not isinstance(rest[0].get("content"), str):
        raise ChatDataError("the conversation must start with a user message (after an optional system message)")
    user = rest.pop(0)["content"]
    if not rest or rest[-1].get("role") != "assistant":
        raise ChatDataError("the conversation must end with an assistant message")
    steps: list[Step] = []
    for i, m in enumerate(rest, start=1 + (system is not None)):  # i: the message's index in the row
        role = m.get("role") if isinstance(m, dict) else None
        if role == "assistant":
            if m.get("content"):
                steps.append(Step("say", str(m["content"])))
            for call in m.get("tool_calls") or []:
                parsed = parse_call_object(call.get("function", call) if isinstance(call, dict) else call,
                                           fmt.preset.tool_name)
                if not parsed.ok:
                    raise ChatDataError(f"messages[{i}]: {parsed.error}")
                steps.append(Step("call", parsed.code or "", stdin=parsed.stdin))
        elif role == "tool":
            content = m.get("content")
            if not isinstance(content, str):
                raise ChatDataError(f"messages[{i}]: tool content must be a string")
            steps.append(Step("tool_text", content))
        else:
            raise ChatDataError(f"messages[{i}]: unexpected role {role!r} after the user message")
    problem = Problem(problem_id=problem_id, prompt=user, answer="")
    return Trace(problem=problem, steps=tuple(steps), chat=True, system=system)


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
