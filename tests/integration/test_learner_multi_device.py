"""The learner service on two CPU processes (torchrun, gloo, FSDP2) against the real broker and
PostgreSQL: scored groups in, weight versions out, recorded in the database; SIGTERM to rank 0
stops both ranks cleanly; the restart resumes on both ranks; the checkpoints equal those of the
single-device engine on the same groups."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from sqlalchemy import select

from services.learner.config import Settings
from services.learner.engine import EngineConfig, LearnerEngine
from shared import stack as stack_mod
from shared import topics
from shared.checkpoint import path_from_uri, verify_checkpoint
from shared.db.models import LearnerStep, PolicyVersion, ServiceInstance
from shared.db.session import make_engine, session_factory
from shared.kafka import EventProducer, ensure_topics
from shared.settings import load_settings
from test_learner_service import _group, _weights, tiny_model_dir  # noqa: F401 - fixture

pytestmark = pytest.mark.integration

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
REPO = Path(__file__).resolve().parents[2]


def _learner_env(stack, topic_prefix: str, model_dir: Path, ckpt: Path, run: str, port: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RSTAR_")}
    env.update({
        "RSTAR_KAFKA_BOOTSTRAP": stack.kafka_bootstrap, "RSTAR_DATABASE_URL": stack.database_url,
        "RSTAR_TOPIC_PREFIX": topic_prefix, "RSTAR_STATE_DIR": str(ckpt.parent / "state"),
        "RSTAR_HEARTBEAT_S": "1", "RSTAR_LOG_JSON": "false",
        "RSTAR_LEARNER_PORT": str(port), "RSTAR_LEARNER_MODEL_DIR": str(model_dir),
        "RSTAR_LEARNER_CHECKPOINT_DIR": str(ckpt), "RSTAR_LEARNER_RUN_ID": run,
        "RSTAR_LEARNER_GROUPS_PER_STEP": "2", "RSTAR_LEARNER_MAX_STALENESS": "1", "RSTAR_LEARNER_LR": "1e-3",
        "RSTAR_LEARNER_WARMUP_STEPS": "0", "RSTAR_LEARNER_DEVICE": "cpu", "RSTAR_LEARNER_TORCH_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO),
    })
    return env


RSTAR = str(Path(sys.executable).with_name("rstar"))
# The two ways to launch the ranks: the module, and `rstar serve learner` (which sees WORLD_SIZE).
ENTRY_MODULE = ["-m", "services.learner.multi_device"]
ENTRY_RSTAR = [RSTAR, "serve", "learner"]


def _start(env: dict, instance: str, log_path: Path, entry: list[str] = ENTRY_MODULE) -> subprocess.Popen:
    return subprocess.Popen(
        [TORCHRUN, "--standalone", "--nproc-per-node", "2", *entry],
        cwd=REPO, env={**env, "RSTAR_INSTANCE_ID": instance}, stdout=log_path.open("w"), stderr=subprocess.STDOUT,
        start_new_session=True,  # a process group of its own: a failed test kills the ranks too
    )


async def _rank0_pid(sessions, instance: str, launcher: subprocess.Popen, log_path: Path) -> int:
    for _ in range(600):
        async with sessions() as s:
            row = (await s.execute(select(ServiceInstance).where(ServiceInstance.instance_id == instance))).scalar()
        if row is not None and row.status == "up":
            return row.pid
        assert launcher.poll() is None, f"torchrun exited early:\n{log_path.read_text()[-4000:]}"
        await asyncio.sleep(0.5)
    raise AssertionError(f"rank 0 never sent a heartbeat:\n{log_path.read_text()[-4000:]}")


async def _sigterm_rank0_and_wait(pid: int, launcher: subprocess.Popen, log_path: Path) -> str:
    os.kill(pid, signal.SIGTERM)
    rc = await asyncio.to_thread(launcher.wait, 180)  # a bound against a hang, not a timing check
    log = log_path.read_text()
    assert rc == 0, f"torchrun exited {rc}:\n{log[-4000:]}"
    return log


def _single_device_checkpoints(settings: Settings, ckpt: Path, steps: list[list]) -> Path:
    cfg = EngineConfig.from_settings(settings)
    cfg.checkpoint_dir = ckpt
    engine = LearnerEngine.open(cfg)
    for groups in steps:
        for g in groups:
            engine.offer(g)
        engine.train_step()
    return ckpt


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        # AdamW's first update is ≈ lr·sign(g): where a gradient entry is ~0, float noise from the
        # different summation order flips it; 1e-4 is a tenth of lr
        assert torch.allclose(wa[k], wb[k], atol=1e-4), k


async def test_two_process_learner_service_trains_publishes_stops_and_resumes(stack, topic_prefix, tiny_model_dir,  # noqa: F811
                                                                                tmp_path):
    run = f"multi-{topic_prefix}"
    ckpt, port = tmp_path / "ckpt", stack_mod._free_port()
    env = _learner_env(stack, topic_prefix, tiny_model_dir, ckpt, run, port)
    settings = load_settings(Settings, kafka_bootstrap=stack.kafka_bootstrap, database_url=stack.database_url,
                             topic_prefix=topic_prefix, model_dir=tiny_model_dir, checkpoint_dir=ckpt, run_id=run,
                             groups_per_step=2, max_staleness=1, lr=1e-3, warmup_steps=0, device="cpu")
    scored_topic, weights_topic = settings.topic(topics.SCORED), settings.topic(topics.WEIGHTS)
    first = [_group("a", 0, run_id=run), _group("b", 0, run_id=run)]
    second = [_group("c", 1, run_id=run), _group("d", 1, run_id=run)]
    await ensure_topics(stack.kafka_bootstrap, topic_prefix)
    producer = EventProducer(stack.kafka_bootstrap)
    await producer.start()
    db = make_engine(stack.database_url)
    sessions = session_factory(db)
    launcher = None
    try:
        log1 = tmp_path / "torchrun-1.log"
        launcher = _start(env, f"learner-{run}-1", log1)
        for g in first:
            await producer.send(scored_topic, g, key=g.group_id)
        seen = await _weights(stack.kafka_bootstrap, weights_topic, until_version=1, timeout=300)
        v1 = max(seen, key=lambda w: w.version)
        assert (v1.version, v1.step, v1.run_id) == (1, 1, run)
        verify_checkpoint(path_from_uri(v1.uri), v1.sha256)
        log = await _sigterm_rank0_and_wait(await _rank0_pid(sessions, f"learner-{run}-1", launcher, log1), launcher, log1)
        assert "follower_stopped" in log  # rank 1 left on rank 0's Stop, not killed

        # restart: both ranks resume from v1; the redelivered a and b are duplicates
        log2 = tmp_path / "torchrun-2.log"
        launcher = _start(env, f"learner-{run}-2", log2, entry=ENTRY_RSTAR)
        for g in first + second:
            await producer.send(scored_topic, g, key=g.group_id)
        seen = await _weights(stack.kafka_bootstrap, weights_topic, until_version=2, timeout=300)
        v2 = max(seen, key=lambda w: w.version)
        assert (v2.version, v2.step) == (2, 2)
        verify_checkpoint(path_from_uri(v2.uri), v2.sha256)
        log = await _sigterm_rank0_and_wait(await _rank0_pid(sessions, f"learner-{run}-2", launcher, log2), launcher, log2)
        assert "learner_resumed" in log and "follower_stopped" in log

        async with sessions() as s:
            steps = (await s.execute(select(LearnerStep).where(LearnerStep.run_id == run)
                                     .order_by(LearnerStep.step))).scalars().all()
            versions = (await s.execute(select(PolicyVersion).where(PolicyVersion.run_id == run)
                                        .order_by(PolicyVersion.version))).scalars().all()
        assert [(st.step, st.version, st.n_groups) for st in steps] == [(1, 1, 2), (2, 2, 2)]
        assert [(v.version, v.sha256) for v in versions][1:] == [(1, v1.sha256), (2, v2.sha256)]

        # the same groups on one device give the same weights, step by step
        ref = _single_device_checkpoints(settings, tmp_path / "single", [first, second])
        _assert_same_weights(path_from_uri(v1.uri), ref / "v00000001" / "weights")
        _assert_same_weights(path_from_uri(v2.uri), ref / "v00000002" / "weights")
    finally:
        if launcher is not None and launcher.poll() is None:
            # SIGKILL to torchrun alone would orphan its ranks (it cannot forward that signal).
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        await producer.stop()
        await db.dispose()
