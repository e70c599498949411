"""Sandbox policy: the pure rules of the tool executor (no I/O, no processes).

What a call may use and how its end is read:

- **Limits** (`resolve_limits`): a request may ask for a wall-clock timeout and a memory budget;
  absent values take the service defaults and values above the service maxima are refused
  (`LimitError` -> HTTP 422), never silently clamped, so a caller learns its real budget.
- **rlimits** (`rlimits_for`): CPU seconds = ceil(timeout) + 1 (the wall-clock timer normally
  fires first; the rlimit is the backstop if the supervisor is starved), address space =
  the pool parent's own address space + memory_mb (the pre-imported libraries are mapped
  already and cost the call nothing, so the budget counts only what the call adds), file size
  = the hard output limit (stdout/stderr are files, so this also stops endless output), open
  files, processes (counted per uid, and each concurrent call has its own uid, so a fork
  bomb only exhausts its own budget), no core dumps.
- **Status** (`classify`): one of ok | error | timeout | memory | output_limit | rejected, read
  from how the call ended, in priority order: the supervisor's own timeout kill, then
  an output file reaching the hard limit, then memory exhaustion (a MemoryError ending the
  traceback, or SIGKILL the supervisor did not send: the kernel OOM killer), then exit 0 -> ok,
  anything else -> error.
- **Output caps** (`cap_output`): each stream is decoded as UTF-8 (invalid bytes replaced) and,
  if longer than the cap, keeps its head and tail with the middle elided and a marker saying
  how much was cut; the caller gets a `truncated` flag.
- **Routing** (`choose_kind`): a call whose code names a heavy library (numpy, sympy, ...) runs
  in a pool whose parent already imported them (fork is slower from a big parent, ~6-9 ms,
  but importing sympy per call costs hundreds of ms); everything else forks from a light
  parent (~1 ms). Misrouting is harmless: the child imports lazily, just slower.
"""

from __future__ import annotations

import math
import re
import resource
import signal
from dataclasses import dataclass
from enum import Enum


class Status(str, Enum):
    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"
    MEMORY = "memory"
    OUTPUT_LIMIT = "output_limit"
    REJECTED = "rejected"


class LimitError(ValueError):
    """A request asked for more than the service allows (HTTP 422)."""


@dataclass(frozen=True)
class Maxima:
    """The service's configured defaults and ceilings for per-call limits."""

    default_timeout_s: float
    max_timeout_s: float
    default_memory_mb: int
    max_memory_mb: int
    output_hard_limit_bytes: int
    max_open_files: int
    max_processes: int


@dataclass(frozen=True)
class Limits:
    timeout_s: float
    memory_mb: int


def resolve_limits(timeout_s: float | None, memory_mb: int | None, maxima: Maxima) -> Limits:
    timeout = maxima.default_timeout_s if timeout_s is None else float(timeout_s)
    memory = maxima.default_memory_mb if memory_mb is None else int(memory_mb)
    if not (timeout > 0 and math.isfinite(timeout)):
        raise LimitError(f"timeout_s must be a positive number, got {timeout_s!r}")
    if timeout > maxima.max_timeout_s:
        raise LimitError(f"timeout_s={timeout:g} exceeds the service maximum {maxima.max_timeout_s:g}")
    if memory <= 0:
        raise LimitError(f"memory_mb must be positive, got {memory_mb!r}")
    if memory > maxima.max_memory_mb:
        raise LimitError(f"memory_mb={memory} exceeds the service maximum {maxima.max_memory_mb}")
    return Limits(timeout_s=timeout, memory_mb=memory)


# Slack on the CPU rlimit beyond the wall-clock timeout: the wall-clock kill is the normal end;
# the rlimit only matters if the supervisor cannot run (it is the backstop).
CPU_RLIMIT_SLACK_S = 1


def rlimits_for(limits: Limits, maxima: Maxima, base_address_space_bytes: int) -> list[tuple[int, int, int]]:
    """(resource, soft, hard) triples applied in the child before it drops privileges.
    Soft == hard so the call cannot raise them again."""
    cpu = int(math.ceil(limits.timeout_s)) + CPU_RLIMIT_SLACK_S
    address_space = base_address_space_bytes + limits.memory_mb * 1024 * 1024
    return [
        (resource.RLIMIT_CPU, cpu, cpu),
        (resource.RLIMIT_AS, address_space, address_space),
        (resource.RLIMIT_FSIZE, maxima.output_hard_limit_bytes, maxima.output_hard_limit_bytes),
        (resource.RLIMIT_NOFILE, maxima.max_open_files, maxima.max_open_files),
        (resource.RLIMIT_NPROC, maxima.max_processes, maxima.max_processes),
        (resource.RLIMIT_CORE, 0, 0),
    ]


