"""Orchestrator commands of the `rstar` CLI (mounted at the top level by services/cli.py)."""

from __future__ import annotations

import typer

app = typer.Typer()


@app.command()
def demo() -> None:
    """Run the main job on the embedded default and print a JSON summary on the last line."""
    from services.orchestrator.demo import main

    main()
