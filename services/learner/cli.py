"""``rstar learner ...`` commands (typer): stage-0 SFT from the command line.

Also runnable without the ``rstar`` entry point: ``python -m services.learner.cli sft ...``.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(help="Learner: stage-0 SFT (the RL learner itself runs with `rstar serve learner`).",
                  no_args_is_help=True)


@app.callback()
def _group() -> None:
    """Keep ``sft`` a sub-command even while it is the only one."""


@app.command()
def sft(
    model_dir: Path = typer.Argument(..., help="HF model directory to start from"),
    traces: Path = typer.Argument(..., help="JSONL of traces: token ids + loss_mask, text_segments, or chat messages "
                                            "with tool calls (OpenAI style)"),
    out_dir: Path = typer.Argument(..., help="output model directory (must not exist)"),
    steps: Optional[int] = typer.Option(None, help="optimizer steps"),
    time_budget_s: Optional[float] = typer.Option(None, help="wall-clock budget of the training loop"),
    lr: float = typer.Option(2e-3, help="peak learning rate"),
    warmup_steps: int = typer.Option(50, help="linear warm-up steps"),
    batch_tokens: int = typer.Option(8192, help="tokens per optimizer step"),
    row_tokens: int = typer.Option(256, help="packed row length (0: one row per micro-batch)"),
    micro_batch_tokens: Optional[int] = typer.Option(None, help="tokens per micro-batch (default: batch_tokens)"),
    seed: int = typer.Option(0),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
    threads: int = typer.Option(0, help="torch CPU threads (0: default)"),
    log_every: int = typer.Option(10, help="print a progress line every N steps"),
    preset: str = typer.Option("rstar2", help="prompt preset of chat-message rows (their tool's name and description)"),
) -> None:
    """Supervised fine-tuning on loss-masked traces; prints the summary as JSON on the last line."""
    from services.learner.sft import train_sft

    def log(rec: dict[str, float]) -> None:
        if int(rec["step"]) % log_every == 0:
            typer.echo(f"step {int(rec['step'])} loss {rec['loss']:.4f} lr {rec['lr']:.2e} "
                       f"tok/s {rec['tokens_per_s']:.0f} elapsed {rec['elapsed_s']:.0f}s", err=True)

    summary = train_sft(model_dir, traces, out_dir, steps=steps, time_budget_s=time_budget_s, lr=lr,
                        warmup_steps=warmup_steps, batch_tokens=batch_tokens, row_tokens=row_tokens,
                        micro_batch_tokens=micro_batch_tokens, seed=seed, device=device, threads=threads,
                        preset=preset, log=log)
    out = asdict(summary)
    out.pop("loss_curve")
    typer.echo(json.dumps(out))


@app.command()
def traces(
    model_dir: Path = typer.Argument(..., help="HF model directory whose conversation format renders the traces"),
    out: Path = typer.Argument(..., help="output JSONL (token ids + loss_mask rows for `rstar learner sft`)"),
    problems: int = typer.Option(2000, help="generated training problems, one trace each"),
    copy_drills: int = typer.Option(0, help="copy drills mixed in (useful for a tiny model only)"),
    preset: str = typer.Option("rstar2", help="prompt preset: rstar2 | boxed | compact"),
    seed: int = typer.Option(0),
) -> None:
    """Stage-0 tool-use traces of generated problems, rendered through MODEL_DIR's format."""
    from shared.datasets import generate_problems, sft_traces
    from shared.formats import ModelDirError, load_format

    try:
        fmt = load_format(model_dir, preset)
    except ModelDirError as exc:
        typer.echo(f"cannot write traces: {exc}", err=True)
        raise typer.Exit(2) from None
    rows = sft_traces.make_traces(generate_problems(problems, seed=seed, split="train"), seed=seed)
    rows += sft_traces.make_copy_drills(copy_drills, seed=seed)
    sft_traces.write_traces_jsonl(rows, fmt, out)
    typer.echo(json.dumps({"out": str(out), "traces": len(rows), "format": fmt.family, "preset": preset}))


def main() -> None:  # pragma: no cover
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
