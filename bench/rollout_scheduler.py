"""Rollout scheduler benchmark: a discrete-event simulation at the paper's scale, and a real run.

Part 1 — simulation (``--sim-only`` runs just this, well under a minute)
    64 engines, 512 prompts x 32 rollouts, long-tailed multi-turn trajectories with tool calls
    whose latency is drawn from a long-tailed distribution, a fixed KV capacity per engine. The
    simulation drives the real ``services.rollout.scheduler.RolloutScheduler``; the engines are
    modelled like vLLM's own scheduler (continuous batching, a step of n running sequences takes
    ``t_fixed + n * t_seq``; a request is admitted while its tokens fit the free KV cache; when
    the cache fills, cached blocks of requests waiting for a tool are evicted first and then the
    newest running request is preempted and later recomputed (prefill cost per token)).

    * dynamic: the cache-aware scheduler decides which engine gets which rollout and when.
    * static: every engine gets an equal share up front (the paper's baseline); the engine's
      own admission then overcommits its KV cache and preempts/recomputes when it overflows.
      ``static_sync`` also synchronises tool calls per turn (each engine's batch finishes a
      turn, runs all its calls, waits for the slowest, starts the next turn).
    * references (not schedulers: they know every rollout's final length): ``clairvoyant``
      reserves exactly each length and admits the longest first; ``exact_fifo`` reserves
      exactly but keeps FIFO order. They split the gap to the bound into "reservation slack"
      and "admission order".

    Lower bound (``lower_bound_s``, see ``lower_bounds``): the largest of a KV bound (every
    decode step holds at most C tokens of KV, so the context lengths of all generated tokens
    need a minimum number of steps), a batch bound (at most max_num_seqs per step) and the
    longest rollout's own critical path. No schedule, however clairvoyant, beats it.

Part 2 — real run (skipped with ``--sim-only``)
    A vLLM CPU engine on the tiny random model (``lab.tiny_model``) runs a batch of tasks
    through the real agent loop and the tool-executor-free "no tool" path twice: with the
    dynamic and with the static scheduler; reports generated tokens/s and wall time.

The last line of output is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import random
import sys
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.rollout.scheduler import RolloutScheduler, SchedulerMode  # noqa: E402


# --------------------------------------------------------------------------- workload


@dataclass
class SimParams:
    engines: int = 64
    prompts: int = 512
    samples: int = 32
    # Stage-1 budget (8K response tokens) on top of prompts of ~150-400 tokens.
    max_tokens: int = 8192
    prompt_tokens: tuple[int, int] = (150, 400)
    # Response length: lognormal around a per-prompt median (harder prompts run longer),
    # truncated at the budget. Median ~1.6K, mean ~2.3K, ~3% hit the budget.
    length_median: float = 1600.0
    length_sigma: float = 0.75
    prompt_difficulty_sigma: float = 0.5
    # Tool calls per trajectory: 0..9 (geometric, mean ~2); each response 30-300 tokens.
    tool_call_p: float = 0.33
    max_tool_calls: int = 9
    tool_response_tokens: tuple[int, int] = (30, 300)
    # Tool latency: lognormal, median 0.4 s, long tail, capped by the 10 s timeout.
    tool_latency_median_s: float = 0.4
    tool_latency_sigma: float = 1.0
    tool_timeout_s: float = 10.0
    # Engine: a 14B-class model on one 80 GB accelerator. KV capacity 300K tokens (~46 GiB at
    # 160 KiB/token, what is left after 28 GB of bf16 weights); a decode step of n sequences costs 12 ms + 0.12 ms * n; prefill
    # (prompts, tool responses, recomputation after preemption) 0.02 ms per token.
    kv_capacity_tokens: int = 300_000
    block_size: int = 16
    max_num_seqs: int = 256
    t_fixed_s: float = 0.012
    t_seq_s: float = 0.00012
    t_prefill_s: float = 0.00002
    # Adaptive reservations of the dynamic scheduler (None: full budget; see scheduler.py).
    reserve_quantile: float | None = 0.8
    seed: int = 0


@dataclass
class SimRollout:
    rid: str
    prompt: int
    segments: list[int]  # generated tokens per turn
    tool_tokens: list[int]  # tokens of each tool response (len = len(segments) - 1)
    tool_latency: list[float]
    # live state
    seg: int = 0
    length: int = 0  # KV tokens (at the start of the current segment while running)
    seg_start_step: float = 0.0
    engine: int = -1
    cached: bool = False  # its KV is (still) in the engine's cache
    order: int = 0  # admission order on its engine (vLLM preempts the newest)
    done_at: float = -1.0

    @property
    def budget(self) -> int:
        return self.prompt + sum(self.segments) + sum(self.tool_tokens)


def make_workload(p: SimParams) -> list[SimRollout]:
    rng = random.Random(p.seed)
    out: list[SimRollout] = []
    for q in range(p.prompts):
        prompt = rng.randint(*p.prompt_tokens)
        difficulty = math.exp(rng.gauss(0.0, p.prompt_difficulty_sigma))
        for s in range(p.samples):
            n_calls = 0  # geometric: mean (1 - p) / p ~ 2 calls
            while n_calls < p.max_tool_calls and rng.random() >= p.tool_call_p:
                n_calls += 1
            tools = [rng.randint(*p.tool_response_tokens) for _ in range(n_calls)]
            total = p.length_median * difficulty * math.exp(rng.gauss(0.0, p.length_sigma))
            gen_budget = p.max_tokens - sum(tools)
            total = int(max(n_calls + 1, min(gen_budget, total)))
            cuts = sorted(rng.random() for _ in range(n_calls))
            bounds = [0.0, *cuts, 1.0]
            segs = [max(1, int(total * (b - a))) for a, b in zip(bounds, bounds[1:])]
            lat = [min(p.tool_timeout_s, p.tool_latency_median_s * math.exp(rng.gauss(0.0, p.tool_latency_sigma)))
                   for _ in range(n_calls)]
            out.append(SimRollout(f"q{q}-s{s}", prompt, segs, tools, lat))
    return out


# --------------------------------------------------------------------------- engine model


@dataclass
class SimEngine:
    eid: int
    p: SimParams
    step: float = 0.0  # decode steps done (continuous)
    t_ref: float = 0.0  # time at which `step` is valid (may lie ahead: prefill stall)
    running: dict[str, SimRollout] = field(default_factory=dict)
    seg_heap: list[tuple[float, str]] = field(default_factory=list)
    a_sum: float = 0.0  # sum(length - seg_start_step) over running: active KV = a_sum + n * step
    cached: OrderedDict = field(default_factory=OrderedDict)  # rid -> KV tokens (tool waits), LRU
    cached_tokens: int = 0
    waiting: deque = field(default_factory=deque)
    version: int = 0
    admitted: int = 0
    preemptions: int = 0
    evictions: int = 0
    recomputed_tokens: int = 0
    peak_kv: float = 0.0
    busy_time: float = 0.0
    sync_tools: bool = False  # turn-synchronous tool calls (the paper's baseline)
    parked: list = field(default_factory=list)

    def step_time(self) -> float:
        return self.p.t_fixed_s + self.p.t_seq_s * len(self.running)

    def active_tokens(self) -> float:
        return self.a_sum + len(self.running) * self.step

    def advance(self, now: float) -> None:
        if self.running and now > self.t_ref:
            self.step += (now - self.t_ref) / self.step_time()
            self.busy_time += now - self.t_ref
        self.t_ref = max(self.t_ref, now)
        self.peak_kv = max(self.peak_kv, self.active_tokens() + self.cached_tokens)

    def next_event(self) -> float | None:
        if not self.running:
            return None
        while self.seg_heap and self.seg_heap[0][1] not in self.running:
            heapq.heappop(self.seg_heap)
        s_seg = self.seg_heap[0][0]
        free = self.p.kv_capacity_tokens - self.cached_tokens - self.active_tokens()
        # fire when less than half a token is free (handle() acts below one token)
        s_ovf = self.step + max(0.0, free - 0.5) / len(self.running)
        s_next = min(s_seg, s_ovf)
        return self.t_ref + max(0.0, s_next - self.step) * self.step_time()

    def _stall(self, tokens: int) -> None:
        self.t_ref += tokens * self.p.t_prefill_s
        self.busy_time += tokens * self.p.t_prefill_s

    def _evict_lru(self) -> bool:
        if not self.cached:
            return False
        rid, tokens = self.cached.popitem(last=False)
        self.cached_tokens -= tokens
        self.evictions += 1
        self._rollouts[rid].cached = False
        return True

    def _start_running(self, r: SimRollout) -> None:
        self.running[r.rid] = r
        r.seg_start_step = self.step
        self.a_sum += r.length - self.step
        heapq.heappush(self.seg_heap, (self.step + r.segments[r.seg], r.rid))

    def _stop_running(self, r: SimRollout) -> None:
        del self.running[r.rid]
        self.a_sum -= r.length - r.seg_start_step
        r.length = int(round(r.length + (self.step - r.seg_start_step)))
        if not self.running:
            self.a_sum = 0.0  # no float drift carried over an idle period

    def try_admit(self) -> None:
        """vLLM-like admission: FIFO, while the request's tokens fit the cache."""
        cap = self.p.kv_capacity_tokens
        # vLLM keeps a watermark of free blocks when admitting (1%), so a request it just
        # preempted is not readmitted into the same full cache.
        watermark = 0.01 * cap
        while self.waiting and len(self.running) < self.p.max_num_seqs:
            r: SimRollout = self.waiting[0]
            own_cached = self.cached.get(r.rid, 0)
            if self.active_tokens() + r.length + watermark > cap:
                break
            self.waiting.popleft()
            if own_cached:
                del self.cached[r.rid]
                self.cached_tokens -= own_cached
            while self.active_tokens() + self.cached_tokens + r.length > cap and self._evict_lru():
                pass
            # Prefill what is not cached: everything after a preemption/eviction, else the
            # tokens appended since (the tool response; the prompt on first admission).
            new_tokens = r.length - own_cached if r.cached else r.length
            if not r.cached and r.seg > 0:
                self.recomputed_tokens += own_cached or r.length
            self._stall(new_tokens)
            r.cached = True
            self.admitted += 1
            r.order = self.admitted
            self._start_running(r)
        self.version += 1

    def handle(self, now: float, sim: "Simulation") -> None:
        self.advance(now)
        cap = self.p.kv_capacity_tokens
        eps = 1e-6
        # KV full: evict cached tool-waiters first, else preempt the newest running request.
        while self.running and self.active_tokens() + self.cached_tokens > cap - 1.0:
            if self._evict_lru():
                continue
            victim = max(self.running.values(), key=lambda r: r.order)
            self._stop_running(victim)
            victim.cached = False
            self.preemptions += 1
            self.waiting.appendleft(victim)
            if not self.running:
                break
        while self.seg_heap and self.seg_heap[0][0] <= self.step + eps:
            s_end, rid = heapq.heappop(self.seg_heap)
            r = self.running.get(rid)
            if r is None or abs(r.seg_start_step + r.segments[r.seg] - s_end) > 1e-6:
                continue
            self._stop_running(r)
            r.length = r.length if r.length >= 0 else 0
            if r.seg == len(r.segments) - 1:
                r.done_at = now
                r.cached = False
                sim.finished(self, r, now)
            else:
                self.cached[r.rid] = r.length
                self.cached_tokens += r.length
                if self.sync_tools:
                    self.parked.append(r)
                else:
                    sim.schedule(now + r.tool_latency[r.seg], "tool", r)
        self.try_admit()
        if self.sync_tools and self.parked and not self.running and not self.waiting:
            # the whole batch finished this turn: run every tool call, resume when the slowest returns
            batch, self.parked = self.parked, []
            sim.schedule(now + max(r.tool_latency[r.seg] for r in batch), "tool_batch", batch)


