"""The learner service end to end on the real broker and PostgreSQL: scored groups in, new
weight versions out (loadable, hash-verified checkpoints), rows in policy_versions and
learner_steps, and a restart that resumes without training a redelivered group twice."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import httpx
import pytest
import torch
from aiokafka import AIOKafkaConsumer
from sqlalchemy import select

from services.learner.config import Settings
from services.learner.runtime import LearnerService
from shared import stack as stack_mod
from shared import topics
from shared.checkpoint import path_from_uri, verify_checkpoint
from shared.db.models import LearnerStep, PolicyVersion, TrajectoryGroupRow
from shared.db.session import make_engine, session_factory, upsert
from shared.events import RocStats, ScoredGroup, ScoredTrajectory, ToolCallRecord, Trajectory, WeightVersion, decode
from shared.kafka import EventProducer, ensure_topics
from shared.runtime import run_service
from shared.settings import load_settings

pytestmark = pytest.mark.integration

RUN = "run-learner-it"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    from lab.tiny_model import create_random_model

    return create_random_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _group(gid: str, version: int, stage: int = 1, run_id: str = RUN) -> ScoredGroup:
    rng = random.Random(gid)
    selected = []
    for i, adv in enumerate([1.0, 1.0, -1.0, -1.0]):
        n = rng.randint(8, 24)
        mask = [0 if 3 <= j < 6 else 1 for j in range(n)]
        selected.append(ScoredTrajectory(
            trajectory=Trajectory(
                traj_id=f"{gid}-{i}", prompt_token_ids=[rng.randrange(20, 500) for _ in range(12)],
                response_token_ids=[rng.randrange(20, 500) for _ in range(n)], loss_mask=mask,
                logprobs=[-rng.uniform(5.5, 6.5) * m for m in mask], token_versions=[version] * n, turns=1,
                tool_calls=[ToolCallRecord(code="print(1)", status="ok", duration_ms=1.0)],
                finish_reason="answer", response_text="x"),
            reward=1.0 if adv > 0 else 0.0, advantage=adv, correct=adv > 0, p_err=0.0, p_format=0.0))
    return ScoredGroup(group_id=gid, run_id=run_id, stage=stage, problem_id=f"p-{gid}", min_policy_version=version,
                       max_policy_version=version, pass_rate=0.5, n_total=8, roc_mode="roc", all_equal=False,
                       selected=selected, roc=RocStats())


async def _weights(bootstrap: str, topic: str, until_version: int, timeout: float = 120.0) -> list[WeightVersion]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, group_id=None, auto_offset_reset="earliest")
    await consumer.start()
    seen: list[WeightVersion] = []
    try:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                seen.extend(decode(r.value, WeightVersion).payload for r in records)
            if any(w.version >= until_version for w in seen):
                return seen
        raise AssertionError(f"no WeightVersion {until_version} within {timeout}s; saw {[w.version for w in seen]}")
    finally:
        await consumer.stop()


async def test_scored_groups_in_weight_versions_out_and_restart_without_retraining(
    stack, topic_prefix, tiny_model_dir, tmp_path
):
    http_port = stack_mod._free_port()
    settings = load_settings(
        Settings, kafka_bootstrap=stack.kafka_bootstrap, database_url=stack.database_url, topic_prefix=topic_prefix,
        port=http_port, model_dir=tiny_model_dir, checkpoint_dir=tmp_path / "ckpt", run_id=RUN,
        groups_per_step=2, max_staleness=1, lr=1e-3, warmup_steps=0, device="cpu", heartbeat_s=1.0,
    )
    await ensure_topics(stack.kafka_bootstrap, topic_prefix)
    producer = EventProducer(stack.kafka_bootstrap)
    await producer.start()
    scored_topic, weights_topic = settings.topic(topics.SCORED), settings.topic(topics.WEIGHTS)
    db = make_engine(stack.database_url)
    sessions = session_factory(db)
    try:
        svc = LearnerService(settings)
        task = asyncio.create_task(run_service(svc, settings, install_signals=False))
        for gid in ("a", "b"):
            await producer.send(scored_topic, _group(gid, version=0), key=gid)
        seen = await _weights(stack.kafka_bootstrap, weights_topic, until_version=1)
        by_version = {w.version: w for w in seen}
        assert by_version[0].uri.endswith(str(tiny_model_dir.name)) or path_from_uri(by_version[0].uri) == tiny_model_dir
        v1 = by_version[1]
        assert v1.run_id == RUN and v1.step == 1 and v1.stage == 1
        v1_dir = path_from_uri(v1.uri)
        verify_checkpoint(v1_dir, v1.sha256)  # the rollout's check
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(str(v1_dir))
        initial = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir))
        AutoTokenizer.from_pretrained(str(v1_dir))  # tokenizer files travel with the weights
        ids = torch.tensor([[5, 17, 42, 99]])
        with torch.no_grad():
            assert not torch.allclose(model(ids).logits, initial(ids).logits)  # it trained

        async with httpx.AsyncClient() as client:
            state = (await client.get(f"http://127.0.0.1:{http_port}/learner/state")).json()
            metrics = (await client.get(f"http://127.0.0.1:{http_port}/metrics")).text
        assert state["version"] == 1 and state["sha256"] == v1.sha256
        assert "rstar_learner_loss" in metrics and "rstar_learner_version 1.0" in metrics

        async with sessions() as s:
            versions = (await s.execute(select(PolicyVersion).where(PolicyVersion.run_id == RUN)
                                        .order_by(PolicyVersion.version))).scalars().all()
            steps = (await s.execute(select(LearnerStep).where(LearnerStep.run_id == RUN))).scalars().all()
        assert [(v.version, v.sha256) for v in versions][-1] == (1, v1.sha256)
        assert len(steps) == 1 and steps[0].n_groups == 2 and steps[0].loss is not None
        assert steps[0].grad_norm > 0 and steps[0].staleness_max == 0 and steps[0].reward_mean == 0.5

        # Restart: the same groups arrive again (a redelivery / re-dispatch) with two new ones.
        svc.request_stop()
        await asyncio.wait_for(task, 60)
        svc2 = LearnerService(settings)
        task2 = asyncio.create_task(run_service(svc2, settings, install_signals=False))
        for g in (_group("a", 0), _group("b", 0), _group("c", 1), _group("d", 1)):
            await producer.send(scored_topic, g, key=g.group_id)
        seen = await _weights(stack.kafka_bootstrap, weights_topic, until_version=2)
        v2 = max(seen, key=lambda w: w.version)
        assert v2.version == 2 and v2.step == 2
        verify_checkpoint(path_from_uri(v2.uri), v2.sha256)
        # partitions are read in no particular order: wait until the redelivered pair has been seen
        for _ in range(100):
            if svc2.engine.assembler.counts["duplicate"] == 2:
                break
            await asyncio.sleep(0.1)
        assert svc2.engine.assembler.counts["duplicate"] == 2
        assert set(svc2.engine.state.consumed) == {"a", "b", "c", "d"}
        assert svc2.engine.version == 2  # a and b did not make a third step

        # A group from version 0 is past the bound now (η = 1): the learner drops it and records
        # that at once, so the orchestrator can admit a replacement without waiting for a step.
        async with sessions() as s:
            await s.execute(upsert(TrajectoryGroupRow, dict(
                run_id=RUN, group_id="old", stage=1, problem_id="p-old", min_version=0, max_version=0, n_total=8,
                n_correct=4, pass_rate=0.5, n_selected=4, all_equal=False, roc_mode="roc", roc_stats={},
                status="published", kafka_topic="t", kafka_partition=0, kafka_offset=0)))
            await s.commit()
        await producer.send(scored_topic, _group("old", version=0), key="old")
        skipped = None
        for _ in range(100):
            async with sessions() as s:
                skipped = (await s.execute(select(TrajectoryGroupRow.learner_skipped).where(
                    TrajectoryGroupRow.run_id == RUN, TrajectoryGroupRow.group_id == "old"))).scalar_one()
            if skipped:
                break
            await asyncio.sleep(0.1)
        assert skipped == "stale"
        svc2.request_stop()
        await asyncio.wait_for(task2, 60)
        async with sessions() as s:
            steps = (await s.execute(select(LearnerStep).where(LearnerStep.run_id == RUN)
                                     .order_by(LearnerStep.step))).scalars().all()
        assert [(st.step, st.version, st.n_groups) for st in steps] == [(1, 1, 2), (2, 2, 2)]
    finally:
        await producer.stop()
        await db.dispose()


async def test_an_untrainable_group_is_dead_lettered_alone_and_training_goes_on(stack, topic_prefix, tiny_model_dir,
                                                                                tmp_path):
    """A schema-valid group with token ids outside the vocabulary used to fail every step it was
    in, and every good group after it; now it goes to rstar.scored.dlq with its reason."""
    run = "run-learner-poison"
    settings = load_settings(
        Settings, kafka_bootstrap=stack.kafka_bootstrap, database_url=stack.database_url, topic_prefix=topic_prefix,
        port=stack_mod._free_port(), model_dir=tiny_model_dir, checkpoint_dir=tmp_path / "ckpt", run_id=run,
        groups_per_step=2, max_staleness=1, lr=1e-3, warmup_steps=0, device="cpu", heartbeat_s=1.0,
        consumer_group=f"learner-{topic_prefix.rstrip('.')}",
    )
    await ensure_topics(stack.kafka_bootstrap, topic_prefix)
    producer = EventProducer(stack.kafka_bootstrap)
    await producer.start()
    scored_topic = settings.topic(topics.SCORED)
    poison = _group("poison", 0, run_id=run)
    st = poison.selected[0]
    poison.selected[0] = st.model_copy(update={"trajectory": st.trajectory.model_copy(
        update={"response_token_ids": [10**6] * len(st.trajectory.response_token_ids)})})
    try:
        svc = LearnerService(settings)
        task = asyncio.create_task(run_service(svc, settings, install_signals=False))
        for g in (poison, _group("ok-1", 0, run_id=run), _group("ok-2", 0, run_id=run)):
            await producer.send(scored_topic, g, key="one-partition")
        seen = await _weights(stack.kafka_bootstrap, settings.topic(topics.WEIGHTS), until_version=1)
        assert max(w.version for w in seen if w.run_id == run) == 1
        assert set(svc.engine.state.consumed) == {"ok-1", "ok-2"}
        consumer = AIOKafkaConsumer(scored_topic + ".dlq", bootstrap_servers=stack.kafka_bootstrap,
                                    auto_offset_reset="earliest")
        await consumer.start()
        try:
            dead = []
            for _ in range(50):
                for recs in (await consumer.getmany(timeout_ms=200)).values():
                    dead.extend(recs)
                if dead:
                    break
        finally:
            await consumer.stop()
        assert len(dead) == 1
        headers = {k: v.decode() for k, v in dead[0].headers}
        assert "outside the vocabulary" in headers.get("error", "") and "poison" in headers["error"]
        svc.request_stop()
        await asyncio.wait_for(task, 60)
    finally:
        await producer.stop()
