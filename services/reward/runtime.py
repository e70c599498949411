"""Reward service runtime: ``rstar.trajectories`` (consumer group ``reward``) → answer checks +
GRPO-RoC → ``rstar.scored``, with each group recorded in PostgreSQL. Stateless: run N replicas.

Exactly-once effect on top of at-least-once delivery (the broker has no transactions):

1. If ``trajectory_groups`` has a row for (run_id, group_id):
   * status ``published`` or ``dropped`` → a redelivery or a re-dispatched attempt of a group
     already handled: skip (nothing recorded twice, nothing published twice);
   * status ``scored`` → we crashed between recording and publishing: rebuild the SAME selection
     from the verdicts and RoC parameters stored in the row (the selection is seeded by the group
     id; stored verdicts make it independent of a check that timed out once) and publish it
     again with the same event id, then mark ``published``;
   * status ``probe`` → a redelivered probe group (a stage-3 entry probe, recorded only): skip;
   * status ``redispatch`` → this attempt or an older one lost too many rollouts to
     ``tool_failure``: skip; a later attempt (the orchestrator's re-dispatch) is scored afresh
     and its row replaces the recorded one.
2. Otherwise check the answers, run RoC, then in ONE transaction insert the row (status
   ``scored``; ``dropped`` for an all-equal group when dropping is on or a group RoC keeps
   nothing of; ``redispatch`` for one that lost too many rollouts to ``tool_failure``,
   :mod:`services.reward.roc` 4.; ``probe`` for a probe task's group, which is never published)
   and add the group's attempts/successes to ``problems``
   (not for ``redispatch`` and ``probe``). If the insert finds a row (a concurrent replica won the race),
   continue as in 1.
3. Publish the ScoredGroup (key group_id, event id derived from run and group id), then mark
   the row ``published``; only then does the consumer loop commit the offset.

Two replicas can both reach step 1's republish for one group after a rebalance; the learner
dedups by group_id, which is why the event id and the selection are deterministic.

Malformed groups (undecodable, no ground truth, repeated trajectory ids) go to
``rstar.trajectories.dlq``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiokafka import ConsumerRecord
from prometheus_client import Counter, Histogram
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from structlog.contextvars import bound_contextvars

from services.reward.answers import AnswerSource
from services.reward.checker import AnswerChecker, CheckerUnavailable
from services.reward.config import Settings
from services.reward.roc import RocConfig
from services.reward.scoring import MalformedGroup, ScoringResult, rescore_from_audit, score_trajectory_group
from services.reward.store import (
    GroupRecord,
    KafkaCoordinates,
    load_group,
    mark_published,
    record_scored,
    replace_unpublished,
)
from shared import topics
from shared.events import Envelope, ScoredGroup, TrajectoryGroup
from shared.kafka import ConsumerLoop, EventProducer, PermanentError
from shared.logging import get_logger
from shared.runtime import RuntimeContext, Service

log = get_logger("reward")

GROUPS = Counter(
    "rstar_reward_groups_total",
    "Trajectory groups by outcome: published, republished (after a crash), dropped_all_equal, dropped_too_small "
    "(deterministic mode, fewer than G rollouts), redispatch (too many tool_failure rollouts), probe (a stage-3 "
    "entry probe, recorded only), duplicate, dead_letter",
    ["outcome"],
)
TOOL_FAILURES = Counter(
    "rstar_reward_tool_failure_trajectories_total",
    "Rollouts left out of RoC and advantages because they ended tool_failure (an infrastructure fault)",
)
ALL_EQUAL = Counter("rstar_reward_all_equal_groups_total", "Groups whose kept rewards are all equal (no gradient)")
PASS_RATE = Histogram("rstar_reward_pass_rate", "Pass rate over all 2G rollouts of a group",
                      buckets=(0.0, 0.05, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 0.95, 1.0))
POS_TOOL_ERROR_RATE = Histogram(
    "rstar_reward_positive_tool_error_rate", "Tool-error rate of positives RoC kept vs dropped",
    ["set"], buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0),
)
POS_FORMAT_PENALTY = Histogram(
    "rstar_reward_positive_format_penalty", "Mean format penalty of positives RoC kept vs dropped",
    ["set"], buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0),
)
GROUP_SECONDS = Histogram("rstar_reward_group_seconds", "Time to handle one group (check, record, publish)",
                          buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))


def scored_event_id(run_id: str, group_id: str) -> str:
    """The same id for every (re)publication of a group's ScoredGroup."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"rstar:scored:{run_id}:{group_id}").hex


