"""Synchronous (η = 0) vs asynchronous (η > 0) training through all five services.

Runs the same number of learner steps twice on the embedded stack — every service its own
process, as `rstar up` runs them — and reports the wall time of each run (from the run's
creation to its last step; service start-up is not counted) and how much of it the rollout
engine and the learner sat idle:

- rollout idle: fraction of 0.25 s samples of the rollout's ``/metrics`` in which its engine
  ran no request;
- learner idle: 1 − (time spent in training steps, from ``rstar_learner_step_seconds``) / wall.

With η = 0 the orchestrator admits a step's B groups only once the previous version exists, so
rollout and learner take turns; with η > 0 rollouts for the next steps overlap training.

Overlap only pays when rollout and learner do not compete for the same compute (on a cluster
they run on different devices). By default the rollout is pinned to half of the machine's cores
and the learner to the other half (``--no-split-cores``: both share every core, and on a
2-core machine the two runs then take about as long: the work is CPU-bound either way). The
first steps of the asynchronous run start later (its first admission is (η + 1)·B groups,
which share the engine), so short runs understate the steady-state gain; the default is 20
steps. Per-run output also has when each step was recorded.

By default the policy is a tiny random model (fast to create; rewards are 0, so the run keeps
all-equal groups — the compute per step is the same as with signal). ``--model DIR`` uses a
real one (e.g. the bootstrapped SFT model). Last line: one JSON object with ``sync_s``,
``async_s``, ``async_speedup`` and the idle fractions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lab.cluster import RANDOM_POLICY_OVERRIDES, cluster_for_run  # noqa: E402
from services.orchestrator.run_config import RunConfig  # noqa: E402
from services.orchestrator.runtime import create_run  # noqa: E402
from shared import stack  # noqa: E402
from shared.db.models import Run  # noqa: E402
from shared.db.session import make_engine, session_factory  # noqa: E402
from shared.settings import DEFAULT_PORTS  # noqa: E402

SAMPLE_S = 0.25


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            m = re.match(rf"{re.escape(name)}(\{{[^}}]*\}})?\s+([0-9.eE+-]+)", line)
            if m:
                total += float(m.group(2))
    return total


class Sampler(threading.Thread):
    """Samples the rollout engine's running requests and the learner's step time."""

    def __init__(self, port_offset: int):
        super().__init__(daemon=True)
        self.rollout = f"http://127.0.0.1:{DEFAULT_PORTS['rollout'] + port_offset}/metrics"
        self.learner = f"http://127.0.0.1:{DEFAULT_PORTS['learner'] + port_offset}/metrics"
        self.samples = 0
        self.rollout_busy = 0
        self.stop_flag = threading.Event()

    def learner_step_seconds(self) -> float:
        return _metric(httpx.get(self.learner, timeout=5).text, "rstar_learner_step_seconds_sum")

    def run(self) -> None:
        while not self.stop_flag.is_set():
            try:
                running = _metric(httpx.get(self.rollout, timeout=2).text, "rstar_rollout_engine_running_requests")
                self.samples += 1
                self.rollout_busy += running > 0
            except httpx.HTTPError:
                pass
            self.stop_flag.wait(SAMPLE_S)


async def _with_sessions(url: str, job):
    engine = make_engine(url)
    try:
        return await job(session_factory(engine))
    finally:
        await engine.dispose()


async def _wait(sessions, run_id: str, timeout: float) -> None:
    from sqlalchemy import select

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        async with sessions() as s:
            status = (await s.execute(select(Run.status).where(Run.run_id == run_id))).scalar_one()
        if status == "finished":
            return
        await asyncio.sleep(0.5)
    raise TimeoutError(f"run {run_id} did not finish in {timeout} s")


async def _timeline(sessions, run_id: str, t0: float) -> dict:
    """When the first group was scored and each step was recorded (seconds after ``t0``, the
    epoch time the measurement started) and what happened to the groups: how many were
    scored, trained, skipped by the learner."""
    from sqlalchemy import func, select

    from shared.db.models import LearnerStep, TrajectoryGroupRow

    async with sessions() as s:
        first = (await s.execute(select(func.min(TrajectoryGroupRow.scored_at)).where(
            TrajectoryGroupRow.run_id == run_id))).scalar_one()
        steps = (await s.execute(select(LearnerStep.created_at).where(LearnerStep.run_id == run_id)
                                 .order_by(LearnerStep.step))).scalars().all()
        groups = (await s.execute(select(
            func.count(), func.count(TrajectoryGroupRow.trained_step),
            func.count(TrajectoryGroupRow.learner_skipped)).where(TrajectoryGroupRow.run_id == run_id))).one()
    return {"first_scored_at_s": round(first.timestamp() - t0, 1),
            "step_at_s": [round(t.timestamp() - t0, 1) for t in steps],
            "groups_scored": groups[0], "groups_trained": groups[1], "groups_skipped_by_learner": groups[2]}


def split_cores(cores: set[int]) -> dict[str, set[int]]:
    """Rollout on the first half of the cores this process may use, learner on the second half
    (the light services float): two devices, as on a cluster, instead of two services fighting
    over the same cores. With one core there is nothing to split."""
    ordered = sorted(cores)
    if len(ordered) < 2:
        return {}
    half = len(ordered) // 2
    return {"rollout": set(ordered[:half]), "learner": set(ordered[half:])}


def run_once(info, state: Path, model: str, eta: int, args, port_offset: int) -> dict:
    cfg = RunConfig.model_validate(dict(
        name=f"bench-eta{eta}", model=model, dataset={"kind": "generated", "n_train": 500, "n_eval": 5, "seed": 0},
        format={"preset": "compact"},
        group_size=args.group_size, n_samples=2 * args.group_size, batch_groups=args.batch_groups, max_staleness=eta,
        lr=1e-5, warmup_steps=0, stages=[{"stage": 1, "steps": args.steps, "max_tokens": args.max_tokens, "max_turns": 3}]))
    run_id = asyncio.run(_with_sessions(info.database_url, lambda sessions: create_run(sessions, cfg)))
    env = {"RSTAR_KAFKA_BOOTSTRAP": info.kafka_bootstrap, "RSTAR_DATABASE_URL": info.database_url,
           "RSTAR_TOPIC_PREFIX": f"bench{eta}-{run_id}.", "VLLM_CPU_KVCACHE_SPACE": "1"}
    # Tasks dispatched before the rollout is up wait in the topic; timing starts once every
    # service is ready.
    overrides = {k: dict(v) for k, v in RANDOM_POLICY_OVERRIDES.items()}
    affinity = {}
    if args.split_cores:
        affinity = split_cores(os.sched_getaffinity(0))
    if affinity:
        overrides.setdefault("learner", {})["torch_threads"] = len(affinity["learner"])
    cluster = cluster_for_run(state, cfg, run_id, env=env, overrides=overrides, port_offset=port_offset,
                              cpu_affinity=affinity)
    cluster.start()
    try:
        print(f"eta={eta}: starting services...", file=sys.stderr)
        cluster.wait_ready(900)
        sampler = Sampler(port_offset)
        learner_before = sampler.learner_step_seconds()
        sampler.start()
        t0, t0_epoch = time.monotonic(), time.time()
        asyncio.run(_with_sessions(info.database_url, lambda sessions: _wait(sessions, run_id, args.timeout)))
        wall = time.monotonic() - t0
        sampler.stop_flag.set()
        sampler.join()
        learner_busy = sampler.learner_step_seconds() - learner_before
        timeline = asyncio.run(_with_sessions(info.database_url, lambda sessions: _timeline(sessions, run_id, t0_epoch)))
    finally:
        cluster.stop()
    out = {"wall_s": round(wall, 1), "rollout_idle": round(1 - sampler.rollout_busy / max(1, sampler.samples), 3),
           "learner_idle": round(max(0.0, 1 - learner_busy / wall), 3), **timeline}
    print(f"eta={eta}: {out}", file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch-groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--eta", type=int, default=2, help="staleness bound of the asynchronous run")
    ap.add_argument("--model", default=None, help="model dir (default: a tiny random model)")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--split-cores", action=argparse.BooleanOptionalAction, default=True,
                    help="pin the rollout to half of the cores and the learner to the other half (default; "
                    "--no-split-cores lets them share every core)")
    args = ap.parse_args()

    state = Path(tempfile.mkdtemp(prefix="rstar-bench-pipeline-"))
    model = args.model
    if model is None:
        from lab.tiny_model import create_random_model

        model = str(create_random_model(state / "tiny", seed=0, heads=6))
    info = stack.up(state, kafka_port=stack._free_port())
    port_offset = 30000 + os.getpid() % 500 * 10
    try:
        sync = run_once(info, state, model, 0, args, port_offset)
        asyn = run_once(info, state, model, args.eta, args, port_offset)
    finally:
        stack.down(state)
    print(f"{args.steps} steps of B={args.batch_groups} groups x {2 * args.group_size} rollouts (max {args.max_tokens} tokens):")
    print(f"  synchronous (eta=0):  {sync['wall_s']} s, rollout idle {sync['rollout_idle']:.0%}, learner idle {sync['learner_idle']:.0%}")
    print(f"  asynchronous (eta={args.eta}): {asyn['wall_s']} s, rollout idle {asyn['rollout_idle']:.0%}, learner idle {asyn['learner_idle']:.0%}")
    print(json.dumps({
        "sync_s": sync["wall_s"], "async_s": asyn["wall_s"], "async_speedup": round(sync["wall_s"] / asyn["wall_s"], 2),
        "sync_rollout_idle": sync["rollout_idle"], "sync_learner_idle": sync["learner_idle"],
        "async_rollout_idle": asyn["rollout_idle"], "async_learner_idle": asyn["learner_idle"],
        "steps": args.steps, "eta": args.eta, "split_cores": args.split_cores,
    }))


if __name__ == "__main__":
    main()
