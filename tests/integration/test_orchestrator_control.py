"""The orchestrator service on the real broker and PostgreSQL. The downstream services' effects
(scored groups, learner steps, weight versions) are written as the rows those services write,
so the orchestrator's admission, leases, stages and finish can be driven step by step; so are
the learner's heartbeats, which tell the orchestrator that someone trains the run."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from dataclasses import dataclass
from datetime import timedelta

import pytest
import yaml
from aiokafka import AIOKafkaConsumer
from sqlalchemy import select, update

from services.orchestrator.config import Settings
from services.orchestrator.run_config import RunConfig, RunConfigError, load_run_config
from services.orchestrator.runtime import OrchestratorService, create_run, run_progress, utcnow
from shared import topics
from shared.db.models import LearnerStep, PolicyVersion, Problem, RolloutTaskRow, Run, Stage, TrajectoryGroupRow
from shared.db.session import session_factory, upsert
from shared.events import RolloutTask, decode
from shared.runtime import heartbeat_upsert, run_service
from shared.settings import load_settings
from shared.stack import _free_port

pytestmark = pytest.mark.integration


class TaskReader:
    """Reads the rollout task topic: training tasks into ``tasks``, probe tasks into ``probes``."""

    def __init__(self, bootstrap: str, topic_name: str):
        self.consumer = AIOKafkaConsumer(topic_name, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
        self.tasks: list[RolloutTask] = []
        self.probes: list[RolloutTask] = []

    async def _poll(self) -> None:
        for recs in (await self.consumer.getmany(timeout_ms=200)).values():
            for r in recs:
                task = decode(r.value, RolloutTask).payload
                (self.tasks if task.purpose == "train" else self.probes).append(task)

    async def read(self, n: int, timeout: float = 60.0, *, probes: bool = False) -> list[RolloutTask]:
        """Wait until ``n`` training tasks (or probe tasks) have arrived; return them all."""
        out = self.probes if probes else self.tasks

        async def _go():
            while len(out) < n:
                await self._poll()
        await asyncio.wait_for(_go(), timeout)
        return out

    async def quiet(self, seconds: float = 2.0) -> int:
        """Read for a while; return how many tasks (of either purpose) arrived."""
        before = len(self.tasks) + len(self.probes)
        end = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < end:
            await self._poll()
        return len(self.tasks) + len(self.probes) - before


async def _score(sessions, run_id: str, task_ids: list[str], *, dropped: bool = False,
                 probe_correct: dict[str, int] | None = None):
    """What the reward service writes for a scored group (or, with ``probe_correct``, for a probe
    group: problem id -> correct of 8)."""
    async with sessions() as s:
        for tid in task_ids:
            task = (await s.execute(select(RolloutTaskRow).where(RolloutTaskRow.task_id == tid))).scalar_one()
            n_correct = 2 if probe_correct is None else probe_correct[task.problem_id]
            status = "probe" if probe_correct is not None else "dropped" if dropped else "published"
            await s.execute(upsert(TrajectoryGroupRow, dict(
                run_id=run_id, group_id=tid, stage=task.stage, problem_id=task.problem_id, min_version=0, max_version=0,
                n_total=8, n_correct=n_correct, pass_rate=n_correct / 8, n_selected=4,
                all_equal=dropped, roc_mode="roc", roc_stats={}, status=status,
                kafka_topic="t", kafka_partition=0, kafka_offset=0)))
        await s.commit()


async def _learner_step(sessions, run_id: str, step: int):
    """What the learner writes after a step."""
    async with sessions() as s:
        await s.execute(upsert(LearnerStep, dict(run_id=run_id, step=step, version=step, n_groups=2)))
        await s.execute(upsert(PolicyVersion, dict(run_id=run_id, version=step, step=step, stage=1,
                                                   uri="file:///x", sha256="0" * 64)))
        await s.commit()


class LearnerHeartbeat:
    """What a live learner of ``run_id`` writes into ``service_instances`` every heartbeat."""

    def __init__(self, sessions, run_id: str, every_s: float = 0.3):
        self.sessions, self.run_id, self.every_s = sessions, run_id, every_s
        self.task: asyncio.Task | None = None

    async def _beat(self):
        row = {"instance_id": f"learner-of-{self.run_id}", "service": "learner", "host": "test", "pid": 1, "port": 1,
               "status": "up", "info": {"run_id": self.run_id, "version": 0}}
        while True:
            async with self.sessions() as s:
                await s.execute(heartbeat_upsert(row))
                await s.commit()
            await asyncio.sleep(self.every_s)

    def start(self):
        self.task = asyncio.create_task(self._beat())

    async def stop(self):
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


def fake_model_dir(tmp_path) -> str:
    """A model directory as much as the run config checks (the orchestrator loads no weights)."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return str(model)


