"""The service runtime over real HTTP: health, readiness following the broker, metrics,
heartbeats, and `rstar serve` as a subprocess."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
from sqlalchemy import select

from shared import stack as stack_mod
from shared.db.models import ServiceInstance
from shared.db.session import session_factory
from shared.runtime import Service, run_service
from shared.settings import ServiceSettings, load_settings, service_config

pytestmark = pytest.mark.integration


class ProbeSettings(ServiceSettings):
    model_config = service_config("PROBE")
    service_name: ClassVar[str] = "probe"


class ProbeService(Service):
    name = "probe"


async def _get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.get(url)


async def _wait_status(url: str, status: int, timeout: float = 30.0) -> httpx.Response:
    deadline = asyncio.get_running_loop().time() + timeout
    last = None
    while asyncio.get_running_loop().time() < deadline:
        try:
            last = await _get(url)
            if last.status_code == status:
                return last
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError(f"{url} never answered {status}; last: {last and (last.status_code, last.text)}")


async def test_readyz_follows_the_broker_without_restart(stack, topic_prefix, db_engine):
    # A broker of its own, so stopping it does not disturb other tests.
    state = Path(tempfile.mkdtemp(prefix="rstar-readyz-"))
    port = stack_mod._free_port()
    bootstrap, pid = stack_mod.start_broker(state, port)
    http_port = stack_mod._free_port()
    settings = load_settings(ProbeSettings, kafka_bootstrap=bootstrap, database_url=stack.database_url,
                             topic_prefix=topic_prefix, port=http_port, heartbeat_s=0.5)
    svc = ProbeService(settings)
    task = asyncio.create_task(run_service(svc, settings, install_signals=False))
    base = f"http://127.0.0.1:{http_port}"
    try:
        r = await _wait_status(f"{base}/readyz", 200)
        assert r.json()["checks"] == {"kafka": True, "database": True}
        assert (await _get(f"{base}/healthz")).json()["status"] == "ok"
        metrics = (await _get(f"{base}/metrics")).text
        assert 'rstar_service_up{service="probe"} 1.0' in metrics

        stack_mod.stop_pid(pid)
        r = await _wait_status(f"{base}/readyz", 503)
        assert r.json()["checks"]["kafka"] is False
        assert (await _get(f"{base}/healthz")).status_code == 200  # alive, just not ready

        bootstrap2, pid = stack_mod.start_broker(state, port)
        r = await _wait_status(f"{base}/readyz", 200)
        assert r.json()["ready"] is True

        # Heartbeats land in service_instances.
        async with session_factory(db_engine)() as s:
            row = (await s.execute(select(ServiceInstance).where(ServiceInstance.instance_id == settings.instance_id))).scalar_one()
        assert row.service == "probe" and row.status == "up" and row.port == http_port
    finally:
        svc.request_stop()
        await asyncio.wait_for(task, 30)
        stack_mod.stop_pid(pid)
    async with session_factory(db_engine)() as s:
        row = (await s.execute(select(ServiceInstance).where(ServiceInstance.instance_id == settings.instance_id))).scalar_one()
    assert row.status == "stopped"


def test_rstar_cli_rejects_unknown_service_and_bad_config(tmp_path):
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "nope"], capture_output=True, text=True)
    assert r.returncode != 0 and "unknown service" in r.stderr
    bad = tmp_path / "c.yaml"
    bad.write_text("- just\n- a list\n")
    r = subprocess.run([sys.executable, "-m", "services.cli", "serve", "reward", "--config", str(bad)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "must hold a mapping" in r.stderr and "Traceback" not in r.stderr


def test_rstar_stack_up_status_down(tmp_path):
    env = {**os.environ, "RSTAR_STATE_DIR": str(tmp_path / "st"), "RSTAR_KAFKA_PORT": str(stack_mod._free_port())}
    env.pop("RSTAR_KAFKA_BOOTSTRAP", None)
    env.pop("RSTAR_DATABASE_URL", None)
    cli = [sys.executable, "-m", "services.cli", "stack"]
    try:
        up = subprocess.run([*cli, "up"], capture_output=True, text=True, env=env, timeout=120)
        assert up.returncode == 0, up.stderr
        assert "RSTAR_KAFKA_BOOTSTRAP=127.0.0.1:" in up.stdout and "RSTAR_DATABASE_URL=postgresql+asyncpg://" in up.stdout
        again = subprocess.run([*cli, "up"], capture_output=True, text=True, env=env, timeout=120)
        assert again.returncode == 0 and again.stdout == up.stdout  # idempotent: same addresses
        st = subprocess.run([*cli, "status"], capture_output=True, text=True, env=env, timeout=60)
        assert st.returncode == 0 and '"kafka_reachable": true' in st.stdout and '"database_running": true' in st.stdout
    finally:
        down = subprocess.run([*cli, "down"], capture_output=True, text=True, env=env, timeout=60)
    assert down.returncode == 0
    st = subprocess.run([*cli, "status"], capture_output=True, text=True, env=env, timeout=60)
    assert st.returncode == 1 and '"running": false' in st.stdout
