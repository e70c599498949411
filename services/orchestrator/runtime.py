"""Orchestrator runtime: every ``tick_s`` it reads each active run's progress from PostgreSQL,
asks :mod:`services.orchestrator.control` what to do, and does it (rows in ``rollout_tasks``,
RolloutTasks on ``rstar.rollout.tasks``). All state lives in the database, so a restarted
orchestrator continues where it stopped. A run no live learner trains (its heartbeats in
``service_instances``) gets no tasks until one does (``control``, "Learner presence").

Order of effects for a new task: the ``rollout_tasks`` row (status ``leased``, deadline) is
committed first, then the task is published. A crash in between leaves a leased row that is
never served: its deadline passes and it is re-dispatched — nothing is lost, at worst late.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from fastapi import APIRouter, HTTPException
from prometheus_client import Counter, Gauge
from pydantic import ValidationError
from sqlalchemy import func, select, update

from services.orchestrator import control
from services.orchestrator.config import Settings
from shared.datasets import Problem as DataProblem
from shared.datasets import ProblemSetReport, load_problem_set, make_splits
from services.orchestrator.run_config import RunConfig
from shared import topics
from shared.db.models import (
    LearnerStep,
    PolicyVersion,
    Problem,
    RolloutTaskRow,
    Run,
    ServiceInstance,
    Stage,
    TrajectoryGroupRow,
)
from shared.db.session import upsert
from shared.events import RolloutTask, SamplingParams, new_id
from shared.logging import get_logger
from shared.runtime import RuntimeContext, Service

TASKS_SENT = Counter("rstar_orchestrator_tasks_total", "Rollout tasks published", ["kind"])
IN_FLIGHT = Gauge("rstar_orchestrator_live_groups", "Admitted groups not yet trained or dropped", ["run_id"])
VERSION = Gauge("rstar_orchestrator_policy_version", "Latest policy version", ["run_id"])
STAGE = Gauge("rstar_orchestrator_stage", "Current curriculum stage", ["run_id"])
LEARNER_PRESENT = Gauge("rstar_orchestrator_learner_present", "1 while a live learner trains the run (else it is paused)",
                        ["run_id"])

ACTIVE = ("created", "running")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def dataset_for(cfg: RunConfig, *, reports: dict[str, ProblemSetReport] | None = None,
                ) -> tuple[list[DataProblem], list[DataProblem]]:
    """(train, eval) problems of a run. For files, each split's load report (schema per file,
    rows, duplicates dropped, bad rows skipped, answer kinds) is logged as ``dataset_loaded``
    (conflicting answers of duplicates also as ``dataset_conflicting_answers``) and, when
    ``reports`` is given, stored in it under ``"train"`` / ``"eval"``."""
    d = cfg.dataset
    if d.kind == "generated":
        return make_splits(d.n_train, d.n_eval, seed=d.seed)
    log = get_logger("orchestrator.dataset")
    splits: dict[str, list[DataProblem]] = {"train": [], "eval": []}
    for split, paths in (("train", d.paths), ("eval", d.eval_paths)):
        if not paths:
            continue
        loaded = load_problem_set(paths, fields=d.fields or None, on_bad_row=d.on_bad_row, dedupe=d.dedupe)
        log.info("dataset_loaded", split=split, **loaded.report.summary())
        if loaded.report.conflicting_answers:
            log.warning("dataset_conflicting_answers", split=split, count=loaded.report.conflicting_answers,
                        first=loaded.report.warnings)
        if reports is not None:
            reports[split] = loaded.report
        splits[split] = loaded.problems
    return splits["train"], splits["eval"]


async def run_progress(session, run_id: str) -> tuple[control.Progress, dict]:
    """The run's progress snapshot, and the figures /v1/runs shows."""
    version = (await session.execute(
        select(func.coalesce(func.max(PolicyVersion.version), 0)).where(PolicyVersion.run_id == run_id))).scalar_one()
    steps_done = (await session.execute(
        select(func.count(LearnerStep.step)).where(LearnerStep.run_id == run_id))).scalar_one()
    # Training tasks only: probes (stage-3 entry) are outside admission.
    train = (RolloutTaskRow.run_id == run_id) & (RolloutTaskRow.purpose == "train")
    dispatched = (await session.execute(select(func.count()).select_from(RolloutTaskRow).where(train))).scalar_one()
    given_up = (await session.execute(select(func.count()).select_from(RolloutTaskRow).where(
        train, RolloutTaskRow.status == "failed"))).scalar_one()
    # A group is dropped when the reward does not publish it (no signal) or the learner gives
    # it up (stale, no signal, past the last step: ``learner_skipped``, recorded at once).
    skipped = (TrajectoryGroupRow.learner_skipped.is_not(None)) & (TrajectoryGroupRow.status != "dropped")
    # Groups lost to tool failures (status redispatch) are neither scored nor dropped: their task
    # is still live (rolled out again, or given up and counted as such). Probe groups train nothing.
    groups = (await session.execute(select(
        func.count(), func.count().filter(TrajectoryGroupRow.status == "dropped"),
        func.count().filter(skipped & (TrajectoryGroupRow.learner_skipped == "stale")),
        func.count().filter(skipped), func.avg(TrajectoryGroupRow.pass_rate),
    ).where(TrajectoryGroupRow.run_id == run_id, TrajectoryGroupRow.status.not_in(("redispatch", "probe"))))).one()
    lost = (await session.execute(select(
        func.count().filter(TrajectoryGroupRow.status == "redispatch"),
        func.coalesce(func.sum(TrajectoryGroupRow.n_tool_failure), 0),
    ).where(TrajectoryGroupRow.run_id == run_id))).one()
    progress = control.Progress(
        version=int(version), steps_done=int(steps_done), dispatched=int(dispatched),
        dropped=int(groups[1]) + int(groups[3]) + int(given_up),
    )
    figures = {"version": progress.version, "steps_done": progress.steps_done, "dispatched": progress.dispatched,
               "dropped": progress.dropped, "groups_scored": int(groups[0]), "groups_dropped_no_signal": int(groups[1]),
               "dropped_stale": int(groups[2]), "tasks_given_up": int(given_up),
               "pass_rate_mean": float(groups[4]) if groups[4] is not None else None,
               # the groups' latest recorded attempts: awaiting a re-dispatch, rollouts left out
               "groups_lost_to_tool_failure": int(lost[0]), "rollouts_lost_to_tool_failure": int(lost[1])}
    return progress, figures


