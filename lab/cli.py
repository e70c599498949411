"""Local tools of the `rstar` CLI (mounted at the top level by services/cli.py): up, down, eval,
report, demo — the local process supervisor, evaluation and the laptop demo around the services."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from services.orchestrator.cli import StateDir, db_sessions, load_run_config_or_exit

app = typer.Typer()
model_app = typer.Typer(help="Model directories: what the pipeline reads from them.", no_args_is_help=True)
console = Console(stderr=True, soft_wrap=True)


def sigterm_as_ctrl_c() -> None:
    """Make SIGTERM (``kill``, systemd, a container stop) stop a long-running command as Ctrl-C
    does: its ``finally`` blocks then stop the services it started. Without this the process
    dies at once and its services keep running until `rstar down`."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)


@app.command()
def up(
    run: Optional[Path] = typer.Option(None, "--run", help="run config whose G/B/η/model the services should follow"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="system YAML with per-service sections"),
    state_dir: Path = StateDir,
) -> None:
    """Start the embedded stack and every service as supervised processes (Ctrl-C or SIGTERM
    stops them)."""
    from lab.cluster import LocalCluster, write_system_config
    from shared import stack

    sigterm_as_ctrl_c()
    with console.status("starting the embedded stack..."):
        info = stack.up(state_dir)
    console.print(f"stack: kafka {info.kafka_bootstrap}, database {info.database_url}")
    system = config
    if run is not None:
        cfg, _ = load_run_config_or_exit(run)
        import yaml

        base = yaml.safe_load(config.read_text()) if config else {}
        system = write_system_config(state_dir / "system.yaml", cfg.service_settings(), base)
    cluster = LocalCluster(state_dir, system)
    try:
        cluster.start()
        with console.status("waiting for the services to be ready...") as st:
            cluster.wait_ready(on_wait=lambda p: st.update(f"waiting for {', '.join(p)}..."))
        console.print(f"[green]all services ready[/green]; logs in {state_dir / 'logs'}. Ctrl-C stops them.")
        while True:
            for name in cluster.supervise_once():
                console.print(f"[yellow]{name} exited; restarted[/yellow]")
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        with console.status("stopping services..."):
            cluster.stop()
        console.print("services stopped (the stack stays up: `rstar down` stops it)")


@app.command()
def down(state_dir: Path = StateDir) -> None:
    """Stop the services started by `rstar up` and the embedded stack."""
    from lab.cluster import stop_recorded
    from shared import stack

    stopped = stop_recorded(state_dir)
    stack.down(state_dir)
    console.print(f"stopped {', '.join(stopped) or 'no services'}; stack down")


@app.command()
def report(
    run_id: str = typer.Argument(...),
    out: Optional[Path] = typer.Option(None, "--out", help="output directory (default <state_dir>/reports/RUN)"),
    state_dir: Path = StateDir,
) -> None:
    """Plots (PNG) and one HTML page of a run's curves."""
    from lab.report import load_steps, render

    async def _go():
        engine, sessions = db_sessions()
        try:
            return await load_steps(sessions, run_id)
        finally:
            await engine.dispose()

    run, steps = asyncio.run(_go())
    if run is None:
        console.print(f"[red]no run {run_id!r}[/red]")
        raise typer.Exit(1)
    index = render(run_id, steps, out or state_dir / "reports" / run_id, {"name": run.name, "status": run.status,
                                                                          "steps": len(steps)})
    console.print(f"report: {index}")
    print(index)


