"""The learner on several devices (FSDP2), one process per device, launched by torchrun::

    torchrun --standalone --nproc-per-node 8 -m services.learner.multi_device [--config learner.yaml] [--port 8104]

(``torchrun ... $(which rstar) serve learner ...`` does the same: ``rstar serve`` sees torchrun's
``WORLD_SIZE`` and comes here.)

Settings are the learner's (``RSTAR_LEARNER_*``, ``--config``), the same on every rank.

* **Rank 0** is the learner service: it alone talks to Kafka and PostgreSQL and serves HTTP. Its
  engine sends every operation on the model to the other ranks as a command
  (:mod:`services.learner.commands`) and writes the checkpoints.
* **Every other rank** loads the same checkpoint, shards, and then only executes rank 0's
  commands (:func:`run_follower`) until rank 0 sends Stop.

Shutdown: SIGTERM / Ctrl-C reach rank 0's service, which finishes the step in flight and sends
Stop; followers ignore those signals (torchrun and a terminal signal every rank at once) and
leave on Stop. If rank 0 dies, torchrun stops the other ranks; without torchrun a follower's
wait for the next command fails after ``dist_timeout_s`` (rank 0 pings idle followers every
quarter of it, so only a dead rank 0 runs into it).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path

import torch

from services.learner.commands import RankWorker, follow
from services.learner.config import Settings
from services.learner.distributed import DataParallel, init_from_env, leave_process_group
from services.learner.engine import EngineConfig, LearnerEngine, load_policy
from services.learner.runtime import LearnerService
from shared.logging import configure_logging, get_logger
from shared.runtime import run_service
from shared.settings import load_settings

log = get_logger("learner.ranks")


def run_leader(settings: Settings, dp: DataParallel) -> None:
    """Rank 0: open the engine with the process group, then run the learner service around it."""
    engine = LearnerEngine.open(EngineConfig.from_settings(settings), dp)
    engine.dispatch.keep_alive(settings.dist_timeout_s / 4)
    try:
        asyncio.run(run_service(LearnerService(settings, engine=engine), settings))
    finally:
        engine.close()


def run_follower(settings: Settings, dp: DataParallel) -> int:
    """Rank > 0: load the policy, execute rank 0's commands until Stop; returns how many."""
    # Rank 0 decides when to stop (after the step in flight); a follower leaving on its own
    # would break that step's collectives.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    policy = load_policy(EngineConfig.from_settings(settings), dp)
    log.info("follower_ready", rank=dp.rank, world_size=dp.world_size, version=policy.state.version if policy.state else 0)
    executed = follow(lambda: dp.broadcast_object(None), RankWorker(policy.trainer, dp))
    log.info("follower_stopped", rank=dp.rank, commands=executed)
    return executed


def run_ranks(settings: Settings) -> None:
    """Join torchrun's process group and play this process's part (rank 0 or a follower)."""
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    dp = init_from_env(timeout_s=settings.dist_timeout_s)
    instance = settings.instance_id if dp.rank == 0 else f"{settings.instance_id}-rank{dp.rank}"
    configure_logging("learner", settings.log_level, json=settings.log_json, instance_id=instance)
    try:
        if dp.rank == 0:
            run_leader(settings, dp)
        else:
            run_follower(settings, dp)
    finally:
        leave_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m services.learner.multi_device",
                                     description="The learner service on several devices (FSDP2).")
    parser.add_argument("--config", "-c", type=Path, default=None, help="YAML settings file")
    parser.add_argument("--port", "-p", type=int, default=None, help="HTTP port of rank 0")
    args = parser.parse_args(argv)
    run_ranks(load_settings(Settings, args.config, port=args.port))


if __name__ == "__main__":
    main()
