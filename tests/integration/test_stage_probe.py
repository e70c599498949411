"""The stage-3 entry probe with the real orchestrator and reward services on the real broker and
PostgreSQL, and a scripted policy (the test answers the rollout tasks): the current policy's
probe of every problem decides which problems stage 3 feeds — exactly those not solved 8/8 —
and no probe group is ever published for training."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from services.orchestrator.run_config import RunConfig
from shared import topics
from shared.db.models import LearnerStep, PolicyVersion, Problem, Stage, TrajectoryGroupRow
from shared.db.session import session_factory, upsert
from shared.events import ScoredGroup, decode, encode
from test_orchestrator_control import fake_model_dir, orchestrating
from test_reward_service import produce, read_topic, running_reward, settings_for
from test_tool_failures import answer_task

pytestmark = pytest.mark.integration


async def test_stage_three_feeds_exactly_the_problems_the_current_policy_does_not_solve_8_of_8(
        stack, topic_prefix, tmp_path, db_engine):
    sessions = session_factory(db_engine)
    cfg = RunConfig(name="probe", model=fake_model_dir(tmp_path),
                    dataset={"kind": "generated", "n_train": 6, "n_eval": 2, "seed": 5},
                    group_size=4, n_samples=8, batch_groups=1, max_staleness=0, task_timeout_s=3600,
                    stages=[{"stage": 1, "steps": 1, "max_tokens": 256, "max_turns": 2},
                            {"stage": 3, "steps": 2, "max_tokens": 384, "max_turns": 3, "probe": {"samples": 8}}])
    traj_topic = topic_prefix + topics.TRAJECTORIES.name
    async with orchestrating(stack, topic_prefix, sessions, cfg) as o:
        run_id, reader = o.run_id, o.reader
        async with running_reward(settings_for(stack, topic_prefix, tmp_path / "reward")):
            (first,) = await reader.read(1)
            assert first.stage == 1
            await produce(stack, traj_topic, [(first.task_id, encode(answer_task(first)))])
            # the learner trains step 1 -> version 1: the next task is stage 3's, so the probe starts
            async with sessions() as s:
                await s.execute(upsert(LearnerStep, dict(run_id=run_id, step=1, version=1, n_groups=1)))
                await s.execute(upsert(PolicyVersion, dict(run_id=run_id, version=1, step=1, stage=1,
                                                           uri="file:///x", sha256="0" * 64)))
                await s.commit()
            probes = await reader.read(6, probes=True)
            assert all(p.min_policy_version == 1 and p.n_samples == 8 for p in probes)
            assert len(reader.tasks) == 1  # nothing of stage 3 while the probe runs
            # the scripted policy: problems 0-1 solved 8/8, 2 solved 7/8, 3-5 solved 2/8
            order = sorted(p.problem_id for p in probes)
            correct = {pid: 8 if i < 2 else 7 if i == 2 else 2 for i, pid in enumerate(order)}
            await produce(stack, traj_topic, [(p.task_id, encode(answer_task(p, n_correct=correct[p.problem_id])))
                                              for p in probes])
            stage3 = (await reader.read(2))[1]
        assert stage3.stage == 3 and stage3.purpose == "train"
        async with sessions() as s:
            row = (await s.execute(select(Stage).where(Stage.run_id == run_id, Stage.stage == 3))).scalar_one()
            probe_rows = (await s.execute(select(TrajectoryGroupRow).where(
                TrajectoryGroupRow.run_id == run_id, TrajectoryGroupRow.status == "probe"))).scalars().all()
            problems = {p.problem_id: p for p in (await s.execute(
                select(Problem).where(Problem.run_id == run_id))).scalars()}
        assert set(row.config["problem_ids"]) == set(order[2:]) and row.config["dropped_solved"] == 2
        assert stage3.problem_id in order[2:]
        assert sorted((r.problem_id, r.n_correct) for r in probe_rows) == sorted(correct.items())
        # the probe's rollouts count nowhere in the training statistics
        assert sum(p.attempts for p in problems.values()) == 8
        scored = [decode(r.value, ScoredGroup).payload for r in
                  await read_topic(stack.kafka_bootstrap, topic_prefix + topics.SCORED.name, expect=1)]
        assert [g.group_id for g in scored] == [first.task_id]
