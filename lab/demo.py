"""`make demo` / `rstar demo`: the main job on the embedded default, end to end.

1. start the embedded stack (broker + PostgreSQL);
2. the tiny model after stage-0 SFT: the committed checkpoint (``lab/stage0.py``: the same
   weights on every machine), or with ``--from-scratch`` the bootstrap's SFT on this machine
   (cached under ``<state_dir>/models`` after the first time);
3. start the tool-executor and evaluate the SFT model on held-out problems (pass@1 over k
   samples at T = 1, with tools);
4. start the other services (`rstar up` machinery) configured from ``configs/demo.yaml``;
5. run asynchronous GRPO-RoC through all five services until the run finishes;
6. stop the training services and evaluate the last policy version the same way;
7. write the report (PNG + HTML) and print the before/after figures; the last line is one
   JSON object with ``pass1_before``, ``pass1_after``, ``steps`` and ``report``.

The terminal gets the phases, progress and warnings; vLLM's INFO lines and the other logs of the
demo's own process go to ``<state_dir>/logs/demo.log`` (:func:`configure_demo_logging`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import logging.config
import os
import sys
import time
from pathlib import Path

import yaml
from rich.console import Console

from shared.settings import DEFAULT_STATE_DIR

console = Console(stderr=True, soft_wrap=True)
REPO = Path(__file__).resolve().parents[1]
# The run config (``model`` is filled in with the bootstrapped model); another file can be tried
# with RSTAR_DEMO_CONFIG=path.
DEMO_CONFIG = Path(os.environ.get("RSTAR_DEMO_CONFIG", REPO / "configs" / "demo.yaml"))

# Held-out problems and samples per problem for the before/after evaluation: 800 samples keep
# the sampling noise of pass@1 near ±2 points (repeated evaluations of one model varied by ±4 at
# 100 × 4) for ~30 s of generation.
EVAL_PROBLEMS = int(os.environ.get("RSTAR_DEMO_EVAL_PROBLEMS", "100"))
EVAL_SAMPLES = int(os.environ.get("RSTAR_DEMO_EVAL_SAMPLES", "8"))
# SFT schedule of the demo's model. A step count, not a time budget, so the model does not depend
# on the machine's speed (a 12-minute budget gave 0.59 on one machine and 0.09 on a slower one);
# it still depends on the CPU's floating-point kernels. Digit copying forms only while the
# learning rate is still high. Since the generated problems draw every digit count of a number
# equally often (data._digits: short copies as well as long ones), copying forms earlier: on two
# AVX-512 cores the loss fell from 0.45 to 0.06 between steps 450 and 650 of a 700-step cosine to
# 30 %, which samples pass@1 0.39 (pass@8 0.80) in ~7 minutes; 1100 steps gave 0.67, too strong
# to leave RL room, and 450 never formed copying (0.00). docs/data.md, "Graded copy lengths".
BOOTSTRAP_STEPS = int(os.environ.get("RSTAR_DEMO_BOOTSTRAP_STEPS", "700"))
BOOTSTRAP_MIN_LR_RATIO = float(os.environ.get("RSTAR_DEMO_BOOTSTRAP_MIN_LR_RATIO", "0.3"))
# The RL phase stops here even if the run has not finished (e.g. a policy that never solves a
# problem yields only all-equal groups, which carry no gradient and never make a step). The
# 60 steps of configs/demo.yaml took 6.5 minutes on two AVX-512 cores; a slower machine stops
# short of them here rather than going past the demo's 25 minutes.
TRAIN_MINUTES = float(os.environ.get("RSTAR_DEMO_TRAIN_MINUTES", "8"))


# The demo's own log: vLLM's records from the engines the demo starts in its own process (the two
# evaluations: dozens of INFO lines per engine start, from this process and its engine-core
# child) and the structured logs of the service code it runs in-process (dataset loading, run
# creation). Warnings and errors also reach the terminal; INFO stays in the file. The services'
# own logs are <state_dir>/logs/<service>.log, as for `rstar up`.
DEMO_LOG = "demo.log"
VLLM_LOG_FORMAT = "%(asctime)s %(levelname)s vllm pid=%(process)d [%(name)s:%(lineno)d] %(message)s"
# The services the demo starts keep vLLM's default logging (to their stdout, i.e. their own log
# file): where the demo named its config in VLLM_LOGGING_CONFIG_PATH, an empty one in theirs
# undoes it (configure_demo_logging fills this in).
SERVICE_ENV: dict[str, str] = {}


def vllm_logging_config(log_file: Path, level: str = "INFO") -> dict:
    """A ``logging.config.dictConfig`` for the ``vllm`` logger: records at ``level`` and above to
    ``log_file``, WARNING and above also to stderr, none to stdout (vLLM's default stream)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"vllm_file": {"format": VLLM_LOG_FORMAT}},
        "handlers": {
            "vllm_file": {"class": "logging.FileHandler", "filename": str(log_file), "mode": "a",
                          "formatter": "vllm_file", "level": level},
            "vllm_terminal": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr",
                              "formatter": "vllm_file", "level": "WARNING"},
        },
        "loggers": {"vllm": {"handlers": ["vllm_file", "vllm_terminal"], "level": level, "propagate": False}},
    }


