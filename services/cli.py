"""The ``rstar`` command (typer + rich).

Foundation commands live here: ``serve`` (one service in the foreground), ``stack`` (the
embedded broker and database) and ``db``. Services and the orchestrator add their own
sub-commands through :data:`EXTENSIONS` (imported lazily so ``rstar stack up`` never imports
torch or vLLM).
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from shared.settings import DEFAULT_STATE_DIR

app = typer.Typer(help="rStar2-Agent pipeline: agentic RL services over Kafka and PostgreSQL.", no_args_is_help=True)
stack_app = typer.Typer(help="The embedded broker and database (local default).", no_args_is_help=True)
db_app = typer.Typer(help="Database migrations.", no_args_is_help=True)
app.add_typer(stack_app, name="stack")
app.add_typer(db_app, name="db")
console = Console(stderr=True, soft_wrap=True)

# service name on the command line → python module under services/
SERVICES = {
    "orchestrator": "orchestrator",
    "rollout": "rollout",
    "tool-executor": "tool_executor",
    "reward": "reward",
    "learner": "learner",
}

# Sub-apps other packages contribute: (module, attribute, name on the command line).
EXTENSIONS = [
    ("services.reward.cli", "app", "replay"),
    ("services.learner.cli", "app", "learner"),
    ("services.orchestrator.cli", "app", None),  # None: its commands join the top level
    ("lab.cli", "app", None),
    ("lab.cli", "model_app", "model"),
    ("shared.datasets.cli", "app", "data"),
]


def settings_class(name: str):
    """A service's Settings class (its config module only); KeyError for an unknown name."""
    return importlib.import_module(f"services.{SERVICES[name]}.config").Settings


def load_service(name: str):
    """(SettingsCls, build_service) for a service name, with a clear error for a bad name."""
    module = SERVICES.get(name)
    if module is None:
        raise typer.BadParameter(f"unknown service {name!r}; choose one of {', '.join(SERVICES)}")
    runtime = importlib.import_module(f"services.{module}.runtime")
    return settings_class(name), runtime.build_service


@app.command()
def serve(
    name: str = typer.Argument(..., help="orchestrator | rollout | tool-executor | reward | learner"),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="YAML settings file"),
    port: Optional[int] = typer.Option(None, "--port", "-p", help="HTTP port"),
) -> None:
    """Start one service in the foreground (settings from RSTAR_* env and --config)."""
    from shared.runtime import serve as run
    from shared.settings import load_settings

    settings_cls, build_service = load_service(name)
    settings = _settings_or_exit(load_settings, settings_cls, config, port=port)
    if name == "learner" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Started by torchrun: one process per device, rank 0 serves (services/learner/multi_device.py).
        from services.learner.multi_device import run_ranks

        run_ranks(settings)
        return
    run(build_service(settings), settings)


def _settings_or_exit(load, *args, **kw):
    """Settings errors are the operator's to fix: one clear line, no traceback."""
    from pydantic import ValidationError

    try:
        return load(*args, **kw)
    except (FileNotFoundError, ValueError, ValidationError) as exc:
        console.print(f"[red]invalid settings:[/red] {exc}")
        raise typer.Exit(2) from None


@stack_app.command("up")
def stack_up(
    state_dir: Path = typer.Option(DEFAULT_STATE_DIR, "--state-dir", envvar="RSTAR_STATE_DIR"),
    kafka_port: Optional[int] = typer.Option(None, "--kafka-port", envvar="RSTAR_KAFKA_PORT"),
) -> None:
    """Start the broker and PostgreSQL (unless RSTAR_KAFKA_BOOTSTRAP / RSTAR_DATABASE_URL are set), migrate."""
    from shared import stack

    with console.status("starting the embedded stack..."):
        info = stack.up(state_dir, kafka_port=kafka_port)
    console.print(f"[green]stack up[/green] (state in {info.state_dir})")
    print(f"RSTAR_KAFKA_BOOTSTRAP={info.kafka_bootstrap}")
    print(f"RSTAR_DATABASE_URL={info.database_url}")


@stack_app.command("down")
def stack_down(state_dir: Path = typer.Option(DEFAULT_STATE_DIR, "--state-dir", envvar="RSTAR_STATE_DIR")) -> None:
    """Stop the broker and PostgreSQL started by `rstar stack up`."""
    from shared import stack

    if stack.down(state_dir):
        console.print("[green]stack down[/green]")
    else:
        console.print(f"no stack recorded under {state_dir}")


@stack_app.command("status")
def stack_status(state_dir: Path = typer.Option(DEFAULT_STATE_DIR, "--state-dir", envvar="RSTAR_STATE_DIR")) -> None:
    """Show the embedded stack's addresses and whether they answer."""
    from shared import stack

    st = stack.status(state_dir)
    table = Table(show_header=False)
    for k, v in st.items():
        table.add_row(k, str(v))
    console.print(table)
    print(json.dumps(st))
    raise typer.Exit(0 if st.get("running") else 1)


@db_app.command("upgrade")
def db_upgrade(url: Optional[str] = typer.Option(None, envvar="RSTAR_DATABASE_URL"), revision: str = "head") -> None:
    """Run Alembic migrations up to REVISION."""
    from shared.db.session import upgrade
    from shared.settings import ServiceSettings, load_settings

    target = url or load_settings(ServiceSettings).database_url
    asyncio.run(upgrade(target, revision))
    console.print(f"[green]migrated to {revision}[/green]")


def settings_reference() -> str:
    """Markdown reference of every setting of every service (docs/configuration.md)."""
    from shared.settings import ServiceSettings

    common = set(ServiceSettings.model_fields) - {"port"}
    out = ["# Configuration reference", "",
           "Generated by `rstar config > docs/configuration.md`. Precedence: flags > environment > YAML (`--config`) > "
           "embedded stack file > defaults. A YAML file takes flat keys or a section per service.", "",
           "## Common (every service)", "", "| setting | env | default | description |", "|---|---|---|---|"]
    for name in sorted(common):
        f = ServiceSettings.model_fields[name]
        default = f.default if "instance_id" != name else "<host>-<pid>-<random>"
        out.append(f"| `{name}` | `RSTAR_{name.upper()}` | `{default}` | {f.description or ''} |")
    for svc, module in SERVICES.items():
        cls = importlib.import_module(f"services.{module}.config").Settings
        prefix = cls.model_config["env_prefix"]
        out += ["", f"## {svc}", "", "| setting | env | default | description |", "|---|---|---|---|"]
        for name, f in cls.model_fields.items():
            if name in common:
                continue
            out.append(f"| `{name}` | `{prefix}{name.upper()}` | `{f.default}` | {(f.description or '').replace('|', '/')} |")
    return "\n".join(out) + "\n"


@app.command("config")
def config_reference() -> None:
    """Print every setting of every service (name, env variable, default, description) as Markdown."""
    print(settings_reference(), end="")


def _mount_extensions() -> None:
    for module, attr, name in EXTENSIONS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name == module:  # not written yet
                continue
            raise
        sub = getattr(mod, attr)
        if name is None:
            for cmd in sub.registered_commands:
                app.registered_commands.append(cmd)
            for grp in sub.registered_groups:
                app.registered_groups.append(grp)
        else:
            app.add_typer(sub, name=name)


def main() -> None:
    _mount_extensions()
    app()


if __name__ == "__main__":
    main()
