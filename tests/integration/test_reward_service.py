"""The reward service on the real broker and PostgreSQL: a group in, a scored group out; a
redelivered group is published once; a crash between recording and publishing republishes the
same selection; malformed groups go to the DLQ; all-equal groups are dropped; replay rescores
into a new run without touching the original."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid

import pytest
from aiokafka import AIOKafkaConsumer
from sqlalchemy import select, update

from services.reward.config import Settings
from services.reward.replay import ReplayError, rescore
from services.reward.runtime import GROUPS, RewardService
from shared import topics
from shared.db.models import Problem, TrajectoryGroupRow
from shared.db.session import session_factory
from shared.events import ScoredGroup, ToolCallRecord, TrajectoryGroup, decode, encode
from shared.kafka import EventProducer, ensure_topics
from shared.runtime import run_service
from shared.settings import load_settings
from shared.testing import sample_trajectory

pytestmark = pytest.mark.integration


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

GOLD = "42"
# (response text, correct?) — a mix of the forms the checker must handle
ANSWERS = [
    ("<answer>The answer is \\boxed{42}</answer>", True),
    ("<answer>So \\boxed{\\frac{84}{2}}.</answer>", True),
    ("<answer>\\boxed{42.0}</answer>", True),
    ("reasoning... finally \\boxed{042}", True),
    ("<answer>\\boxed{41}</answer>", False),
    ("<answer>I think 42</answer>", False),
    ("<answer>\\boxed{\\frac{1}{2}}</answer>", False),
    ("no answer at all", False),
]


def make_group(run_id: str, answers=ANSWERS, *, group_id: str | None = None, answer: str = GOLD) -> TrajectoryGroup:
    trajs = []
    for i, (text, _) in enumerate(answers):
        t = sample_trajectory(16, seed=i, version=3)
        statuses = ["ok"] if i % 2 == 0 else ["error", "ok"]
        trajs.append(t.model_copy(update={
            "traj_id": f"traj-{i}",
            "response_text": text,
            "tool_calls": [ToolCallRecord(code="print(42)", status=s, duration_ms=3.0) for s in statuses],
        }))
    return TrajectoryGroup(group_id=group_id or uuid.uuid4().hex, run_id=run_id, stage=1,
                           problem_id=f"prob-{uuid.uuid4().hex[:6]}", answer=answer, trajectories=trajs)


def settings_for(stack, topic_prefix: str, tmp_path, **kw) -> Settings:
    """Reward settings on the test stack. The consumer group is the test's own (its topic
    prefix): the broker is shared by the whole session, and a group member an earlier test left
    behind (a killed service) would hold every later join of a shared group for up to the
    rebalance timeout."""
    return load_settings(
        Settings,
        kafka_bootstrap=stack.kafka_bootstrap,
        database_url=stack.database_url,
        topic_prefix=topic_prefix,
        state_dir=tmp_path,
        port=free_port(),
        group_size=4,
        check_workers=1,
        check_timeout_s=10.0,
        **{"consumer_group": f"reward-{topic_prefix.rstrip('.')}", **kw},
    )


@contextlib.asynccontextmanager
async def running_reward(settings: Settings):
    service = RewardService(settings)
    task = asyncio.create_task(run_service(service, settings, install_signals=False))
    try:
        for _ in range(1200):  # the checker pool and the group join: seconds, more on a busy machine
            if service.loop is not None and service.loop.started.is_set():
                break
            if task.done():
                task.result()
            await asyncio.sleep(0.05)
        else:
            raise TimeoutError("reward service did not start")
        yield service
    finally:
        service.request_stop()
        await asyncio.wait_for(task, 60)


async def read_topic(bootstrap: str, name: str, *, expect: int, settle_s: float = 1.5, timeout_s: float = 30.0):
    """Every record of ``name``: waits for ``expect`` of them, then ``settle_s`` more for extras."""
    consumer = AIOKafkaConsumer(name, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                max_partition_fetch_bytes=64 * 1024 * 1024, fetch_max_bytes=128 * 1024 * 1024)
    await consumer.start()
    out = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        settle_until = None
        while loop.time() < deadline:
            batches = await consumer.getmany(timeout_ms=200)
            for recs in batches.values():
                out.extend(recs)
            if len(out) >= expect:
                settle_until = settle_until or loop.time() + settle_s
                if loop.time() >= settle_until:
                    break
    finally:
        await consumer.stop()
    return out


async def wait_for_row(sessions, run_id: str, group_id: str, status: str, timeout_s: float = 60.0):
    for _ in range(int(timeout_s / 0.1)):
        async with sessions() as s:
            row = (await s.execute(select(TrajectoryGroupRow).where(
                TrajectoryGroupRow.run_id == run_id, TrajectoryGroupRow.group_id == group_id))).scalar_one_or_none()
        if row is not None and row.status == status:
            return row
        await asyncio.sleep(0.1)
    raise TimeoutError(f"group {group_id} never reached status {status!r}")


async def problem_row(sessions, run_id: str, problem_id: str) -> Problem | None:
    async with sessions() as s:
        return (await s.execute(select(Problem).where(Problem.run_id == run_id, Problem.problem_id == problem_id))).scalar_one_or_none()


async def produce(stack, name: str, values: list[tuple[str, bytes]]) -> list:
    """Send and return each message's RecordMetadata (partition, offset)."""
    producer = EventProducer(stack.kafka_bootstrap)
    await producer.start()
    try:
        return [await producer.send_raw(name, value, key=key) for key, value in values]
    finally:
        await producer.stop()


