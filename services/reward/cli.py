"""``rstar replay ...`` (mounted by :mod:`services.cli`): replays of stored streams."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

app = typer.Typer(help="Replay stored event streams (the originals stay untouched).", no_args_is_help=True)
console = Console(stderr=True)


@app.command("rescore")
def rescore_cmd(
    from_run: str = typer.Option(..., "--from-run", help="run whose trajectory groups are rescored"),
    to_run: Optional[str] = typer.Option(None, "--to-run", help="new run id: publish and record under it"),
    to_topic: Optional[str] = typer.Option(None, "--to-topic", help="topic to publish to (default: the scored topic)"),
    mode: Optional[str] = typer.Option(None, "--mode", help="roc | deterministic | grpo (default: settings)"),
    group_size: Optional[int] = typer.Option(None, "--group-size", "-G", help="kept per group (default: settings)"),
    source_topic: Optional[str] = typer.Option(None, "--source-topic", help="default: the trajectories topic"),
    start_offset: Optional[int] = typer.Option(None, "--start-offset", help="first offset, every partition"),
    end_offset: Optional[int] = typer.Option(None, "--end-offset", help="stop before this offset, every partition"),
    start_time: Optional[datetime] = typer.Option(None, "--start-time", help="ISO time: skip records before it"),
    end_time: Optional[datetime] = typer.Option(None, "--end-time", help="ISO time: skip records at/after it"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML settings file"),
) -> None:
    """Rescore a run's trajectory groups with another RoC mode/config into a new run or topic."""
    from services.reward.config import Settings
    from services.reward.replay import ReplayError, rescore
    from shared.logging import configure_logging
    from shared.settings import load_settings

    settings = load_settings(Settings, config)
    configure_logging("reward-replay", settings.log_level, json=settings.log_json)
    try:
        summary = asyncio.run(
            rescore(
                settings,
                from_run=from_run,
                to_run=to_run,
                to_topic=to_topic,
                source_topic=source_topic,
                roc_mode=mode,
                group_size=group_size,
                start_offset=start_offset,
                end_offset=end_offset,
                start_time=start_time,
                end_time=end_time,
            )
        )
    except ReplayError as exc:
        console.print(f"[red]error:[/red] {exc}")
        raise typer.Exit(2) from exc
    console.print(
        f"[green]rescored[/green] {summary['matched']} groups of {from_run}: "
        f"{summary['published']} published, {summary['dropped_all_equal']} dropped (all equal), "
        f"{summary['duplicate']} already done, {summary['malformed']} malformed → {summary['to_topic']}"
    )
    print(json.dumps(summary))
