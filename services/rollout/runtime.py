"""Rollout service wiring: ``rstar.rollout.tasks`` in (group ``rollout``), ``rstar.trajectories``
out, ``rstar.weights`` read by every instance; vLLM engines, scheduler and agent loop from the
modules beside this one.

Task handling (one handler call per task, ``max_concurrent_tasks`` at once):

1. past its deadline → skipped (the orchestrator has re-dispatched it), offset committed;
2. wait until the engines serve ``min_policy_version`` (at most until the deadline; a task
   whose deadline passes while waiting is skipped);
3. generate ``n_samples`` trajectories (``RolloutRunner``), publish ONE ``TrajectoryGroup``
   keyed by ``group_id = task_id`` and wait for the broker's ack;
4. return → the consumer loop commits. Tasks finish out of order; ``shared.kafka.ConsumerLoop``
   commits per partition only the highest offset below which every task is done, so a crash
   replays exactly the unfinished ones (downstream dedupes by group_id).

A prompt too long for the context or an unknown preset is a ``PermanentError`` (dead-lettered with
the reason).
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Any

from prometheus_client import Counter

from services.rollout.config import Settings
from services.rollout.rollouts import AdmissionGate, BadTask, RolloutRunner, publish_engine_stats
from services.rollout.scheduler import RolloutScheduler
from services.rollout.weights import WeightUpdater, tensor_index
from shared import topics
from shared.events import Envelope, RolloutTask, WeightVersion
from shared.kafka import ConsumerLoop, PermanentError
from shared.logging import get_logger
from shared.runtime import RuntimeContext, Service

log = get_logger("rollout")

TASKS = Counter("rstar_rollout_tasks_total", "Rollout tasks by outcome", ["outcome"])

CONSUMER_GROUP = "rollout"


class RolloutService(Service):
    name = "rollout"
    needs_kafka = True
    needs_db = True  # heartbeats only

    def __init__(self, settings: Settings, engines: list[Any] | None = None):
        super().__init__(settings)
        self.settings: Settings = settings
        # Engines already started by the caller (shared, e.g. by tests); else built in start().
        self._given_engines = engines
        self.engines: list[Any] = list(engines or [])
        self.scheduler: RolloutScheduler | None = None
        self.runner: RolloutRunner | None = None
        self.weights: WeightUpdater | None = None
        self.tool_client: Any = None
        self.tasks_loop: ConsumerLoop | None = None
        self.weights_loop: ConsumerLoop | None = None
        self._engines_ready = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self, ctx: RuntimeContext) -> None:
        await super().start(ctx)
        s = self.settings
        from services.rollout.engine import RolloutEngine
        from services.tool_executor.client import ToolExecutorClient
        from shared.formats import load_format

        model_dir = s.model_path.resolve()
        # Checked before any engine starts: a directory the format cannot use fails in a second.
        self.fmt = load_format(model_dir, s.prompt_preset, tool_response_max_chars=s.tool_response_max_chars)
        log.info("rollout_format", **{k: v for k, v in self.fmt.describe().items() if k != "tool_wrap"})
        reference = tensor_index(model_dir)
        self.engines = self._given_engines or [
            RolloutEngine(i, model=model_dir, dtype=s.dtype, block_size=s.block_size, max_model_len=s.max_model_len,
                          kv_cache_gib=s.kv_cache_gib, max_num_seqs=s.max_num_seqs,
                          tensor_parallel_size=s.tensor_parallel_size, seed=s.seed + i,
                          enforce_eager=s.enforce_eager, version=s.initial_version)
            for i in range(s.num_engines)
        ]
        for engine in self.engines:  # one at a time: each start compiles and profiles
            if not engine.healthy:
                await engine.start()
        smallest = min(e.capacity_tokens for e in self.engines)
        if s.scheduler_mode == "dynamic" and smallest < s.max_model_len:
            raise ValueError(
                f"an engine holds {smallest} KV tokens, fewer than max_model_len {s.max_model_len}: a rollout "
                "using its whole context could never be admitted; raise kv_cache_gib or lower max_model_len"
            )
        self.scheduler = RolloutScheduler(
            {e.index: e.capacity_tokens for e in self.engines}, mode=s.scheduler_mode,
            block_size=self.engines[0].block_size, max_rollouts_per_engine=s.max_num_seqs,
            reserve_quantile=s.reserve_quantile,
        )
        self.tool_client = ToolExecutorClient(s.tool_executor_urls, timeout_s=s.tool_timeout_s,
                                              max_attempts=s.tool_max_attempts)
        self.runner = RolloutRunner(
            self.engines, AdmissionGate(self.scheduler), self.fmt, self.tool_client,
            max_model_len=s.max_model_len, tool_timeout_s=s.tool_timeout_s, instance_id=s.instance_id,
        )
        self.weights = WeightUpdater(self.engines, reference, min(e.version for e in self.engines), run_id=s.run_id)
        self._engines_ready = True
        assert ctx.producer is not None
        self.tasks_loop = ConsumerLoop(
            s.kafka_bootstrap, s.topic(topics.ROLLOUT_TASKS), CONSUMER_GROUP, self.handle_task, ctx.producer,
            expect=RolloutTask, concurrency=s.max_concurrent_tasks, client_id=f"rollout-{s.instance_id}",
        )
        self.weights_loop = ConsumerLoop(
            s.kafka_bootstrap, s.topic(topics.WEIGHTS), None, self.handle_weights, ctx.producer,
            expect=WeightVersion, client_id=f"rollout-weights-{s.instance_id}",
        )
        log.info("rollout_started", engines=len(self.engines), mode=s.scheduler_mode,
                 kv_tokens=[e.capacity_tokens for e in self.engines], version=s.initial_version)

    async def run(self) -> None:
        assert self.tasks_loop and self.weights_loop and self.weights
        jobs = [
            asyncio.create_task(self.weights_loop.run(), name="weights-consumer"),
            asyncio.create_task(self.weights.run(self._stop), name="weights-loader"),
            asyncio.create_task(self._stats_loop(), name="engine-stats"),
            asyncio.create_task(self.tasks_loop.run(), name="tasks-consumer"),
        ]
        stopper = asyncio.create_task(self._stop.wait())
        try:
            done, _ = await asyncio.wait([*jobs, stopper], return_when=asyncio.FIRST_COMPLETED)
            for job in done:
                if job is not stopper and job.exception() is not None:
                    raise job.exception()
        finally:
            self.tasks_loop.stop()
            self.weights_loop.stop()
            stopper.cancel()
            await asyncio.gather(*jobs, return_exceptions=True)
            await self.close()

    async def stop(self) -> None:
        await super().stop()
        if self.tasks_loop:
            self.tasks_loop.stop()
        if self.weights_loop:
            self.weights_loop.stop()

    async def close(self) -> None:
        """Release the engines and the tool client (after ``run`` returned)."""
        if self.tool_client is not None:
            await self.tool_client.aclose()
        if self._given_engines is None:
            for e in self.engines:
                e.shutdown()
        self._engines_ready = False

    async def ready(self) -> dict[str, bool]:
        return {"engines": self._engines_ready and all(e.healthy for e in self.engines)}

    def info(self) -> dict[str, Any]:
        return {
            "policy_version": self.weights.version if self.weights else None,
            "engines": len(self.engines),
            "scheduler_mode": self.settings.scheduler_mode,
            "waiting_rollouts": self.scheduler.waiting if self.scheduler else 0,
            "running_rollouts": self.scheduler.running if self.scheduler else 0,
            "weights_error": self.weights.last_error if self.weights else None,
        }

    async def _stats_loop(self) -> None:
        while not self._stop.is_set():
            if self.scheduler is not None:
                publish_engine_stats(self.engines, self.scheduler)
                if self.runner is not None:
                    self.runner.gate.pump()  # observed usage may have dropped: admit
            try:
                await asyncio.wait_for(self._stop.wait(), self.settings.stats_interval_s)
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------------ handlers

    async def handle_weights(self, envelope: Envelope, record) -> None:
        wv: WeightVersion = envelope.payload
        assert self.weights is not None
        self.weights.announce(wv)

    async def handle_task(self, envelope: Envelope, record) -> None:
        task: RolloutTask = envelope.payload
        assert self.runner is not None and self.weights is not None and self.ctx and self.ctx.producer
        if _past(task.deadline):
            TASKS.labels("skipped_deadline").inc()
            log.info("task_skipped_deadline", task_id=task.task_id, deadline=task.deadline.isoformat())
            return
        if self.weights.version < task.min_policy_version:
            remaining = (task.deadline - datetime.now(timezone.utc)).total_seconds()
            if not await self.weights.wait_for(task.min_policy_version, max(0.0, remaining)):
                TASKS.labels("skipped_version_wait").inc()
                log.info("task_skipped_version", task_id=task.task_id, need=task.min_policy_version,
                         serving=self.weights.version)
                return
        try:
            group = await self.runner.run_task(task)
        except BadTask as exc:  # a prompt too long for the context, an unknown preset
            TASKS.labels("dead_letter").inc()
            raise PermanentError(str(exc)) from exc
        await self.ctx.producer.send(self.settings.topic(topics.TRAJECTORIES), group, key=group.group_id,
                                     run_id=task.run_id)
        TASKS.labels("published").inc()
        lo, hi = group.policy_version_range
        log.info("group_published", task_id=task.task_id, trajectories=len(group.trajectories),
                 versions=[lo, hi], offset=record.offset, partition=record.partition)


def _past(deadline: datetime) -> bool:
    if deadline.tzinfo is None:
        deadline = deadline.replace(tzinfo=timezone.utc)
    return datetime.now(timezone.utc) > deadline


def build_service(settings: Settings) -> RolloutService:
    return RolloutService(settings)
