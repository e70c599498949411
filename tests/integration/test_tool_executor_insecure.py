"""Where namespaces cannot be created, the service refuses to start unless told `insecure`,
and then says so in its logs and /readyz. No privileges are simulated by dropping
CAP_SYS_ADMIN from the capability bounding set (setpriv), which makes unshare() fail."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from services.tool_executor.testing import free_port, running_server

SETPRIV = shutil.which("setpriv")
NO_SYS_ADMIN = [SETPRIV or "setpriv", "--bounding-set", "-sys_admin", "--inh-caps", "-sys_admin"]
ENV = {"RSTAR_TOOL_EXECUTOR_WORKERS": "1", "RSTAR_TOOL_EXECUTOR_SLOTS_PER_WORKER": "2", "RSTAR_TOOL_EXECUTOR_UID_BASE": "340000"}

pytestmark = pytest.mark.skipif(SETPRIV is None or os.geteuid() != 0, reason="needs root and setpriv to simulate missing privileges")


def test_refuses_to_start_without_isolation():
    rstar = Path(sys.executable).parent / "rstar"
    proc = subprocess.run(
        [*NO_SYS_ADMIN, str(rstar), "serve", "tool-executor", "--port", str(free_port())],
        env={**os.environ, **ENV},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert "sandbox_not_isolated_refusing_to_start" in proc.stderr
    assert "RSTAR_TOOL_EXECUTOR_INSECURE" in proc.stderr


def test_insecure_setting_serves_and_says_so(tmp_path):
    log = tmp_path / "server.log"
    with running_server({**ENV, "RSTAR_TOOL_EXECUTOR_INSECURE": "true"}, wrapper=NO_SYS_ADMIN, log_path=log) as server:
        ready = httpx.get(f"{server.url}/readyz").json()
        assert ready["ready"] and ready["checks"]["insecure_sandbox"] is True and "sandbox_isolated" not in ready["checks"]
        assert httpx.get(f"{server.url}/healthz").json()["secure"] is False
        r = httpx.post(f"{server.url}/v1/execute", json={"code": "print(1 + 1)"}, timeout=30).json()
        assert (r["status"], r["stdout"]) == ("ok", "2\n")
    assert "sandbox_insecure" in log.read_text()