def cpu_limit_s(rlimits: list[tuple[int, int, int]]) -> float | None:
    """The RLIMIT_CPU (seconds) among :func:`rlimits_for`'s triples."""
    return next((float(soft) for res, soft, _ in rlimits if res == resource.RLIMIT_CPU), None)


@dataclass(frozen=True)
class Ending:
    """How a call's main process ended, as seen by its supervisor."""

    exit_code: int | None  # None when killed by a signal
    term_signal: int | None  # the signal that killed it, if any
    timed_out: bool  # the supervisor killed it at its wall-clock deadline
    stdout_bytes: int  # size of what it wrote (before capping)
    stderr_bytes: int
    output_hard_limit_bytes: int
    stderr_tail: str  # last few hundred characters of stderr, decoded
    cpu_s: float | None = None  # user + system CPU seconds of the call's process (wait4), if known
    cpu_limit_s: float | None = None  # its RLIMIT_CPU


# How far below its RLIMIT_CPU a SIGKILLed call's measured CPU time may be and still count as the
# kernel's RLIMIT_CPU kill: the kernel checks the limit on its scheduler tick against the exact
# runtime, while wait4's rusage is accounted in ticks (4 ms at HZ = 250), so a small margin is
# enough; an out-of-memory kill of a call that just happened to be this close to its CPU limit
# is the only case it misreads.
CPU_LIMIT_TOLERANCE_S = 0.25


def hit_cpu_limit(ending: Ending) -> bool:
    """A SIGKILL from the kernel's RLIMIT_CPU: soft == hard, so the kernel sends SIGKILL, not
    SIGXCPU, when a call burns its CPU time (e.g. threads outside the GIL on several cores,
    faster than the wall-clock deadline)."""
    return (
        ending.term_signal == signal.SIGKILL
        and ending.cpu_s is not None
        and ending.cpu_limit_s is not None
        and ending.cpu_s >= ending.cpu_limit_s - CPU_LIMIT_TOLERANCE_S
    )


_MEMORY_ERROR_RE = re.compile(r"(^|\n)(MemoryError|numpy\.core\._exceptions\._ArrayMemoryError|numpy\._core\._exceptions\._ArrayMemoryError)\b[^\n]*\n?\s*$")


def classify(ending: Ending) -> Status:
    """The call's status from how it ended: past its time (the supervisor's wall-clock kill or the
    kernel's CPU-limit kill, whatever signals it ignored) is ``timeout``; ``memory`` is a
    MemoryError or a SIGKILL that neither of them sent (the OOM killer)."""
    if ending.timed_out or ending.term_signal == signal.SIGXCPU or hit_cpu_limit(ending):
        return Status.TIMEOUT
    if (
        ending.stdout_bytes >= ending.output_hard_limit_bytes
        or ending.stderr_bytes >= ending.output_hard_limit_bytes
        or ending.term_signal == signal.SIGXFSZ
    ):
        return Status.OUTPUT_LIMIT
    if ending.term_signal == signal.SIGKILL or _MEMORY_ERROR_RE.search(ending.stderr_tail):
        # SIGKILL that the supervisor did not send (it would have set timed_out): the OOM killer.
        return Status.MEMORY
    if ending.exit_code == 0:
        return Status.OK
    return Status.ERROR


ELISION_MARKER = "\n...[{n} characters elided]...\n"


def cap_output(data: bytes, max_chars: int) -> tuple[str, bool]:
    """Decode (invalid UTF-8 replaced) and keep head and tail if longer than max_chars."""
    text = data.decode("utf-8", errors="replace")
    if len(text) <= max_chars:
        return text, False
    head = max_chars // 2
    tail = max_chars - head
    elided = len(text) - head - tail
    return text[:head] + ELISION_MARKER.format(n=elided) + text[len(text) - tail :], True


class Kind(str, Enum):
    LIGHT = "light"
    HEAVY = "heavy"


def heavy_pattern(heavy_modules: list[str]) -> re.Pattern[str]:
    names = "|".join(re.escape(m) for m in heavy_modules)
    return re.compile(rf"\b({names})\b")


def choose_kind(code: str, pattern: re.Pattern[str]) -> Kind:
    return Kind.HEAVY if pattern.search(code) else Kind.LIGHT


_RANDOM_USE_RE = re.compile(r"rand")


def may_use_random(code: str) -> bool:
    """Whether a call could read Python's `random` state (random, randint, randprime, ...).
    Reseeding costs ~0.1 ms per call and is needed only then: every child starts with its
    parent's random state, which a fresh interpreter would not share with other calls."""
    return _RANDOM_USE_RE.search(code) is not None


def exit_code_from_system_exit(code: object) -> tuple[int, str | None]:
    """What CPython does with SystemExit(code): (exit status, text to print on stderr)."""
    if code is None:
        return 0, None
    if isinstance(code, bool):
        return int(code), None
    if isinstance(code, int):
        return code & 0xFF, None
    return 1, str(code)