class Simulation:
    def __init__(self, p: SimParams, mode: SchedulerMode, workload: list[SimRollout],
                 reserve_quantile: float | None = None, sync_tools: bool = False, clairvoyant: bool = False,
                 longest_first: bool = True):
        self.p = p
        self.mode = mode
        self.rollouts = {r.rid: r for r in workload}
        self.engines = [SimEngine(i, p) for i in range(p.engines)]
        for e in self.engines:
            e._rollouts = self.rollouts  # type: ignore[attr-defined]
            e.sync_tools = sync_tools
        self.sched = RolloutScheduler(
            {i: p.kv_capacity_tokens for i in range(p.engines)}, mode=mode, block_size=p.block_size,
            max_rollouts_per_engine=p.max_num_seqs, reserve_quantile=reserve_quantile,
        )
        self.events: list = []
        self.counter = 0
        self.n_done = 0
        self.makespan = 0.0
        self.max_reserved_over_capacity = 0.0
        # Reference, not a real scheduler: knows every rollout's final length, reserves exactly
        # it and admits the longest first (LPT).
        self.clairvoyant = clairvoyant
        self.longest_first = longest_first

    def schedule(self, t: float, kind: str, obj) -> None:
        self.counter += 1
        heapq.heappush(self.events, (t, self.counter, kind, obj))

    def _engine_changed(self, e: SimEngine) -> None:
        t = e.next_event()
        if t is not None:
            self.schedule(t, "engine", (e, e.version))

    def _dispatch(self, now: float) -> None:
        for adm in self.sched.admit():
            r = self.rollouts[adm.rollout_id]
            e = self.engines[adm.engine_id]
            e.advance(now)
            r.engine = e.eid
            r.length = r.prompt
            e.waiting.append(r)
            e.try_admit()
            self._engine_changed(e)
        for es in self.sched.engines.values():
            self.max_reserved_over_capacity = max(
                self.max_reserved_over_capacity, es.reserved_tokens / es.capacity_tokens)

    def finished(self, e: SimEngine, r: SimRollout, now: float) -> None:
        self.n_done += 1
        self.makespan = max(self.makespan, now)
        if self.mode is SchedulerMode.DYNAMIC:
            self.sched.finish(r.rid, response_tokens=r.length - r.prompt)
        self._pending_dispatch = True

    def run(self) -> dict:
        order = list(self.rollouts.values())
        if self.clairvoyant and self.longest_first:
            order.sort(key=lambda r: -r.budget)
        for r in order:
            budget = r.budget if self.clairvoyant else r.prompt + self.p.max_tokens
            self.sched.submit(r.rid, budget, prompt_tokens=r.prompt, group=r.rid.split("-")[0])
        self._dispatch(0.0)
        while self.events:
            t, _, kind, obj = heapq.heappop(self.events)
            self._pending_dispatch = False
            if kind == "engine":
                e, version = obj
                if version != e.version:
                    continue
                e.handle(t, self)
                self._engine_changed(e)
            elif kind in ("tool", "tool_batch"):
                batch = obj if kind == "tool_batch" else [obj]
                e = self.engines[batch[0].engine]
                e.advance(t)
                for r in batch:
                    r.length += r.tool_tokens[r.seg]
                    r.seg += 1
                    if self.mode is SchedulerMode.DYNAMIC and not self.clairvoyant:  # reported at turn boundaries
                        self.sched.progress(r.rid, r.length)
                        self._pending_dispatch = True
                    e.waiting.append(r)
                e.try_admit()
                self._engine_changed(e)
            if self._pending_dispatch:
                self._dispatch(t)
        assert self.n_done == len(self.rollouts), f"{self.n_done} of {len(self.rollouts)} finished"
        tokens = sum(sum(r.segments) for r in self.rollouts.values())
        return {
            "makespan_s": self.makespan,
            "generated_tokens": tokens,
            "preemptions": sum(e.preemptions for e in self.engines),
            "evictions": sum(e.evictions for e in self.engines),
            "recomputed_tokens": sum(e.recomputed_tokens for e in self.engines),
            "peak_kv_fraction": max(e.peak_kv for e in self.engines) / self.p.kv_capacity_tokens,
            "max_reserved_fraction": self.max_reserved_over_capacity,
            "engine_busy_fraction": sum(e.busy_time for e in self.engines) / (self.makespan * len(self.engines)),
        }