@dataclass
class Orchestrated:
    run_id: str
    reader: TaskReader
    learner: LearnerHeartbeat
    service: OrchestratorService


@contextlib.asynccontextmanager
async def orchestrating(stack, topic_prefix: str, sessions, cfg: RunConfig, *, with_learner: bool = True,
                        learner_timeout_s: float = 5.0):
    """The orchestrator service on the test stack with ``cfg``'s run created, a reader of the tasks
    it sends, and (``with_learner``) a learner's heartbeats for the run, all stopped afterwards."""
    settings = load_settings(Settings, kafka_bootstrap=stack.kafka_bootstrap, database_url=stack.database_url,
                             topic_prefix=topic_prefix, port=_free_port(), tick_s=0.2,
                             learner_timeout_s=learner_timeout_s)
    service = OrchestratorService(settings)
    task = asyncio.create_task(run_service(service, settings, install_signals=False))
    reader = TaskReader(stack.kafka_bootstrap, topic_prefix + topics.ROLLOUT_TASKS.name)
    await reader.consumer.start()
    learner = None
    try:
        run_id = await create_run(sessions, cfg)
        learner = LearnerHeartbeat(sessions, run_id)
        if with_learner:
            learner.start()
        yield Orchestrated(run_id, reader, learner, service)
    finally:
        if learner is not None:
            await learner.stop()
        await reader.consumer.stop()
        service.request_stop()
        await asyncio.wait_for(task, 30)


async def _wait(cond, timeout=30.0):
    end = asyncio.get_running_loop().time() + timeout
    while not await cond():
        assert asyncio.get_running_loop().time() < end, "condition not met in time"
        await asyncio.sleep(0.2)


