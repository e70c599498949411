"""``rstar replay rescore``: score a stored trajectory stream again, with another RoC mode or
configuration, into a new run or a new topic — the original run's rows and topics stay as they
are.

The source is read without a consumer group (no committed offsets change) from every partition
of the source topic, from ``start_offset`` (or the beginning) up to ``end_offset`` (exclusive)
or the end offsets seen when the replay starts, so a replay of a live topic terminates. A time
range filters by the records' broker timestamps. Only groups of ``from_run`` are rescored.

Destinations:

* ``to_run`` (≠ ``from_run``): published with ``run_id = to_run`` to ``to_topic`` (default: the
  scored topic, where a learner of ``to_run`` reads), recorded in ``trajectory_groups`` /
  ``problems`` under ``to_run`` with the live service's idempotent protocol, so running the
  same replay twice publishes nothing twice;
* only ``to_topic``: published there with the original run id, nothing written to the database
  (an ablation stream for offline analysis); ``to_topic`` may then not be the live scored topic.

Undecodable or malformed messages are counted and skipped (a replay never writes to a DLQ).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from pydantic import ValidationError

from services.reward.checker import AnswerChecker
from services.reward.config import Settings
from services.reward.roc import ROC_MODES
from services.reward.runtime import GroupProcessor
from services.reward.scoring import MalformedGroup
from services.reward.store import KafkaCoordinates
from shared import topics
from shared.db.session import make_engine, session_factory
from shared.events import EventDecodeError, TrajectoryGroup, decode
from shared.kafka import MAX_REQUEST_BYTES, EventProducer, ensure_topics
from shared.logging import get_logger

log = get_logger("reward.replay")

POLL_TIMEOUT_MS = 500


class ReplayError(ValueError):
    """Arguments that would touch the original run, or name nothing to replay."""


@dataclass
class RescoreSummary:
    source_topic: str
    from_run: str
    to_run: str | None
    to_topic: str
    roc_mode: str
    group_size: int
    read: int = 0
    matched: int = 0
    published: int = 0
    republished: int = 0
    dropped_all_equal: int = 0
    duplicate: int = 0
    malformed: int = 0
    other_runs: int = 0
    outside_time_range: int = 0
    pass_rate_sum: float = 0.0
    partitions: dict[str, list[int]] = field(default_factory=dict)  # "p" → [start, stop)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("pass_rate_sum")
        scored = self.published + self.republished + self.dropped_all_equal
        out["pass_rate_mean"] = self.pass_rate_sum / scored if scored else None
        return out


def _ms(t: datetime | None) -> int | None:
    """Broker timestamps are epoch milliseconds; a time without a zone is taken as UTC."""
    if t is None:
        return None
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return int(t.timestamp() * 1000)


async def rescore(
    settings: Settings,
    *,
    from_run: str,
    to_run: str | None = None,
    to_topic: str | None = None,
    source_topic: str | None = None,
    roc_mode: str | None = None,
    group_size: int | None = None,
    start_offset: int | None = None,
    end_offset: int | None = None,
    start_time: datetime | None = None,
    end_time: datetime | None = None,
) -> dict[str, Any]:
    """Rescore ``from_run``'s groups of ``source_topic`` (see the module docstring); returns a
    summary (counts by outcome, mean pass rate, the offset ranges read)."""
    if roc_mode is not None and roc_mode not in ROC_MODES:
        raise ReplayError(f"unknown roc mode {roc_mode!r}; one of {ROC_MODES}")
    live_scored = settings.topic(topics.SCORED)
    if to_run is not None and to_run == from_run:
        raise ReplayError("to_run must differ from from_run: a replay never writes into the original run")
    if to_run is None and to_topic is None:
        raise ReplayError("give to_run (a new run) or to_topic (an analysis topic)")
    if to_run is None and to_topic == live_scored:
        raise ReplayError(f"without to_run, to_topic may not be the live scored topic {live_scored}")
    source = source_topic or settings.topic(topics.TRAJECTORIES)
    out_topic = to_topic or live_scored
    if out_topic == source:
        raise ReplayError("to_topic must differ from the source topic")
    overrides = {k: v for k, v in (("roc_mode", roc_mode), ("group_size", group_size)) if v is not None}
    try:  # validated again: the overrides must fit the other settings (e.g. deterministic's minimum)
        cfg = type(settings).model_validate({**settings.model_dump(), **overrides})
    except ValidationError as exc:
        raise ReplayError("; ".join(e["msg"] for e in exc.errors())) from exc
    summary = RescoreSummary(source, from_run, to_run, out_topic, cfg.roc_mode, cfg.group_size)

    if to_topic is not None:
        spec = topics.TopicSpec(to_topic, "group_id", "ScoredGroup", topics.SCORED.partitions,
                                topics.SCORED.retention_ms, topics.SCORED.max_message_bytes)
        await ensure_topics(settings.kafka_bootstrap, "", (spec,), with_dlq=False)
    else:
        await ensure_topics(settings.kafka_bootstrap, settings.topic_prefix, (topics.SCORED,))
    producer = EventProducer(settings.kafka_bootstrap, client_id="reward-replay")
    await producer.start()
    engine = make_engine(settings.database_url) if to_run is not None else None
    processor = GroupProcessor(
        producer=producer,
        out_topic=out_topic,
        checker_factory=lambda: AnswerChecker(cfg.check_workers, cfg.check_timeout_s),
        roc=cfg.roc_config(),
        answer_source=cfg.answer_source,
        drop_all_equal=cfg.drop_all_equal,
        sessions=session_factory(engine) if engine is not None else None,
        run_id_override=to_run,
    )
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        group_id=None,
        enable_auto_commit=False,
        max_partition_fetch_bytes=MAX_REQUEST_BYTES,
        fetch_max_bytes=4 * MAX_REQUEST_BYTES,
    )
    await consumer.start()
    try:
        if source not in await consumer.topics():
            raise ReplayError(f"source topic {source} does not exist")
        tps = [TopicPartition(source, p) for p in sorted(consumer.partitions_for_topic(source) or ())]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        begins = await consumer.beginning_offsets(tps)
        stop_at: dict[TopicPartition, int] = {}
        for tp in tps:
            start = max(begins[tp], start_offset or 0)
            stop = ends[tp] if end_offset is None else min(ends[tp], end_offset)
            summary.partitions[str(tp.partition)] = [start, stop]
            if start < stop:
                consumer.seek(tp, start)
                stop_at[tp] = stop
            else:
                consumer.pause(tp)
        lo_ms, hi_ms = _ms(start_time), _ms(end_time)
        while stop_at:
            batches = await consumer.getmany(*stop_at.keys(), timeout_ms=POLL_TIMEOUT_MS)
            for tp, records in batches.items():
                for record in records:
                    if tp not in stop_at or record.offset >= stop_at[tp]:
                        break
                    await _one(record, processor, summary, from_run, lo_ms, hi_ms)
                    if record.offset + 1 >= stop_at[tp]:
                        del stop_at[tp]
                        consumer.pause(tp)
                        break
            for tp in list(stop_at):  # a partition whose tail was compacted/deleted
                if await consumer.position(tp) >= stop_at[tp]:
                    del stop_at[tp]
                    consumer.pause(tp)
    finally:
        await consumer.stop()
        processor.close()
        await producer.stop()
        if engine is not None:
            await engine.dispose()
    result = summary.as_dict()
    log.info("rescore_done", **{k: v for k, v in result.items() if k != "partitions"})
    return result


async def _one(record, processor: GroupProcessor, summary: RescoreSummary, from_run: str,
               lo_ms: int | None, hi_ms: int | None) -> None:
    summary.read += 1
    if (lo_ms is not None and record.timestamp < lo_ms) or (hi_ms is not None and record.timestamp >= hi_ms):
        summary.outside_time_range += 1
        return
    try:
        group = decode(record.value or b"", TrajectoryGroup).payload
    except EventDecodeError:
        summary.malformed += 1
        return
    if group.run_id != from_run:
        summary.other_runs += 1
        return
    summary.matched += 1
    try:
        done = await processor.process(group, KafkaCoordinates(record.topic, record.partition, record.offset))
    except MalformedGroup:
        summary.malformed += 1
        return
    setattr(summary, done.outcome, getattr(summary, done.outcome) + 1)
    if done.scored is not None:
        summary.pass_rate_sum += done.scored.pass_rate