class _DemoLogSink:
    """structlog's logger in the demo's process: every line to the log file, warnings and
    errors to the terminal too."""

    def __init__(self, file, terminal) -> None:
        self._file, self._terminal = file, terminal

    def _to_file(self, message: str) -> None:
        print(message, file=self._file, flush=True)

    def _to_both(self, message: str) -> None:
        self._to_file(message)
        print(message, file=self._terminal, flush=True)

    msg = debug = info = _to_file
    warning = warn = error = err = critical = fatal = exception = _to_both


def configure_demo_logging(state_dir: Path) -> Path:
    """Route the demo process's logs to ``<state_dir>/logs/demo.log`` (see ``DEMO_LOG``); return it.

    vLLM configures its logging when an engine starts, in this process and again in the engine's
    child processes, from ``VLLM_LOGGING_CONFIG_PATH``: the config is written beside the log and
    named there (children inherit the environment), and applied here at once for records logged
    before an engine starts. A VLLM_LOGGING_CONFIG_PATH or VLLM_CONFIGURE_LOGGING=0 of the caller's
    own is left as it is."""
    import structlog

    from shared.logging import configure_logging

    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_file = logs / DEMO_LOG
    if not os.environ.get("VLLM_LOGGING_CONFIG_PATH") and os.environ.get("VLLM_CONFIGURE_LOGGING", "1") != "0":
        config = vllm_logging_config(log_file, os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
        config_path = logs / "demo-vllm-logging.json"
        config_path.write_text(json.dumps(config, indent=1))
        os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(config_path)
        SERVICE_ENV["VLLM_LOGGING_CONFIG_PATH"] = ""
        logging.config.dictConfig(config)
    configure_logging("demo")  # structlog's JSON lines, bound to service=demo ...
    sink = _DemoLogSink(open(log_file, "a", buffering=1), sys.stderr)  # open for the process's life
    structlog.configure(logger_factory=lambda *_: sink)  # ... to the file (warnings to the terminal too)
    # and the other libraries' standard-library loggers likewise: INFO to the file, not to stderr.
    terminal = logging.StreamHandler(sys.stderr)
    terminal.setLevel(logging.WARNING)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO, force=True,
                        handlers=[logging.FileHandler(log_file), terminal])
    return log_file


def _phase(name: str, t0: float) -> None:
    console.rule(f"[bold]{name}[/bold]  (t = {time.monotonic() - t0:.0f} s)")


async def _stop_run(sessions, run_id: str) -> None:
    from sqlalchemy import update

    from shared.db.models import Run

    async with sessions() as s:
        await s.execute(update(Run).where(Run.run_id == run_id, Run.status.in_(("created", "running")))
                        .values(status="stopped"))
        await s.commit()


async def _latest_checkpoint(sessions, run_id: str) -> tuple[int, str | None]:
    from sqlalchemy import select

    from shared.db.models import PolicyVersion

    async with sessions() as s:
        row = (await s.execute(select(PolicyVersion).where(PolicyVersion.run_id == run_id)
                               .order_by(PolicyVersion.version.desc()).limit(1))).scalar_one_or_none()
    return (row.version, row.uri) if row else (0, None)