def lower_bounds(p: SimParams, workload: list[SimRollout]) -> dict:
    """Bounds no schedule can beat (tool waits and prefill ignored except on the critical path).

    * KV bound: a decode step holds at most C tokens of KV, and a rollout's k-th generated token
      needs a step in which it holds (prompt + tokens before it) of KV. So an engine needs at
      least (sum over its tokens of their context length) / C steps, each costing >= t_fixed,
      plus t_seq per token. Spread perfectly over E engines:
      T >= D / (E * C) * t_fixed + W / E * t_seq, with D = sum of context lengths, W = tokens.
    * batch bound: an engine runs at most max_num_seqs sequences per step: T >= W / (E * thr(max)).
    * critical path: the longest rollout alone (its tokens at single-sequence speed + its tools).
    """
    t1 = p.t_fixed_s + p.t_seq_s
    critical = max(sum(r.segments) * t1 + sum(r.tool_latency) + r.budget * p.t_prefill_s for r in workload)
    tokens = 0
    context = 0.0
    for r in workload:
        base = r.prompt
        for i, seg in enumerate(r.segments):
            context += seg * base + seg * (seg + 1) / 2
            base += seg + (r.tool_tokens[i] if i < len(r.tool_tokens) else 0)
        tokens += sum(r.segments)
    kv_bound = context / (p.engines * p.kv_capacity_tokens) * p.t_fixed_s + tokens / p.engines * p.t_seq_s
    thr_max = p.max_num_seqs / (p.t_fixed_s + p.t_seq_s * p.max_num_seqs)
    batch_bound = tokens / (p.engines * thr_max)
    return {
        "lower_bound_s": max(kv_bound, batch_bound, critical),
        "kv_bound_s": kv_bound,
        "batch_bound_s": batch_bound,
        "critical_path_s": critical,
    }