async def test_admission_leases_stages_and_finish(stack, topic_prefix, db_engine, tmp_path):
    sessions = session_factory(db_engine)
    cfg = RunConfig(
        name="ctl", model=fake_model_dir(tmp_path), dataset={"kind": "generated", "n_train": 6, "n_eval": 2, "seed": 1},
        group_size=4, n_samples=8, batch_groups=2, max_staleness=1, task_timeout_s=3600,
        stages=[{"stage": 1, "steps": 2, "max_tokens": 512, "max_turns": 3},
                {"stage": 3, "steps": 1, "max_tokens": 768, "max_turns": 4, "probe": {"samples": 8}}],
    )
    async with orchestrating(stack, topic_prefix, sessions, cfg, with_learner=False, learner_timeout_s=2.0) as o:
        run_id, reader, learner = o.run_id, o.reader, o.learner
        # The run starts, but no learner trains it yet: nothing is rolled out for it.
        await reader.quiet(3.0)
        assert reader.tasks == []
        async with sessions() as s:
            assert (await s.execute(select(Run.status).where(Run.run_id == run_id))).scalar_one() == "running"
        learner.start()
        # (η + v + 1)·B = (1 + 0 + 1)·2 = 4 tasks, and no more until the learner moves.
        first = await reader.read(4)
        assert await reader.quiet(1.5) == 0
        assert {t.stage for t in first} == {1} and all(t.n_samples == 8 for t in first)
        assert first[0].sampling.max_tokens == 512 and first[0].sampling.max_turns == 3
        assert all(t.min_policy_version == 0 and t.attempt == 1 for t in first)
        async with sessions() as s:
            assert (await s.execute(select(Run.status).where(Run.run_id == run_id))).scalar_one() == "running"
            assert len((await s.execute(select(Problem).where(Problem.run_id == run_id))).all()) == 6

        async with sessions() as s:
            pids = [p for (p,) in (await s.execute(select(Problem.problem_id).where(Problem.run_id == run_id)))]

        # A dropped group (no signal) frees its place at once.
        await _score(sessions, run_id, [first[0].task_id], dropped=True)
        await reader.read(5)
        # Two groups trained -> version 1 -> budget (1+1+1)·2 = 6 live. The last two are trained
        # at step 3, in stage 3: before any stage-3 task, the current policy probes every problem
        # (8 rollouts each, stage-3 budgets, outside admission); no stage-3 task while it runs.
        await _score(sessions, run_id, [t.task_id for t in first[1:3]])
        await _learner_step(sessions, run_id, 1)
        probes = await reader.read(6, probes=True)
        assert sorted(t.problem_id for t in probes) == sorted(pids)
        assert all(t.n_samples == 8 and t.stage == 3 and t.min_policy_version == 1 for t in probes)
        assert probes[0].sampling.max_tokens == 768 and probes[0].sampling.max_turns == 4
        assert await reader.quiet(1.5) == 0 and len(reader.tasks) == 5
        # Solved 8/8 by the current policy: dropped; 7/8 and worse: kept.
        solved = pids[:2]
        correct = {pid: 8 if pid in solved else 7 if pid == pids[2] else 1 for pid in pids}
        await _score(sessions, run_id, [t.task_id for t in probes], probe_correct=correct)
        tasks = await reader.read(7)
        assert tasks[-1].min_policy_version == 1
        assert [t.stage for t in tasks] == [1] * 5 + [3] * 2
        async with sessions() as s:  # probes count neither as dispatched nor as scored groups
            progress, figures = await run_progress(s, run_id)
        assert progress.dispatched == 7 and figures["groups_scored"] == 3

        async def stage3_row():
            async with sessions() as s:
                return (await s.execute(select(Stage).where(Stage.run_id == run_id, Stage.stage == 3))).scalar_one_or_none()
        st3 = await stage3_row()
        assert st3.config["dropped_solved"] == 2 and set(st3.config["problem_ids"]) == set(pids) - set(solved)
        assert st3.config["first_task_index"] == 5 and st3.start_version == 1 and st3.status == "running"
        assert st3.config["probe"]["candidates"] == 6 and st3.config["probe"]["missing"] == 0
        assert all(t.problem_id not in solved for t in tasks[5:])
        assert tasks[5].sampling.max_turns == 4 and tasks[5].sampling.max_tokens == 768

        # An expired lease is re-dispatched under the same task id with attempt 2, but only
        # while the run has a learner: with its heartbeats gone (killed), the run is paused.
        await learner.stop()
        await asyncio.sleep(2.5)
        victim = tasks[3].task_id
        async with sessions() as s:
            await s.execute(update(RolloutTaskRow).where(RolloutTaskRow.task_id == victim).values(
                deadline=utcnow() - timedelta(seconds=1)))
            await s.commit()
        assert await reader.quiet(2.0) == 0
        learner.start()
        await reader.read(8)
        again = [t for t in reader.tasks if t.task_id == victim]
        assert [t.attempt for t in again] == [1, 2]
        async with sessions() as s:
            row = (await s.execute(select(RolloutTaskRow).where(RolloutTaskRow.task_id == victim))).scalar_one()
            assert row.attempts == 2 and row.status == "leased"

        # Step 2 -> budget (1+2+1)·2 = 8 live = (S + η)·B, the most a 3-step run ever has: two
        # groups beyond the last step's (the learner trains whichever finish first), in the last stage.
        await _learner_step(sessions, run_id, 2)
        n_before = len(reader.tasks)
        extra = (await reader.read(n_before + 2))[n_before:]
        assert [t.stage for t in extra] == [3, 3] and all(t.min_policy_version == 2 for t in extra)
        assert await reader.quiet(1.0) == 0
        async with sessions() as s:
            assert (await s.execute(select(Run.current_stage).where(Run.run_id == run_id))).scalar_one() == 3

        # The learner gives a scored group up (stale under the newer version): it is recorded at
        # once, and its place goes to a replacement (a stage-3 task: the run's last step trains it).
        await _score(sessions, run_id, [tasks[4].task_id])
        async with sessions() as s:
            await s.execute(update(TrajectoryGroupRow).where(TrajectoryGroupRow.group_id == tasks[4].task_id).values(
                learner_skipped="stale"))
            await s.commit()
        n_before = len(reader.tasks)
        replacement = (await reader.read(n_before + 1))[-1]
        assert replacement.stage == 3 and replacement.min_policy_version == 2
        assert await reader.quiet(1.0) == 0

        # Last step -> run finished, nothing more dispatched.
        await _learner_step(sessions, run_id, 3)

        async def finished():
            async with sessions() as s:
                return (await s.execute(select(Run.status).where(Run.run_id == run_id))).scalar_one() == "finished"
        await _wait(finished)
        await reader.quiet(0.5)
        assert await reader.quiet(1.0) == 0


