"""FSDP2 data parallelism on the CPU: two gloo processes give the single-process update."""

import copy
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from services.learner.trainer import PolicyTrainer, TrainerConfig

sys.path.insert(0, str(Path(__file__).parent))
from learner_helpers import random_sequences, tiny_llama  # noqa: E402

CFG = dict(lr=1e-2, warmup_steps=0, micro_batch_tokens=48)


def _train_and_save(rank: int, world: int, out_dir: str, mode: str) -> None:
    from services.learner.distributed import DataParallel, split_for_ranks

    model = tiny_llama(seed=5)
    dp = DataParallel()
    trainer = PolicyTrainer(model, TrainerConfig(**CFG), dist=dp)
    seqs = random_sequences(7, seed=2, rl=mode == "rl")
    mine = split_for_ranks(seqs, world)[rank]
    m = trainer.train_step(mine).metrics if mode == "rl" else trainer.sft_step(mine)
    full = dp.full_state_dict(trainer.net.model)
    if rank == 0:
        torch.save({"metrics": m, "weights": {k: v.clone() for k, v in full.items()}}, Path(out_dir) / f"{mode}.pt")


def _worker(rank: int, world: int, init_file: str, out_dir: str, mode: str) -> None:
    import torch.distributed as dist

    from services.learner.distributed import leave_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        _train_and_save(rank, world, out_dir, mode)  # its sharded model is gone when it returns
    finally:
        leave_process_group()


@pytest.mark.parametrize("mode", ["rl", "sft"])
def test_fsdp2_two_processes_match_one_process(tmp_path, mode):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path), mode), nprocs=2, join=True)
    got = torch.load(tmp_path / f"{mode}.pt", weights_only=False)

    model = tiny_llama(seed=5)
    trainer = PolicyTrainer(model, TrainerConfig(**CFG))
    seqs = random_sequences(7, seed=2, rl=mode == "rl")
    ref = trainer.train_step(seqs).metrics if mode == "rl" else trainer.sft_step(seqs)
    assert got["metrics"]["loss"] == pytest.approx(ref["loss"], abs=1e-5)
    assert got["metrics"]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)
    assert got["metrics"]["tokens"] == ref["tokens"]
    state = model.state_dict()
    for k, v in got["weights"].items():
        assert torch.allclose(v, state[k], atol=1e-4), k