def counter(outcome: str) -> float:
    return GROUPS.labels(outcome)._value.get()


async def test_group_in_scored_group_out_then_redelivery_and_crash_recovery(stack, topic_prefix, tmp_path, db_engine):
    sessions = session_factory(db_engine)
    settings = settings_for(stack, topic_prefix, tmp_path)
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    group = make_group(run_id)
    raw = encode(group)
    traj_topic = topic_prefix + topics.TRAJECTORIES.name
    scored_topic = topic_prefix + topics.SCORED.name
    expected_correct = {f"traj-{i}": ok for i, (_, ok) in enumerate(ANSWERS)}

    async with running_reward(settings):
        (meta,) = await produce(stack, traj_topic, [(group.group_id, raw)])
        row = await wait_for_row(sessions, run_id, group.group_id, "published")
        records = await read_topic(stack.kafka_bootstrap, scored_topic, expect=1)
        assert len(records) == 1
        env = decode(records[0].value, ScoredGroup)
        scored: ScoredGroup = env.payload
        assert records[0].key == group.group_id.encode()
        assert scored.run_id == run_id and scored.group_id == group.group_id
        assert scored.n_total == 8 and scored.pass_rate == 0.5 and scored.roc_mode == "roc"
        assert len(scored.selected) == 4 and scored.roc.n_kept_pos == 2 and scored.roc.n_kept_neg == 2
        for s in scored.selected:
            assert s.correct is expected_correct[s.trajectory.traj_id]
            assert s.reward == (1.0 if s.correct else 0.0)
            assert s.advantage == pytest.approx(1.0 if s.correct else -1.0, abs=1e-4)
        assert scored.min_policy_version == 3 == scored.max_policy_version
        # recorded with its Kafka coordinates and the problem's counters
        assert (row.kafka_topic, row.kafka_partition, row.kafka_offset) == (traj_topic, meta.partition, meta.offset)
        assert row.kafka_topic == traj_topic and row.n_total == 8 and row.n_correct == 4 and row.n_selected == 4
        assert row.roc_stats["n_kept_pos"] == 2 and row.roc_stats["verdicts"] == [ok for _, ok in ANSWERS]
        prob = await problem_row(sessions, run_id, group.problem_id)
        assert prob is not None and (prob.attempts, prob.successes) == (8, 4)
        assert (prob.last_attempts, prob.last_successes, prob.last_version) == (8, 4, 3)

        # redelivery of the same message: handled, not published again, not counted again
        dup_before = counter("duplicate")
        await produce(stack, traj_topic, [(group.group_id, raw)])
        for _ in range(300):
            if counter("duplicate") > dup_before:
                break
            await asyncio.sleep(0.1)
        assert counter("duplicate") == dup_before + 1
        assert len(await read_topic(stack.kafka_bootstrap, scored_topic, expect=1)) == 1
        prob = await problem_row(sessions, run_id, group.problem_id)
        assert (prob.attempts, prob.successes) == (8, 4)

        # a crash after recording but before publishing: the redelivery republishes the SAME selection
        async with sessions() as s, s.begin():
            await s.execute(update(TrajectoryGroupRow).where(
                TrajectoryGroupRow.run_id == run_id, TrajectoryGroupRow.group_id == group.group_id).values(status="scored"))
        await produce(stack, traj_topic, [(group.group_id, raw)])
        await wait_for_row(sessions, run_id, group.group_id, "published")
        records = await read_topic(stack.kafka_bootstrap, scored_topic, expect=2)
        assert len(records) == 2
        first, second = (decode(r.value, ScoredGroup) for r in records)
        assert first.event_id == second.event_id  # the learner sees one event, twice at most
        assert [s.trajectory.traj_id for s in first.payload.selected] == [s.trajectory.traj_id for s in second.payload.selected]
        assert [s.advantage for s in first.payload.selected] == [s.advantage for s in second.payload.selected]
        prob = await problem_row(sessions, run_id, group.problem_id)
        assert (prob.attempts, prob.successes) == (8, 4)


