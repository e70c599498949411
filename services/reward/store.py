"""The reward service's database writes: one ``trajectory_groups`` row per (run_id, group_id)
and the per-run ``problems`` counters, written in ONE transaction so a group is counted once.

Status of a row: ``scored`` (recorded, not yet confirmed published), ``published`` (the
ScoredGroup reached the broker), ``dropped`` (no kept rollout carries a gradient: never
published), ``redispatch`` (too many rollouts ended ``tool_failure``: never published, not
counted in ``problems``; the orchestrator rolls the task out again as attempt + 1), ``probe``
(a stage-3 entry probe's verdicts: never published, not counted in ``problems``). See :mod:`services.reward.runtime` for how redeliveries use it.
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
    attempt: int


async def load_group(sessions: async_sessionmaker[AsyncSession], run_id: str, group_id: str) -> GroupRecord | None:
    async with sessions() as session:
        row = (
            await session.execute(
                select(TrajectoryGroupRow.status, TrajectoryGroupRow.roc_mode, TrajectoryGroupRow.roc_stats,
                       TrajectoryGroupRow.attempt).where(
                    TrajectoryGroupRow.run_id == run_id, TrajectoryGroupRow.group_id == group_id
                )
            )
        ).one_or_none()
    if row is None:
        return None
    return GroupRecord(row.status, row.roc_mode, dict(row.roc_stats or {}), row.attempt)


# Row statuses whose group counts in ``problems`` (a redispatch row's attempt was lost; a probe
# measures the policy and trains nothing).
COUNTED_STATUSES = ("scored", "dropped")
ROW_STATUSES = ("scored", "dropped", "redispatch", "probe")


def _attempt_columns(group: TrajectoryGroup, scored: ScoredGroup, audit: dict[str, Any], coords: KafkaCoordinates,
                     status: str) -> dict[str, Any]:
    """The columns of a group's row that describe the attempt recorded (all but the key, stage
    and problem): written on insert, rewritten when another attempt takes the row's place."""
    return {
        "min_version": scored.min_policy_version,
        "max_version": scored.max_policy_version,
        "n_total": scored.n_total,
        "n_correct": round(scored.pass_rate * scored.n_total),
        "pass_rate": scored.pass_rate,
        "n_selected": len(scored.selected),
        "all_equal": scored.all_equal,
        "dropped": status == "dropped",
        "roc_mode": scored.roc_mode,
        "roc_stats": audit,
        "status": status,
        "attempt": group.attempt,
        "n_tool_failure": scored.roc.n_tool_failure,
        "kafka_topic": coords.topic,
        "kafka_partition": coords.partition,
        "kafka_offset": coords.offset,
    }


async def _count_problem(session: AsyncSession, run_id: str, group: TrajectoryGroup, scored: ScoredGroup) -> None:
    """Add the group's attempts/successes (the rollouts that count) to its ``problems`` row."""
    n_total = scored.n_total
    n_correct = round(scored.pass_rate * n_total)
    versions = [v for t in group.trajectories for v in t.token_versions]
    group_max_version = max(versions) if versions else scored.max_policy_version
    stmt = pg_insert(Problem).values(
        run_id=run_id,
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


async def record_scored(
    sessions: async_sessionmaker[AsyncSession],
    group: TrajectoryGroup,
    scored: ScoredGroup,
    *,
    audit: dict[str, Any],
    coords: KafkaCoordinates,
    status: str,
    run_id: str | None = None,
) -> bool:
    """Insert the group's row with ``status`` (``scored``, ``dropped``, ``redispatch`` or
    ``probe``) and add its attempts/successes to ``problems``, atomically (only for
    :data:`COUNTED_STATUSES`: the attempt that replaces a redispatch row counts instead).

    Returns False (and changes nothing) when a row for (run_id, group_id) already exists — a
    concurrent replica or an earlier delivery recorded it first. ``run_id`` overrides the
    group's run (replay into a new run).
    """
    run = run_id or group.run_id
    row = {"run_id": run, "group_id": group.group_id, "stage": group.stage, "problem_id": group.problem_id,
           **_attempt_columns(group, scored, audit, coords, status)}
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
        if status in COUNTED_STATUSES:
            await _count_problem(session, run, group, scored)
    return True


async def replace_unpublished(
    sessions: async_sessionmaker[AsyncSession],
    run_id: str,
    group: TrajectoryGroup,
    scored: ScoredGroup,
    audit: dict[str, Any],
    coords: KafkaCoordinates,
    *,
    status: str,
) -> bool:
    """Another attempt of a recorded-but-unpublished group takes the recorded one's place (whose
    trajectories are not at hand): its row follows, with ``status``. Problem counters are added
    only when the recorded row counted nothing (``redispatch``) and this one counts; a ``scored``
    row was counted once for the group id. False (nothing changed) when the row was
    published or dropped meanwhile by another replica."""
    async with sessions() as session, session.begin():
        previous = (
            await session.execute(
                select(TrajectoryGroupRow.status)
                .where(TrajectoryGroupRow.run_id == run_id, TrajectoryGroupRow.group_id == scored.group_id)
                .with_for_update()
            )
        ).scalar_one_or_none()
        if previous not in ("scored", "redispatch"):
            return False
        await session.execute(
            update(TrajectoryGroupRow)
            .where(TrajectoryGroupRow.run_id == run_id, TrajectoryGroupRow.group_id == scored.group_id)
            .values(**_attempt_columns(group, scored, audit, coords, status))
        )
        if previous not in COUNTED_STATUSES and status in COUNTED_STATUSES:
            await _count_problem(session, run_id, group, scored)
    return True


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
