"""Answer checking with a hard timeout per symbolic check, in a pool of worker processes.

Integer answers are decided in the caller (a string comparison: it cannot hang). Everything else
goes to :func:`services.reward.answers.symbolic_equal` in a pebble worker process: pebble kills
the one worker whose task overruns ``timeout_s`` and starts a replacement, so a sympy expression
that never simplifies costs one timeout, not the service. A timeout or a crashed worker counts as
*incorrect* and is reported in the verdict's ``outcome`` (the runtime counts them in metrics).

Workers come from a ``forkserver`` that has already imported math-verify and sympy: replacing a
killed worker is a cheap fork from that server, not a fork of the (threaded, asyncio) service
process and not a fresh multi-hundred-millisecond sympy import.

Within one call of :meth:`AnswerChecker.check_group` each distinct (answer, gold) pair is checked
once: rollouts of one problem often agree on an answer.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Literal, Sequence

from pebble import ProcessExpired, ProcessPool

from services.reward.answers import integer_verdict, symbolic_equal, too_long_for_symbolic

Outcome = Literal["integer", "symbolic", "no_answer", "too_long", "timeout", "error"]


class CheckerUnavailable(RuntimeError):
    """The worker pool cannot run checks (not a property of the answer being checked)."""


@dataclass(frozen=True)
class Verdict:
    correct: bool
    outcome: Outcome
    detail: str = ""


def _warm_worker() -> None:
    import math_verify.grader
    import math_verify.parser

    # math-verify warns once per process that its own timeouts are off; here that is by design
    # (pebble owns the timeout), and a warning from every replaced worker would only be noise.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    # pay sympy's import and math-verify's first-parse cost before the first timed check
    symbolic_equal("\\frac{1}{2}", "0.5")


def _forkserver_context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["services.reward.answers", "math_verify", "sympy"])
    return ctx


class AnswerChecker:
    """Owns the worker pool; ``await check_group(...)`` from the event loop."""

    def __init__(self, workers: int, timeout_s: float) -> None:
        if workers < 1:
            raise ValueError("workers must be ≥ 1")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        self.timeout_s = timeout_s
        self._pool = ProcessPool(max_workers=workers, initializer=_warm_worker, context=_forkserver_context())

    async def check(self, predicted: str | None, gold: str) -> Verdict:
        if predicted is None:
            return Verdict(False, "no_answer")
        fast = integer_verdict(predicted, gold)
        if fast is not None:
            return Verdict(fast, "integer")
        if too_long_for_symbolic(predicted):
            return Verdict(False, "too_long", f"{len(predicted)} characters, not an integer")
        try:
            future = self._pool.schedule(symbolic_equal, args=(predicted, gold), timeout=self.timeout_s)
        except RuntimeError as exc:
            raise CheckerUnavailable(f"answer-checking pool failed: {exc}") from exc
        try:
            return Verdict(bool(await asyncio.wrap_future(future)), "symbolic")
        except FutureTimeout:
            return Verdict(False, "timeout", f"symbolic check exceeded {self.timeout_s}s")
        except ProcessExpired as exc:  # this input killed its worker (e.g. memory blow-up)
            return Verdict(False, "error", f"checker worker died: {exc}")
        except BrokenProcessPool as exc:
            # the pool itself is gone: an outage, not a wrong answer (a RecursionError raised by
            # sympy is a RuntimeError too, so only the pool's own error qualifies here)
            raise CheckerUnavailable(f"answer-checking pool failed: {exc}") from exc
        except Exception as exc:  # noqa: BLE001 - a check that raises is a failed check, not a crash
            return Verdict(False, "error", f"{type(exc).__name__}: {exc}")

    async def check_group(self, predicted: Sequence[str | None], gold: str) -> list[Verdict]:
        distinct = list(dict.fromkeys(p for p in predicted))
        verdicts = await asyncio.gather(*(self.check(p, gold) for p in distinct))
        by_answer = dict(zip(distinct, verdicts))
        return [by_answer[p] for p in predicted]

    def close(self) -> None:
        self._pool.stop()
        self._pool.join(timeout=5)

    def __enter__(self) -> "AnswerChecker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
