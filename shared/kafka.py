"""Kafka plumbing on aiokafka: topic creation, an event producer, and the consumer loop.

Delivery is at-least-once everywhere. The consumer loop commits a message's offset only after
its handler returned (its effect is durable), so a crash before that replays the message and
every handler must be idempotent (by event_id / group_id).

The consumer loop, in order, for each message:

1. decode the envelope (:func:`shared.events.decode`); a message that does not decode goes to
   ``<topic>.dlq`` with the raw bytes and the error, and its offset is committed;
2. await ``handler(envelope, record)``:
   - returns → the message is done;
   - raises :class:`PermanentError` → dead-lettered, done;
   - raises a transient error (broker/database unreachable) → retried with exponential backoff,
     without limit: the message is never skipped because a dependency is down;
   - raises anything else → retried ``max_attempts`` times, then dead-lettered;
3. commit. With ``concurrency > 1`` several handlers run at once and the loop commits, per
   partition, the highest offset below which every message is done (out-of-order completion
   never commits past an unfinished message). With ``manual_commit=True`` the loop never
   commits: the service calls :meth:`ConsumerLoop.commit` once a batch's effect is durable
   (the learner commits a step's B groups after its checkpoint).

Broker outages: start-up retries until the broker answers; once running, aiokafka reconnects
by itself and the loop keeps polling.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAlreadyExistsError
from prometheus_client import Counter, Histogram
from pydantic import BaseModel

from shared import topics as topic_registry
from shared.events import Envelope, EventDecodeError, decode, encode
from shared.logging import get_logger

log = get_logger("shared.kafka")

# Broker-side limit asked for on created topics and the client's request cap: a TrajectoryGroup
# of 32 x 12K-token trajectories is ~5 MB packed (less after gzip).
MAX_REQUEST_BYTES = topic_registry.MAX_MESSAGE_BYTES + 1024 * 1024
# Backoff for start-up and transient handler failures: 0.2 s doubling to 10 s, with jitter.
BACKOFF_INITIAL_S = 0.2
BACKOFF_MAX_S = 10.0
# Records fetched per poll; a poll waits at most this long when idle.
POLL_MAX_RECORDS = 64
POLL_TIMEOUT_MS = 500

MESSAGES = Counter("rstar_kafka_messages_total", "Messages handled by consumer loops", ["topic", "outcome"])
HANDLER_SECONDS = Histogram("rstar_kafka_handler_seconds", "Handler duration", ["topic"])
PRODUCED = Counter("rstar_kafka_produced_total", "Messages produced", ["topic"])


class PermanentError(Exception):
    """Raised by a handler for a message that can never be processed: it is dead-lettered."""


def _is_transient(exc: BaseException) -> bool:
    """Errors that mean "a dependency is away", not "this message is bad"."""
    if isinstance(exc, (KafkaConnectionError, ConnectionError, OSError, asyncio.TimeoutError)):
        return True
    if isinstance(exc, KafkaError) and getattr(exc, "retriable", False):
        return True
    try:
        from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

        if isinstance(exc, (OperationalError, InterfaceError)):
            return True
        if isinstance(exc, DBAPIError) and exc.connection_invalidated:
            return True
    except ImportError:  # pragma: no cover
        pass
    try:
        import asyncpg

        if isinstance(exc, (asyncpg.PostgresConnectionError, asyncpg.CannotConnectNowError)):
            return True
    except ImportError:  # pragma: no cover
        pass
    return False


def _backoff(attempt: int) -> float:
    return min(BACKOFF_MAX_S, BACKOFF_INITIAL_S * 2**attempt) * (0.5 + random.random() / 2)


async def _retry_start(what: str, start: Callable[[], Awaitable[Any]], stopping: asyncio.Event | None = None) -> None:
    """Keep trying ``start`` while the broker is away (a service waits, it does not crash)."""
    attempt = 0
    while True:
        try:
            await start()
            return
        except (KafkaConnectionError, KafkaError, OSError) as exc:
            if stopping is not None and stopping.is_set():
                raise
            delay = _backoff(attempt)
            log.warning("kafka_unavailable", what=what, error=str(exc), retry_in_s=round(delay, 2))
            await asyncio.sleep(delay)
            attempt += 1


def topic(spec_or_name: Any, prefix: str = "") -> str:
    return f"{prefix}{getattr(spec_or_name, 'name', spec_or_name)}"


async def ensure_topics(
    bootstrap: str,
    prefix: str = "",
    specs: tuple[topic_registry.TopicSpec, ...] = topic_registry.ALL,
    *,
    replication_factor: int = 1,
    with_dlq: bool = True,
) -> list[str]:
    """Create every topic (and its DLQ) that does not exist yet; idempotent. Returns names created."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    await _retry_start("admin", admin.start)
    try:
        existing = set(await admin.list_topics())
        wanted: list[NewTopic] = []
        for spec in specs:
            configs = {"retention.ms": str(spec.retention_ms), "max.message.bytes": str(spec.max_message_bytes)}
            for name, parts in ((spec.name, spec.partitions), (spec.dlq, 1) if with_dlq else (None, 0)):
                if name and topic(name, prefix) not in existing:
                    wanted.append(NewTopic(topic(name, prefix), parts, replication_factor, topic_configs=configs))
        created = []
        for new in wanted:
            try:
                await admin.create_topics([new])
                created.append(new.name)
            except TopicAlreadyExistsError:
                pass  # a replica of this service created it first
        if created:
            log.info("topics_created", topics=created)
        return created
    finally:
        await admin.close()