def simulate(p: SimParams) -> dict:
    workload = make_workload(p)
    bounds = lower_bounds(p, workload)
    results = {}
    runs = {
        "dynamic": (SchedulerMode.DYNAMIC, p.reserve_quantile, False, False, False),
        "dynamic_budget": (SchedulerMode.DYNAMIC, None, False, False, False),
        "static": (SchedulerMode.STATIC, None, False, False, False),
        "static_sync": (SchedulerMode.STATIC, None, True, False, False),
        "clairvoyant": (SchedulerMode.DYNAMIC, None, False, True, True),
        "exact_fifo": (SchedulerMode.DYNAMIC, None, False, True, False),
    }
    for name, (mode, q, sync, oracle, lpt) in runs.items():
        fresh = make_workload(p)  # fresh state per run
        t0 = time.perf_counter()
        sim = Simulation(p, mode, fresh, reserve_quantile=q, sync_tools=sync, clairvoyant=oracle, longest_first=lpt)
        res = sim.run()
        res["promotions"] = sim.sched.promotions
        res["sim_wall_s"] = time.perf_counter() - t0
        results[name] = res
    lengths = sorted(sum(r.segments) for r in workload)
    return {
        "params": {k: v for k, v in p.__dict__.items()},
        "workload": {
            "rollouts": len(workload),
            "mean_response_tokens": sum(lengths) / len(lengths),
            "p50_response_tokens": lengths[len(lengths) // 2],
            "p99_response_tokens": lengths[int(len(lengths) * 0.99)],
            "mean_tool_calls": sum(len(r.tool_latency) for r in workload) / len(workload),
        },
        "bounds": bounds,
        **results,
    }


# --------------------------------------------------------------------------- real run


async def real_run(*, tasks: int, samples: int, max_tokens: int, kv_cache_gib: float, model_dir: str) -> dict:
    """One vLLM CPU engine (tiny random model), the real agent loop and scheduler; the same batch
    of tasks with the dynamic and with the static scheduler (same engine, started once).

    The random model writes random tokens: some turns end on </tool_call> (a parse_error tool
    response is appended and generation continues), most run to the token budget. The tool
    executor is not needed (a random model never writes a well-formed call); a dead URL stands
    in so that a call, were one written, would be recorded as a tool failure, not hidden.
    """
    import uuid
    from datetime import timedelta

    from services.rollout.config import Settings
    from services.rollout.engine import RolloutEngine
    from services.rollout.rollouts import AdmissionGate, RolloutRunner
    from services.tool_executor.client import ToolExecutorClient
    from shared.events import RolloutTask, SamplingParams, utcnow
    from lab.tiny_model import create_random_model
    from shared.formats import load_format

    model = create_random_model(model_dir, seed=0)
    tok = load_format(model, "compact", tool_response_max_chars=256)
    engine = RolloutEngine(0, model=model, max_model_len=2048, kv_cache_gib=kv_cache_gib, max_num_seqs=256)
    t0 = time.perf_counter()
    await engine.start()
    start_s = time.perf_counter() - t0
    out: dict = {"engine_start_s": round(start_s, 1), "kv_capacity_tokens": engine.capacity_tokens,
                 "tasks": tasks, "samples": samples, "max_tokens": max_tokens}
    client = ToolExecutorClient(["http://127.0.0.1:9"], max_attempts=1)
    try:
        for label, mode in (("warmup", "dynamic"), ("dynamic", "dynamic"), ("static", "static")):
            sched = RolloutScheduler({0: engine.capacity_tokens}, mode=mode, block_size=engine.block_size,
                                     max_rollouts_per_engine=256, reserve_quantile=Settings().reserve_quantile)
            runner = RolloutRunner([engine], AdmissionGate(sched), tok, client, max_model_len=2048,
                                   tool_timeout_s=5.0)
            batch = [RolloutTask(task_id=uuid.uuid4().hex, run_id="bench", stage=1, problem_id=f"p{i}",
                                 prompt=f"Compute {i} * 37 + 5.", answer="0", n_samples=samples,
                                 sampling=SamplingParams(temperature=1.0, max_tokens=max_tokens, max_turns=4),
                                 deadline=utcnow() + timedelta(hours=1)) for i in range(tasks)]
            pre0 = engine.stats.preemptions
            t0 = time.perf_counter()
            groups = await asyncio.gather(*(runner.run_task(t) for t in batch))
            wall = time.perf_counter() - t0
            model_tokens = sum(sum(t.loss_mask) for g in groups for t in g.trajectories)
            out[label] = {
                "wall_s": round(wall, 2),
                "model_tokens": model_tokens,
                "tokens_per_s": round(model_tokens / wall, 1),
                "preemptions": engine.stats.preemptions - pre0,
                "finish_reasons": _count(t.finish_reason for g in groups for t in g.trajectories),
            }
    finally:
        await client.aclose()
        engine.shutdown()
    return out


def _count(items) -> dict:
    counts: dict = {}
    for x in items:
        counts[x] = counts.get(x, 0) + 1
    return counts


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sim-only", action="store_true", help="run only the simulation")
    parser.add_argument("--engines", type=int, default=SimParams.engines)
    parser.add_argument("--prompts", type=int, default=SimParams.prompts)
    parser.add_argument("--samples", type=int, default=SimParams.samples)
    parser.add_argument("--kv-capacity", type=int, default=SimParams.kv_capacity_tokens)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reserve-quantile", type=float, default=SimParams.reserve_quantile,
                        help="adaptive reservation quantile of the dynamic scheduler (0: full budget)")
    parser.add_argument("--real-tasks", type=int, default=8, help="tasks in the real CPU run")
    parser.add_argument("--real-samples", type=int, default=8, help="rollouts per task in the real run")
    parser.add_argument("--real-max-tokens", type=int, default=256)
    parser.add_argument("--real-kv-gib", type=float, default=0.04,
                        help="KV cache of the real engine: small, so the batch does not fit at once")
    parser.add_argument("--real-model-dir", default=".rstar/bench/rollout-tiny-random",
                        help="where the tiny random model is built (reused when it exists)")
    args = parser.parse_args()

    p = SimParams(engines=args.engines, prompts=args.prompts, samples=args.samples,
                  kv_capacity_tokens=args.kv_capacity, seed=args.seed,
                  reserve_quantile=args.reserve_quantile or None)
    sim = simulate(p)
    dyn, sta, b = sim["dynamic"], sim["static"], sim["bounds"]
    print("== simulation ==")
    print(json.dumps({k: sim[k] for k in ("workload", "bounds")}, indent=1))
    for mode in ("dynamic", "dynamic_budget", "static", "static_sync", "clairvoyant", "exact_fifo"):
        r = sim[mode]
        print(f"{mode:14s} makespan {r['makespan_s']:8.1f} s  ({r['makespan_s'] / b['lower_bound_s']:.3f}x bound)  "
              f"preemptions {r['preemptions']}  evictions {r['evictions']}  recomputed {r['recomputed_tokens']} tok  "
              f"promoted {r['promotions']}  peak KV {r['peak_kv_fraction']:.2f}  busy {r['engine_busy_fraction']:.2f}  (sim {r['sim_wall_s']:.1f} s)")
    headline = {
        "sim_makespan_s_dynamic": round(dyn["makespan_s"], 2),
        "sim_makespan_s_static": round(sta["makespan_s"], 2),
        "sim_lower_bound_s": round(b["lower_bound_s"], 2),
        "sim_makespan_vs_lower_bound": round(dyn["makespan_s"] / b["lower_bound_s"], 4),
        "sim_speedup_vs_static": round(sta["makespan_s"] / dyn["makespan_s"], 4),
        "sim_overflows": dyn["preemptions"] + dyn["evictions"],
        "sim_overflows_static": sta["preemptions"] + sta["evictions"],
        "sim_speedup_vs_static_sync_tools": round(sim["static_sync"]["makespan_s"] / dyn["makespan_s"], 4),
        "sim_makespan_vs_clairvoyant": round(dyn["makespan_s"] / sim["clairvoyant"]["makespan_s"], 4),
        "sim_makespan_vs_lower_bound_budget_reservation": round(sim["dynamic_budget"]["makespan_s"] / b["lower_bound_s"], 4),
        "sim_overflows_budget_reservation": sim["dynamic_budget"]["preemptions"] + sim["dynamic_budget"]["evictions"],
    }
    if not args.sim_only:
        real = asyncio.run(real_run(tasks=args.real_tasks, samples=args.real_samples, max_tokens=args.real_max_tokens,
                                    kv_cache_gib=args.real_kv_gib, model_dir=args.real_model_dir))
        print("== real CPU run ==")
        print(json.dumps(real, indent=1))
        headline.update({
            "cpu_tokens_per_s_dynamic": real["dynamic"]["tokens_per_s"],
            "cpu_tokens_per_s_static": real["static"]["tokens_per_s"],
            "cpu_wall_s_dynamic": real["dynamic"]["wall_s"],
            "cpu_wall_s_static": real["static"]["wall_s"],
        })
    print("headline: makespan vs the lower bound and vs static allocation; overflows = preemptions + "
          "evictions of the dynamic scheduler (target 0); cpu_* = tiny model on this CPU")
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