async def _evaluate_train_evaluate(cfg, model: Path, eval_problems: list, state_dir: Path, t0: float) -> dict:
    from services.orchestrator.cli import watch_run
    from lab.cluster import SERVICE_ORDER, LocalCluster, cluster_for_run
    from lab.evaluate import EvalConfig, evaluate_model
    from lab.report import EvalPoint, load_steps, render
    from services.orchestrator.runtime import create_run
    from shared.checkpoint import path_from_uri
    from shared.db.session import make_engine, session_factory

    eval_cfg = EvalConfig(samples=EVAL_SAMPLES, max_tokens=cfg.stages[-1].max_tokens, max_turns=cfg.stages[-1].max_turns,
                          preset=cfg.format.preset)
    tool_urls = ["http://127.0.0.1:8102"]
    engine = make_engine(os.environ["RSTAR_DATABASE_URL"])
    sessions = session_factory(engine)

    def progress(done: int, total: int) -> None:
        if done % 20 == 0 or done == total:
            console.print(f"  evaluated {done}/{total} problems")

    tools = LocalCluster(state_dir, None, services=("tool-executor",), name="cluster-tools", env=dict(SERVICE_ENV))
    rest: LocalCluster | None = None
    run_id: str | None = None
    try:
        _phase("3/7 tool-executor; evaluate the SFT model", t0)
        tools.start()
        await asyncio.to_thread(tools.wait_ready, 300)
        before = await evaluate_model(model, eval_problems, tool_urls, eval_cfg, progress=progress)
        console.print(f"before RL: pass@1 {before['pass@1_mean']:.3f} ({before['problems']} problems x {EVAL_SAMPLES})")

        _phase("4/7 reward, learner, rollout, orchestrator", t0)
        run_id = await create_run(sessions, cfg)
        rest = cluster_for_run(state_dir, cfg, run_id, services=tuple(n for n in SERVICE_ORDER if n != "tool-executor"),
                               env=dict(SERVICE_ENV))
        rest.start()
        await asyncio.to_thread(rest.wait_ready, 600)

        _phase("5/7 asynchronous GRPO-RoC through all five services", t0)
        console.print(f"run {run_id}: {cfg.total_steps} steps, G={cfg.group_size}/{cfg.n_samples}, "
                      f"B={cfg.batch_groups}, η={cfg.max_staleness}; logs in {state_dir / 'logs'}")
        try:
            fig = await watch_run(sessions, run_id, live=console.is_terminal, timeout_s=TRAIN_MINUTES * 60)
        except TimeoutError:
            await _stop_run(sessions, run_id)
            fig = await watch_run(sessions, run_id, live=False)
            console.print(f"[yellow]the run did not finish within {TRAIN_MINUTES:.0f} minutes; stopped at "
                          f"{fig['steps_done']} steps[/yellow]")
        version, uri = await _latest_checkpoint(sessions, run_id)
        await asyncio.to_thread(rest.stop)  # free the cores for the evaluation
        rest = None

        _phase(f"6/7 evaluate policy version {version}", t0)
        if uri is None:
            console.print("[yellow]no new policy version: the SFT model is the final policy[/yellow]")
            after = before
        else:
            after = await evaluate_model(path_from_uri(uri), eval_problems, tool_urls, eval_cfg, progress=progress)
        console.print(f"after RL: pass@1 {after['pass@1_mean']:.3f}")

        _phase("7/7 report", t0)
        _, steps = await load_steps(sessions, run_id)
    except BaseException:
        # Interrupted (Ctrl-C, SIGTERM) or failed: leave no run marked running, or the next
        # cluster's orchestrator would go on feeding it tasks beside its own run.
        if run_id is not None:
            await _stop_run(sessions, run_id)
        raise
    finally:
        if rest is not None:
            await asyncio.to_thread(rest.stop)
        await asyncio.to_thread(tools.stop)
        await engine.dispose()
    # The held-out pass@1 on the pass-rate panel: the SFT model before step 1, the evaluated
    # version at the step that produced it.
    evaluations = [EvalPoint(0, before["pass@1_mean"], "held-out pass@1 before RL")]
    if uri is not None:
        after_step = next((s.step for s in steps if s.version == version), steps[-1].step if steps else 0)
        evaluations.append(EvalPoint(after_step, after["pass@1_mean"], f"held-out pass@1 of version {version}"))
    report = render(run_id, steps, state_dir / "reports" / run_id, {
        "pass@1 before (SFT)": f"{before['pass@1_mean']:.3f}", "pass@1 after (RL)": f"{after['pass@1_mean']:.3f}",
        "policy version": version, "eval problems": before["problems"], "samples per problem": EVAL_SAMPLES},
        evaluations=evaluations)
    return {
        "pass1_before": round(before["pass@1_mean"], 4),
        "pass1_after": round(after["pass@1_mean"], 4),
        f"pass{EVAL_SAMPLES}_before": round(before[f"pass@{EVAL_SAMPLES}"], 4),
        f"pass{EVAL_SAMPLES}_after": round(after[f"pass@{EVAL_SAMPLES}"], 4),
        "response_len_before": before.get("mean_response_tokens"),
        "response_len_after": after.get("mean_response_tokens"),
        "steps": fig["steps_done"],
        "run_status": fig["status"],
        "version": version,
        "run_id": run_id,
        "report": str(report),
        "wall_s": round(time.monotonic() - t0, 1),
    }