async def learner_present(session, run_id: str, timeout_s: float) -> bool:
    """Whether a live learner trains the run (:func:`control.learner_present`), judged by the
    database's clock, which also stamped the heartbeats."""
    rows = (await session.execute(select(
        ServiceInstance.info["run_id"].astext, ServiceInstance.last_heartbeat, func.now()).where(
        ServiceInstance.service == "learner", ServiceInstance.status == "up"))).all()
    if not rows:
        return False
    beats = [control.LearnerBeat(r[0] or "", r[1]) for r in rows]
    return control.learner_present(beats, run_id, rows[0][2], timeout_s=timeout_s)


class OrchestratorService(Service):
    name = "orchestrator"

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.settings: Settings = settings
        self._problems: dict[str, list[str]] = {}  # run_id -> problem ids of its training set
        # run_id -> whether a learner trained it at the last pass (absent: not seen yet); only
        # its changes are logged.
        self._learner_present: dict[str, bool] = {}

    async def start(self, ctx: RuntimeContext) -> None:
        await super().start(ctx)

    async def run(self) -> None:
        log = self.ctx.log
        while not self._stop.is_set():
            try:
                await self.tick()
            except Exception as exc:  # noqa: BLE001 - keep controlling; the DB/broker may be away
                log.warning("tick_failed", error=repr(exc))
            try:
                await asyncio.wait_for(self._stop.wait(), self.settings.tick_s)
            except asyncio.TimeoutError:
                pass

    # ------------------------------------------------------------------ one control pass
    async def tick(self) -> None:
        async with self.ctx.sessions() as session:
            runs = (await session.execute(select(Run).where(Run.status.in_(ACTIVE)))).scalars().all()
        for run in runs:  # one run's failure must not stall the others
            try:
                await self.control_run(run)
            except ValidationError as exc:
                await self._fail_run(run.run_id, f"invalid run config: {exc}")
            except Exception as exc:  # noqa: BLE001 - e.g. the database or broker is away: retry next tick
                self.ctx.log.warning("run_control_failed", run_id=run.run_id, error=repr(exc))

    async def _fail_run(self, run_id: str, reason: str) -> None:
        self.ctx.log.error("run_failed", run_id=run_id, reason=reason[:2000])
        async with self.ctx.sessions() as session:
            await session.execute(update(Run).where(Run.run_id == run_id).values(
                status="failed", config=Run.config.op("||")({"failure": reason[:2000]})))
            await session.commit()

    async def _start_run(self, run: Run, cfg: RunConfig) -> None:
        train, _ = dataset_for(cfg)
        name = cfg.dataset.kind if cfg.dataset.kind == "generated" else ",".join(cfg.dataset.paths)
        async with self.ctx.sessions() as session:
            for i in range(0, len(train), 500):
                await session.execute(upsert(Problem, [
                    {"run_id": run.run_id, "problem_id": p.problem_id, "dataset": name, "prompt": p.prompt, "answer": p.answer}
                    for p in train[i:i + 500]]))
            await session.execute(upsert(Stage, {"run_id": run.run_id, "stage": cfg.stages[0].stage, "status": "running",
                                                 "started_at": utcnow(), "start_version": 0,
                                                 "config": {"first_task_index": 0, **cfg.stages[0].model_dump()}}))
            await session.execute(update(Run).where(Run.run_id == run.run_id).values(
                status="running", current_stage=cfg.stages[0].stage))
            await session.commit()
        self.ctx.log.info("run_started", run_id=run.run_id, problems=len(train), stages=[s.stage for s in cfg.stages])

    async def _problem_ids(self, run_id: str) -> list[str]:
        if run_id not in self._problems:
            async with self.ctx.sessions() as session:
                rows = await session.execute(
                    select(Problem.problem_id).where(Problem.run_id == run_id).order_by(Problem.problem_id))
                self._problems[run_id] = [r[0] for r in rows]
        return self._problems[run_id]

    async def control_run(self, run: Run) -> None:
        cfg = RunConfig.model_validate(run.config)
        if run.status == "created":
            await self._start_run(run, cfg)
        run_id = run.run_id
        now = utcnow()
        async with self.ctx.sessions() as session:
            # Tasks whose group was scored are done (the lease is released); a group lost to
            # infrastructure faults (status redispatch) is not: its task is rolled out again below.
            scored = select(TrajectoryGroupRow.group_id).where(
                TrajectoryGroupRow.run_id == run_id, TrajectoryGroupRow.status != "redispatch")
            await session.execute(update(RolloutTaskRow).where(
                RolloutTaskRow.run_id == run_id, RolloutTaskRow.status == "leased",
                RolloutTaskRow.task_id.in_(scored)).values(status="done"))
            await session.commit()
            progress, _ = await run_progress(session, run_id)
            position = control.stage_position(progress.steps_done, [s.steps for s in cfg.stages])
            VERSION.labels(run_id).set(progress.version)
            IN_FLIGHT.labels(run_id).set(progress.dispatched - progress.dropped - progress.steps_done * cfg.batch_groups)
            if position.finished:
                await session.execute(update(Stage).where(Stage.run_id == run_id, Stage.status == "running").values(
                    status="done", ended_at=now))
                await session.execute(update(Run).where(Run.run_id == run_id).values(
                    status="finished", current_version=progress.version))
                await session.commit()
                self.ctx.log.info("run_finished", run_id=run_id, steps=progress.steps_done, version=progress.version)
                return
            training_stage = cfg.stages[position.index].stage  # new tasks may already be a stage ahead
            STAGE.labels(run_id).set(training_stage)
            await session.execute(update(Run).where(Run.run_id == run_id).values(
                current_stage=training_stage, current_version=progress.version))
            present = await learner_present(session, run_id, self.settings.learner_timeout_s)
            LEARNER_PRESENT.labels(run_id).set(int(present))
            before = self._learner_present.get(run_id)
            self._learner_present[run_id] = present
            if present and before is False:
                self.ctx.log.info("run_resumed", run_id=run_id)
            if not present:
                await session.commit()
                if before is not False:
                    # A new run's learner is often still loading: only losing one is a warning.
                    log = self.ctx.log.warning if before else self.ctx.log.info
                    log("run_paused_no_learner", run_id=run_id, timeout_s=self.settings.learner_timeout_s)
                return

            # Leases past their deadline, and tasks whose current attempt was lost to tool failures.
            faulted = select(TrajectoryGroupRow.group_id).where(
                TrajectoryGroupRow.run_id == run_id, TrajectoryGroupRow.status == "redispatch",
                TrajectoryGroupRow.group_id == RolloutTaskRow.task_id,
                TrajectoryGroupRow.attempt >= RolloutTaskRow.attempts).exists()
            leased = (await session.execute(select(RolloutTaskRow, faulted).where(
                RolloutTaskRow.run_id == run_id, RolloutTaskRow.status == "leased",
                (RolloutTaskRow.deadline <= now) | faulted))).all()
            by_id = {t.task_id: t for t, _ in leased}
            faulted_ids = frozenset(t.task_id for t, lost in leased if lost)
            decision = control.expired_leases(
                [control.Lease(t.task_id, t.deadline, t.attempts) for t, _ in leased], now,
                max_attempts=cfg.max_task_attempts, faulted=faulted_ids)
            for lease in decision.give_up:
                by_id[lease.task_id].status = "failed"
                self.ctx.log.warning("task_given_up", run_id=run_id, task_id=lease.task_id, attempts=lease.attempts,
                                     reason="tool_failure" if lease.task_id in faulted_ids else "deadline")
            again = [by_id[lease.task_id] for lease in decision.redispatch]
            for row in again:
                row.attempts += 1
                row.deadline = control.new_deadline(now, cfg.task_timeout_s)
                row.min_policy_version = progress.version
            resend = await self._task_events(session, run_id, cfg, again)
            await session.commit()

        for task in resend:
            await self.ctx.producer.send(self.ctx.topic(topics.ROLLOUT_TASKS), task, key=task.problem_id)
            TASKS_SENT.labels("redispatch").inc()
            self.ctx.log.info("task_redispatched", run_id=run_id, task_id=task.task_id, attempt=task.attempt,
                              reason="tool_failure" if task.task_id in faulted_ids else "deadline")

        # New tasks within the admission budget.
        budget = min(control.admission_budget(progress, batch_groups=cfg.batch_groups, max_staleness=cfg.max_staleness,
                                              total_steps=cfg.total_steps),
                     self.settings.max_dispatch_per_tick)
        if budget <= 0:
            return
        stage_steps = [s.steps for s in cfg.stages]
        live = progress.dispatched - progress.dropped
        new_rows: list[RolloutTaskRow] = []
        probe_rows: list[RolloutTaskRow] = []
        stage_rows: dict[int, Stage | None] = {}
        async with self.ctx.sessions() as session:
            for j in range(budget):
                index = progress.dispatched + j
                stage_index = control.stage_of_new_task(live + j, batch_groups=cfg.batch_groups, stage_steps=stage_steps)
                stage_cfg = cfg.stages[stage_index]
                if stage_index not in stage_rows:
                    stage_rows[stage_index] = await self._enter_stage(
                        session, run_id, cfg, stage_index, index, progress.version, now, probe_rows)
                stage_row = stage_rows[stage_index]
                if stage_row is None:
                    break  # the stage's entry probe runs: none of its tasks before it is over
                stage_ids = stage_row.config.get("problem_ids") or await self._problem_ids(run_id)
                first = int(stage_row.config.get("first_task_index", 0))
                pid = control.problem_at(index - first, stage_ids, cfg.seed * 1000 + stage_cfg.stage)
                new_rows.append(RolloutTaskRow(
                    task_id=new_id(), run_id=run_id, stage=stage_cfg.stage, problem_id=pid, status="leased",
                    deadline=control.new_deadline(now, cfg.task_timeout_s), attempts=1,
                    min_policy_version=progress.version, lease_owner=None))
            session.add_all(new_rows)
            await session.commit()
            events = await self._task_events(session, run_id, cfg, new_rows + probe_rows)
        for task in events:
            await self.ctx.producer.send(self.ctx.topic(topics.ROLLOUT_TASKS), task, key=task.problem_id)
            TASKS_SENT.labels("new" if task.purpose == "train" else "probe").inc()

    async def _enter_stage(self, session, run_id: str, cfg: RunConfig, index: int, first_task_index: int,
                           version: int, now: datetime, probe_rows: list[RolloutTaskRow]) -> Stage | None:
        """The Stage row of stage ``index``, created when its first task (the run's
        ``first_task_index``-th) is due. A hard-only stage is probed first (control, "Hard-only
        stages"): while its probe runs this returns None; the probe's task rows are added to the
        session and to ``probe_rows`` (for the caller to publish after the commit)."""
        stage_cfg = cfg.stages[index]
        row = (await session.execute(select(Stage).where(Stage.run_id == run_id, Stage.stage == stage_cfg.stage))).scalar_one_or_none()
        if row is not None and row.status != "probing":
            return row
        config: dict = {"first_task_index": first_task_index, **stage_cfg.model_dump()}
        if stage_cfg.only_hard:
            assert stage_cfg.probe is not None  # StageConfig gives hard-only stages one
            if row is None:
                await self._start_probe(session, run_id, cfg, index, version, now, probe_rows)
                return None
            outcome = await self._probe_outcome(session, run_id, stage_cfg, row, now)
            if outcome is None:
                return None
            config.update(problem_ids=outcome.kept, dropped_solved=len(outcome.solved),
                          probe={**row.config["probe"], "missing": outcome.missing, "all_solved": outcome.all_solved})
            if outcome.all_solved:
                self.ctx.log.warning("stage_hard_filter_empty", run_id=run_id, stage=stage_cfg.stage)
        await session.execute(update(Stage).where(Stage.run_id == run_id, Stage.status == "running").values(
            status="done", ended_at=now))
        if row is None:
            row = Stage(run_id=run_id, stage=stage_cfg.stage)
            session.add(row)
        row.status, row.started_at, row.start_version, row.config = "running", now, version, config
        await session.flush()
        self.ctx.log.info("stage_entered", run_id=run_id, stage=stage_cfg.stage, version=version,
                          problems=len(config.get("problem_ids", [])) or None,
                          dropped_solved=config.get("dropped_solved"))
        return row

    async def _start_probe(self, session, run_id: str, cfg: RunConfig, index: int, version: int, now: datetime,
                           probe_rows: list[RolloutTaskRow]) -> None:
        stage_cfg = cfg.stages[index]
        probe = stage_cfg.probe
        assert probe is not None
        candidates = control.probe_candidates(await self._problem_ids(run_id), max_problems=probe.max_problems,
                                              seed=cfg.seed * 1000 + stage_cfg.stage)
        deadline = control.new_deadline(now, cfg.task_timeout_s)
        rows = [RolloutTaskRow(task_id=new_id(), run_id=run_id, stage=stage_cfg.stage, problem_id=pid, status="leased",
                               deadline=deadline, attempts=1, min_policy_version=version, lease_owner=None,
                               purpose="probe") for pid in candidates]
        session.add_all(rows)
        probe_rows.extend(rows)
        # "probing": the stage row exists but the stage is not entered (no task of it admitted)
        session.add(Stage(run_id=run_id, stage=stage_cfg.stage, status="probing", start_version=version, config={
            "candidates": candidates,
            "probe": {"samples": probe.samples, "candidates": len(candidates), "version": version,
                      "started_at": now.isoformat()}}))
        await session.flush()
        self.ctx.log.info("stage_probe_started", run_id=run_id, stage=stage_cfg.stage, version=version,
                          problems=len(candidates), samples=probe.samples)

    async def _probe_outcome(self, session, run_id: str, stage_cfg, row: Stage, now: datetime
                             ) -> control.ProbeOutcome | None:
        """The probe's outcome once it is over (control.probe_finished), else None."""
        probe = stage_cfg.probe
        probe_tasks = (RolloutTaskRow.run_id == run_id) & (RolloutTaskRow.purpose == "probe") & (
            RolloutTaskRow.stage == stage_cfg.stage)
        results = [control.ProbeResult(pid, n, k) for pid, n, k in (await session.execute(
            select(RolloutTaskRow.problem_id, TrajectoryGroupRow.n_total, TrajectoryGroupRow.n_correct)
            .join(TrajectoryGroupRow, (TrajectoryGroupRow.run_id == RolloutTaskRow.run_id)
                  & (TrajectoryGroupRow.group_id == RolloutTaskRow.task_id))
            .where(probe_tasks, TrajectoryGroupRow.status == "probe"))).all()]
        given_up = {pid for (pid,) in (await session.execute(
            select(RolloutTaskRow.problem_id).where(probe_tasks, RolloutTaskRow.status == "failed"))).all()}
        candidates = row.config["candidates"]
        started = datetime.fromisoformat(row.config["probe"]["started_at"])
        settled = {r.problem_id for r in results} | given_up
        if not control.probe_finished(candidates, settled, started=started, now=now, timeout_s=probe.timeout_s):
            return None
        outcome = control.probe_outcome(candidates, results, samples=probe.samples)
        log = self.ctx.log.warning if outcome.missing else self.ctx.log.info
        log("stage_probe_finished", run_id=run_id, stage=stage_cfg.stage, problems=len(candidates),
            solved=len(outcome.solved), kept=len(outcome.kept), missing=outcome.missing,
            seconds=round((now - started).total_seconds(), 1))
        return outcome

    async def _task_events(self, session, run_id: str, cfg: RunConfig, rows: list[RolloutTaskRow]) -> list[RolloutTask]:
        """RolloutTask events for task rows (their problems read in one query)."""
        if not rows:
            return []
        problems = {p.problem_id: p for p in (await session.execute(
            select(Problem.problem_id, Problem.prompt, Problem.answer).where(
                Problem.run_id == run_id, Problem.problem_id.in_({r.problem_id for r in rows})))).all()}
        stages = {s.stage: s for s in cfg.stages}

        def n_samples(row: RolloutTaskRow) -> int:
            probe = stages[row.stage].probe
            return probe.samples if row.purpose == "probe" and probe is not None else cfg.n_samples

        return [RolloutTask(
            task_id=row.task_id, run_id=run_id, stage=row.stage, problem_id=row.problem_id,
            prompt=problems[row.problem_id].prompt, answer=problems[row.problem_id].answer, n_samples=n_samples(row),
            sampling=SamplingParams(temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p,
                                    max_tokens=stages[row.stage].max_tokens, max_turns=stages[row.stage].max_turns),
            min_policy_version=row.min_policy_version, deadline=row.deadline, attempt=row.attempts,
            prompt_preset=cfg.format.preset, purpose=row.purpose) for row in rows]

    # ------------------------------------------------------------------ HTTP
    def router(self) -> APIRouter:
        r = APIRouter()

        @r.get("/v1/runs")
        async def runs() -> list[dict]:
            async with self.ctx.sessions() as session:
                rows = (await session.execute(select(Run).order_by(Run.created_at.desc()).limit(100))).scalars().all()
            return [{"run_id": x.run_id, "name": x.name, "status": x.status, "stage": x.current_stage,
                     "version": x.current_version} for x in rows]

        @r.get("/v1/runs/{run_id}")
        async def run_status(run_id: str) -> dict:
            async with self.ctx.sessions() as session:
                run = (await session.execute(select(Run).where(Run.run_id == run_id))).scalar_one_or_none()
                if run is None:
                    raise HTTPException(404, f"no run {run_id!r}")
                _, figures = await run_progress(session, run_id)
                present = await learner_present(session, run_id, self.settings.learner_timeout_s)
            return {"run_id": run.run_id, "name": run.name, "status": run.status, "stage": run.current_stage,
                    "learner_present": present, **figures}

        return r


def build_service(settings: Settings) -> OrchestratorService:
    return OrchestratorService(settings)


async def create_run(sessions, cfg: RunConfig, *, run_id: str | None = None) -> str:
    """Record a run (status ``created``); the orchestrator service starts it on its next pass."""
    run_id = run_id or f"{cfg.name}-{new_id()[:8]}"
    async with sessions() as session:
        session.add(Run(run_id=run_id, name=cfg.name, config=cfg.model_dump(mode="json"), status="created"))
        await session.commit()
    return run_id