async def test_malformed_groups_go_to_the_dlq_and_all_equal_groups_are_dropped(stack, topic_prefix, tmp_path, db_engine):
    sessions = session_factory(db_engine)
    settings = settings_for(stack, topic_prefix, tmp_path)
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    traj_topic = topic_prefix + topics.TRAJECTORIES.name
    no_gold = make_group(run_id, answer="   ")
    dup_ids = make_group(run_id)
    dup_ids.trajectories[1] = dup_ids.trajectories[1].model_copy(update={"traj_id": "traj-0"})
    all_wrong = make_group(run_id, [("<answer>\\boxed{7}</answer>", False)] * 8)
    async with running_reward(settings):
        await produce(stack, traj_topic, [
            ("junk", b"this is not an envelope"),
            (no_gold.group_id, encode(no_gold)),
            (dup_ids.group_id, encode(dup_ids)),
            (all_wrong.group_id, encode(all_wrong)),
        ])
        dlq = await read_topic(stack.kafka_bootstrap, traj_topic + ".dlq", expect=3)
        row = await wait_for_row(sessions, run_id, all_wrong.group_id, "dropped")
    assert len(dlq) == 3
    errors = sorted(dict(r.headers)["error"].decode() for r in dlq)
    assert any("decode" in e for e in errors)
    assert any("no ground-truth answer" in e for e in errors)
    assert any("repeats trajectory ids" in e for e in errors)
    assert row.all_equal and row.dropped and row.pass_rate == 0.0
    # dropped: never published; malformed: never recorded
    assert await read_topic(stack.kafka_bootstrap, topic_prefix + topics.SCORED.name, expect=0, settle_s=1.0) == []
    for bad in (no_gold, dup_ids):
        async with sessions() as s:
            assert (await s.execute(select(TrajectoryGroupRow).where(
                TrajectoryGroupRow.group_id == bad.group_id))).scalar_one_or_none() is None
    prob = await problem_row(sessions, run_id, all_wrong.problem_id)
    assert prob is not None and (prob.attempts, prob.successes) == (8, 0)


async def test_replay_rescores_into_a_new_run_and_leaves_the_original_alone(stack, topic_prefix, tmp_path, db_engine):
    sessions = session_factory(db_engine)
    settings = settings_for(stack, topic_prefix, tmp_path)
    await ensure_topics(stack.kafka_bootstrap, topic_prefix)
    run_a, run_b = f"run-a-{uuid.uuid4().hex[:6]}", f"run-b-{uuid.uuid4().hex[:6]}"
    traj_topic = topic_prefix + topics.TRAJECTORIES.name
    groups = [make_group(run_a) for _ in range(3)]
    other = make_group("some-other-run")
    metas = await produce(stack, traj_topic, [(g.group_id, encode(g)) for g in groups] + [(other.group_id, encode(other))])

    with pytest.raises(ReplayError, match="min_per_class"):  # the release keeps ≥ 2 of each class: G ≥ 4
        await rescore(settings, from_run=run_a, to_run=run_b, roc_mode="deterministic", group_size=2)
    summary = await rescore(settings, from_run=run_a, to_run=run_b, roc_mode="deterministic", group_size=4)
    assert summary["matched"] == 3 and summary["published"] == 3 and summary["other_runs"] == 1
    assert summary["roc_mode"] == "deterministic" and summary["pass_rate_mean"] == pytest.approx(0.5)
    records = await read_topic(stack.kafka_bootstrap, topic_prefix + topics.SCORED.name, expect=3)
    assert len(records) == 3
    for r in records:
        scored = decode(r.value, ScoredGroup).payload
        assert scored.run_id == run_b and scored.roc_mode == "deterministic" and len(scored.selected) == 4
        # deterministic keeps the 2 cleanest positives: the even trajectories (one ok call), not the odd
        pos = [s for s in scored.selected if s.correct]
        assert len(pos) == 2 and all(s.p_err == 0.0 for s in pos)
    async with sessions() as s:
        rows_b = (await s.execute(select(TrajectoryGroupRow).where(TrajectoryGroupRow.run_id == run_b))).scalars().all()
        rows_a = (await s.execute(select(TrajectoryGroupRow).where(TrajectoryGroupRow.run_id == run_a))).scalars().all()
    assert len(rows_b) == 3 and all(r.status == "published" for r in rows_b) and rows_a == []

    # the same replay again publishes nothing new; an analysis stream needs no run
    again = await rescore(settings, from_run=run_a, to_run=run_b, roc_mode="deterministic", group_size=4)
    assert again["duplicate"] == 3 and again["published"] == 0
    analysis = topic_prefix + "analysis.grpo"
    first_in_partition = sum(1 for m in metas[:3] if m.offset == 0)  # end_offset=1 reads offset 0 only
    only = await rescore(settings, from_run=run_a, to_topic=analysis, roc_mode="grpo", end_offset=1)
    # grpo keeps a uniform 4 of the 8 (seeded by the random group id): 2 in 70 such samples are
    # all correct or all wrong, and an all-equal group is dropped, not published
    assert only["matched"] == first_in_partition
    assert only["published"] + only["dropped_all_equal"] == first_in_partition
    stream = [decode(r.value, ScoredGroup).payload for r in
              await read_topic(stack.kafka_bootstrap, analysis, expect=only["published"])]
    assert len(stream) == only["published"] and all(g.run_id == run_a and g.roc_mode == "grpo" for g in stream)
    # the live scored topic got nothing from the analysis replay
    assert len(await read_topic(stack.kafka_bootstrap, topic_prefix + topics.SCORED.name, expect=3)) == 3


