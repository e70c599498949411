"""The reward service's database writes: one ``trajectory_groups`` row per (run_id, group_id)
and the per-run ``problems`` counters, written in ONE transaction so a group is counted once.

Status of a row: ``scored`` (recorded, not yet confirmed published), ``published`` (the
ScoredGroup reached the broker), ``dropped`` (all kept rewards equal and dropping is on: never
published). See :mod:`services.reward.runtime` for how redeliveries use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared.db.models import Problem, TrajectoryGroupRow
from shared.events import ScoredGroup, TrajectoryGroup


@dataclass(frozen=True)
class KafkaCoordinates:
    topic: str
    partition: int
    offset: int


@dataclass(frozen=True)
class GroupRecord:
    status: str
    roc_mode: str
    roc_stats: dict[str, Any]


async def load_group(sessions: async_sessionmaker[AsyncSession], run_id: str, group_id: str) -> GroupRecord | None:
    async with sessions() as session:
        row = (
            await session.execute(
                select(TrajectoryGroupRow.status, TrajectoryGroupRow.roc_mode, TrajectoryGroupRow.roc_stats).where(
                    TrajectoryGroupRow.run_id == run_id, TrajectoryGroupRow.group_id == group_id
                )
            )
        ).one_or_none()
    return GroupRecord(row.status, row.roc_mode, dict(row.roc_stats or {})) if row is not None else None


async def record_scored(
    sessions: async_sessionmaker[AsyncSession],
    group: TrajectoryGroup,
    scored: ScoredGroup,
    *,
    audit: dict[str, Any],
    coords: KafkaCoordinates,
    dropped: bool,
    run_id: str | None = None,
) -> bool:
    """Insert the group's row and add its attempts/successes to ``problems``, atomically.

    Returns False (and changes nothing) when a row for (run_id, group_id) already exists — a
    concurrent replica or an earlier delivery recorded it first. ``run_id`` overrides the
    group's run (replay into a new run).
    """
    run = run_id or group.run_id
    n_total = len(group.trajectories)
    n_correct = round(scored.pass_rate * n_total)
    versions = [v for t in group.trajectories for v in t.token_versions]
    group_max_version = max(versions) if versions else scored.max_policy_version
    row = {
        "run_id": run,
        "group_id": group.group_id,
        "stage": group.stage,
        "problem_id": group.problem_id,
        "min_version": scored.min_policy_version,
        "max_version": scored.max_policy_version,
        "n_total": n_total,
        "n_correct": n_correct,
        "pass_rate": scored.pass_rate,
        "n_selected": len(scored.selected),
        "all_equal": scored.all_equal,
        "dropped": dropped,
        "roc_mode": scored.roc_mode,
        "roc_stats": audit,
        "status": "dropped" if dropped else "scored",
        "kafka_topic": coords.topic,
        "kafka_partition": coords.partition,
        "kafka_offset": coords.offset,
    }
    async with sessions() as session, session.begin():
        inserted = (
            await session.execute(
                pg_insert(TrajectoryGroupRow)
                .values(row)
                .on_conflict_do_nothing(index_elements=["run_id", "group_id"])
                .returning(TrajectoryGroupRow.group_id)
            )
        ).scalar_one_or_none()
        if inserted is None:
            return False
        stmt = pg_insert(Problem).values(
            run_id=run,
            problem_id=group.problem_id,
            answer=group.answer,
            attempts=n_total,
            successes=n_correct,
            last_attempts=n_total,
            last_successes=n_correct,
            last_version=group_max_version,
        )
        # "last_*" describe the most recent policy's group: only a group at least as new replaces them
        newer = or_(Problem.last_version.is_(None), stmt.excluded.last_version >= Problem.last_version)
        await session.execute(
            stmt.on_conflict_do_update(
                index_elements=["run_id", "problem_id"],
                set_={
                    "attempts": Problem.attempts + stmt.excluded.attempts,
                    "successes": Problem.successes + stmt.excluded.successes,
                    "last_attempts": case((newer, stmt.excluded.last_attempts), else_=Problem.last_attempts),
                    "last_successes": case((newer, stmt.excluded.last_successes), else_=Problem.last_successes),
                    "last_version": case((newer, stmt.excluded.last_version), else_=Problem.last_version),
                },
            )
        )
    return True


async def replace_unpublished(
    sessions: async_sessionmaker[AsyncSession],
    run_id: str,
    scored: ScoredGroup,
    audit: dict[str, Any],
    coords: KafkaCoordinates,
    *,
    dropped: bool,
) -> None:
    """A different attempt of a recorded-but-unpublished group is published instead of the one
    recorded (whose trajectories are not at hand): its row follows; problem counters are not
    touched again (the group id was counted once)."""
    async with sessions() as session, session.begin():
        await session.execute(
            update(TrajectoryGroupRow)
            .where(
                TrajectoryGroupRow.run_id == run_id,
                TrajectoryGroupRow.group_id == scored.group_id,
                TrajectoryGroupRow.status == "scored",
            )
            .values(
                min_version=scored.min_policy_version,
                max_version=scored.max_policy_version,
                pass_rate=scored.pass_rate,
                n_selected=len(scored.selected),
                all_equal=scored.all_equal,
                roc_stats=audit,
                dropped=dropped,
                status="dropped" if dropped else "scored",
                kafka_topic=coords.topic,
                kafka_partition=coords.partition,
                kafka_offset=coords.offset,
            )
        )


async def mark_published(sessions: async_sessionmaker[AsyncSession], run_id: str, group_id: str) -> None:
    async with sessions() as session, session.begin():
        await session.execute(
            update(TrajectoryGroupRow)
            .where(
                TrajectoryGroupRow.run_id == run_id,
                TrajectoryGroupRow.group_id == group_id,
                TrajectoryGroupRow.status == "scored",
            )
            .values(status="published")
        )