def _observe(scored: ScoredGroup, *, trained: bool = True) -> None:
    if scored.roc.n_tool_failure:
        TOOL_FAILURES.inc(scored.roc.n_tool_failure)
    if not trained:
        return  # a probe, or a group lost to an outage: its figures are not the training stream's
    PASS_RATE.observe(scored.pass_rate)
    if scored.all_equal:
        ALL_EQUAL.inc()
    roc = scored.roc
    for label, err, fmt in (("kept", roc.kept_pos_tool_error_rate, roc.kept_pos_format_penalty),
                            ("dropped", roc.dropped_pos_tool_error_rate, roc.dropped_pos_format_penalty)):
        if err is not None:
            POS_TOOL_ERROR_RATE.labels(label).observe(err)
        if fmt is not None:
            POS_FORMAT_PENALTY.labels(label).observe(fmt)


@dataclass(frozen=True)
class Processed:
    outcome: str
    scored: ScoredGroup | None


class GroupProcessor:
    """The record → publish → mark protocol of the module docstring, for one group at a time.

    Used by the live service and by replay (which may write to another run and topic, or with
    ``sessions=None`` only publish).
    """

    def __init__(
        self,
        *,
        producer: EventProducer,
        out_topic: str,
        checker_factory: Callable[[], AnswerChecker],
        roc: RocConfig,
        answer_source: AnswerSource,
        drop_all_equal: bool,
        sessions: async_sessionmaker[AsyncSession] | None,
        run_id_override: str | None = None,
    ):
        self.producer = producer
        self.out_topic = out_topic
        self._checker_factory = checker_factory
        self.checker = checker_factory()
        self.roc = roc
        self.answer_source = answer_source
        self.drop_all_equal = drop_all_equal
        self.sessions = sessions
        self.run_id_override = run_id_override

    def close(self) -> None:
        self.checker.close()

    async def _score(self, group: TrajectoryGroup) -> ScoringResult:
        try:
            return await score_trajectory_group(group, self.checker, self.roc, self.answer_source)
        except CheckerUnavailable as exc:
            # the pool broke (not this group's fault): start a fresh one and try once more
            log.warning("checker_restart", error=str(exc))
            self.checker.close()
            self.checker = self._checker_factory()
            return await score_trajectory_group(group, self.checker, self.roc, self.answer_source)

    def _for_run(self, scored: ScoredGroup, run_id: str) -> ScoredGroup:
        return scored if scored.run_id == run_id else scored.model_copy(update={"run_id": run_id})

    async def _publish(self, scored: ScoredGroup) -> None:
        await self.producer.send(
            self.out_topic, scored, key=scored.group_id, event_id=scored_event_id(scored.run_id, scored.group_id)
        )

    def _status(self, group: TrajectoryGroup, result: ScoringResult, scored: ScoredGroup) -> str:
        """The row status this scoring gives (store.ROW_STATUSES); only ``scored`` is published.
        ``dropped``: no kept rollout (a deterministic-mode group smaller than G) or, when dropping
        is on, all kept rewards equal (no gradient either way)."""
        if result.redispatch:
            return "redispatch"
        if group.purpose == "probe":
            return "probe"
        if not scored.selected or (scored.all_equal and self.drop_all_equal):
            return "dropped"
        return "scored"

    @staticmethod
    def _recorded(group: TrajectoryGroup, scored: ScoredGroup, status: str) -> Processed | None:
        """After a group's row is written with ``status``: its outcome when it is not published
        (None: publish it)."""
        _observe(scored, trained=status in ("scored", "dropped"))
        if status == "scored":
            return None
        if status == "redispatch":
            log.warning("group_lost_to_tool_failures", attempt=group.attempt, n_tool_failure=scored.roc.n_tool_failure,
                        n=len(group.trajectories), hint="the tool executor failed these rollouts; the orchestrator "
                        "rolls the task out again")
        if status == "dropped":
            return Processed("dropped_all_equal" if scored.selected else "dropped_too_small", scored)
        return Processed(status, scored)  # redispatch | probe

    async def process(self, group: TrajectoryGroup, coords: KafkaCoordinates) -> Processed:
        """Handle one group; returns its outcome (a GROUPS label) and the ScoredGroup it
        published or dropped (None for a duplicate). Raises MalformedGroup."""
        run_id = self.run_id_override or group.run_id
        if self.sessions is not None:
            existing = await load_group(self.sessions, run_id, group.group_id)
            if existing is not None:
                return await self._resume(group, existing, run_id, coords)
        result = await self._score(group)
        scored = self._for_run(result.scored, run_id)
        status = self._status(group, result, scored)
        if self.sessions is not None:
            audit = result.audit(self.roc, self.answer_source)
            inserted = await record_scored(self.sessions, group, scored, audit=audit, coords=coords, status=status,
                                           run_id=run_id)
            if not inserted:  # another replica recorded it between our read and our insert
                existing = await load_group(self.sessions, run_id, group.group_id)
                if existing is None:
                    raise RuntimeError(f"group {group.group_id}: insert conflicted but no row is there")
                return await self._resume(group, existing, run_id, coords)
        if (unpublished := self._recorded(group, scored, status)) is not None:
            return unpublished
        await self._publish(scored)
        if self.sessions is not None:
            await mark_published(self.sessions, run_id, group.group_id)
        return Processed("published", scored)

    async def _resume(
        self, group: TrajectoryGroup, existing: GroupRecord, run_id: str, coords: KafkaCoordinates
    ) -> Processed:
        assert self.sessions is not None
        if existing.status in ("published", "dropped", "probe"):
            return Processed("duplicate", None)
        if existing.status == "redispatch" and group.attempt <= existing.attempt:
            return Processed("duplicate", None)  # that attempt (or an older one) was already judged
        scored = rescore_from_audit(group, existing.roc_stats, existing.roc_mode) if existing.status == "scored" else None
        if scored is None:
            # A later attempt after a redispatch row, or another attempt of a recorded-but-unpublished
            # group whose trajectories are not at hand: this attempt takes its place.
            result = await self._score(group)
            scored = self._for_run(result.scored, run_id)
            status = self._status(group, result, scored)
            if status == "redispatch" and existing.status == "scored":
                # the recorded attempt is good and its message is redelivered until it is published
                return Processed("duplicate", None)
            replaced = await replace_unpublished(
                self.sessions, run_id, group, scored, result.audit(self.roc, self.answer_source), coords, status=status)
            if not replaced:
                return Processed("duplicate", None)
            if (unpublished := self._recorded(group, scored, status)) is not None:
                return unpublished
        scored = self._for_run(scored, run_id)
        await self._publish(scored)
        await mark_published(self.sessions, run_id, group.group_id)
        return Processed("republished", scored)


