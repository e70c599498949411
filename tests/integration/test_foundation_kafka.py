"""Kafka plumbing against the real (embedded) broker: round trips, commit semantics, DLQ,
consumer-group rebalancing."""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer

from shared import topics
from shared.events import decode, encode
from shared.kafka import ConsumerLoop, EventProducer, PermanentError, dlq_headers, ensure_topics
from shared.testing import sample_group, sample_scored, sample_task, sample_weights

pytestmark = pytest.mark.integration


async def _producer(stack) -> EventProducer:
    p = EventProducer(stack.kafka_bootstrap)
    await p.start()
    return p


async def _read_all(bootstrap: str, topic_name: str, n: int, timeout: float = 60.0):
    consumer = AIOKafkaConsumer(topic_name, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                max_partition_fetch_bytes=64 * 1024 * 1024, fetch_max_bytes=128 * 1024 * 1024)
    await consumer.start()
    out = []
    try:
        async def _go():
            while len(out) < n:
                batches = await consumer.getmany(timeout_ms=200)
                for recs in batches.values():
                    out.extend(recs)
        await asyncio.wait_for(_go(), timeout)
    finally:
        await consumer.stop()
    return out


async def _run_until(loop: ConsumerLoop, cond, timeout: float = 60.0) -> None:
    task = asyncio.create_task(loop.run())
    try:
        async def _wait():
            while not cond():
                if task.done():
                    task.result()
                await asyncio.sleep(0.05)
        await asyncio.wait_for(_wait(), timeout)
    finally:
        loop.stop()
        await task


async def test_every_event_type_round_trips_byte_exact(stack, topic_prefix):
    await ensure_topics(stack.kafka_bootstrap, topic_prefix)
    # ensure_topics is idempotent
    assert await ensure_topics(stack.kafka_bootstrap, topic_prefix) == []
    producer = await _producer(stack)
    big = sample_group(n=2, n_tokens=12_000)
    events = [
        (topics.ROLLOUT_TASKS, sample_task()),
        (topics.TRAJECTORIES, sample_group()),
        (topics.TRAJECTORIES, big),
        (topics.SCORED, sample_scored()),
        (topics.WEIGHTS, sample_weights()),
    ]
    sent: dict[str, list[bytes]] = {}
    try:
        for spec, ev in events:
            raw = encode(ev)
            name = topic_prefix + spec.name
            await producer.send_raw(name, raw, key=ev.run_id)
            sent.setdefault(name, []).append(raw)
    finally:
        await producer.stop()
    for name, raws in sent.items():
        got = await _read_all(stack.kafka_bootstrap, name, len(raws))
        assert sorted(r.value for r in got) == sorted(raws)
        for r in got:
            env = decode(r.value)
            assert encode(env) == r.value  # decode → encode is byte-exact
    big_back = [decode(r.value).payload for r in await _read_all(stack.kafka_bootstrap, topic_prefix + topics.TRAJECTORIES.name, 2)]
    assert any(len(g.trajectories[0].response_token_ids) == 12_000 and g == big for g in big_back)


async def test_uncommitted_message_is_redelivered_committed_is_not(stack, topic_prefix):
    await ensure_topics(stack.kafka_bootstrap, topic_prefix)
    name = topic_prefix + topics.WEIGHTS.name
    producer = await _producer(stack)
    try:
        await producer.send(name, sample_weights(version=1), key="r")

        # A consumer whose handler "dies" (is cancelled) before the commit.
        seen: list[int] = []

        async def dying(env, rec):
            seen.append(env.payload.version)
            raise asyncio.CancelledError  # the process dies mid-effect

        loop1 = ConsumerLoop(stack.kafka_bootstrap, name, "g-redeliver", dying, producer)
        task = asyncio.create_task(loop1.run())
        for _ in range(1200):
            if seen:
                break
            await asyncio.sleep(0.05)
        loop1.stop()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert seen == [1]

        # The next member of the group gets it again, and commits.
        got: list[int] = []

        async def ok(env, rec):
            got.append(env.payload.version)

        await _run_until(ConsumerLoop(stack.kafka_bootstrap, name, "g-redeliver", ok, producer), lambda: got == [1])

        # Now committed: a third consumer sees only the new message.
        await producer.send(name, sample_weights(version=2), key="r")
        got2: list[int] = []

        async def ok2(env, rec):
            got2.append(env.payload.version)

        await _run_until(ConsumerLoop(stack.kafka_bootstrap, name, "g-redeliver", ok2, producer), lambda: got2 == [2])
        assert got2 == [2]
    finally:
        await producer.stop()