async def test_a_new_attempt_of_an_unpublished_group_takes_its_place(stack, topic_prefix, tmp_path, db_engine):
    """Recorded but never published (crash), then the task was re-dispatched: the new attempt
    (same group id, other trajectories) is published once, the problem counted once."""
    sessions = session_factory(db_engine)
    settings = settings_for(stack, topic_prefix, tmp_path)
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    traj_topic = topic_prefix + topics.TRAJECTORIES.name
    scored_topic = topic_prefix + topics.SCORED.name
    first = make_group(run_id)
    second = make_group(run_id, group_id=first.group_id).model_copy(update={"problem_id": first.problem_id})
    second.trajectories = [t.model_copy(update={"traj_id": f"retry-{t.traj_id}"}) for t in second.trajectories]
    async with running_reward(settings):
        await produce(stack, traj_topic, [(first.group_id, encode(first))])
        await wait_for_row(sessions, run_id, first.group_id, "published")
        async with sessions() as s, s.begin():  # the publish "never happened"
            await s.execute(update(TrajectoryGroupRow).where(
                TrajectoryGroupRow.run_id == run_id, TrajectoryGroupRow.group_id == first.group_id).values(status="scored"))
        republished_before = counter("republished")
        await produce(stack, traj_topic, [(second.group_id, encode(second))])
        for _ in range(300):
            if counter("republished") > republished_before:
                break
            await asyncio.sleep(0.1)
        row = await wait_for_row(sessions, run_id, first.group_id, "published")
    records = await read_topic(stack.kafka_bootstrap, scored_topic, expect=2)
    latest = decode(records[-1].value, ScoredGroup).payload
    assert all(s.trajectory.traj_id.startswith("retry-") for s in latest.selected)
    assert row.roc_stats["traj_ids"][0].startswith("retry-")
    prob = await problem_row(sessions, run_id, first.problem_id)
    assert (prob.attempts, prob.successes) == (8, 4)


async def test_two_replicas_in_one_consumer_group_publish_each_group_once(stack, topic_prefix, tmp_path, db_engine):
    sessions = session_factory(db_engine)
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    traj_topic = topic_prefix + topics.TRAJECTORIES.name
    groups = [make_group(run_id) for _ in range(12)]
    a = settings_for(stack, topic_prefix, tmp_path / "a")
    b = settings_for(stack, topic_prefix, tmp_path / "b")
    async with running_reward(a), running_reward(b):
        await produce(stack, traj_topic, [(g.group_id, encode(g)) for g in groups])
        for g in groups:
            await wait_for_row(sessions, run_id, g.group_id, "published")
    records = await read_topic(stack.kafka_bootstrap, topic_prefix + topics.SCORED.name, expect=12)
    ids = sorted(decode(r.value, ScoredGroup).payload.group_id for r in records)
    assert ids == sorted(g.group_id for g in groups)