class RewardService(Service):
    name = "reward"
    needs_kafka = True
    needs_db = True

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.settings: Settings = settings
        self.processor: GroupProcessor | None = None
        self.loop: ConsumerLoop | None = None

    async def start(self, ctx: RuntimeContext) -> None:
        await super().start(ctx)
        s = self.settings
        assert ctx.producer is not None and ctx.sessions is not None
        self.processor = GroupProcessor(
            producer=ctx.producer,
            out_topic=ctx.topic(topics.SCORED),
            checker_factory=lambda: AnswerChecker(s.check_workers, s.check_timeout_s),
            roc=s.roc_config(),
            answer_source=s.answer_source,
            drop_all_equal=s.drop_all_equal,
            sessions=ctx.sessions,
        )
        self.loop = ConsumerLoop(
            s.kafka_bootstrap,
            ctx.topic(topics.TRAJECTORIES),
            s.consumer_group,
            self.handle,
            ctx.producer,
            expect=TrajectoryGroup,
            concurrency=s.concurrency,
            client_id=f"reward-{s.instance_id}",
        )

    async def handle(self, envelope: Envelope, record: ConsumerRecord) -> None:
        assert self.processor is not None
        group: TrajectoryGroup = envelope.payload
        coords = KafkaCoordinates(record.topic, record.partition, record.offset)
        with bound_contextvars(run_id=group.run_id, group_id=group.group_id, event_id=envelope.event_id):
            t0 = time.perf_counter()
            try:
                outcome = (await self.processor.process(group, coords)).outcome
            except MalformedGroup as exc:
                GROUPS.labels("dead_letter").inc()
                raise PermanentError(str(exc)) from exc
            GROUP_SECONDS.observe(time.perf_counter() - t0)
            GROUPS.labels(outcome).inc()
            log.info("group_handled", outcome=outcome, n=len(group.trajectories),
                     seconds=round(time.perf_counter() - t0, 4))

    async def run(self) -> None:
        assert self.loop is not None and self.processor is not None
        try:
            await self.loop.run()  # returns after stop(), once in-flight groups are done
        finally:
            self.processor.close()

    async def stop(self) -> None:
        await super().stop()
        if self.loop is not None:
            self.loop.stop()

    def request_stop(self) -> None:
        super().request_stop()
        if self.loop is not None:
            self.loop.stop()

    async def ready(self) -> dict[str, bool]:
        return {"consumer": self.loop is not None and self.loop.started.is_set()}

    def info(self) -> dict[str, Any]:
        s = self.settings
        return {"roc_mode": s.roc_mode, "group_size": s.group_size, "drop_all_equal": s.drop_all_equal}


def build_service(settings: Settings) -> RewardService:
    return RewardService(settings)
