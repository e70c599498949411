"""Start a real tool executor (`rstar serve tool-executor`) on a free loopback port, for the
integration tests and the benchmark."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx


# Without root the service refuses to start unless told `insecure`: tests of the API (not of
# the isolation) still run there, explicitly insecure.
NOT_ROOT_ENV = {} if os.geteuid() == 0 else {"RSTAR_TOOL_EXECUTOR_INSECURE": "true"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunningServer:
    url: str
    port: int
    proc: subprocess.Popen

    @property
    def pid(self) -> int:
        return self.proc.pid

    def pool_parent_pids(self) -> list[int]:
        children = Path(f"/proc/{self.pid}/task/{self.pid}/children").read_text().split()
        return [int(p) for p in children]


@contextlib.contextmanager
def running_server(
    env: dict[str, str] | None = None,
    *,
    ready_timeout_s: float = 120.0,
    log_path: Path | None = None,
    wrapper: list[str] | None = None,
) -> Iterator[RunningServer]:
    """`wrapper`: a command prefix (e.g. setpriv dropping capabilities)."""
    port = free_port()
    rstar = Path(sys.executable).parent / "rstar"
    full_env = {**os.environ, "RSTAR_LOG_LEVEL": "WARNING", **(env or {})}
    log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen([*(wrapper or []), str(rstar), "serve", "tool-executor", "--port", str(port)], env=full_env, stdout=log, stderr=log if log_path else None)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"tool executor exited with status {proc.returncode} before it was ready")
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("tool executor did not become ready in time")
            time.sleep(0.1)
        yield RunningServer(url=url, port=port, proc=proc)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log_path:
            log.close()
