"""Checkpoint validation before a reload, and the updater's behaviour with engines that load,
fail, or are asked for stale versions (fake engines: the real one is in the vllm tests)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from safetensors.numpy import save_file

from services.rollout.weights import WeightRejected, WeightUpdater, tensor_index, validate_checkpoint
from shared.checkpoint import checkpoint_sha256, uri_for
from shared.events import WeightVersion


def make_ckpt(path, shape=(4, 8), seed=0):
    path.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    save_file({"a.weight": rng.standard_normal(shape).astype(np.float32),
               "b.weight": rng.standard_normal(3).astype(np.float32)}, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return path


def wv(path, version, sha=None, run_id="r"):
    return WeightVersion(run_id=run_id, version=version, step=version, stage=1, uri=uri_for(path),
                         sha256=sha or checkpoint_sha256(path))


def test_tensor_index_and_validation(tmp_path):
    ref_dir = make_ckpt(tmp_path / "ref")
    ref = tensor_index(ref_dir)
    assert ref == {"a.weight": ("F32", (4, 8)), "b.weight": ("F32", (3,))}
    new = make_ckpt(tmp_path / "new", seed=1)
    assert validate_checkpoint(wv(new, 1), ref) == new

    # bytes changed after hashing
    sha = checkpoint_sha256(new)
    with open(new / "model.safetensors", "r+b") as fh:
        fh.seek(-4, 2)
        fh.write(b"\0\0\0\0")
    with pytest.raises(WeightRejected, match="sha256"):
        validate_checkpoint(wv(new, 2, sha=sha), ref)

    # well hashed but another shape
    other = make_ckpt(tmp_path / "other", shape=(8, 8))
    with pytest.raises(WeightRejected, match="changed"):
        validate_checkpoint(wv(other, 3), ref)

    # garbage where the header should be
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(WeightRejected, match="not a safetensors"):
        validate_checkpoint(wv(junk, 4), ref)

    with pytest.raises(WeightRejected, match="not a local"):
        validate_checkpoint(WeightVersion(run_id="r", version=5, step=5, stage=1, uri="s3://b/k", sha256="0" * 64), ref)


class FakeEngine:
    def __init__(self, index, fail_on=None):
        self.index = index
        self.version = 0
        self.weights_path = "base"
        self.fail_on = fail_on
        self.loads = []
        self.restarts = []

    async def load_weights(self, path, version):
        if version == self.fail_on:
            raise RuntimeError("reload exploded")
        self.loads.append(version)
        self.version, self.weights_path = version, str(path)

    async def restart(self, path, version):
        self.restarts.append(version)
        self.version, self.weights_path = version, str(path)


def test_updater_loads_newest_announced_and_rolls_back_a_failed_load(tmp_path):
    async def scenario():
        ref_dir = make_ckpt(tmp_path / "v0")
        ref = tensor_index(ref_dir)
        ckpts = {v: make_ckpt(tmp_path / f"v{v}", seed=v) for v in (1, 2, 3)}
        engines = [FakeEngine(0), FakeEngine(1, fail_on=3)]
        up = WeightUpdater(engines, ref, 0)
        stop = asyncio.Event()
        loader = asyncio.create_task(up.run(stop))
        # a backlog of versions coalesces into the newest
        up.announce(wv(ckpts[1], 1))
        up.announce(wv(ckpts[2], 2))
        assert await up.wait_for(2, timeout_s=5)
        assert [e.loads for e in engines] == [[2], [2]]
        up.announce(wv(ckpts[1], 1))  # stale: ignored
        # engine 1 fails to load v3: engine 0 is reloaded back to v2, engine 1 restarted on v2
        assert not await up.load(wv(ckpts[3], 3))
        assert up.version == 2 and "failed to load" in up.last_error
        assert engines[0].version == 2 and engines[0].loads == [2, 3, 2]
        assert engines[1].restarts == [2] and engines[1].version == 2
        assert not await up.wait_for(3, timeout_s=0.2)
        stop.set()
        await loader

    asyncio.run(scenario())


def test_updater_for_a_run_ignores_other_runs_versions(tmp_path):
    async def scenario():
        ref = tensor_index(make_ckpt(tmp_path / "v0"))
        old_run, new_run = make_ckpt(tmp_path / "old-v12", seed=12), make_ckpt(tmp_path / "new-v1", seed=1)
        engines = [FakeEngine(0)]
        up = WeightUpdater(engines, ref, 0, run_id="new")
        stop = asyncio.Event()
        loader = asyncio.create_task(up.run(stop))
        up.announce(wv(old_run, 12, run_id="old"))  # the previous run's newest version, still on the topic
        up.announce(wv(new_run, 1, run_id="new"))
        assert await up.wait_for(1, timeout_s=5)
        assert not await up.wait_for(12, timeout_s=0.2)
        assert engines[0].loads == [1] and up.version == 1 and up.run_id == "new"
        stop.set()
        await loader

    asyncio.run(scenario())


def test_a_rejected_bogus_announcement_does_not_hide_the_real_version_of_that_number(tmp_path):
    async def scenario():
        ref = tensor_index(make_ckpt(tmp_path / "v0"))
        real = {v: make_ckpt(tmp_path / f"v{v}", seed=v) for v in (1, 2)}
        engines = [FakeEngine(0)]
        up = WeightUpdater(engines, ref, 0)
        stop = asyncio.Event()
        loader = asyncio.create_task(up.run(stop))
        # v1 announced with a checkpoint that does not exist: rejected
        up.announce(WeightVersion(run_id="r", version=1, step=1, stage=1, uri=uri_for(tmp_path / "missing"),
                                  sha256="0" * 64))
        for _ in range(100):
            if up.last_error:
                break
            await asyncio.sleep(0.02)
        assert "rejected" in up.last_error and up.version == 0
        # the learner's real v1 is loaded, not ignored as stale
        up.announce(wv(real[1], 1))
        assert await up.wait_for(1, timeout_s=5) and engines[0].loads == [1]
        # the same bogus announcement again changes nothing
        up.announce(WeightVersion(run_id="r", version=1, step=1, stage=1, uri=uri_for(tmp_path / "missing"),
                                  sha256="0" * 64))
        # both announcements of v2 pending at once, the bogus one last: it is tried first, rejected,
        # and the real one of that number is loaded after it
        up.announce(wv(real[2], 2))
        up.announce(WeightVersion(run_id="r", version=2, step=2, stage=1, uri=uri_for(tmp_path / "missing2"),
                                  sha256="1" * 64))
        assert await up.wait_for(2, timeout_s=5) and engines[0].loads == [1, 2]
        stop.set()
        await loader

    asyncio.run(scenario())
