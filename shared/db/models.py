"""Run metadata in PostgreSQL (SQLAlchemy 2 declarative models; the schema is owned by the
Alembic migrations in ``shared/migrations``, which must be kept in step with this file).

Only ``stages`` has a foreign key to ``runs``: the other tables are written by services that
consume events of runs created elsewhere (a replay into a new run, a learner started before the
orchestrator recorded the run), so they reference ``run_id`` by value.

Keys are chosen so that every write the services make is an idempotent upsert: a redelivered
Kafka message re-runs the same INSERT ... ON CONFLICT and changes nothing.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Boolean, DateTime, Float, ForeignKey, Index, Integer, String, Text, func
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


def _now() -> Mapped[datetime]:
    return mapped_column(DateTime(timezone=True), server_default=func.now(), nullable=False)


class Run(Base):
    __tablename__ = "runs"
    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    config: Mapped[dict] = mapped_column(JSONB, default=dict)
    status: Mapped[str] = mapped_column(String(32), default="created")  # created|running|finished|failed|stopped
    current_stage: Mapped[int] = mapped_column(Integer, default=0)
    current_version: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = _now()
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now(), nullable=False
    )


class Stage(Base):
    __tablename__ = "stages"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True)
    stage: Mapped[int] = mapped_column(Integer, primary_key=True)
    config: Mapped[dict] = mapped_column(JSONB, default=dict)
    status: Mapped[str] = mapped_column(String(32), default="pending")  # pending|running|done
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    start_version: Mapped[int | None] = mapped_column(Integer)


class PolicyVersion(Base):
    __tablename__ = "policy_versions"
    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    version: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer)
    stage: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = _now()


class Problem(Base):
    """A problem of a run's dataset with the run's attempts/successes (stage-3 hard filter)."""

    __tablename__ = "problems"
    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    problem_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    dataset: Mapped[str] = mapped_column(String(200), default="")
    prompt: Mapped[str] = mapped_column(Text, default="")
    answer: Mapped[str] = mapped_column(Text, default="")
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    successes: Mapped[int] = mapped_column(Integer, default=0)
    # The most recent scored group of this problem: what "the latest policy solves" reads.
    last_attempts: Mapped[int] = mapped_column(Integer, default=0)
    last_successes: Mapped[int] = mapped_column(Integer, default=0)
    last_version: Mapped[int | None] = mapped_column(Integer)


class RolloutTaskRow(Base):
    __tablename__ = "rollout_tasks"
    task_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(64), index=True)
    stage: Mapped[int] = mapped_column(Integer)
    problem_id: Mapped[str] = mapped_column(String(128))
    status: Mapped[str] = mapped_column(String(32), default="leased")  # leased|done|expired|failed
    lease_owner: Mapped[str | None] = mapped_column(String(128))
    deadline: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    attempts: Mapped[int] = mapped_column(Integer, default=1)
    min_policy_version: Mapped[int] = mapped_column(Integer, default=0)
    # train: admitted under bounded staleness, trained on; probe: a stage-3 entry probe of the
    # current policy (not counted in admission, never trained on)
    purpose: Mapped[str] = mapped_column(String(16), default="train", server_default="train")
    created_at: Mapped[datetime] = _now()
    updated_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), server_default=func.now(), onupdate=func.now(), nullable=False
    )

    __table_args__ = (Index("ix_rollout_tasks_run_status_deadline", "run_id", "status", "deadline"),)


class TrajectoryGroupRow(Base):
    __tablename__ = "trajectory_groups"
    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    group_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    stage: Mapped[int] = mapped_column(Integer)
    problem_id: Mapped[str] = mapped_column(String(128), index=True)
    min_version: Mapped[int] = mapped_column(Integer)
    max_version: Mapped[int] = mapped_column(Integer)
    n_total: Mapped[int] = mapped_column(Integer)
    n_correct: Mapped[int] = mapped_column(Integer)
    pass_rate: Mapped[float] = mapped_column(Float)
    n_selected: Mapped[int] = mapped_column(Integer)
    all_equal: Mapped[bool] = mapped_column(Boolean)
    dropped: Mapped[bool] = mapped_column(Boolean, default=False)  # not published (no signal)
    roc_mode: Mapped[str] = mapped_column(String(32))
    roc_stats: Mapped[dict] = mapped_column(JSONB, default=dict)
    # scored|published|dropped|redispatch (lost too many rollouts to tool_failure: not trained,
    # the orchestrator rolls the task out again)|probe (a probe task's verdicts: never trained)
    status: Mapped[str] = mapped_column(String(32), default="scored")
    attempt: Mapped[int] = mapped_column(Integer, default=1, server_default="1")  # the task attempt it came from
    n_tool_failure: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # rollouts left out
    # Where the raw TrajectoryGroup sits, for replay.
    kafka_topic: Mapped[str] = mapped_column(String(200))
    kafka_partition: Mapped[int] = mapped_column(Integer)
    kafka_offset: Mapped[int] = mapped_column(BigInteger)
    scored_at: Mapped[datetime] = _now()
    # Set by the learner in the transaction that records the step that trained on the group.
    trained_step: Mapped[int | None] = mapped_column(Integer)
    # Set by the learner when it gives a published group up for good ("stale": past the
    # staleness bound; "no_signal": all advantages 0; "run_complete": past the run's last
    # step), at once, so that the orchestrator can
    # admit a replacement without waiting for a step that may need that replacement.
    learner_skipped: Mapped[str | None] = mapped_column(String(32))


class LearnerStep(Base):
    __tablename__ = "learner_steps"
    run_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[int] = mapped_column(Integer)
    stage: Mapped[int] = mapped_column(Integer, default=0)
    n_groups: Mapped[int] = mapped_column(Integer, default=0)
    n_tokens: Mapped[int] = mapped_column(Integer, default=0)
    loss: Mapped[float | None] = mapped_column(Float)
    clip_frac_low: Mapped[float | None] = mapped_column(Float)
    clip_frac_high: Mapped[float | None] = mapped_column(Float)
    is_weight_mean: Mapped[float | None] = mapped_column(Float)
    is_weight_max: Mapped[float | None] = mapped_column(Float)
    approx_kl: Mapped[float | None] = mapped_column(Float)
    entropy: Mapped[float | None] = mapped_column(Float)
    grad_norm: Mapped[float | None] = mapped_column(Float)
    tokens_per_s: Mapped[float | None] = mapped_column(Float)
    staleness_mean: Mapped[float | None] = mapped_column(Float)
    staleness_max: Mapped[float | None] = mapped_column(Float)
    reward_mean: Mapped[float | None] = mapped_column(Float)
    pass_rate_mean: Mapped[float | None] = mapped_column(Float)
    response_len_mean: Mapped[float | None] = mapped_column(Float)
    tool_error_rate_pos: Mapped[float | None] = mapped_column(Float)
    dropped_stale: Mapped[int] = mapped_column(Integer, default=0)
    optimizer_reset: Mapped[bool] = mapped_column(Boolean, default=False)
    metrics: Mapped[dict] = mapped_column(JSONB, default=dict)
    created_at: Mapped[datetime] = _now()


class ServiceInstance(Base):
    __tablename__ = "service_instances"
    instance_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    service: Mapped[str] = mapped_column(String(64), index=True)
    host: Mapped[str] = mapped_column(String(200))
    pid: Mapped[int] = mapped_column(Integer)
    port: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(32), default="up")  # up|stopped
    info: Mapped[dict] = mapped_column(JSONB, default=dict)
    started_at: Mapped[datetime] = _now()
    last_heartbeat: Mapped[datetime] = _now()