@app.command("eval")
def eval_(
    model: Path = typer.Argument(..., help="HF model directory (the SFT model or a checkpoint)"),
    dataset: Optional[list[Path]] = typer.Option(None, "--dataset", "-d",
                                                 help="benchmark file(s): AIME/DAPO/rStar JSONL or Parquet (see docs/data.md)"),
    run_config: Optional[Path] = typer.Option(None, "--run", help="take the held-out problems (and preset) of this run config"),
    preset: Optional[str] = typer.Option(None, help="prompt preset: rstar2 | boxed | compact (default: the run's, else rstar2)"),
    problems: int = typer.Option(100, help="at most this many problems"),
    samples: int = typer.Option(4, "-k", "--samples", help="samples per problem (avg@k = pass@1 averaged over them)"),
    max_tokens: int = typer.Option(768, help="token budget per trajectory"),
    max_turns: int = typer.Option(5, help="turns per trajectory"),
    max_model_len: int = typer.Option(4096, help="context limit of the engine"),
    temperature: float = typer.Option(1.0),
    dtype: str = typer.Option("float32", help="float32 on CPU, bfloat16 on GPUs"),
    kv_cache_gib: float = typer.Option(1.0, help="KV cache of the engine in GiB"),
    tool_url: list[str] = typer.Option(["http://127.0.0.1:8102"], help="tool-executor URL(s) (a running service)"),
) -> None:
    """avg@k (pass@1 averaged over k samples, with tools), pass@k and mean response length, as in the
    paper's tables: on benchmark files (--dataset), a run's held-out set (--run) or generated problems."""
    from lab.evaluate import EvalConfig, evaluate_model
    from services.orchestrator.runtime import dataset_for
    from shared.datasets import ProblemSetError, load_problems, make_splits
    from shared.formats import ModelDirError, load_format

    chosen = preset
    if run_config is not None:
        cfg, _ = load_run_config_or_exit(run_config)
        chosen = chosen or cfg.format.preset
    chosen = chosen or "rstar2"
    try:  # the model check comes first: a bad directory fails in a second, not after the engine start
        fmt = load_format(model, chosen)
    except (ModelDirError, ValueError) as exc:
        console.print(f"[red]cannot evaluate:[/red] {exc}")
        raise typer.Exit(2) from None
    console.print(f"format: {fmt.family} / preset {chosen} / tool call by {fmt.describe()['tool_call_detection']}")
    if dataset:
        try:
            held_out = load_problems(dataset)
        except ProblemSetError as exc:
            console.print(f"[red]cannot evaluate:[/red] {exc}")
            raise typer.Exit(2) from None
    elif run_config is not None:
        held_out = dataset_for(cfg)[1]
    else:
        held_out = make_splits(1, problems, seed=0)[1]
    if not held_out:
        console.print("[red]no problems to evaluate (no --dataset, and the run's dataset.eval_paths is empty)[/red]")
        raise typer.Exit(2)
    cfg_eval = EvalConfig(samples=samples, temperature=temperature, max_tokens=max_tokens, max_turns=max_turns,
                          max_model_len=max_model_len, kv_cache_gib=kv_cache_gib, preset=chosen, dtype=dtype)
    summary = asyncio.run(evaluate_model(model, held_out[:problems], tool_url, cfg_eval, fmt=fmt,
                                         progress=lambda d, n: console.print(f"{d}/{n}") if d % 20 == 0 or d == n else None))
    t = Table(show_header=False, title=f"eval of {model}")
    for k, v in summary.items():
        t.add_row(k, f"{v:.4f}" if isinstance(v, float) else str(v))
    console.print(t)
    print(json.dumps(summary))


@app.command()
def demo(
    from_scratch: bool = typer.Option(False, "--from-scratch", help="train the stage-0 model on this machine with the "
                                      "bootstrap instead of starting from the committed checkpoint"),
) -> None:
    """Run the main job on the embedded default and print a JSON summary on the last line."""
    from lab.demo import main

    sigterm_as_ctrl_c()
    main(from_scratch=from_scratch)


@model_app.command("inspect")
def model_inspect(
    model: Path = typer.Argument(..., help="Hugging Face model directory"),
    preset: str = typer.Option("rstar2", help="prompt preset: rstar2 | boxed | compact"),
    problem: str = typer.Option("What is 6 times 7?", help="a problem to render the prompt of"),
) -> None:
    """Check a model directory the way `rstar train` / `rstar eval` / the rollout do (config, tokenizer,
    chat template, what the preset needs), show the conversation format, and render one prompt and
    one tool turn. Exit 2 with every reason if the directory cannot be used."""
    from shared.formats import ModelDirError, ToolResult, load_format

    try:
        fmt = load_format(model, preset)
    except (ModelDirError, ValueError) as exc:
        console.print(f"[red]unusable:[/red] {exc}")
        raise typer.Exit(2) from None
    info = fmt.describe()
    t = Table(show_header=False, title=f"{model}")
    for k, v in info.items():
        t.add_row(k, repr(v) if k == "tool_wrap" else str(v))
    prompt_ids = fmt.prompt_ids(problem)
    t.add_row("prompt tokens", str(len(prompt_ids)))
    console.print(t)
    console.rule("prompt")
    console.print(fmt.prompt_text(problem), markup=False, highlight=False)
    console.rule("a tool turn (loss mask 0)")
    console.print(fmt.tool_response_text(ToolResult("ok", "42\n")), markup=False, highlight=False)
    print(json.dumps({**info, "prompt_tokens": len(prompt_ids)}))