def test_bad_run_configs_fail_clearly(tmp_path):
    from lab.tiny_model import create_random_model

    model = create_random_model(tmp_path / "m", seed=0, hidden=64, layers=1, heads=2, intermediate=64)
    no_template = tmp_path / "no-template"
    shutil.copytree(model, no_template)
    (no_template / "chat_template.jinja").unlink()
    good = {"model": str(model), "format": {"preset": "compact"},
            "stages": [{"stage": 1, "steps": 1, "max_tokens": 10, "max_turns": 1}]}

    def write(d):
        p = tmp_path / "run.yaml"
        p.write_text(yaml.safe_dump(d))
        return p

    assert load_run_config(write(good)).n_samples == 32
    cases = [
        ({**good, "group_size": 8, "n_samples": 4}, "n_samples (4) must be >= group_size (8)"),
        ({**good, "stages": [{"stage": 2, "steps": 1, "max_tokens": 1, "max_turns": 1},
                             {"stage": 1, "steps": 1, "max_tokens": 1, "max_turns": 1}]}, "increasing order"),
        ({**good, "bogus": 1}, "bogus: Extra inputs are not permitted"),
        ({**good, "model": str(tmp_path / "nope")}, "does not exist"),
        ({**good, "model": str(no_template)}, "no chat template"),
        ({**good, "format": {"preset": "fancy"}}, "unknown prompt preset 'fancy'"),
        ({**good, "sampling": {"top_p": 0.9}}, "top_p 0.9 < 1 cannot be reproduced by the learner"),
        ({**good, "sampling": {"temperature": 0}}, "sampling.temperature: Input should be greater than 0"),
        ({**good, "dataset": {"kind": "file"}}, "needs dataset.paths"),
        ({**good, "max_staleness": -1}, "max_staleness"),
        ({**good, "services": {"lerner": {}}}, "unknown service 'lerner'"),
        ({**good, "services": {"learner": {"torch_thread": 1}}}, "services.learner: unknown setting(s) torch_thread"),
    ]
    for data, reason in cases:
        with pytest.raises(RunConfigError, match=reason.replace("(", r"\(").replace(")", r"\)")):
            load_run_config(write(data))

    # Per-service settings reach the service's section and win over what the run derives.
    tuned = load_run_config(write({**good, "lr": 1e-4, "services": {"learner": {"torch_threads": 1, "lr": 3e-4},
                                                                    "rollout": {"max_num_seqs": 64}}}))
    sections = tuned.service_settings()
    assert sections["learner"]["torch_threads"] == 1 and sections["learner"]["lr"] == 3e-4
    assert sections["learner"]["groups_per_step"] == tuned.batch_groups
    assert sections["rollout"] == {"model_path": str(model), "prompt_preset": "compact", "max_num_seqs": 64}
    # The learner divides its logits by the run's sampling temperature; top_p < 1 only by consent.
    hot = load_run_config(write({**good, "sampling": {"temperature": 0.7, "top_p": 0.95, "allow_inexact_logprobs": True}}))
    assert hot.service_settings()["learner"]["sampling_temperature"] == 0.7


async def test_a_run_with_an_invalid_config_fails_without_stalling_the_others(stack, topic_prefix, db_engine):
    sessions = session_factory(db_engine)
    async with sessions() as s:
        s.add(Run(run_id=f"bad-{topic_prefix}", name="bad", config={"stages": "nope"}, status="created"))
        await s.commit()
    settings = load_settings(Settings, kafka_bootstrap=stack.kafka_bootstrap, database_url=stack.database_url,
                             topic_prefix=topic_prefix, port=_free_port())
    svc = OrchestratorService(settings)
    await svc.start(type("Ctx", (), {"sessions": sessions, "log": __import__("shared.logging", fromlist=["x"]).get_logger("t"),
                                     "producer": None})())
    await svc.tick()
    async with sessions() as s:
        run = (await s.execute(select(Run).where(Run.run_id == f"bad-{topic_prefix}"))).scalar_one()
    assert run.status == "failed" and "invalid run config" in run.config["failure"]
