"""Run-controller commands of the `rstar` CLI (mounted at the top level by services/cli.py):
train (create a run and watch it) and status. The local tools (up, down, eval, report, demo)
are in ``lab/cli.py``."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.live import Live
from rich.table import Table

from shared.settings import DEFAULT_STATE_DIR

app = typer.Typer()
console = Console(stderr=True, soft_wrap=True)

StateDir = typer.Option(DEFAULT_STATE_DIR, "--state-dir", envvar="RSTAR_STATE_DIR", help="local state directory")


def _database_url() -> str:
    from shared.settings import ServiceSettings, load_settings

    return load_settings(ServiceSettings).database_url


def db_sessions():
    from shared.db.session import make_engine, session_factory

    engine = make_engine(_database_url())
    return engine, session_factory(engine)


def load_run_config_or_exit(path: Path):
    from services.orchestrator.run_config import RunConfigError, load_run_config
    from services.orchestrator.runtime import dataset_for

    reports: dict = {}
    try:
        cfg = load_run_config(path)  # the model directory is checked here (about a second)
        train, _ = dataset_for(cfg, reports=reports)  # bad dataset rows fail here, before anything starts
    except (RunConfigError, ValueError) as exc:
        console.print(f"[red]cannot start:[/red] {exc}")
        raise typer.Exit(2) from None
    for split, report in reports.items():
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(report.answer_kinds.items(), key=lambda kv: -kv[1]))
        console.print(f"{split} data: {report.rows} rows, {report.problems} problems ({report.duplicates} duplicates "
                      f"dropped, {report.skipped} bad rows skipped); answers: {kinds}")
    return cfg, len(train)


def _progress_table(run_id: str, fig: dict, last: dict | None) -> Table:
    t = Table(title=f"run {run_id}", show_header=False)
    t.add_row("status", str(fig.get("status")))
    t.add_row("stage", str(fig.get("stage")))
    t.add_row("step / version", f"{fig.get('steps_done')} / {fig.get('version')}")
    if fig.get("learner_present") is False:
        t.add_row("learner", "[yellow]none alive: no new tasks until one trains this run[/yellow]")
    t.add_row("groups dispatched / scored / dropped", f"{fig.get('dispatched')} / {fig.get('groups_scored')} / {fig.get('dropped')}")
    if last:
        t.add_row("reward (last step)", f"{last.get('reward_mean'):.3f}" if last.get("reward_mean") is not None else "-")
        t.add_row("pass rate (last step)", f"{last.get('pass_rate_mean'):.3f}" if last.get("pass_rate_mean") is not None else "-")
        t.add_row("tool-error rate of positives", f"{last['tool_error_rate_pos']:.3f}" if last.get("tool_error_rate_pos") is not None else "-")
        t.add_row("staleness mean/max", f"{last.get('staleness_mean')} / {last.get('staleness_max')}")
        t.add_row("learner tokens/s", f"{last['tokens_per_s']:.0f}" if last.get("tokens_per_s") else "-")
    return t


async def watch_run(sessions, run_id: str, *, timeout_s: float | None = None, live: bool = True) -> dict:
    """Poll the run until it finishes (or fails); show live progress. Returns the last figures."""
    from sqlalchemy import select

    from services.orchestrator.config import LEARNER_TIMEOUT_S
    from services.orchestrator.runtime import learner_present, run_progress
    from shared.db.models import LearnerStep, Run

    start = time.monotonic()
    ctx = Live(console=console, refresh_per_second=2) if live else None
    fig: dict = {}
    try:
        if ctx:
            ctx.__enter__()
        while True:
            async with sessions() as session:
                run = (await session.execute(select(Run).where(Run.run_id == run_id))).scalar_one()
                _, fig = await run_progress(session, run_id)
                # Shown with the default timeout; the orchestrator's own setting decides the pause.
                fig.update(status=run.status, stage=run.current_stage,
                           learner_present=await learner_present(session, run_id, LEARNER_TIMEOUT_S))
                last = (await session.execute(select(LearnerStep).where(LearnerStep.run_id == run_id)
                                              .order_by(LearnerStep.step.desc()).limit(1))).scalar_one_or_none()
            last_d = {c: getattr(last, c) for c in ("reward_mean", "pass_rate_mean", "tool_error_rate_pos",
                                                   "staleness_mean", "staleness_max", "tokens_per_s")} if last else None
            if ctx:
                ctx.update(_progress_table(run_id, fig, last_d))
            if run.status in ("finished", "failed", "stopped"):
                return fig
            if timeout_s is not None and time.monotonic() - start > timeout_s:
                raise TimeoutError(f"run {run_id} did not finish within {timeout_s:.0f} s: {fig}")
            await asyncio.sleep(1.0)
    finally:
        if ctx:
            ctx.__exit__(None, None, None)


@app.command()
def train(
    run_config: Path = typer.Argument(..., help="run YAML (see docs/orchestrator.md)"),
    wait: bool = typer.Option(True, help="show live progress until the run finishes"),
) -> None:
    """Start a run (the orchestrator service picks it up) and show its progress."""
    from services.orchestrator.runtime import create_run

    cfg, n_train = load_run_config_or_exit(run_config)

    async def _go() -> None:
        engine, sessions = db_sessions()
        try:
            run_id = await create_run(sessions, cfg)
            console.print(f"run [bold]{run_id}[/bold]: {n_train} problems, {cfg.total_steps} steps, "
                          f"G={cfg.group_size} of {cfg.n_samples}, B={cfg.batch_groups}, η={cfg.max_staleness}")
            print(run_id)
            if wait:
                fig = await watch_run(sessions, run_id)
                console.print(f"run {run_id} {fig['status']}: {fig['steps_done']} steps, version {fig['version']}")
        finally:
            await engine.dispose()

    asyncio.run(_go())


@app.command()
def status(state_dir: Path = StateDir) -> None:
    """The stack, the services (heartbeats) and the runs."""
    from sqlalchemy import func, select

    from shared import stack
    from shared.db.models import Run, ServiceInstance

    st = stack.status(state_dir)
    console.print(f"stack: {'up' if st.get('running') else 'down'} "
                  f"(kafka {st.get('kafka_bootstrap', '-')} reachable={st.get('kafka_reachable')})")

    async def _go() -> None:
        engine, sessions = db_sessions()
        try:
            async with sessions() as s:
                now = (await s.execute(select(func.now()))).scalar_one()
                services = (await s.execute(select(ServiceInstance).where(ServiceInstance.status == "up")
                                            .order_by(ServiceInstance.service))).scalars().all()
                runs = (await s.execute(select(Run).order_by(Run.created_at.desc()).limit(10))).scalars().all()
        finally:
            await engine.dispose()
        t = Table("service", "instance", "port", "last heartbeat")
        for x in services:
            t.add_row(x.service, x.instance_id, str(x.port), f"{(now - x.last_heartbeat).total_seconds():.0f} s ago")
        console.print(t)
        r = Table("run", "status", "stage", "version", "created")
        for x in runs:
            r.add_row(x.run_id, x.status, str(x.current_stage), str(x.current_version), x.created_at.strftime("%Y-%m-%d %H:%M"))
        console.print(r)

    try:
        asyncio.run(_go())
    except Exception as exc:  # noqa: BLE001
        console.print(f"[red]database unreachable:[/red] {exc}")
        raise typer.Exit(1) from None


