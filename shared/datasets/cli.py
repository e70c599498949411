"""``rstar data ...`` (mounted by :mod:`services.cli`): looking at problem-set files.

``rstar data inspect FILE [FILE...] [--field prompt=PATH ...] [--examples N]`` loads the files
as a run would (schema detection or the given field mapping, de-duplication), but skips bad
rows instead of failing on them, and prints — as rich tables on stderr — the schema and row
figures of each file, the answer kinds with an example each, the first bad rows and conflicting
answers, and a few example problems; the last stdout line is one JSON object with the figures
(``ProblemSetReport.summary()``). Exit status 2 when a file cannot be loaded at all.

Light imports only (pyarrow, rich, typer): no torch, vLLM or transformers.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from shared.datasets.problem import Problem

app = typer.Typer(help="Problem-set files: what they load as.", no_args_is_help=True)
console = Console(stderr=True)


@app.callback()
def _data() -> None:
    """Problem-set files: what they load as."""  # a callback keeps `inspect` a sub-command


def _short(text: str, limit: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


@app.command("inspect")
def inspect_cmd(
    files: list[Path] = typer.Argument(..., help="JSONL / JSON / Parquet problem-set files (loaded together, in order)"),
    field: list[str] = typer.Option(
        [], "--field", "-f",
        help="explicit field mapping instead of schema detection: KEY=DOTTED.PATH, KEY one of prompt, answer, id "
             "(prompt and answer both needed), e.g. --field prompt=data.question --field answer=reward_model.ground_truth"),
    examples: int = typer.Option(3, "--examples", "-n", min=0, help="example problems to show"),
) -> None:
    """Print the detected schema, rows, distinct problems, duplicates, answer kinds and examples."""
    from shared.datasets.answers import answer_kind
    from shared.datasets.files import ProblemSetError, load_problem_set

    try:
        problem_set = load_problem_set(files, fields=field or None, on_bad_row="skip", dedupe=True)
    except ProblemSetError as exc:
        console.print("[red]cannot load:[/red]")
        console.print(str(exc), markup=False, highlight=False)
        raise typer.Exit(2) from None
    except ValueError as exc:  # a malformed --field
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    report = problem_set.report

    t = Table(title="problem-set files")
    for col in ("file", "schema", "rows", "problems", "duplicates", "bad rows skipped"):
        t.add_column(col, justify="left" if col in ("file", "schema") else "right", overflow="fold")
    for f in report.files:
        t.add_row(f.path, f.schema, str(f.rows), str(f.problems), str(f.duplicates), str(f.skipped))
    if len(report.files) > 1:
        t.add_row("total", "", str(report.rows), str(report.problems), str(report.duplicates), str(report.skipped))
    console.print(t)

    first_of_kind: dict[str, Problem] = {}  # in file order: the examples show these first
    for p in problem_set.problems:
        first_of_kind.setdefault(answer_kind(p.answer), p)
    k = Table(title="answer kinds (distinct problems)")
    k.add_column("kind")
    k.add_column("problems", justify="right")
    k.add_column("example")
    for kind, count in report.answer_kinds.items():
        k.add_row(kind, str(count), _short(first_of_kind[kind].answer, 40))
    console.print(k)

    if report.conflicting_answers:
        console.print(f"[yellow]{report.conflicting_answers} duplicate(s) with another answer "
                      "than the kept row[/yellow] (first kept):")
        for w in report.warnings:
            console.print(f"  {w}", markup=False, highlight=False, soft_wrap=True)
    if report.skipped:
        console.print(f"[yellow]{report.skipped} bad row(s)[/yellow] (a run fails on them unless "
                      "dataset.on_bad_row is skip):")
        for e in report.skipped_rows:
            console.print(f"  {e}", markup=False, highlight=False, soft_wrap=True)

    if examples:
        # The first problem of each answer kind first (to show the variety), then in file order.
        chosen = list(first_of_kind.values())[:examples]
        chosen += itertools.islice((p for p in problem_set.problems if p not in chosen), examples - len(chosen))
        e = Table(title="examples (the problem as the policy sees it, the gold answer)")
        e.add_column("id", overflow="fold")
        e.add_column("problem")
        e.add_column("answer")
        for p in chosen:
            e.add_row(_short(p.problem_id, 40), _short(p.prompt, 160), _short(p.answer, 40))
        console.print(e)

    print(json.dumps(report.summary()))
