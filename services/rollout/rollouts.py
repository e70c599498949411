"""Running a task's rollouts: admission through the scheduler, the agent loop on the admitted
engine, tool calls through the tool-executor client, metrics. No Kafka here (runtime.py).

``AdmissionGate`` is the async face of the pure ``RolloutScheduler``: a rollout awaits its
admission (a future resolved when ``admit()`` places it), runs every turn on that engine,
reports its KV length at each turn boundary, and frees its reservation when it ends, which
admits the next waiting rollout at once. Tool calls are awaited by the rollout that made them
only: the other rollouts of the engine keep generating (asynchronous tool dispatch), and the
waiting rollout keeps its reservation and its cached prefix.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Protocol

from prometheus_client import Counter, Gauge, Histogram

from services.rollout.agent import (
    AgentConfig,
    AgentLoop,
    Generation,
    GenerateRequest,
    ToolOutcome,
    ToolRequest,
    outcome_from_execution,
    run_agent,
    unavailable_outcome,
)
from services.rollout.scheduler import RolloutScheduler
from shared.formats import ConversationFormat, ToolResult
from shared.events import RolloutTask, Trajectory, TrajectoryGroup
from shared.logging import get_logger

log = get_logger("rollout.rollouts")

KV_USAGE = Gauge("rstar_rollout_kv_cache_usage", "KV cache fraction held by requests", ["engine"])
ENGINE_RUNNING = Gauge("rstar_rollout_engine_running_requests", "Requests running in the engine", ["engine"])
ENGINE_WAITING = Gauge("rstar_rollout_engine_waiting_requests", "Requests waiting in the engine", ["engine"])
ENGINE_PREEMPTIONS = Gauge("rstar_rollout_engine_preemptions", "Preemptions (KV overflow) since start", ["engine"])
SCHED_RUNNING = Gauge("rstar_rollout_admitted_rollouts", "Rollouts admitted by the scheduler", ["engine"])
SCHED_RESERVED = Gauge("rstar_rollout_reserved_kv_tokens", "KV tokens reserved by admitted rollouts", ["engine"])
SCHED_WAITING = Gauge("rstar_rollout_waiting_rollouts", "Rollouts waiting for admission")
GENERATED_TOKENS = Counter("rstar_rollout_generated_tokens_total", "Model tokens generated")
TOOL_LATENCY = Histogram("rstar_rollout_tool_latency_seconds", "Tool call wall time (queue + run)", ["status"],
                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
TURNS = Histogram("rstar_rollout_turns", "Generation turns per trajectory", buckets=(1, 2, 3, 4, 5, 6, 8, 10, 15, 20))
FINISH = Counter("rstar_rollout_finished_total", "Trajectories by finish reason", ["reason"])
TOOL_UNAVAILABLE = Counter("rstar_rollout_tool_executor_unavailable_total",
                           "Tool calls the executor could not run at all (each ends its trajectory: tool_failure)")
# An executor outage fails every call in flight: one warning per this many seconds, with the count
# since the last one, says so without a line per call.
OUTAGE_LOG_INTERVAL_S = 30.0
ADMISSION_WAIT = Histogram("rstar_rollout_admission_wait_seconds", "Time a rollout waited for admission",
                           buckets=(0.001, 0.01, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
RESPONSE_TOKENS = Histogram("rstar_rollout_response_tokens", "Response tokens per trajectory (model + tool)",
                            buckets=(64, 128, 256, 512, 1024, 2048, 4096, 8192, 12288, 16384))


class Engine(Protocol):
    index: int
    version: int

    @property
    def capacity_tokens(self) -> int: ...
    @property
    def used_tokens(self) -> int: ...

    async def generate(self, req: GenerateRequest, *, temperature: float, top_p: float,
                       stop_token_ids: list[int], stop_strings: list[str] | None = None,
                       request_id: str | None = None, extra: dict[str, Any] | None = None) -> Generation: ...


class AdmissionGate:
    def __init__(self, scheduler: RolloutScheduler) -> None:
        self.scheduler = scheduler
        self._futures: dict[str, asyncio.Future[int]] = {}

    async def acquire(self, rollout_id: str, budget_tokens: int, prompt_tokens: int, group: str) -> int:
        """Wait until the scheduler admits the rollout; returns its engine index."""
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._futures[rollout_id] = fut
        self.scheduler.submit(rollout_id, budget_tokens, prompt_tokens=prompt_tokens, group=group)
        self.pump()
        try:
            return await fut
        except asyncio.CancelledError:
            self._futures.pop(rollout_id, None)
            if not self.scheduler.cancel(rollout_id) and self.scheduler.engine_of(rollout_id) is not None:
                self.release(rollout_id)  # admitted in the same instant it was cancelled
            raise

    def release(self, rollout_id: str, response_tokens: int | None = None) -> None:
        self.scheduler.finish(rollout_id, response_tokens=response_tokens)
        self.pump()

    def progress(self, rollout_id: str, kv_tokens: int) -> None:
        self.scheduler.progress(rollout_id, kv_tokens)

    def pump(self) -> None:
        for adm in self.scheduler.admit():
            fut = self._futures.pop(adm.rollout_id, None)
            if fut is None or fut.done():
                self.scheduler.finish(adm.rollout_id)  # its waiter is gone
                continue
            fut.set_result(adm.engine_id)
        SCHED_WAITING.set(self.scheduler.waiting)
        for eid, e in self.scheduler.engines.items():
            SCHED_RUNNING.labels(str(eid)).set(len(e.rollouts))
            SCHED_RESERVED.labels(str(eid)).set(e.reserved_tokens)


class BadTask(ValueError):
    """A task this service can never run (dead-lettered with the reason, not retried)."""


class PromptTooLong(BadTask):
    """The rendered prompt leaves no room to generate within max_model_len."""


class RolloutRunner:
    """Generates the ``n_samples`` trajectories of a task on the engines."""

    def __init__(self, engines: Sequence[Engine], gate: AdmissionGate, fmt: ConversationFormat, tool_client: Any, *,
                 max_model_len: int, tool_timeout_s: float, instance_id: str = "") -> None:
        self.engines = list(engines)
        self.gate = gate
        self.fmt = fmt
        self._formats: dict[str, ConversationFormat] = {fmt.preset.name: fmt}
        self.tools = tool_client
        self.max_model_len = max_model_len
        self.tool_timeout_s = tool_timeout_s
        self.instance_id = instance_id
        self._unavailable_since_log = 0
        self._last_outage_log = float("-inf")

    def format_for(self, task: RolloutTask) -> ConversationFormat:
        """The model's format with the task's preset (a run's own, else this service's)."""
        name = task.prompt_preset or self.fmt.preset.name
        if name not in self._formats:
            try:
                self._formats[name] = self.fmt.with_preset(name)
            except ValueError as exc:
                raise BadTask(f"task {task.task_id}: {exc}") from exc
        return self._formats[name]

    def prompt_ids(self, task: RolloutTask) -> list[int]:
        ids = self.format_for(task).prompt_ids(task.prompt)
        if len(ids) >= self.max_model_len:
            raise PromptTooLong(f"prompt of {len(ids)} tokens does not fit max_model_len {self.max_model_len}")
        return ids

    async def run_task(self, task: RolloutTask) -> TrajectoryGroup:
        prompt = self.prompt_ids(task)
        # A TaskGroup cancels the siblings when one rollout fails (an engine died): a retry of
        # the task must not meet its own leftover rollouts in the scheduler.
        try:
            async with asyncio.TaskGroup() as tg:
                runs = [tg.create_task(self.run_one(task, prompt, i)) for i in range(task.n_samples)]
        except ExceptionGroup as group_error:
            raise group_error.exceptions[0]  # the first failure is the one to report
        trajectories = [r.result() for r in runs]
        return TrajectoryGroup(
            group_id=task.task_id, run_id=task.run_id, stage=task.stage, problem_id=task.problem_id,
            answer=task.answer, trajectories=list(trajectories), attempt=task.attempt,
            rollout_instance=self.instance_id, purpose=task.purpose,
        )

    async def run_one(self, task: RolloutTask, prompt: list[int], sample: int) -> Trajectory:
        sp = task.sampling
        response_budget = min(sp.max_tokens, self.max_model_len - len(prompt))
        rollout_id = f"{task.task_id}/{task.attempt}/{sample}"
        t0 = time.monotonic()
        engine_idx = await self.gate.acquire(rollout_id, len(prompt) + response_budget, len(prompt), task.task_id)
        ADMISSION_WAIT.observe(time.monotonic() - t0)
        engine = self.engines[engine_idx]
        config = AgentConfig(max_tokens=response_budget, max_turns=sp.max_turns, max_model_len=self.max_model_len)
        fmt = self.format_for(task)
        loop = AgentLoop(f"{task.task_id}-{sample}", prompt, config, fmt)
        natural_end = False
        try:
            async def generate(req: GenerateRequest) -> Generation:
                gen = await engine.generate(
                    req, temperature=sp.temperature, top_p=sp.top_p, stop_token_ids=fmt.stop_token_ids,
                    stop_strings=fmt.stop_strings, request_id=f"{rollout_id}/t{req.turn}",
                )
                GENERATED_TOKENS.inc(len(gen.token_ids))
                return gen

            traj = await run_agent(loop, generate, self.run_tool,
                                   on_turn=lambda lp: self.gate.progress(rollout_id, lp.kv_tokens))
            natural_end = True
        finally:
            self.gate.release(rollout_id, response_tokens=len(loop.response_ids) if natural_end else None)
        FINISH.labels(traj.finish_reason).inc()
        TURNS.observe(traj.turns)
        RESPONSE_TOKENS.observe(len(traj.response_token_ids))
        return traj

    async def run_tool(self, call: ToolRequest) -> ToolOutcome:
        from services.tool_executor.client import ToolExecutorRequestError, ToolExecutorUnavailable

        t0 = time.monotonic()
        try:
            result = await self.tools.execute(call.code, stdin=call.stdin, timeout_s=self.tool_timeout_s)
        except ToolExecutorUnavailable as exc:
            outcome = unavailable_outcome(str(exc), (time.monotonic() - t0) * 1000)
            self._note_outage(str(exc))
        except ToolExecutorRequestError as exc:
            # The service refused this code as a request (e.g. too long): the model's doing.
            outcome = ToolOutcome(ToolResult("error", stderr=f"ToolCallError: {exc}"), (time.monotonic() - t0) * 1000)
        else:
            outcome = outcome_from_execution(result.status, result.stdout, result.stderr, result.duration_ms,
                                             timeout_s=self.tool_timeout_s)
        TOOL_LATENCY.labels(outcome.status if not outcome.fatal else "unavailable").observe(time.monotonic() - t0)
        return outcome

    def _note_outage(self, error: str) -> None:
        """Count a call the executor could not run; warn at most every OUTAGE_LOG_INTERVAL_S."""
        TOOL_UNAVAILABLE.inc()
        self._unavailable_since_log += 1
        now = time.monotonic()
        if now - self._last_outage_log >= OUTAGE_LOG_INTERVAL_S:
            log.warning("tool_executor_unavailable", calls=self._unavailable_since_log, error=error[:500],
                        hint="these trajectories end tool_failure: the reward leaves them out and re-dispatches "
                        "groups that lost too many")
            self._unavailable_since_log = 0
            self._last_outage_log = now


def publish_engine_stats(engines: Sequence[Any], scheduler: RolloutScheduler) -> None:
    """Engine KV statistics -> scheduler (``observe``) and metrics."""
    for e in engines:
        if not getattr(e, "healthy", True):
            continue
        label = str(e.index)
        scheduler.observe(e.index, used_tokens=e.used_tokens)
        KV_USAGE.labels(label).set(e.stats.kv_usage)
        ENGINE_RUNNING.labels(label).set(e.stats.running)
        ENGINE_WAITING.labels(label).set(e.stats.waiting)
        ENGINE_PREEMPTIONS.labels(label).set(e.stats.preemptions)
