"""End to end on the embedded stack: the real broker and PostgreSQL, a real vLLM CPU engine,
the real tool-executor, reward and learner, each service its own process (the `rstar up`
machinery). The policy is a tiny random model, so rewards are mostly 0: the reward keeps
all-equal groups and the learner steps on them anyway, which is what lets versions advance
here (the gradient is zero; the pipeline is what is under test)."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from sqlalchemy import func, select

from lab.cluster import RANDOM_POLICY_OVERRIDES, LocalCluster, cluster_for_run
from services.orchestrator.run_config import RunConfig
from services.orchestrator.runtime import create_run
from shared.db.models import LearnerStep, PolicyVersion, RolloutTaskRow, Run, TrajectoryGroupRow
from shared.db.session import session_factory

# Each test starts every service (a vLLM engine twice in the kill test): more than the default
# 300 s per test when the machine is busy.
pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.timeout(900)]



@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from lab.tiny_model import create_random_model

    return create_random_model(tmp_path_factory.mktemp("model") / "tiny", seed=0, heads=6)


def _cluster(tmp_path, stack, topic_prefix, run_cfg: RunConfig, run_id: str) -> LocalCluster:
    env = {"RSTAR_KAFKA_BOOTSTRAP": stack.kafka_bootstrap, "RSTAR_DATABASE_URL": stack.database_url,
           "RSTAR_TOPIC_PREFIX": topic_prefix, "RSTAR_STATE_DIR": str(tmp_path / "state"),
           "RSTAR_HEARTBEAT_S": "2", "VLLM_CPU_KVCACHE_SPACE": "1"}
    return cluster_for_run(tmp_path, run_cfg, run_id, env=env, overrides=RANDOM_POLICY_OVERRIDES,
                           port_offset=20000 + os.getpid() % 1000 * 10)  # beside a running `rstar up`


def _run_config(model, **kw) -> RunConfig:
    base = dict(
        name="e2e", model=str(model), dataset={"kind": "generated", "n_train": 50, "n_eval": 5, "seed": 0},
        format={"preset": "compact"},
        group_size=2, n_samples=4, batch_groups=2, max_staleness=1, lr=1e-4, warmup_steps=0,
        stages=[{"stage": 1, "steps": 3, "max_tokens": 48, "max_turns": 2}],
    )
    base.update(kw)
    return RunConfig.model_validate(base)


async def _wait_finished(sessions, run_id: str, cluster: LocalCluster, timeout: float, on_tick=None) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        async with sessions() as s:
            status = (await s.execute(select(Run.status).where(Run.run_id == run_id))).scalar_one()
        if status in ("finished", "failed"):
            return status
        cluster.supervise_once()
        if on_tick:
            await on_tick()
        await asyncio.sleep(1)
    logs = "\n".join(f"--- {m.name}\n{__import__('lab.cluster', fromlist=['tail']).tail(m.log, 15)}"
                     for m in cluster.managed.values())
    raise AssertionError(f"run {run_id} did not finish in {timeout:.0f} s\n{logs}")


async def _trained_exactly_once(sessions, run_id: str) -> tuple[int, int]:
    async with sessions() as s:
        trained = (await s.execute(select(func.count()).select_from(TrajectoryGroupRow).where(
            TrajectoryGroupRow.run_id == run_id, TrajectoryGroupRow.trained_step.is_not(None)))).scalar_one()
        summed = (await s.execute(select(func.coalesce(func.sum(LearnerStep.n_groups), 0)).where(
            LearnerStep.run_id == run_id))).scalar_one()
    return int(trained), int(summed)


async def test_versions_advance_and_every_group_is_trained_once(stack, topic_prefix, db_engine, tiny_model, tmp_path):
    sessions = session_factory(db_engine)
    cfg = _run_config(tiny_model)
    run_id = await create_run(sessions, cfg)
    cluster = _cluster(tmp_path, stack, topic_prefix, cfg, run_id)
    cluster.start()
    try:
        await asyncio.to_thread(cluster.wait_ready, 600)
        assert await _wait_finished(sessions, run_id, cluster, 600) == "finished"
        async with sessions() as s:
            versions = [v for (v,) in await s.execute(select(PolicyVersion.version).where(
                PolicyVersion.run_id == run_id).order_by(PolicyVersion.version))]
            steps = (await s.execute(select(func.count()).select_from(LearnerStep).where(
                LearnerStep.run_id == run_id))).scalar_one()
            newest_tokens = (await s.execute(select(func.max(TrajectoryGroupRow.max_version)).where(
                TrajectoryGroupRow.run_id == run_id))).scalar_one()
        assert versions[-3:] == [1, 2, 3] and steps == 3
        # Rollouts picked the new weights up: later groups carry tokens of version >= 1.
        assert newest_tokens >= 1
        trained, summed = await _trained_exactly_once(sessions, run_id)
        assert trained == summed == 3 * cfg.batch_groups
    finally:
        await asyncio.to_thread(cluster.stop)


async def test_killed_rollout_task_is_redispatched_and_not_trained_twice(stack, topic_prefix, db_engine, tiny_model, tmp_path):
    sessions = session_factory(db_engine)
    cfg = _run_config(tiny_model, task_timeout_s=20, stages=[{"stage": 1, "steps": 2, "max_tokens": 48, "max_turns": 2}])
    run_id = await create_run(sessions, cfg)
    cluster = _cluster(tmp_path, stack, topic_prefix, cfg, run_id)
    cluster.start()
    killed = False

    async def kill_rollout_mid_task():
        nonlocal killed
        if killed:
            return
        async with sessions() as s:
            leased = (await s.execute(select(func.count()).select_from(RolloutTaskRow).where(
                RolloutTaskRow.run_id == run_id, RolloutTaskRow.status == "leased"))).scalar_one()
        if leased:
            proc = cluster.managed["rollout"].proc
            os.killpg(proc.pid, signal.SIGKILL)  # the engine-core child goes too
            proc.wait()
            killed = True

    try:
        await asyncio.to_thread(cluster.wait_ready, 600)
        assert await _wait_finished(sessions, run_id, cluster, 900, on_tick=kill_rollout_mid_task) == "finished"
        assert killed
        async with sessions() as s:
            redispatched = (await s.execute(select(func.count()).select_from(RolloutTaskRow).where(
                RolloutTaskRow.run_id == run_id, RolloutTaskRow.attempts >= 2))).scalar_one()
        assert redispatched >= 1, "a task of the killed instance should have been re-dispatched after its deadline"
        trained, summed = await _trained_exactly_once(sessions, run_id)
        assert trained == summed == 2 * cfg.batch_groups
    finally:
        await asyncio.to_thread(cluster.stop)
