"""Crash after the checkpoint, before the step is recorded, published and committed; restart.

The broker redelivers the step's groups (their offsets were never committed); the restarted
learner resumes from the checkpoint, records and publishes that version itself, and treats the
redelivered groups as duplicates: same state, nothing trained twice."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from services.learner.config import Settings
from services.learner.runtime import LearnerService
from shared import stack as stack_mod
from shared import topics
from shared.checkpoint import path_from_uri, verify_checkpoint
from shared.db.models import LearnerStep, PolicyVersion
from shared.db.session import make_engine, session_factory
from shared.kafka import EventProducer, ensure_topics
from shared.runtime import run_service
from shared.settings import load_settings
from test_learner_service import _group, _weights, tiny_model_dir  # noqa: F401 - fixture

pytestmark = pytest.mark.integration


class Crash(BaseException):
    """Stands for the process dying: not an Exception, so no handler retry catches it."""


async def test_crash_after_checkpoint_before_commit_then_restart(stack, topic_prefix, tiny_model_dir, tmp_path):  # noqa: F811
    run = f"crash-{topic_prefix}"  # this test's own rows in the shared database
    settings = load_settings(
        Settings, kafka_bootstrap=stack.kafka_bootstrap, database_url=stack.database_url, topic_prefix=topic_prefix,
        port=stack_mod._free_port(), model_dir=tiny_model_dir, checkpoint_dir=tmp_path / "ckpt", run_id=run,
        groups_per_step=2, max_staleness=1, lr=1e-3, warmup_steps=0, device="cpu", heartbeat_s=1.0,
    )
    await ensure_topics(stack.kafka_bootstrap, topic_prefix)
    producer = EventProducer(stack.kafka_bootstrap)
    await producer.start()
    db = make_engine(stack.database_url)
    sessions = session_factory(db)
    try:
        svc = LearnerService(settings)
        real_announce = svc._announce

        async def announce_then_die(outcome):
            if outcome.group_ids:  # a new step: its checkpoint is on disk, nothing else happened yet
                svc.request_stop()  # the consumer loop ends without committing anything more
                raise Crash()
            await real_announce(outcome)

        svc._announce = announce_then_die  # type: ignore[method-assign]
        task = asyncio.create_task(run_service(svc, settings, install_signals=False))
        for gid in ("a", "b"):
            await producer.send(settings.topic(topics.SCORED), _group(gid, version=0, run_id=run), key=gid)
        await asyncio.wait_for(task, 180)
        weights_dir = svc.engine.store.weights_dir(1)
        assert weights_dir.is_dir()  # the checkpoint was written before the crash
        async with sessions() as s:
            assert (await s.execute(select(LearnerStep).where(LearnerStep.run_id == run))).first() is None

        svc2 = LearnerService(settings)
        task2 = asyncio.create_task(run_service(svc2, settings, install_signals=False))
        seen = await _weights(stack.kafka_bootstrap, settings.topic(topics.WEIGHTS), until_version=1)
        v1 = max(seen, key=lambda w: w.version)
        assert v1.version == 1 and path_from_uri(v1.uri) == weights_dir
        verify_checkpoint(weights_dir, v1.sha256)
        for _ in range(300):  # the uncommitted a and b come back from the broker
            if svc2.engine.assembler.counts["duplicate"] >= 2:
                break
            await asyncio.sleep(0.1)
        assert svc2.engine.assembler.counts["duplicate"] == 2
        assert svc2.engine.version == 1 and not svc2.engine.assembler.buffer
        svc2.request_stop()
        await asyncio.wait_for(task2, 60)
        async with sessions() as s:
            rows = (await s.execute(select(LearnerStep).where(LearnerStep.run_id == run))).scalars().all()
            versions = (await s.execute(select(PolicyVersion.version).where(PolicyVersion.run_id == run)
                                        .order_by(PolicyVersion.version))).scalars().all()
        assert [(r.step, r.version, r.n_groups) for r in rows] == [(1, 1, 2)]  # recorded once, on restart
        assert versions == [0, 1]
    finally:
        await producer.stop()
        await db.dispose()
