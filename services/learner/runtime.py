"""Learner runtime: ``rstar.scored`` (consumer group ``learner``) → GRPO-RoC steps →
checkpoints → ``policy_versions`` / ``learner_steps`` → ``rstar.weights``.

One learner instance per run (it owns the policy; the consumer group only guarantees no two
learners read the same partition). Exactly-once training on top of at-least-once delivery:

1. Every consumed ScoredGroup is offered to the engine's step assembler (dedupe by group_id,
   staleness bound, no-signal skip). The consumer loop runs with ``manual_commit``: nothing is
   committed while groups sit in the buffer.
2. When B groups are buffered the step trains in a worker thread (the HTTP endpoints and
   heartbeats keep running) and the checkpoint — weights, optimizer, step, version, stage and
   the consumed group ids — is renamed into place.
3. Then, retried until it succeeds (transient or not: a step that is not recorded must not be
   forgotten): insert ``policy_versions`` and ``learner_steps``, mark the groups'
   ``trajectory_groups.trained_step``, publish the WeightVersion (key run_id, event id derived
   from run and version, so a re-publication is recognisable).
4. Commit the offsets of every consumed message below the first one still buffered.

A crash before 2 finishes: nothing durable happened, the groups are redelivered. A crash
between 2 and 4: the restart resumes from the checkpoint, re-records and re-publishes the
current version (step 3 is idempotent), and the redelivered groups are duplicates of the
consumed set. On a fresh start the initial model is recorded and announced as version 0.

On several devices (``torchrun ... -m services.learner.multi_device``) this service runs on
rank 0 only, around an engine opened with the process group; the other ranks follow the
engine's commands (:mod:`services.learner.commands`).
"""

from __future__ import annotations

import asyncio
import math
import os
import uuid
from collections import defaultdict
from typing import Any

from aiokafka import ConsumerRecord, TopicPartition
from fastapi import APIRouter
from prometheus_client import Counter, Gauge, Histogram
from sqlalchemy import func, update
from structlog.contextvars import bound_contextvars
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential

from services.learner.assembly import Decision
from services.learner.config import Settings
from services.learner.engine import BadGroup, EngineConfig, LearnerEngine, StepOutcome
from shared import topics
from shared.checkpoint import uri_for
from shared.db.models import LearnerStep, PolicyVersion, Run, TrajectoryGroupRow
from shared.db.session import upsert
from shared.events import Envelope, ScoredGroup, WeightVersion
from shared.kafka import BACKOFF_MAX_S, ConsumerLoop, PermanentError
from shared.logging import get_logger
from shared.runtime import RuntimeContext, Service

log = get_logger("learner")


def _skip(run_id: str, group_ids: list[str], reason: str):
    # Never over a group some step trained on (a redelivered duplicate is not a skip).
    return (update(TrajectoryGroupRow)
            .where(TrajectoryGroupRow.run_id == run_id, TrajectoryGroupRow.group_id.in_(group_ids),
                   TrajectoryGroupRow.trained_step.is_(None))
            .values(learner_skipped=reason))

# Per-step metrics exported as gauges named rstar_learner_<name> (the latest step's value).
STEP_METRICS = {
    "loss": "GRPO-RoC surrogate loss (token-mean)",
    "clip_frac_low": "fraction of tokens whose lower PPO clip binds",
    "clip_frac_high": "fraction of tokens whose upper (clip-higher) PPO clip binds",
    "is_weight_mean": "mean behaviour importance weight (before truncation)",
    "is_weight_max": "max behaviour importance weight (before truncation)",
    "is_truncated_frac": "fraction of tokens whose importance weight was truncated",
    "approx_kl_behav": "k3 estimate of KL(behaviour || current policy)",
    "entropy": "mean policy entropy over loss tokens",
    "grad_norm": "global gradient norm before clipping",
    "tokens_per_s": "training tokens per second (prompt + response)",
    "staleness_mean": "mean version lag of trained tokens",
    "staleness_max": "max version lag of trained tokens",
    "reward_mean": "mean reward of trained trajectories",
    "pass_rate_mean": "mean pass rate of trained groups",
    "response_len_mean": "mean response length (tokens) of trained trajectories",
    "tool_error_rate_pos": "tool-error rate of trained positive trajectories",
    "lr": "learning rate of the step",
}
GAUGES = {name: Gauge(f"rstar_learner_{name}", desc) for name, desc in STEP_METRICS.items()}
VERSION = Gauge("rstar_learner_version", "Current policy version")
STEP = Gauge("rstar_learner_step", "Training steps done")
BUFFERED = Gauge("rstar_learner_buffered_groups", "Scored groups waiting for the next step")
GROUPS = Counter("rstar_learner_groups_total", "Scored groups by decision (and dead_letter: untrainable, "
                 "assembly.defects)", ["decision"])
