"""The multi-device learner engine (rank 0) and its follower (rank 1) on two gloo processes: the
checkpoints — weights and optimizer moments, through an optimizer reset and a restart — equal
those of the single-device engine on the same groups."""

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from learner_helpers import save_tiny_model, scored_group
from services.learner.checkpoints import OPTIMIZER_FILE, TRAINER, CheckpointStore
from services.learner.config import Settings
from services.learner.engine import EngineConfig, LearnerEngine
from shared.settings import load_settings

# (group ids, stage, policy version of their tokens) per step
FIRST_RUN = [(("a0", "a1"), 2, 0), (("b0", "b1"), 3, 1)]  # the second step enters stage 3: optimizer reset
AFTER_RESTART = [(("c0", "c1"), 3, 2)]


def _settings(model_dir: Path, ckpt: Path) -> Settings:
    return load_settings(Settings, model_dir=model_dir, checkpoint_dir=ckpt, run_id="run-a", groups_per_step=2,
                         max_staleness=1, lr=1e-2, warmup_steps=1, micro_batch_tokens=48, device="cpu",
                         state_dir=ckpt.parent / "state")


def _train(engine: LearnerEngine, steps) -> None:
    for gids, stage, version in steps:
        for gid in gids:
            engine.offer(scored_group(gid, stage=stage, version=version))
        assert engine.ready()
        engine.train_step()


def _ranks(rank: int, init_file: str, model_dir: str, ckpt: str, steps) -> None:
    import torch.distributed as dist

    from services.learner.distributed import leave_process_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        _rank_main(rank, Path(model_dir), Path(ckpt), steps)  # its sharded model is gone when it returns
    finally:
        leave_process_group()


def _rank_main(rank: int, model_dir: Path, ckpt: Path, steps) -> None:
    from services.learner.distributed import DataParallel
    from services.learner.multi_device import run_follower

    settings = _settings(model_dir, ckpt)
    dp = DataParallel()
    if rank == 0:
        engine = LearnerEngine.open(EngineConfig.from_settings(settings), dp)
        _train(engine, steps)
        engine.close()
    else:
        assert run_follower(settings, dp) > 0


def _checkpoint(ckpt: Path, version: int):
    store = CheckpointStore(ckpt, ckpt, writer=False)
    weights = load_file(store.weights_dir(version) / "model.safetensors")
    trainer = torch.load(store.version_dir(version) / TRAINER / OPTIMIZER_FILE, weights_only=True)
    return store.read_state(version), weights, trainer


def _assert_same_checkpoint(got_dir: Path, ref_dir: Path, version: int) -> None:
    got_state, got_w, got_t = _checkpoint(got_dir, version)
    ref_state, ref_w, ref_t = _checkpoint(ref_dir, version)
    assert (got_state.step, got_state.stage, got_state.consumed, got_state.optimizer_reset_steps) == (
        ref_state.step, ref_state.stage, ref_state.consumed, ref_state.optimizer_reset_steps)
    assert got_state.metrics["loss"] == pytest.approx(ref_state.metrics["loss"], abs=1e-5)
    assert got_w.keys() == ref_w.keys()
    for k in ref_w:
        # Adam at lr 1e-2 turns float-summation-order noise of ~1e-9 in the moments into ~1e-5
        assert torch.allclose(got_w[k], ref_w[k], atol=1e-4), k
    assert (got_t["steps_done"], got_t["sched_offset"], got_t["optimizer_resets"]) == (
        ref_t["steps_done"], ref_t["sched_offset"], ref_t["optimizer_resets"])
    got_opt, ref_opt = got_t["optimizer"]["state"], ref_t["optimizer"]["state"]
    assert got_opt.keys() == ref_opt.keys() and len(ref_opt) > 0
    for name in ref_opt:
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(got_opt[name][moment], ref_opt[name][moment], atol=1e-6, rtol=1e-4), (name, moment)


def test_two_ranks_checkpoint_and_resume_like_one_device(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model", seed=3)
    multi, single = tmp_path / "multi", tmp_path / "single"

    mp.spawn(_ranks, args=(str(tmp_path / "init1"), str(model_dir), str(multi), FIRST_RUN), nprocs=2, join=True)
    reference = LearnerEngine.open(EngineConfig.from_settings(_settings(model_dir, single)))
    _train(reference, FIRST_RUN)
    _assert_same_checkpoint(multi, single, 2)
    assert _checkpoint(multi, 2)[0].optimizer_reset_steps == [2]

    # restart: both ranks resume from v2 (weights and optimizer state), the step after equals
    # the single-device engine's third step
    mp.spawn(_ranks, args=(str(tmp_path / "init2"), str(model_dir), str(multi), AFTER_RESTART), nprocs=2, join=True)
    _train(reference, AFTER_RESTART)
    _assert_same_checkpoint(multi, single, 3)
