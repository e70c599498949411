"""`rstar up`: every service as a supervised local process on the embedded stack.

Each service runs as ``python -m services.cli serve NAME --config <system yaml>`` with its log
in ``<state_dir>/logs/NAME.log``. The supervisor restarts a service that exits unexpectedly
(backoff doubling up to 30 s) and stops all of them with SIGTERM (then SIGKILL after a grace
period) on Ctrl-C or `rstar down`. Pids are recorded in ``<state_dir>/cluster.json``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import orjson
import yaml

from shared.settings import DEFAULT_PORTS
from shared.stack import _pid_alive, stop_pid

# Start order: dependencies first (rollout needs the tool-executor; everything needs the stack).
SERVICE_ORDER = ("tool-executor", "reward", "learner", "rollout", "orchestrator")
RESTART_BACKOFF_MAX_S = 30.0
STOP_GRACE_S = 20.0


@dataclass
class Managed:
    name: str
    port: int
    log: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0
    next_restart: float = 0.0
    backoff: float = 1.0


def write_system_config(path: Path, sections: dict[str, dict], base: dict | None = None) -> Path:
    """A system YAML: flat keys from ``base`` plus a section per service."""
    data = dict(base or {})
    for name, values in sections.items():
        data.setdefault(name, {}).update({k: (str(v) if isinstance(v, Path) else v) for k, v in values.items()})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=True))
    return path


@dataclass
class LocalCluster:
    state_dir: Path
    config_file: Path | None = None
    services: tuple[str, ...] = SERVICE_ORDER
    env: dict[str, str] = field(default_factory=dict)
    name: str = "cluster"  # several clusters can share a state dir (the demo starts tools first)
    port_offset: int = 0  # added to every default port (tests run clusters beside other ones)
    # service -> CPU cores it (and every process it starts) may run on; unlisted: any core.
    # Gives services disjoint compute on one machine, as separate devices would on a cluster.
    cpu_affinity: dict[str, set[int]] = field(default_factory=dict)
    managed: dict[str, Managed] = field(default_factory=dict)

    @property
    def record(self) -> Path:
        return self.state_dir / f"{self.name}.json"

    def _spawn(self, m: Managed) -> None:
        cmd = [sys.executable, "-m", "services.cli", "serve", m.name, "--port", str(m.port)]
        if self.config_file:
            cmd += ["--config", str(self.config_file)]
        env = {**os.environ, **self.env, "PYTHONUNBUFFERED": "1"}
        with open(m.log, "ab") as log:
            log.write(f"\n=== start {time.strftime('%H:%M:%S')} {' '.join(cmd)}\n".encode())
            cores = self.cpu_affinity.get(m.name)
            m.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=env, start_new_session=True,
                                      preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores else None)

    def _save(self) -> None:
        self.record.write_bytes(orjson.dumps({n: m.proc.pid for n, m in self.managed.items() if m.proc}))

    def start(self) -> None:
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for name in self.services:
            m = Managed(name, DEFAULT_PORTS[name] + self.port_offset, logs / f"{name}.log")
            self.managed[name] = m
            self._spawn(m)
        self._save()

    def wait_ready(self, timeout: float = 300.0, on_wait=None) -> None:
        """Block until every service answers /readyz 200; raise with the log tail of a dead one."""
        deadline = time.monotonic() + timeout
        pending = set(self.managed)
        while pending:
            for name in list(pending):
                m = self.managed[name]
                if m.proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {m.proc.returncode} during start-up:\n{tail(m.log)}")
                try:
                    if httpx.get(f"http://127.0.0.1:{m.port}/readyz", timeout=3).status_code == 200:
                        pending.discard(name)
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout:.0f} s: {sorted(pending)}")
            if on_wait:
                on_wait(sorted(pending))
            time.sleep(0.5)

    def supervise_once(self) -> list[str]:
        """Restart services that died; return the names restarted."""
        restarted = []
        now = time.monotonic()
        for m in self.managed.values():
            if m.proc is not None and m.proc.poll() is not None and now >= m.next_restart:
                m.restarts += 1
                m.next_restart = now + m.backoff
                m.backoff = min(RESTART_BACKOFF_MAX_S, m.backoff * 2)
                self._spawn(m)
                restarted.append(m.name)
        if restarted:
            self._save()
        return restarted

    def stop(self, names: tuple[str, ...] | None = None) -> None:
        targets = [self.managed[n] for n in (names or tuple(reversed(self.services))) if n in self.managed]
        for m in targets:
            if m.proc and m.proc.poll() is None:
                m.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for m in targets:
            if m.proc is None:
                continue
            try:
                m.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(m.proc.pid, signal.SIGKILL)
                m.proc.wait()
        if names is None:
            self.record.unlink(missing_ok=True)


# For tests and benchmarks that drive the pipeline with a random policy: it earns no reward, so
# keep its all-equal groups and train on them anyway (zero gradient, but every step, version
# and weight update happens), on a small engine.
RANDOM_POLICY_OVERRIDES: dict[str, dict] = {
    "reward": {"drop_all_equal": False},
    "learner": {"skip_zero_advantage_groups": False},
    "rollout": {"kv_cache_gib": 0.5, "max_model_len": 1024, "enforce_eager": True},
    "orchestrator": {"tick_s": 0.3},
}


def cluster_for_run(state_dir: Path, run_cfg, run_id: str, *, services: tuple[str, ...] = SERVICE_ORDER,
                    overrides: dict[str, dict] | None = None, env: dict[str, str] | None = None,
                    port_offset: int = 0, name: str = "cluster",
                    cpu_affinity: dict[str, set[int]] | None = None) -> LocalCluster:
    """A cluster whose services follow ``run_cfg``: the reward keeps G, the learner steps on B
    groups with η, trains ``run_id`` only into a checkpoint dir of its own, and the rollout
    serves the run's model and versions and calls this cluster's tool-executor."""
    sections = run_cfg.service_settings()
    sections["learner"].update(run_id=run_id, checkpoint_dir=str(state_dir / "runs" / run_id / "checkpoints"))
    sections["rollout"].update(run_id=run_id, tool_executor_urls=[f"http://127.0.0.1:{DEFAULT_PORTS['tool-executor'] + port_offset}"])
    for section, values in (overrides or {}).items():
        sections.setdefault(section, {}).update(values)
    system = write_system_config(state_dir / "runs" / run_id / "system.yaml", sections)
    return LocalCluster(state_dir, system, services=services, env=dict(env or {}), name=name, port_offset=port_offset,
                        cpu_affinity=dict(cpu_affinity or {}))


def stop_recorded(state_dir: Path) -> list[str]:
    """`rstar down`: stop the services a (possibly gone) `rstar up` recorded."""
    pids: dict[str, int] = {}
    records = list(state_dir.glob("cluster*.json"))
    for record in records:
        pids.update(orjson.loads(record.read_bytes()))
    for pid in pids.values():
        if _pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
    for pid in pids.values():
        stop_pid(pid, timeout=STOP_GRACE_S)
    for record in records:
        record.unlink(missing_ok=True)
    return list(pids)


def tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"