class EventProducer:
    """Produces events in their envelope. acks=all and zstd; not idempotent (the embedded broker
    does not support it), so consumers dedupe."""

    def __init__(self, bootstrap: str, *, client_id: str = "rstar", linger_ms: int = 5):
        self._producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            client_id=client_id,
            acks="all",
            compression_type="zstd",
            max_request_size=MAX_REQUEST_BYTES,
            linger_ms=linger_ms,
            request_timeout_ms=30000,
            enable_idempotence=False,
        )
        self._started = False

    async def start(self, stopping: asyncio.Event | None = None) -> None:
        await _retry_start("producer", self._producer.start, stopping)
        self._started = True

    async def stop(self) -> None:
        if self._started:
            await self._producer.stop()
            self._started = False

    async def send(
        self,
        topic_name: str,
        event: BaseModel | Envelope,
        *,
        key: str | bytes | None = None,
        run_id: str | None = None,
        event_id: str | None = None,
    ):
        """Send one event and wait for the broker's acknowledgement; returns RecordMetadata."""
        value = encode(event, run_id=run_id, event_id=event_id) if not isinstance(event, Envelope) else encode(event)
        return await self.send_raw(topic_name, value, key=key)

    async def send_raw(self, topic_name: str, value: bytes, *, key: str | bytes | None = None, headers=None):
        k = key.encode() if isinstance(key, str) else key
        meta = await self._producer.send_and_wait(topic_name, value, key=k, headers=headers)
        PRODUCED.labels(topic_name).inc()
        return meta

    async def dead_letter(self, record: ConsumerRecord, error: str) -> None:
        """Send the raw message, its error and its coordinates to ``<topic>.dlq``."""
        headers = [
            ("error", error[:4000].encode()),
            ("source_topic", record.topic.encode()),
            ("source_partition", str(record.partition).encode()),
            ("source_offset", str(record.offset).encode()),
        ]
        await self.send_raw(topic_registry.dlq_name(record.topic), record.value or b"", key=record.key, headers=headers)


Handler = Callable[[Envelope, ConsumerRecord], Awaitable[Any]]


@dataclass
class _PartitionProgress:
    """Offsets in flight for one partition, to commit only below the lowest unfinished one."""

    pending: set[int] = field(default_factory=set)
    done: set[int] = field(default_factory=set)
    committed: int = -1  # next offset to commit - 1

    def committable(self) -> int | None:
        """The offset to commit (next to read), if it advanced."""
        floor = min(self.pending) if self.pending else None
        finished = sorted(o for o in self.done if floor is None or o < floor)
        if not finished:
            return None
        top = finished[-1]
        self.done -= set(finished)
        if top <= self.committed:
            return None
        self.committed = top
        return top + 1


