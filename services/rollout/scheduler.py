"""Cache-aware dynamic rollout scheduler (pure: no I/O, no clock, no tasks).

Why
---
A rollout engine that is handed more rollouts than its KV cache can hold lets them grow until
the cache overflows, then preempts running requests and recomputes them (vLLM evicts the
newest requests and re-prefills them later). With long-tailed multi-turn trajectories this
throws away a large part of the work, and a static equal split of the rollouts over the
engines leaves engines that drew short rollouts idle while others still grind through long
ones (rStar2-Agent, section "efficient rollout"). This module decides *which engine runs which
rollout and when*, so that neither happens.

Algorithm (mode ``dynamic``)
----------------------------
Every engine ``e`` has a KV capacity ``C_e`` in tokens (``num_gpu_blocks * block_size`` of the
real engine) and a running set of admitted rollouts. Each admitted rollout ``r`` reserves
``R_r = ceil(budget_r / block) * block`` tokens, where ``budget_r`` = prompt tokens + the
response token budget (all turns, model and tool tokens together: the most KV it can ever
occupy). The engine's occupied KV is ``max(sum R_r, observed_used_e)``: the reservations, or
what the engine's own KV statistics report if that is more (another tenant, accounting drift).

1. Waiting rollouts form ONE global FIFO queue.
2. ``admit()`` repeatedly takes the head of the queue and places it on the engine with the most
   free KV (``C_e - occupied_e``) among those where ``occupied_e + R_r <= C_e`` (and fewer than
   ``max_rollouts_per_engine`` running, if set); ties go to the engine with fewer rollouts,
   then the lower id. It stops at the first head that fits nowhere (strict FIFO: a later,
   smaller rollout never overtakes it, so nothing starves).
3. ``finish(r)`` releases ``R_r`` at once; the caller calls ``admit()`` right after, so the next
   waiting rollout starts the moment room appears.
4. A rollout that is waiting for a tool call stays admitted: it keeps its reservation, so the
   engine never needs its KV blocks for someone else and its prefix is still cached when the
   tool returns. All turns of a rollout run on the engine that admitted it.

Because ``sum R_r <= C_e`` and no rollout ever occupies more than ``R_r``, an engine never
overflows its KV cache: no preemption, no recomputation.

Mode ``static`` (the paper's baseline, for comparison)
-------------------------------------------------------
Tasks (the ``group`` of a rollout: the 2G samples of one prompt) are dealt round-robin over
the engines (an equal share each, all samples of a prompt on one engine for prefix reuse) and
admitted immediately; the engine's own scheduler then decides what runs, and overflows and
preempts when the share does not fit.

Reservation size (setting ``reserve_quantile``)
-----------------------------------------------
* ``None`` (default, "budget"): ``budget_r`` = prompt + the full response budget, as above.
  Guaranteed overflow-free, but with long-tailed lengths (median far below the budget) most
  of each reservation is never used, so an engine runs fewer rollouts than its cache could
  hold and the last-admitted long rollouts stretch the makespan.
* ``q`` in (0, 1) ("adaptive"): a rollout is admitted with ``prompt + L_q``, where ``L_q`` is
  the q-quantile of the response lengths (model + tool tokens) of the last ``window`` finished
  rollouts (the full budget until ``min_samples`` have finished: a cold start is as safe as
  budget mode). The runtime reports each rollout's KV length at every turn boundary
  (``progress``), and a rollout's
  reservation never drops below its current length. A rollout whose response outgrows its
  reservation is re-reserved at the q-quantile of the finished lengths *longer than what it
  has already written* (the full budget when none were that long): the long tail climbs to
  larger reservations step by step, ending at the full budget. The engine's live KV usage
  (``observe``) caps admission as well. Overflow is then possible only if many rollouts of
  one engine outgrow ``L_q`` within one turn; the benchmark measures how often.

Constraint: a rollout whose reservation exceeds every engine's capacity can never run; it is
rejected at ``submit`` with ``ValueError`` instead of blocking the queue forever.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from dataclasses import dataclass, field


class SchedulerMode(str, enum.Enum):
    DYNAMIC = "dynamic"
    STATIC = "static"


@dataclass(frozen=True)
class Admission:
    rollout_id: str
    engine_id: int
    reserved_tokens: int


@dataclass
class EngineState:
    engine_id: int
    capacity_tokens: int
    reserved_tokens: int = 0
    # Tokens in use as reported by the engine's KV statistics (0 until the first report).
    observed_used_tokens: int = 0
    rollouts: dict[str, int] = field(default_factory=dict)  # rollout_id -> reserved tokens

    @property
    def occupied_tokens(self) -> int:
        return max(self.reserved_tokens, self.observed_used_tokens)

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.occupied_tokens


@dataclass(frozen=True)
class _Waiting:
    rollout_id: str
    budget_tokens: int
    prompt_tokens: int
    group: str | None


@dataclass
class _Running:
    engine_id: int
    budget_tokens: int
    prompt_tokens: int
    reserved: int
    promoted: bool = False


class LengthQuantile:
    """Running q-quantile of the last ``window`` response lengths (sorted window, O(window))."""

    def __init__(self, q: float, window: int, min_samples: int) -> None:
        if not 0.0 < q < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {q}")
        self.q, self.window, self.min_samples = q, window, min_samples
        self._fifo: deque[int] = deque()
        self._sorted: list[int] = []

    def add(self, value: int) -> None:
        self._fifo.append(value)
        bisect.insort(self._sorted, value)
        if len(self._fifo) > self.window:
            old = self._fifo.popleft()
            del self._sorted[bisect.bisect_left(self._sorted, old)]

    def value(self, at_least: int = 0) -> int | None:
        """The q-quantile of the samples > ``at_least`` (None: too few samples to say)."""
        if len(self._sorted) < self.min_samples:
            return None
        lo = bisect.bisect_right(self._sorted, at_least) if at_least > 0 else 0
        n = len(self._sorted) - lo
        if n <= 0:
            return None
        return self._sorted[lo + min(n - 1, int(self.q * n))]


class RolloutScheduler:
    """Assigns rollouts to engines; the caller starts what ``admit()`` returns.

    ``engine_capacity`` maps engine id -> KV capacity in tokens. ``block_size`` is the KV block
    size in tokens (reservations are rounded up to whole blocks, as the engine allocates).
    """

    def __init__(
        self,
        engine_capacity: dict[int, int],
        *,
        mode: SchedulerMode | str = SchedulerMode.DYNAMIC,
        block_size: int = 32,
        max_rollouts_per_engine: int | None = None,
        reserve_quantile: float | None = None,
        quantile_window: int = 2048,
        quantile_min_samples: int = 64,
    ) -> None:
        if not engine_capacity:
            raise ValueError("the scheduler needs at least one engine")
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        for eid, cap in engine_capacity.items():
            if cap <= 0:
                raise ValueError(f"engine {eid} has non-positive KV capacity {cap}")
        self.mode = SchedulerMode(mode)
        self.block_size = block_size
        self.max_rollouts_per_engine = max_rollouts_per_engine
        self.engines: dict[int, EngineState] = {
            eid: EngineState(eid, cap) for eid, cap in sorted(engine_capacity.items())
        }
        self._queue: deque[_Waiting] = deque()
        self._where: dict[str, _Running] = {}  # admitted rollouts
        self._queued: set[str] = set()
        self._round_robin = 0
        self._static_groups: dict[str, int] = {}  # static mode: group -> its engine
        self.lengths = (
            LengthQuantile(reserve_quantile, quantile_window, quantile_min_samples)
            if reserve_quantile is not None else None
        )
        self.promotions = 0

    # ------------------------------------------------------------------ inputs

    def reservation(self, budget_tokens: int) -> int:
        """Tokens reserved for a rollout of ``budget_tokens`` (rounded up to whole blocks)."""
        blocks = -(-budget_tokens // self.block_size)
        return blocks * self.block_size

    def submit(self, rollout_id: str, budget_tokens: int, prompt_tokens: int = 0,
               group: str | None = None) -> None:
        """Queue a rollout whose prompt + response budget is ``budget_tokens`` tokens.

        ``group`` (the task id) only matters in static mode: a group's rollouts share an engine.
        """
        if budget_tokens <= 0:
            raise ValueError(f"rollout {rollout_id}: budget must be positive, got {budget_tokens}")
        if rollout_id in self._queued or rollout_id in self._where:
            raise ValueError(f"rollout {rollout_id} is already scheduled")
        reserve = self.reservation(budget_tokens)
        largest = max(e.capacity_tokens for e in self.engines.values())
        if self.mode is SchedulerMode.DYNAMIC and reserve > largest:
            raise ValueError(
                f"rollout {rollout_id} needs {reserve} KV tokens, more than any engine holds "
                f"({largest}); lower max_tokens or give the engines more KV cache"
            )
        if not 0 <= prompt_tokens <= budget_tokens:
            raise ValueError(f"rollout {rollout_id}: prompt_tokens must be within 0..budget")
        self._queue.append(_Waiting(rollout_id, budget_tokens, prompt_tokens, group))
        self._queued.add(rollout_id)

    def progress(self, rollout_id: str, kv_tokens: int) -> None:
        """A running rollout now holds ``kv_tokens`` (prompt + response so far): adjust its
        reservation. Adaptive mode: once the response outgrows what its reservation assumed,
        re-reserve for the q-quantile of the lengths of finished rollouts that were at least
        this long (the full budget if none were). Any mode: never below what it holds."""
        run = self._where.get(rollout_id)
        if run is None:
            raise KeyError(f"rollout {rollout_id} is not running")
        want = run.reserved
        response = kv_tokens - run.prompt_tokens
        if self.lengths is not None and not run.promoted and response > run.reserved - run.prompt_tokens - self.block_size:
            estimate = self.lengths.value(at_least=response)
            if estimate is None or run.prompt_tokens + estimate >= run.budget_tokens:
                want = max(want, self.reservation(run.budget_tokens))
                run.promoted = True
            else:
                want = max(want, self.reservation(run.prompt_tokens + estimate))
            self.promotions += 1
        want = max(want, self.reservation(min(kv_tokens, run.budget_tokens)))
        self._set_reserved(rollout_id, run, want)

    def finish(self, rollout_id: str, response_tokens: int | None = None) -> int:
        """A rollout ended (any reason): free its reservation. Returns the engine it ran on.

        ``response_tokens`` (model + tool tokens it produced) feeds the length estimate of
        adaptive mode; leave it out for rollouts that did not run to a natural end.
        """
        run = self._where.pop(rollout_id, None)
        if run is None:
            raise KeyError(f"rollout {rollout_id} is not running")
        engine = self.engines[run.engine_id]
        engine.reserved_tokens -= engine.rollouts.pop(rollout_id)
        if self.lengths is not None and response_tokens is not None:
            self.lengths.add(response_tokens)
        return run.engine_id

    def _set_reserved(self, rollout_id: str, run: _Running, tokens: int) -> None:
        engine = self.engines[run.engine_id]
        engine.reserved_tokens += tokens - run.reserved
        engine.rollouts[rollout_id] = tokens
        run.reserved = tokens

    def _initial_reservation(self, w: _Waiting) -> tuple[int, bool]:
        """(tokens, promoted) for a rollout about to be admitted."""
        if self.lengths is not None:
            estimate = self.lengths.value()
            if estimate is not None and w.prompt_tokens + estimate < w.budget_tokens:
                return self.reservation(w.prompt_tokens + estimate), False
        return self.reservation(w.budget_tokens), True

    def cancel(self, rollout_id: str) -> bool:
        """Withdraw a rollout that is still waiting. Returns False if it was not waiting."""
        if rollout_id not in self._queued:
            return False
        self._queued.discard(rollout_id)
        self._queue = deque(w for w in self._queue if w.rollout_id != rollout_id)
        return True

    def observe(self, engine_id: int, *, used_tokens: int, capacity_tokens: int | None = None) -> None:
        """Feed the engine's KV statistics (tokens in use; capacity if it changed)."""
        engine = self.engines[engine_id]
        engine.observed_used_tokens = max(0, used_tokens)
        if capacity_tokens is not None:
            if capacity_tokens <= 0:
                raise ValueError(f"engine {engine_id}: capacity must be positive")
            engine.capacity_tokens = capacity_tokens

    # ------------------------------------------------------------------ decisions

    def admit(self) -> list[Admission]:
        """Admit every waiting rollout that fits now, in FIFO order (see module docstring)."""
        admitted: list[Admission] = []
        while self._queue:
            head = self._queue[0]
            reserve, promoted = self._initial_reservation(head)
            eid = self._place(reserve, head.group)
            if eid is None:
                break
            self._queue.popleft()
            self._queued.discard(head.rollout_id)
            engine = self.engines[eid]
            engine.rollouts[head.rollout_id] = reserve
            engine.reserved_tokens += reserve
            self._where[head.rollout_id] = _Running(eid, head.budget_tokens, head.prompt_tokens, reserve, promoted)
            admitted.append(Admission(head.rollout_id, eid, reserve))
        return admitted

    def _place(self, reserve: int, group: str | None) -> int | None:
        if self.mode is SchedulerMode.STATIC:
            if group is not None and group in self._static_groups:
                return self._static_groups[group]
            ids = list(self.engines)
            eid = ids[self._round_robin % len(ids)]
            self._round_robin += 1
            if group is not None:
                self._static_groups[group] = eid
            return eid
        best: EngineState | None = None
        for engine in self.engines.values():
            if engine.occupied_tokens + reserve > engine.capacity_tokens:
                continue
            if self.max_rollouts_per_engine is not None and len(engine.rollouts) >= self.max_rollouts_per_engine:
                continue
            if best is None or (engine.free_tokens, -len(engine.rollouts)) > (best.free_tokens, -len(best.rollouts)):
                best = engine
        return None if best is None else best.engine_id

    # ------------------------------------------------------------------ views

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._where)

    def engine_of(self, rollout_id: str) -> int | None:
        run = self._where.get(rollout_id)
        return None if run is None else run.engine_id

    def is_waiting(self, rollout_id: str) -> bool:
        return rollout_id in self._queued