def demo_state_dir() -> Path:
    return Path(os.environ.get("RSTAR_STATE_DIR", DEFAULT_STATE_DIR)).resolve()


def demo_bootstrap_settings():
    """The bootstrap recipe of the demo's model (its digest names the committed checkpoint)."""
    from lab.bootstrap import BootstrapSettings

    return BootstrapSettings(seed=0, steps=BOOTSTRAP_STEPS, min_lr_ratio=BOOTSTRAP_MIN_LR_RATIO)


def bootstrap_demo_model(state_dir: Path, *, from_scratch: bool = False) -> Path:
    """The demo's policy: the committed stage-0 checkpoint (lab/stage0.py), verified and copied
    under ``<state_dir>/models``; with ``from_scratch``, the stage-0 SFT trained on this machine
    by the bootstrap (once; then cached there). ``bench/policy_update.py`` measures the same model."""
    from lab import stage0
    from lab.bootstrap import bootstrap_tiny_model

    settings = demo_bootstrap_settings()
    if not from_scratch:
        return stage0.install(state_dir / "models", digest=settings.digest())
    return bootstrap_tiny_model(state_dir / "models", steps=settings.steps, seed=settings.seed,
                                min_lr_ratio=settings.min_lr_ratio,
                                log=lambda r: console.print(f"  sft step {int(r['step'])} loss {r['loss']:.3f}")
                                if int(r["step"]) % 25 == 0 else None)


def main(*, from_scratch: bool = False) -> None:
    from services.orchestrator.run_config import RunConfig
    from services.orchestrator.runtime import dataset_for
    from shared import stack

    t0 = time.monotonic()
    state_dir = demo_state_dir()
    log_file = configure_demo_logging(state_dir)
    _phase("1/7 embedded stack", t0)
    console.print(f"demo log (vLLM, in-process services): {log_file}")
    info = stack.up(state_dir)
    console.print(f"kafka {info.kafka_bootstrap}; database {info.database_url}")
    os.environ.setdefault("RSTAR_KAFKA_BOOTSTRAP", info.kafka_bootstrap)
    os.environ.setdefault("RSTAR_DATABASE_URL", info.database_url)

    if from_scratch:
        _phase("2/7 tiny model: stage-0 SFT on this machine (trained the first time, then cached)", t0)
    else:
        _phase("2/7 tiny model: the committed stage-0 checkpoint (lab/checkpoints/tiny-sft)", t0)
    model = bootstrap_demo_model(state_dir, from_scratch=from_scratch)
    console.print(f"model: {model}")

    raw = yaml.safe_load(DEMO_CONFIG.read_text())
    raw["model"] = str(model)
    cfg = RunConfig.model_validate(raw)
    _, eval_problems = dataset_for(cfg)
    eval_problems = eval_problems[:EVAL_PROBLEMS]

    result = asyncio.run(_evaluate_train_evaluate(cfg, model, eval_problems, state_dir, t0))
    console.print(f"pass@1 {result['pass1_before']:.3f} -> {result['pass1_after']:.3f} after {result['steps']} steps; "
                  f"report: {result['report']}")
    # The stack stays up so the run can still be inspected; removing the state directory under
    # a running stack would leave its broker holding the port.
    console.print("the embedded stack is still running (`rstar status`, `rstar report RUN_ID`); "
                  "`rstar down` stops it")
    print(json.dumps(result))
