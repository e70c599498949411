"""Jupyter-style sessions by replay (pure; the clock is injected).

A session is the ordered list of cells that ran `ok` under one `session_id`. A new call in the
session runs, in one fresh sandboxed process, every earlier cell with its output suppressed and
then the new cell, so it sees their definitions (functions, variables, imports) the way a
notebook kernel would, without a long-lived process per session to leak or to be attacked
across calls. Only cells that ended `ok` are kept: replaying a failing cell would repeat its error on every
later call, so a caller who wants its definitions re-runs a fixed version.

Costs and bounds: a call pays the time of replaying its session, so the supervisor's deadline
is extended by the recorded duration of the replayed cells (times `REPLAY_TIME_FACTOR`, capped
by the service's maximum timeout); a session holds at most `max_cells` cells and
`max_code_chars` characters (then new calls are refused with a reason), expires `ttl_s` after
its last use, and the store holds at most `max_sessions` sessions (least recently used go
first). Sessions live in one replica's memory: the client routes a session's calls to the same
replica (by hashing the session id).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

# Replay of earlier cells normally takes about as long as they took the first time; the
# factor leaves room for noise (a busier machine) without letting a session run unbounded.
REPLAY_TIME_FACTOR = 1.5


class SessionFull(ValueError):
    """The session holds as many cells or characters as allowed."""


@dataclass
class Session:
    cells: list[str] = field(default_factory=list)
    durations_ms: list[float] = field(default_factory=list)
    code_chars: int = 0
    last_used: float = 0.0


@dataclass(frozen=True)
class ReplayPlan:
    cells: tuple[str, ...]
    extra_time_s: float  # deadline extension for the replay
    replayed_ms: float = 0.0  # what the replayed cells took when they ran


class SessionStore:
    def __init__(
        self,
        *,
        ttl_s: float,
        max_cells: int,
        max_code_chars: int,
        max_sessions: int,
        clock: Callable[[], float],
    ) -> None:
        self.ttl_s = ttl_s
        self.max_cells = max_cells
        self.max_code_chars = max_code_chars
        self.max_sessions = max_sessions
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def plan(self, session_id: str, new_code: str) -> ReplayPlan:
        """The cells to replay before `new_code`; refuses if the session would overflow."""
        self.expire()
        session = self._sessions.get(session_id)
        if session is None:
            return ReplayPlan(cells=(), extra_time_s=0.0, replayed_ms=0.0)
        if len(session.cells) + 1 > self.max_cells:
            raise SessionFull(f"session {session_id!r} holds the maximum of {self.max_cells} cells")
        if session.code_chars + len(new_code) > self.max_code_chars:
            raise SessionFull(f"session {session_id!r} would exceed {self.max_code_chars} characters of code")
        session.last_used = self._clock()
        self._sessions.move_to_end(session_id)
        replayed_ms = sum(session.durations_ms)
        return ReplayPlan(cells=tuple(session.cells), extra_time_s=replayed_ms / 1000.0 * REPLAY_TIME_FACTOR, replayed_ms=replayed_ms)

    def record(self, session_id: str, code: str, duration_ms: float) -> None:
        """Keep a cell that ran ok (its duration excludes the replay of earlier cells)."""
        session = self._sessions.get(session_id)
        if session is None:
            session = Session()
            self._sessions[session_id] = session
        session.cells.append(code)
        session.durations_ms.append(max(0.0, duration_ms))
        session.code_chars += len(code)
        session.last_used = self._clock()
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def touch(self, session_id: str) -> None:
        session = self._sessions.get(session_id)
        if session is not None:
            session.last_used = self._clock()
            self._sessions.move_to_end(session_id)

    def expire(self) -> int:
        now = self._clock()
        dead = [sid for sid, s in self._sessions.items() if now - s.last_used > self.ttl_s]
        for sid in dead:
            del self._sessions[sid]
        return len(dead)

    def drop(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    def cells(self, session_id: str) -> list[str]:
        session = self._sessions.get(session_id)
        return list(session.cells) if session else []