class ConsumerLoop:
    def __init__(
        self,
        bootstrap: str,
        topic_name: str,
        group_id: str | None,
        handler: Handler,
        producer: EventProducer,
        *,
        expect: type[BaseModel] | None = None,
        concurrency: int = 1,
        manual_commit: bool = False,
        max_attempts: int = 3,
        auto_offset_reset: str = "earliest",
        client_id: str = "rstar",
        session_timeout_ms: int = 10000,
        max_poll_interval_ms: int = 10000,
    ):
        if manual_commit and group_id is None:
            raise ValueError("manual_commit needs a consumer group")
        self.topic_name = topic_name
        self.group_id = group_id
        self._handler = handler
        self._producer = producer
        self._expect = expect
        self._concurrency = max(1, concurrency)
        self._manual = manual_commit
        self._max_attempts = max_attempts
        self._consumer = AIOKafkaConsumer(
            topic_name,
            bootstrap_servers=bootstrap,
            group_id=group_id,
            client_id=client_id,
            enable_auto_commit=False,
            auto_offset_reset=auto_offset_reset,
            max_partition_fetch_bytes=MAX_REQUEST_BYTES,
            fetch_max_bytes=4 * MAX_REQUEST_BYTES,
            session_timeout_ms=session_timeout_ms,
            heartbeat_interval_ms=max(500, session_timeout_ms // 10),
            # The loop polls continuously (handlers run as tasks), so this can stay short; it is
            # also the rebalance timeout, which decides how fast a group re-forms.
            max_poll_interval_ms=max_poll_interval_ms,
        )
        self._stopping = asyncio.Event()
        self._progress: dict[TopicPartition, _PartitionProgress] = {}
        self._tasks: set[asyncio.Task] = set()
        self.started = asyncio.Event()

    # -------------------------------------------------------------------- public
    async def run(self) -> None:
        await _retry_start(f"consumer {self.topic_name}", self._consumer.start, self._stopping)
        self.started.set()
        log.info("consumer_started", topic=self.topic_name, group=self.group_id)
        try:
            while not self._stopping.is_set():
                # Keep polling even when every handler slot is busy (partitions paused): a
                # consumer that stops polling is evicted from its group after
                # max_poll_interval, and a long rollout must not cause a rebalance.
                free = self._concurrency - len(self._tasks)
                assigned = self._consumer.assignment()
                if free <= 0:
                    self._consumer.pause(*assigned)
                else:
                    paused = self._consumer.paused()
                    if paused:
                        self._consumer.resume(*paused)
                batches = await self._consumer.getmany(
                    timeout_ms=POLL_TIMEOUT_MS, max_records=max(1, min(free, POLL_MAX_RECORDS))
                )
                for tp, records in batches.items():
                    for record in records:
                        self._progress.setdefault(tp, _PartitionProgress()).pending.add(record.offset)
                        task = asyncio.create_task(self._process(tp, record))
                        self._tasks.add(task)
                        task.add_done_callback(self._tasks.discard)
        finally:
            if self._tasks:
                await asyncio.gather(*self._tasks, return_exceptions=True)
            await self._consumer.stop()
            log.info("consumer_stopped", topic=self.topic_name, group=self.group_id)

    def stop(self) -> None:
        self._stopping.set()

    async def commit(self, records: list[ConsumerRecord]) -> None:
        """Manual mode: commit past these records (their effect is durable)."""
        offsets: dict[TopicPartition, int] = {}
        for r in records:
            tp = TopicPartition(r.topic, r.partition)
            offsets[tp] = max(offsets.get(tp, 0), r.offset + 1)
        if offsets and self.group_id is not None:
            await self._consumer.commit(offsets)

    # -------------------------------------------------------------------- internals
    async def _process(self, tp: TopicPartition, record: ConsumerRecord) -> None:
        try:
            await self._handle(record)
            self._finish(tp, record.offset)
            if not self._manual:
                await self._commit_progress(tp)
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - only when stopping mid-retry: leave it uncommitted
            log.exception("message_left_uncommitted", topic=record.topic, offset=record.offset)

    def _finish(self, tp: TopicPartition, offset: int) -> None:
        prog = self._progress.setdefault(tp, _PartitionProgress())
        prog.pending.discard(offset)
        prog.done.add(offset)

    async def _commit_progress(self, tp: TopicPartition) -> None:
        nxt = self._progress[tp].committable()
        if nxt is not None and self.group_id is not None:
            try:
                await self._consumer.commit({tp: nxt})
            except KafkaError as exc:  # rebalanced away: the new owner re-reads, handlers are idempotent
                log.warning("commit_failed", topic=tp.topic, partition=tp.partition, error=str(exc))

    async def _handle(self, record: ConsumerRecord) -> None:
        topic_name = record.topic
        try:
            envelope = decode(record.value or b"", self._expect)
        except EventDecodeError as exc:
            MESSAGES.labels(topic_name, "dead_letter").inc()
            log.warning("dead_letter", topic=topic_name, offset=record.offset, error=str(exc))
            await self._with_retry(lambda: self._producer.dead_letter(record, f"decode: {exc}"))
            return
        attempt = 0
        while True:
            try:
                with HANDLER_SECONDS.labels(topic_name).time():
                    await self._handler(envelope, record)
                MESSAGES.labels(topic_name, "ok").inc()
                return
            except PermanentError as exc:
                error = f"permanent: {exc}"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - classified below
                if _is_transient(exc):
                    if self._stopping.is_set():
                        raise
                    delay = _backoff(min(attempt, 8))
                    log.warning("handler_transient_error", topic=topic_name, offset=record.offset,
                                error=repr(exc), retry_in_s=round(delay, 2))
                    MESSAGES.labels(topic_name, "retry").inc()
                    await asyncio.sleep(delay)
                    attempt += 1
                    continue
                attempt += 1
                if attempt < self._max_attempts:
                    log.warning("handler_error_retry", topic=topic_name, offset=record.offset,
                                error=repr(exc), attempt=attempt)
                    MESSAGES.labels(topic_name, "retry").inc()
                    await asyncio.sleep(_backoff(attempt))
                    continue
                log.exception("handler_failed", topic=topic_name, offset=record.offset)
                error = f"failed after {attempt} attempts: {exc!r}"
            MESSAGES.labels(topic_name, "dead_letter").inc()
            await self._with_retry(lambda: self._producer.dead_letter(record, error))
            return

    async def _with_retry(self, op: Callable[[], Awaitable[Any]]) -> None:
        attempt = 0
        while True:
            try:
                await op()
                return
            except Exception as exc:  # noqa: BLE001
                if not _is_transient(exc) or self._stopping.is_set():
                    raise
                await asyncio.sleep(_backoff(min(attempt, 8)))
                attempt += 1


def dlq_headers(record: ConsumerRecord) -> dict[str, str]:
    return {k: v.decode() for k, v in (record.headers or ())}