async def test_malformed_and_failing_messages_go_to_dlq_and_loop_goes_on(stack, topic_prefix):
    await ensure_topics(stack.kafka_bootstrap, topic_prefix)
    name = topic_prefix + topics.WEIGHTS.name
    producer = await _producer(stack)
    try:
        await producer.send_raw(name, b"{not json", key="r")
        await producer.send_raw(name, encode(sample_weights(version=1)).replace(b'"schema_version":1', b'"schema_version":99'), key="r")
        await producer.send(name, sample_weights(version=2), key="r")  # handler rejects it
        await producer.send(name, sample_weights(version=3), key="r")
        handled: list[int] = []

        async def handler(env, rec):
            if env.payload.version == 2:
                raise PermanentError("version 2 is poison")
            handled.append(env.payload.version)

        await _run_until(ConsumerLoop(stack.kafka_bootstrap, name, "g-dlq", handler, producer), lambda: handled == [3])
        dead = await _read_all(stack.kafka_bootstrap, topics.dlq_name(name), 3)
        assert dead[0].value == b"{not json"
        headers = [dlq_headers(r) for r in dead]
        assert "not JSON" in headers[0]["error"]
        assert "schema_version 99" in headers[1]["error"]
        assert "poison" in headers[2]["error"]
        assert [h["source_offset"] for h in headers] == ["0", "1", "2"]
        assert all(h["source_topic"] == name for h in headers)
    finally:
        await producer.stop()


async def test_two_consumers_split_partitions_and_survivor_takes_all(stack, topic_prefix):
    await ensure_topics(stack.kafka_bootstrap, topic_prefix)
    name = topic_prefix + topics.SCORED.name  # 8 partitions
    producer = await _producer(stack)
    by_member: dict[str, set[int]] = {"a": set(), "b": set()}

    def handler_for(member):
        async def h(env, rec):
            by_member[member].add(rec.partition)
        return h

    loop_a = ConsumerLoop(stack.kafka_bootstrap, name, "g-split", handler_for("a"), producer)
    loop_b = ConsumerLoop(stack.kafka_bootstrap, name, "g-split", handler_for("b"), producer)
    ta, tb = asyncio.create_task(loop_a.run()), asyncio.create_task(loop_b.run())
    try:
        # Wait until both members have an assignment.
        for _ in range(1200):
            a_parts = loop_a._consumer.assignment()
            b_parts = loop_b._consumer.assignment()
            if a_parts and b_parts and len(a_parts) + len(b_parts) == topics.SCORED.partitions:
                break
            await asyncio.sleep(0.05)
        assert a_parts and b_parts, "both members should own partitions"
        assert not ({p.partition for p in a_parts} & {p.partition for p in b_parts})

        loop_b.stop()
        await tb
        for _ in range(1200):
            if len(loop_a._consumer.assignment()) == topics.SCORED.partitions:
                break
            await asyncio.sleep(0.05)
        assert len(loop_a._consumer.assignment()) == topics.SCORED.partitions

        # Messages to every partition now reach the survivor.
        for i in range(32):
            await producer.send(name, sample_scored(), key=f"k{i}")
        for _ in range(1200):
            if len(by_member["a"]) >= 4:
                break
            await asyncio.sleep(0.05)
        assert len(by_member["a"]) >= 4
    finally:
        loop_a.stop()
        await asyncio.gather(ta, return_exceptions=True)
        await producer.stop()


async def test_concurrent_handlers_commit_only_below_unfinished(stack, topic_prefix):
    """With concurrency, a slow early message holds back the commit of later finished ones."""
    await ensure_topics(stack.kafka_bootstrap, topic_prefix)
    name = topic_prefix + topics.WEIGHTS.name
    producer = await _producer(stack)
    try:
        for v in range(1, 5):
            await producer.send(name, sample_weights(version=v), key="r")
        release = asyncio.Event()
        done: list[int] = []

        async def handler(env, rec):
            if env.payload.version == 1:
                await release.wait()
            done.append(env.payload.version)

        loop = ConsumerLoop(stack.kafka_bootstrap, name, "g-conc", handler, producer, concurrency=4)
        task = asyncio.create_task(loop.run())
        for _ in range(1200):
            if sorted(done) == [2, 3, 4]:
                break
            await asyncio.sleep(0.05)
        assert sorted(done) == [2, 3, 4]
        # Nothing committed yet: offset 0 is unfinished.
        from aiokafka import TopicPartition
        assert await loop._consumer.committed(TopicPartition(name, 0)) is None
        release.set()
        for _ in range(1200):
            if await loop._consumer.committed(TopicPartition(name, 0)) == 4:
                break
            await asyncio.sleep(0.05)
        assert await loop._consumer.committed(TopicPartition(name, 0)) == 4
        loop.stop()
        await task
    finally:
        await producer.stop()
