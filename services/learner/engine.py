"""The learner engine: model + trainer + step assembly + checkpoints, without Kafka or SQL.

``LearnerEngine.open`` resumes from the newest complete checkpoint (weights, optimizer and
schedule, step, version, stage, consumed group ids) or starts from the initial model as
version 0. ``offer`` feeds one scored group to the :class:`~services.learner.assembly.StepAssembler`;
when a step is ready, ``train_step`` (blocking — the runtime runs it in a worker thread)
trains on it, writes the checkpoint atomically and only then marks the groups consumed. The
runtime records the outcome in PostgreSQL, publishes the WeightVersion and commits the Kafka
offsets afterwards; a crash anywhere before the checkpoint rename loses nothing (the groups are
redelivered), a crash after it leaves a checkpoint whose consumed ids make the redelivered
groups duplicates.

Multi-device (FSDP2, launched by torchrun, see :mod:`services.learner.multi_device`): the engine
lives on rank 0 only; everything it does to the model goes through a
:class:`~services.learner.commands.CommandDispatcher`, which has the other ranks execute the same
command. :func:`load_policy` is the start-up every rank shares.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from services.learner.assembly import Decision, GroupStats, StepAssembler, defects, group_stats
from services.learner.checkpoints import CheckpointStore, LearnerState
from services.learner.commands import (
    CheckpointParts,
    CommandDispatcher,
    GatherCheckpoint,
    RankWorker,
    ResetOptimizer,
    Train,
)
from services.learner.packing import TrainSequence
from services.learner.trainer import PolicyTrainer, TrainerConfig, load_model, resolve_device
from shared.checkpoint import checkpoint_sha256, uri_for
from shared.events import ScoredGroup
from shared.logging import get_logger

if TYPE_CHECKING:
    from services.learner.distributed import DataParallel

log = get_logger("learner.engine")


@dataclass
class StepOutcome:
    version: int
    step: int
    stage: int
    weights_dir: Path
    sha256: str
    group_ids: list[str]
    metrics: dict[str, Any]
    optimizer_reset: bool
    dropped_stale: int
    trained: bool = True  # False: the batch was given up (non-finite gradient)
    stats: GroupStats | None = None
    # buffered groups given up after the step: (group id, reason: stale or run_complete)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    @property
    def uri(self) -> str:
        return uri_for(self.weights_dir)


def pad_token_id(model_dir: Path) -> int:
    """A harmless id for row padding (it is never a loss token): pad, else eos, else 0."""
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    for key in ("pad_token_id", "eos_token_id"):
        v = cfg.get(key)
        if isinstance(v, list):
            v = v[0] if v else None
        if isinstance(v, int):
            return v
    return 0


class BadGroup(ValueError):
    """A schema-valid group that cannot be trained (token ids outside the vocabulary, NaN
    log-probs, versions from the future): it belongs in the dead-letter topic, alone."""


# Finish reason of a response cut at its token budget (the one overlong filtering masks).
TRUNCATED_FINISH_REASON = "max_tokens"


def group_sequences(groups: list[ScoredGroup], *, overlong_filter: bool = False) -> list[TrainSequence]:
    """The training sequences of a step's groups. With ``overlong_filter`` (DAPO's "overlong
    filtering"), responses cut at the token budget are masked out of the loss entirely: they
    keep their place in the group's advantage statistics (computed by the reward) but add no
    tokens to the step's token-mean. Off by default, as in the public release's recipe (it has
    no such filter): a truncated response scores 0 like any unanswered one and is trained on."""
    return [
        TrainSequence(
            prompt_ids=st.trajectory.prompt_token_ids,
            response_ids=st.trajectory.response_token_ids,
            loss_mask=st.trajectory.loss_mask,
            behaviour_logprobs=st.trajectory.logprobs,
            advantage=st.advantage,
        )
        for g in groups
        for st in g.selected
        if not (overlong_filter and st.trajectory.finish_reason == TRUNCATED_FINISH_REASON)
    ]


@dataclass
class EngineConfig:
    model_dir: Path
    checkpoint_dir: Path
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    groups_per_step: int = 8
    max_staleness: int = 2
    run_id: str = ""
    device: str = "auto"
    keep_last: int = 3
    skip_zero_advantage_groups: bool = True
    max_steps: int = 0  # 0: no limit
    overlong_filter: bool = False  # mask responses cut at the token budget out of the loss (DAPO)

    @classmethod
    def from_settings(cls, s: Any) -> "EngineConfig":
        if s.model_dir is None:
            raise ValueError("learner needs model_dir (RSTAR_LEARNER_MODEL_DIR): the initial HF model directory")
        return cls(model_dir=Path(s.model_dir), checkpoint_dir=s.resolved_checkpoint_dir(), trainer=s.trainer_config(),
                   groups_per_step=s.groups_per_step, max_staleness=s.max_staleness, run_id=s.run_id,
                   device=s.device, keep_last=s.keep_last, skip_zero_advantage_groups=s.skip_zero_advantage_groups,
                   max_steps=s.max_steps, overlong_filter=s.overlong_filter)


@dataclass
class LoadedPolicy:
    """A rank's model and trainer, resumed from the newest complete checkpoint (``state``) or
    fresh from the initial model (``state`` None)."""

    model: torch.nn.Module
    trainer: PolicyTrainer
    store: CheckpointStore
    state: LearnerState | None


def load_policy(cfg: EngineConfig, dp: "DataParallel | None" = None) -> LoadedPolicy:
    """Load the policy on this rank. Under FSDP2 every rank calls it: rank 0 picks the
    checkpoint (it verifies the hashes and owns the directory), every rank loads that same
    checkpoint in full, then shards model and optimizer state (collective)."""
    if not (cfg.model_dir / "config.json").is_file():
        raise FileNotFoundError(f"model_dir {cfg.model_dir} is not an HF model directory (no config.json)")
    device = resolve_device(cfg.device) if dp is None else dp.rank_device()
    leader = dp is None or dp.rank == 0
    store = CheckpointStore(cfg.checkpoint_dir, cfg.model_dir, writer=leader)
    state = store.latest() if leader else None
    if dp is not None:
        state = dp.broadcast_object(state)
    if state is not None and cfg.run_id and state.run_id and state.run_id != cfg.run_id:
        raise ValueError(f"checkpoints in {cfg.checkpoint_dir} belong to run {state.run_id!r}, not {cfg.run_id!r}")
    model = load_model(store.weights_dir(state.version) if state is not None else cfg.model_dir, device)
    trainer = PolicyTrainer(model, cfg.trainer, pad_id=pad_token_id(cfg.model_dir), dist=dp)
    if state is not None:
        # Under FSDP2 the full optimizer state is read into CPU memory and each rank keeps its shard.
        trainer.load_state_dict(store.load_trainer_state(state.version, device if dp is None else "cpu"))
    return LoadedPolicy(model, trainer, store, state)


class LearnerEngine:
    def __init__(self, cfg: EngineConfig, model: torch.nn.Module, trainer: PolicyTrainer, store: CheckpointStore,
                 state: LearnerState, resumed: bool, dispatch: CommandDispatcher | None = None):
        self.cfg = cfg
        self.model = model
        # Rows of the input embedding: a token id at or past it fails every step it is in.
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.trainer = trainer
        self.store = store
        self.state = state
        self.resumed = resumed
        # Every operation on the model goes through here (on several devices, every rank runs it).
        self.dispatch = dispatch or CommandDispatcher(RankWorker(trainer))
        self.assembler = StepAssembler(
            groups_per_step=cfg.groups_per_step, max_staleness=cfg.max_staleness, version=state.version,
            run_id=state.run_id or cfg.run_id, stage=state.stage, consumed=set(state.consumed),
            skip_zero_advantage=cfg.skip_zero_advantage_groups, final_version=cfg.max_steps or None,
        )
        self._initial_sha: str | None = None
        self.poisoned = False  # set when in-memory weights are ahead of the last checkpoint

    @classmethod
    def open(cls, cfg: EngineConfig, dp: "DataParallel | None" = None) -> "LearnerEngine":
        """One device, or rank 0 of several (``dp``; the other ranks run
        :func:`services.learner.multi_device.run_follower` at the same time)."""
        if dp is not None and dp.rank != 0:
            raise ValueError(f"the learner engine runs on rank 0; rank {dp.rank} follows its commands")
        loaded = load_policy(cfg, dp)
        worker = RankWorker(loaded.trainer, dp)
        dispatch = CommandDispatcher(worker, send=dp.broadcast_object if dp is not None else None)
        ranks = dp.world_size if dp is not None else 1
        state = loaded.state
        if state is not None:
            log.info("learner_resumed", version=state.version, step=state.step, stage=state.stage,
                     consumed=len(state.consumed), ranks=ranks)
            return cls(cfg, loaded.model, loaded.trainer, loaded.store, state, resumed=True, dispatch=dispatch)
        log.info("learner_fresh_start", model_dir=str(cfg.model_dir), device=str(loaded.trainer.device), ranks=ranks)
        return cls(cfg, loaded.model, loaded.trainer, loaded.store, LearnerState(run_id=cfg.run_id, version=0, step=0),
                   resumed=False, dispatch=dispatch)

    def close(self) -> None:
        """Release the other ranks (multi-device); the engine takes no more commands."""
        self.dispatch.stop_followers()

    # ------------------------------------------------------------------ queries
    @property
    def version(self) -> int:
        return self.state.version

    @property
    def run_id(self) -> str:
        return self.state.run_id or self.assembler.run_id

    def current_weights(self) -> tuple[Path, str]:
        """(directory, sha256) of the current version: the checkpoint, or the initial model (v0)."""
        if self.state.version == 0 and not self.resumed:
            if self._initial_sha is None:
                self._initial_sha = checkpoint_sha256(self.cfg.model_dir)
            return self.cfg.model_dir, self._initial_sha
        return self.store.weights_dir(self.state.version), self.state.weights_sha256

    # ------------------------------------------------------------------ commands
    def offer(self, group: ScoredGroup) -> Decision:
        """The assembler's decision on a group; raises BadGroup for one that cannot be trained
        (assembly.defects), before it can join a batch."""
        reasons = defects(group, vocab_size=self.vocab_size, version=self.version)
        if reasons:
            raise BadGroup(f"group {group.group_id}: " + "; ".join(reasons))
        return self.assembler.offer(group)

    def ready(self) -> bool:
        return self.assembler.ready()

    def train_step(self) -> StepOutcome:
        """Train on the next B groups, checkpoint the result as a new version (blocking)."""
        if self.poisoned:
            raise RuntimeError("a checkpoint write failed after an update; restart to resume from the last checkpoint")
        groups = self.assembler.peek()
        stage = self.assembler.step_stage(groups)
        reset = self.assembler.needs_optimizer_reset(groups)
        stats = group_stats(groups, self.state.version)
        dropped = self.assembler.dropped_stale
        if reset:
            self.dispatch(ResetOptimizer())
            log.info("optimizer_reset", stage=stage, step=self.state.step + 1)
        t0 = time.perf_counter()
        try:
            sequences = group_sequences(groups, overlong_filter=self.cfg.overlong_filter)
            result = self.dispatch(Train(sequences))
        except FloatingPointError as exc:
            # The update was skipped and the weights are untouched; the batch is given up so
            # a redelivery cannot loop on it. It is recorded with the next checkpoint.
            log.error("step_skipped_non_finite", error=str(exc), groups=[g.group_id for g in groups])
            self.assembler.discard(groups)
            return StepOutcome(self.state.version, self.state.step, stage, *self.current_weights(),
                               group_ids=[g.group_id for g in groups], metrics={}, optimizer_reset=reset,
                               dropped_stale=dropped, trained=False, stats=stats)
        metrics = dict(result.metrics)
        metrics.update(
            staleness_mean=stats.staleness_mean, staleness_max=stats.staleness_max, reward_mean=stats.reward_mean,
            pass_rate_mean=stats.pass_rate_mean, response_len_mean=stats.response_len_mean,
            tool_error_rate_pos=stats.tool_error_rate_pos, n_groups=len(groups),
            n_trajectories=stats.n_trajectories, dropped_stale=dropped, optimizer_reset=reset,
            overlong_masked=stats.n_trajectories - len(sequences),
            train_seconds=time.perf_counter() - t0,
        )
        new = LearnerState(
            run_id=self.run_id,
            version=self.state.version + 1,
            step=self.state.step + 1,
            stage=stage,
            consumed=sorted(self.assembler.consumed | {g.group_id for g in groups}),
            optimizer_reset_steps=self.state.optimizer_reset_steps + ([self.state.step + 1] if reset else []),
            metrics=metrics,
        )
        t1 = time.perf_counter()
        try:
            parts: CheckpointParts = self.dispatch(GatherCheckpoint())
            weights_dir, sha = self.store.save(new, self.model, parts.trainer_state, weights=parts.weights)
        except BaseException:
            # The weights in memory moved past the last checkpoint: training on would make the
            # next checkpoint claim updates it cannot replay. Only a restart (resume from the
            # last checkpoint, the groups redelivered) is consistent.
            self.poisoned = True
            raise
        metrics["checkpoint_seconds"] = time.perf_counter() - t1
        self.state = new
        self.resumed = True
        skipped = self.assembler.complete(groups, new.version)
        removed = self.store.prune(self.cfg.keep_last)
        log.info("step_done", step=new.step, version=new.version, loss=metrics["loss"], tokens_per_s=round(metrics["tokens_per_s"]),
                 pruned=removed)
        return StepOutcome(new.version, new.step, stage, weights_dir, sha, [g.group_id for g in groups], metrics,
                           optimizer_reset=reset, dropped_stale=dropped, stats=stats,
                           skipped=[(gid, why.value) for gid, why in skipped])
