"""Learner engine: steps → checkpoints → resume; duplicates, staleness, optimizer reset."""

from pathlib import Path

import pytest
import torch

from learner_helpers import save_tiny_model, scored_group
from services.learner.assembly import Decision, StepAssembler
from services.learner.checkpoints import CheckpointStore
from services.learner.engine import EngineConfig, LearnerEngine
from services.learner.trainer import TrainerConfig
from shared.checkpoint import TMP_PREFIX, verify_checkpoint


def _cfg(tmp_path: Path, **kw) -> EngineConfig:
    model_dir = tmp_path / "model"
    if not model_dir.exists():
        save_tiny_model(model_dir)
    base = dict(model_dir=model_dir, checkpoint_dir=tmp_path / "ckpt", device="cpu", groups_per_step=2,
                max_staleness=1, trainer=TrainerConfig(lr=1e-3, warmup_steps=2, micro_batch_tokens=64))
    base.update(kw)
    return EngineConfig(**base)


def _weights(engine):
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def test_crash_after_checkpoint_before_commit_resumes_same_state_without_retraining(tmp_path):
    cfg = _cfg(tmp_path)
    eng = LearnerEngine.open(cfg)
    assert eng.version == 0 and not eng.resumed
    groups = [scored_group(f"g{i}") for i in range(2)]
    assert [eng.offer(g) for g in groups] == [Decision.ACCEPTED, Decision.ACCEPTED]
    out = eng.train_step()
    assert out.version == 1 and out.step == 1 and out.trained
    verify_checkpoint(out.weights_dir, out.sha256)
    before = _weights(eng)
    opt_before = eng.trainer.optimizer.state_dict()
    lr_before = eng.trainer.current_lr()
    # "crash": the offsets were never committed, so the broker redelivers g0 and g1.
    del eng
    eng2 = LearnerEngine.open(cfg)
    assert eng2.resumed and eng2.version == 1 and eng2.state.step == 1
    after = _weights(eng2)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert eng2.trainer.current_lr() == pytest.approx(lr_before)
    exp_avg = [s["exp_avg"] for s in opt_before["state"].values()]
    exp_avg2 = [s["exp_avg"] for s in eng2.trainer.optimizer.state_dict()["state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(exp_avg, exp_avg2))
    assert [eng2.offer(g) for g in groups] == [Decision.DUPLICATE, Decision.DUPLICATE]
    assert not eng2.ready()
    # training continues with new groups, from version 1
    for g in ("g2", "g3"):
        assert eng2.offer(scored_group(g, version=1)) is Decision.ACCEPTED
    out2 = eng2.train_step()
    assert out2.version == 2 and set(eng2.state.consumed) == {"g0", "g1", "g2", "g3"}


def test_incomplete_or_corrupt_checkpoints_are_ignored(tmp_path):
    cfg = _cfg(tmp_path, keep_last=5)
    eng = LearnerEngine.open(cfg)
    for i in range(2):
        eng.offer(scored_group(f"a{i}"))
    eng.train_step()
    for i in range(2):
        eng.offer(scored_group(f"b{i}", version=1))
    out2 = eng.train_step()
    # an interrupted write of v3 (temporary dir) and a corrupted v2 weights file
    (cfg.checkpoint_dir / f"{TMP_PREFIX}v00000003-0000").mkdir()
    with open(out2.weights_dir / "model.safetensors", "r+b") as fh:
        fh.seek(-4, 2)
        fh.write(b"\0\0\0\1")
    eng3 = LearnerEngine.open(cfg)
    assert eng3.version == 1  # v2 fails its sha256, the .tmp- dir is garbage
    assert not any(p.name.startswith(TMP_PREFIX) for p in cfg.checkpoint_dir.iterdir())
    assert eng3.offer(scored_group("b0", version=1)) is Decision.ACCEPTED  # v2's groups were not durable


def test_keep_last_prunes_old_checkpoints(tmp_path):
    cfg = _cfg(tmp_path, groups_per_step=1, keep_last=2, max_staleness=10)
    eng = LearnerEngine.open(cfg)
    for i in range(4):
        eng.offer(scored_group(f"k{i}", version=i))
        eng.train_step()
    assert CheckpointStore(cfg.checkpoint_dir, cfg.model_dir).versions() == [3, 4]


def test_stage_three_resets_the_optimizer_once(tmp_path):
    cfg = _cfg(tmp_path, groups_per_step=1, max_staleness=10)
    eng = LearnerEngine.open(cfg)
    eng.offer(scored_group("s2", stage=2))
    assert not eng.train_step().optimizer_reset
    eng.offer(scored_group("s3", stage=3, version=1))
    out = eng.train_step()
    assert out.optimizer_reset and out.metrics["optimizer_reset"]
    assert eng.state.optimizer_reset_steps == [2]
    eng.offer(scored_group("s3b", stage=3, version=2))
    assert not eng.train_step().optimizer_reset


def test_assembler_drops_stale_and_skips_no_signal_and_other_runs():
    a = StepAssembler(groups_per_step=2, max_staleness=1, version=5, run_id="run-a")
    assert a.offer(scored_group("old", version=3)) is Decision.STALE
    assert a.offer(scored_group("ok", version=4)) is Decision.ACCEPTED
    assert a.offer(scored_group("ok", version=4)) is Decision.DUPLICATE
    assert a.offer(scored_group("flat", version=5, advantages=[0.0] * 4)) is Decision.NO_SIGNAL
    assert a.offer(scored_group("other", run_id="run-b", version=5)) is Decision.WRONG_RUN
    assert not a.ready()
    assert a.offer(scored_group("ok2", version=5)) is Decision.ACCEPTED
    assert a.ready() and a.dropped_stale == 1
    groups = a.peek()
    a.offer(scored_group("later", version=4))
    # "later" (from version 4) became stale when the version moved to 6 with η = 1
    assert a.complete(groups, 6) == [("later", Decision.STALE)]
    assert a.buffer == [] and a.dropped_stale == 1 and a.consumed == {"ok", "ok2"}


def test_assembler_trains_nothing_past_the_runs_last_step():
    a = StepAssembler(groups_per_step=1, max_staleness=2, version=1, run_id="run-a", final_version=2)
    assert a.offer(scored_group("last", version=1)) is Decision.ACCEPTED
    assert a.offer(scored_group("extra", version=1)) is Decision.ACCEPTED
    assert a.ready()
    assert a.complete(a.peek(), 2) == [("extra", Decision.RUN_COMPLETE)]
    assert not a.ready() and a.buffer == []
    assert a.offer(scored_group("late", version=2)) is Decision.RUN_COMPLETE
    assert not a.ready()


def test_a_failed_checkpoint_write_poisons_the_engine_and_restart_resumes(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, groups_per_step=1)
    eng = LearnerEngine.open(cfg)
    eng.offer(scored_group("p0"))
    eng.train_step()

    def disk_full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(eng.store, "save", disk_full)
    eng.offer(scored_group("p1", version=1))
    with pytest.raises(OSError):
        eng.train_step()
    assert eng.poisoned
    with pytest.raises(RuntimeError):
        eng.train_step()
    monkeypatch.undo()
    eng2 = LearnerEngine.open(cfg)
    assert eng2.version == 1 and eng2.offer(scored_group("p1", version=1)) is Decision.ACCEPTED


def _truncate(group, index: int):
    st = group.selected[index]
    cut = st.model_copy(update={"trajectory": st.trajectory.model_copy(update={"finish_reason": "max_tokens"})})
    return group.model_copy(update={"selected": [cut if i == index else s for i, s in enumerate(group.selected)]})


def test_overlong_filter_masks_truncated_responses_out_of_the_loss():
    from services.learner.engine import group_sequences

    groups = [_truncate(scored_group("g0"), 1), scored_group("g1")]
    every = group_sequences(groups)
    filtered = group_sequences(groups, overlong_filter=True)
    assert len(every) == 8 and len(filtered) == 7
    cut = groups[0].selected[1].trajectory.response_token_ids
    assert all(s.response_ids != cut for s in filtered)


def test_overlong_filter_changes_the_steps_loss_tokens(tmp_path):
    groups = [_truncate(scored_group("g0"), 0), scored_group("g1")]
    tokens = {}
    for on in (False, True):
        eng = LearnerEngine.open(_cfg(tmp_path / str(on), overlong_filter=on))
        for g in groups:
            eng.offer(g)
        out = eng.train_step()
        tokens[on] = out.metrics["loss_tokens"]
        assert out.metrics["overlong_masked"] == (1 if on else 0)
    truncated = groups[0].selected[0].trajectory
    assert tokens[False] - tokens[True] == sum(truncated.loss_mask)


def test_an_untrainable_group_is_refused_alone_and_the_step_goes_on(tmp_path):
    from services.learner.engine import BadGroup

    eng = LearnerEngine.open(_cfg(tmp_path))
    good = [scored_group("g0"), scored_group("g1")]
    oov = scored_group("bad-oov")
    st = oov.selected[0]
    ids = list(st.trajectory.response_token_ids)
    ids[0] = eng.vocab_size + 5  # schema-valid, but past the embedding: IndexError in every step
    oov = oov.model_copy(update={"selected": [st.model_copy(update={"trajectory": st.trajectory.model_copy(
        update={"response_token_ids": ids})}), *oov.selected[1:]]})
    nan = scored_group("bad-nan")
    nan = nan.model_copy(update={"selected": [nan.selected[0].model_copy(update={"advantage": float("nan")}),
                                              *nan.selected[1:]]})
    future = scored_group("bad-future", version=3)
    assert eng.offer(good[0]) is Decision.ACCEPTED
    for bad, reason in ((oov, "outside the vocabulary"), (nan, "non-finite advantage"), (future, "newer than")):
        with pytest.raises(BadGroup, match=reason):
            eng.offer(bad)
    assert [g.group_id for g in eng.assembler.buffer] == ["g0"]
    assert eng.offer(good[1]) is Decision.ACCEPTED
    assert eng.train_step().trained
