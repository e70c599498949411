"""Infrastructure faults on the real broker and PostgreSQL, with the real reward and orchestrator
services: rollouts that ended ``tool_failure`` get no advantage and are counted; a group that
lost more than the allowed share is not trained but rolled out again as attempt 2, whose group
is then published once and counted once in ``problems``. The test plays the rollout service:
it reads the orchestrator's tasks and answers them with groups it builds."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from services.orchestrator.run_config import RunConfig
from services.orchestrator.runtime import run_progress
from services.reward.runtime import GROUPS, TOOL_FAILURES
from shared import topics
from shared.db.models import Problem, RolloutTaskRow, TrajectoryGroupRow
from shared.db.session import session_factory
from shared.events import RolloutTask, ScoredGroup, TrajectoryGroup, decode, encode
from shared.testing import sample_trajectory
from test_orchestrator_control import fake_model_dir, orchestrating
from test_reward_service import produce, read_topic, running_reward, settings_for, wait_for_row

pytestmark = pytest.mark.integration


def answer_task(task: RolloutTask, *, lost: set[int] = frozenset(), n_correct: int | None = None) -> TrajectoryGroup:
    """What a rollout instance sends back: n_samples trajectories, the even ones correct (or the
    first ``n_correct``), those in ``lost`` cut short by an unreachable tool executor."""
    trajs = []
    for i in range(task.n_samples):
        t = sample_trajectory(16, seed=i, version=0)
        right = i % 2 == 0 if n_correct is None else i < n_correct
        update = {"traj_id": f"{task.task_id}-a{task.attempt}-{i}",
                  "response_text": f"<answer>\\boxed{{{task.answer if right else 'nope'}}}</answer>"}
        if i in lost:
            update["finish_reason"] = "tool_failure"
        trajs.append(t.model_copy(update=update))
    return TrajectoryGroup(group_id=task.task_id, run_id=task.run_id, stage=task.stage, problem_id=task.problem_id,
                           answer=task.answer, trajectories=trajs, attempt=task.attempt, purpose=task.purpose)


async def test_a_group_lost_to_tool_failures_is_rolled_out_again_not_trained(stack, topic_prefix, tmp_path, db_engine):
    sessions = session_factory(db_engine)
    cfg = RunConfig(name="faults", model=fake_model_dir(tmp_path),
                    dataset={"kind": "generated", "n_train": 4, "n_eval": 2, "seed": 3},
                    group_size=4, n_samples=8, batch_groups=2, max_staleness=0, task_timeout_s=3600,
                    stages=[{"stage": 1, "steps": 1, "max_tokens": 256, "max_turns": 2}])
    # G = 4 of 8: up to a quarter (2) may be lost
    reward_settings = settings_for(stack, topic_prefix, tmp_path / "reward")
    traj_topic = topic_prefix + topics.TRAJECTORIES.name
    lost_before = TOOL_FAILURES._value.get()
    redispatch_before = GROUPS.labels("redispatch")._value.get()
    async with orchestrating(stack, topic_prefix, sessions, cfg) as o:
        run_id, reader = o.run_id, o.reader
        first = await reader.read(2)  # (η + v + 1)·B = 2 tasks
        hit, fine = first
        async with running_reward(reward_settings):
            # hit: 3 of 8 lost (more than a quarter); fine: 1 of 8 lost (left out, trained)
            await produce(stack, traj_topic, [(hit.task_id, encode(answer_task(hit, lost={0, 1, 3}))),
                                              (fine.task_id, encode(answer_task(fine, lost={2})))])
            row = await wait_for_row(sessions, run_id, hit.task_id, "redispatch")
            assert row.attempt == 1 and row.n_tool_failure == 3
            # re-dispatched at once (the lease runs for an hour), nothing new admitted beside it
            tasks = await reader.read(3)
            retry = tasks[2]
            assert (retry.task_id, retry.attempt) == (hit.task_id, 2)
            assert await reader.quiet(1.5) == 0
            # a redelivery of the lost attempt changes nothing; attempt 2 is clean and published
            await produce(stack, traj_topic, [(hit.task_id, encode(answer_task(hit, lost={0, 1, 3}))),
                                              (retry.task_id, encode(answer_task(retry, lost=set())))])
            row = await wait_for_row(sessions, run_id, hit.task_id, "published")
            assert row.attempt == 2 and row.n_tool_failure == 0
            await wait_for_row(sessions, run_id, fine.task_id, "published")

        scored = [decode(r.value, ScoredGroup).payload
                  for r in await read_topic(stack.kafka_bootstrap, topic_prefix + topics.SCORED.name, expect=2)]
        by_id = {g.group_id: g for g in scored}
        assert sorted(by_id) == sorted([hit.task_id, fine.task_id]) and len(scored) == 2  # each published once
        assert all("-a2-" in s.trajectory.traj_id for s in by_id[hit.task_id].selected)
        fine_group = by_id[fine.task_id]
        assert f"{fine.task_id}-a1-2" not in {s.trajectory.traj_id for s in fine_group.selected}
        assert fine_group.roc.n_tool_failure == 1 and fine_group.n_total == 7
        assert TOOL_FAILURES._value.get() - lost_before == 4  # 3 + 1 (the redelivery is a duplicate)
        assert GROUPS.labels("redispatch")._value.get() - redispatch_before == 1

        async with sessions() as s:
            problems = {p.problem_id: p for p in (await s.execute(select(Problem).where(Problem.run_id == run_id))).scalars()}
            task_rows = {t.task_id: t for t in (await s.execute(
                select(RolloutTaskRow).where(RolloutTaskRow.run_id == run_id))).scalars()}
            progress, figures = await run_progress(s, run_id)
        # counted once: attempt 2's 8 rollouts (4 correct), not the lost attempt's; fine: the 7 that
        # count (the lost one was correct: 3 correct remain)
        assert hit.problem_id != fine.problem_id  # one epoch of a seeded permutation
        assert (problems[hit.problem_id].attempts, problems[hit.problem_id].successes) == (8, 4)
        assert (problems[fine.problem_id].attempts, problems[fine.problem_id].successes) == (7, 3)
        assert task_rows[hit.task_id].attempts == 2

        async def done():
            async with sessions() as s:
                return (await s.execute(select(RolloutTaskRow.status).where(
                    RolloutTaskRow.task_id == hit.task_id))).scalar_one() == "done"
        for _ in range(100):
            if await done():
                break
            await asyncio.sleep(0.2)
        assert await done()
        assert progress.dispatched == 2 and progress.dropped == 0
        assert figures["rollouts_lost_to_tool_failure"] == 1 and figures["groups_lost_to_tool_failure"] == 0


async def test_a_task_lost_on_its_last_attempt_is_given_up(stack, topic_prefix, tmp_path, db_engine):
    sessions = session_factory(db_engine)
    cfg = RunConfig(name="faults-last", model=fake_model_dir(tmp_path), dataset={"kind": "generated", "n_train": 4,
                                                                                 "n_eval": 2},
                    group_size=4, n_samples=8, batch_groups=1, max_staleness=0, task_timeout_s=3600,
                    max_task_attempts=1, stages=[{"stage": 1, "steps": 1, "max_tokens": 256, "max_turns": 2}])
    async with orchestrating(stack, topic_prefix, sessions, cfg) as o:
        (task,) = await o.reader.read(1)
        async with running_reward(settings_for(stack, topic_prefix, tmp_path / "reward")):
            await produce(stack, topic_prefix + topics.TRAJECTORIES.name,
                          [(task.task_id, encode(answer_task(task, lost=set(range(8)))))])
            await wait_for_row(sessions, o.run_id, task.task_id, "redispatch")
            # one attempt allowed: given up, counted as dropped, and a new task takes its place
            replacement = (await o.reader.read(2))[1]
        assert replacement.task_id != task.task_id and replacement.attempt == 1
        async with sessions() as s:
            status = (await s.execute(select(RolloutTaskRow.status).where(
                RolloutTaskRow.task_id == task.task_id))).scalar_one()
            group_status = (await s.execute(select(TrajectoryGroupRow.status).where(
                TrajectoryGroupRow.group_id == task.task_id))).scalar_one()
            progress, _ = await run_progress(s, o.run_id)
        assert (status, group_status) == ("failed", "redispatch")
        assert progress.dropped == 1 and progress.dispatched == 2