OPTIMIZER_RESETS = Counter("rstar_learner_optimizer_resets_total", "Optimizer resets (curriculum stage 3)")
SKIPPED_STEPS = Counter("rstar_learner_skipped_steps_total", "Steps given up because the gradient was not finite")
STEP_SECONDS = Histogram("rstar_learner_step_seconds", "Wall time of a training step incl. checkpoint",
                         buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))


def weights_event_id(run_id: str, version: int) -> str:
    """The same id for every (re)publication of a version."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"rstar:weights:{run_id}:{version}").hex


def _finite(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def learner_step_row(run_id: str, outcome: StepOutcome) -> dict[str, Any]:
    m = outcome.metrics
    json_metrics = {k: (_finite(v) if not isinstance(v, bool) else v) for k, v in m.items()}
    return {
        "run_id": run_id,
        "step": outcome.step,
        "version": outcome.version,
        "stage": outcome.stage,
        "n_groups": int(m.get("n_groups", 0)),
        "n_tokens": int(m.get("tokens", 0)),
        "loss": _finite(m.get("loss")),
        "clip_frac_low": _finite(m.get("clip_frac_low")),
        "clip_frac_high": _finite(m.get("clip_frac_high")),
        "is_weight_mean": _finite(m.get("is_weight_mean")),
        "is_weight_max": _finite(m.get("is_weight_max")),
        "approx_kl": _finite(m.get("approx_kl_behav")),
        "entropy": _finite(m.get("entropy")),
        "grad_norm": _finite(m.get("grad_norm")),
        "tokens_per_s": _finite(m.get("tokens_per_s")),
        "staleness_mean": _finite(m.get("staleness_mean")),
        "staleness_max": _finite(m.get("staleness_max")),
        "reward_mean": _finite(m.get("reward_mean")),
        "pass_rate_mean": _finite(m.get("pass_rate_mean")),
        "response_len_mean": _finite(m.get("response_len_mean")),
        "tool_error_rate_pos": _finite(m.get("tool_error_rate_pos")),
        "dropped_stale": int(m.get("dropped_stale", 0)),
        "optimizer_reset": bool(m.get("optimizer_reset", False)),
        "metrics": json_metrics,
    }


class LearnerService(Service):
    name = "learner"
    needs_kafka = True
    needs_db = True

    def __init__(self, settings: Settings, engine: LearnerEngine | None = None):
        """``engine``: already opened (rank 0 of a multi-device learner opens it with the process
        group before the service starts); by default ``start`` opens one on this process's device."""
        super().__init__(settings)
        self.settings: Settings = settings
        self.engine: LearnerEngine | None = engine
        self.loop: ConsumerLoop | None = None
        self._pending: list[tuple[ConsumerRecord, str | None]] = []
        self._unannounced: list[StepOutcome] = []
        self._announced_initial = False

    # ------------------------------------------------------------------ lifecycle
    async def start(self, ctx: RuntimeContext) -> None:
        await super().start(ctx)
        s = self.settings
        if self.engine is None:
            if s.torch_threads:
                import torch

                torch.set_num_threads(s.torch_threads)
            self.engine = await asyncio.to_thread(LearnerEngine.open, EngineConfig.from_settings(s))
        VERSION.set(self.engine.version)
        STEP.set(self.engine.state.step)
        if self.engine.run_id:
            # Re-record and re-announce the current version: covers a crash between a checkpoint
            # and its publication, and tells late joiners where version 0 lives.
            await self._announce(await asyncio.to_thread(self._current_outcome))
        assert ctx.producer is not None
        self.loop = ConsumerLoop(
            s.kafka_bootstrap, ctx.topic(topics.SCORED), s.consumer_group, self._handle, ctx.producer,
            expect=ScoredGroup, manual_commit=True, client_id=f"learner-{s.instance_id}",
        )

    async def run(self) -> None:
        assert self.loop is not None
        await self.loop.run()

    def request_stop(self) -> None:
        super().request_stop()
        if self.loop is not None:
            self.loop.stop()

    async def stop(self) -> None:
        self.request_stop()
        await super().stop()

    async def ready(self) -> dict[str, bool]:
        return {"model": self.engine is not None, "consumer": self.loop is not None and self.loop.started.is_set()}

    def info(self) -> dict[str, Any]:
        if self.engine is None:
            return {}
        return {"version": self.engine.version, "step": self.engine.state.step, "run_id": self.engine.run_id,
                "buffered": len(self.engine.assembler.buffer)}

    def router(self) -> APIRouter:
        r = APIRouter(prefix="/learner")

        @r.get("/state")
        async def state() -> dict[str, Any]:
            if self.engine is None:
                return {"ready": False}
            e = self.engine
            weights_dir, sha = e.current_weights()
            return {"ready": True, "run_id": e.run_id, "version": e.version, "step": e.state.step, "stage": e.state.stage,
                    "uri": uri_for(weights_dir), "sha256": sha, "buffered": len(e.assembler.buffer),
                    "groups_per_step": e.cfg.groups_per_step, "decisions": dict(e.assembler.counts),
                    "optimizer_reset_steps": e.state.optimizer_reset_steps, "last_metrics": e.state.metrics}

        return r

    # ------------------------------------------------------------------ consuming
    async def _handle(self, envelope: Envelope, record: ConsumerRecord) -> None:
        assert self.engine is not None
        group: ScoredGroup = envelope.payload
        with bound_contextvars(run_id=group.run_id, group_id=group.group_id, event_id=envelope.event_id):
            await self._announce_pending()
            try:
                decision = self.engine.offer(group)
            except BadGroup as exc:
                # alone to the dead-letter topic; the batch it would have joined trains on
                GROUPS.labels("dead_letter").inc()
                raise PermanentError(str(exc)) from exc
            GROUPS.labels(decision.value).inc()
            BUFFERED.set(len(self.engine.assembler.buffer))
            self._pending.append((record, group.group_id))
            if decision is not Decision.ACCEPTED:
                log.info("group_skipped", decision=decision.value, min_version=group.min_policy_version,
                         version=self.engine.version)
            if decision in (Decision.STALE, Decision.NO_SIGNAL, Decision.RUN_COMPLETE):
                await self._until_done("record_skip", lambda: self._record_skipped(
                    group.run_id, [group.group_id], decision.value))
            if not self._announced_initial and self.engine.run_id:
                # in a thread: version 0's hash reads the whole initial model, and a blocked event
                # loop would stop the consumer's polls and heartbeats
                await self._announce(await asyncio.to_thread(self._current_outcome))
            if self.engine.ready():
                await self._step()
            await self._commit_done()

    async def _step(self) -> None:
        assert self.engine is not None
        try:
            with STEP_SECONDS.time():
                outcome = await asyncio.to_thread(self.engine.train_step)
        except Exception:
            if self.engine.poisoned:
                # Weights in memory are ahead of the last checkpoint (its write failed): stop;
                # the restart resumes from that checkpoint and the groups are redelivered.
                log.critical("checkpoint_write_failed_stopping")
                self.request_stop()
            raise
        BUFFERED.set(len(self.engine.assembler.buffer))
        if not outcome.trained:
            SKIPPED_STEPS.inc()
            return
        self._unannounced.append(outcome)
        await self._announce_pending()

    async def _announce_pending(self) -> None:
        while self._unannounced:
            await self._announce(self._unannounced[0])
            self._unannounced.pop(0)

    def _current_outcome(self) -> StepOutcome:
        assert self.engine is not None
        e = self.engine
        weights_dir, sha = e.current_weights()
        return StepOutcome(version=e.version, step=e.state.step, stage=e.state.stage or 0, weights_dir=weights_dir,
                           sha256=sha, group_ids=[], metrics=dict(e.state.metrics),
                           optimizer_reset=bool(e.state.metrics.get("optimizer_reset", False)), dropped_stale=0)

    async def _announce(self, outcome: StepOutcome) -> None:
        """Record the version (and its step) in PostgreSQL, then publish it; retried until done."""
        assert self.ctx is not None and self.ctx.sessions is not None and self.ctx.producer is not None
        assert self.engine is not None
        run_id = self.engine.run_id

        async def announce() -> None:
            await self._record(run_id, outcome)
            event = WeightVersion(run_id=run_id, version=outcome.version, step=outcome.step, stage=outcome.stage,
                                  uri=outcome.uri, sha256=outcome.sha256)
            await self.ctx.producer.send(self.ctx.topic(topics.WEIGHTS), event, key=run_id,
                                         event_id=weights_event_id(run_id, outcome.version))

        await self._until_done("announce", announce, version=outcome.version)
        self._announced_initial = True
        VERSION.set(outcome.version)
        STEP.set(outcome.step)
        if outcome.group_ids:  # a new step (not a re-announcement on start-up)
            for name, gauge in GAUGES.items():
                v = _finite(outcome.metrics.get(name))
                if v is not None:
                    gauge.set(v)
            if outcome.optimizer_reset:
                OPTIMIZER_RESETS.inc()
        log.info("version_published", version=outcome.version, step=outcome.step, uri=outcome.uri)

    async def _until_done(self, what: str, op, **log_fields) -> None:
        """Run ``op`` until it succeeds (transient or not: what it records must not be
        forgotten), backing off 0.2 s doubling to BACKOFF_MAX_S; only a stop request (or a
        cancellation, which is no Exception) ends the retries."""
        def log_retry(state: RetryCallState) -> None:
            log.warning(f"{what}_failed", error=repr(state.outcome.exception()),
                        retry_in_s=state.next_action.sleep, **log_fields)

        async for attempt in AsyncRetrying(
            retry=retry_if_exception(lambda exc: isinstance(exc, Exception) and not self._stop.is_set()),
            wait=wait_exponential(multiplier=0.2, max=BACKOFF_MAX_S), before_sleep=log_retry, reraise=True,
        ):
            with attempt:
                await op()

    async def _record_skipped(self, run_id: str, group_ids: list[str], reason: str) -> None:
        """Mark groups the learner gave up for good (stale, no signal, past the run's last step):
        the orchestrator counts them as dropped and admits replacements."""
        assert self.ctx is not None and self.ctx.sessions is not None
        async with self.ctx.sessions() as session:
            await session.execute(_skip(run_id, group_ids, reason))
            await session.commit()

    async def _record(self, run_id: str, outcome: StepOutcome) -> None:
        assert self.ctx is not None and self.ctx.sessions is not None
        async with self.ctx.sessions() as session:
            await session.execute(upsert(PolicyVersion, {
                "run_id": run_id, "version": outcome.version, "step": outcome.step, "stage": outcome.stage,
                "uri": outcome.uri, "sha256": outcome.sha256,
            }))
            if outcome.step > 0 and outcome.metrics:
                await session.execute(upsert(LearnerStep, learner_step_row(run_id, outcome)))
            if outcome.group_ids:
                await session.execute(
                    update(TrajectoryGroupRow)
                    .where(TrajectoryGroupRow.run_id == run_id, TrajectoryGroupRow.group_id.in_(outcome.group_ids))
                    .values(trained_step=outcome.step)
                )
            for why in {why for _, why in outcome.skipped}:
                await session.execute(_skip(run_id, [gid for gid, w in outcome.skipped if w == why], why))
            await session.execute(
                update(Run).where(Run.run_id == run_id)
                .values(current_version=func.greatest(Run.current_version, outcome.version))
            )
            await session.commit()

    async def _commit_done(self) -> None:
        """Commit every consumed message below the first one whose group is still buffered."""
        assert self.engine is not None and self.loop is not None
        if self._unannounced or not self._pending:
            return
        buffered = {g.group_id for g in self.engine.assembler.buffer}
        floor: dict[TopicPartition, int] = {}
        for rec, gid in self._pending:
            if gid in buffered:
                tp = TopicPartition(rec.topic, rec.partition)
                floor[tp] = min(floor.get(tp, rec.offset), rec.offset)
        done, keep = [], []
        for rec, gid in self._pending:
            tp = TopicPartition(rec.topic, rec.partition)
            (done if tp not in floor or rec.offset < floor[tp] else keep).append((rec, gid))
        if not done:
            return
        try:
            await self.loop.commit([rec for rec, _ in done])
        except Exception as exc:  # noqa: BLE001 - rebalanced away: the new owner re-reads; dedupe covers it
            log.warning("commit_failed", error=repr(exc))
            return
        self._pending = keep


def build_service(settings: Settings) -> LearnerService:
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # `rstar serve learner` routes torchrun launches to multi_device.run_ranks before this.
        raise RuntimeError("build_service makes the one-device learner; under torchrun run "
                           "services.learner.multi_device.run_ranks (what `rstar serve learner` does)")
    return LearnerService(settings)
