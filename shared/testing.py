"""Sample events for tests and benchmarks (deterministic, realistic shapes)."""

from __future__ import annotations

import random
from datetime import timedelta

from shared.events import (
    RolloutTask,
    RocStats,
    SamplingParams,
    ScoredGroup,
    ScoredTrajectory,
    ToolCallRecord,
    Trajectory,
    TrajectoryGroup,
    WeightVersion,
    new_id,
    utcnow,
)


def sample_trajectory(n_tokens: int = 64, *, seed: int = 0, version: int = 0, text: str = "") -> Trajectory:
    rng = random.Random(seed)
    mask = [0 if 20 <= i < 30 else 1 for i in range(n_tokens)]
    return Trajectory(
        traj_id=new_id(),
        prompt_token_ids=[rng.randrange(512) for _ in range(32)],
        response_token_ids=[rng.randrange(512) for _ in range(n_tokens)],
        loss_mask=mask,
        logprobs=[(-rng.random() * 5 if m else 0.0) for m in mask],
        token_versions=[version] * n_tokens,
        turns=2,
        tool_calls=[ToolCallRecord(code="print(6*7)", status="ok", duration_ms=12.5, output="42\n")],
        finish_reason="answer",
        response_text=text or "<tool_call>...</tool_call> <answer>\\boxed{42}</answer>",
    )


def sample_group(n: int = 4, n_tokens: int = 64, *, run_id: str = "run-test", group_id: str | None = None) -> TrajectoryGroup:
    return TrajectoryGroup(
        group_id=group_id or new_id(),
        run_id=run_id,
        stage=1,
        problem_id="p-1",
        answer="42",
        trajectories=[sample_trajectory(n_tokens, seed=i) for i in range(n)],
    )


def sample_task(run_id: str = "run-test") -> RolloutTask:
    return RolloutTask(
        task_id=new_id(),
        run_id=run_id,
        stage=1,
        problem_id="p-1",
        prompt="What is 6*7?",
        answer="42",
        n_samples=4,
        sampling=SamplingParams(max_tokens=512, max_turns=4),
        deadline=utcnow() + timedelta(minutes=5),
    )


def sample_scored(group: TrajectoryGroup | None = None) -> ScoredGroup:
    group = group or sample_group()
    sel = [
        ScoredTrajectory(trajectory=t, reward=float(i % 2), advantage=1.0 if i % 2 else -1.0,
                         correct=bool(i % 2), p_err=0.0, p_format=0.0)
        for i, t in enumerate(group.trajectories)
    ]
    return ScoredGroup(
        group_id=group.group_id, run_id=group.run_id, stage=group.stage, problem_id=group.problem_id,
        min_policy_version=0, max_policy_version=0, pass_rate=0.5, n_total=len(sel), roc_mode="roc",
        all_equal=False, selected=sel, roc=RocStats(n_pos=2, n_neg=2),
    )


def sample_weights(run_id: str = "run-test", version: int = 1) -> WeightVersion:
    return WeightVersion(run_id=run_id, version=version, step=version, stage=1,
                         uri="file:///tmp/ckpt/v1", sha256="0" * 64)
