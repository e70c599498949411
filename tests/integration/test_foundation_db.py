"""Migrations and upserts against a real PostgreSQL."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import inspect, select, text

from shared.db.models import Base, Problem, Run, TrajectoryGroupRow
from shared.db.session import downgrade, make_engine, session_factory, upgrade, upsert

pytestmark = pytest.mark.integration

TABLES = {"runs", "stages", "policy_versions", "problems", "rollout_tasks", "trajectory_groups",
          "learner_steps", "service_instances"}


async def _tables(engine) -> set[str]:
    async with engine.connect() as conn:
        return set(await conn.run_sync(lambda c: inspect(c).get_table_names()))


async def test_migrations_upgrade_from_empty_and_downgrade_back(stack):
    # A fresh database on the same server.
    name = f"mig_{uuid.uuid4().hex[:8]}"
    admin = make_engine(stack.database_url, isolation_level="AUTOCOMMIT")
    async with admin.connect() as conn:
        await conn.execute(text(f"CREATE DATABASE {name}"))
    url = stack.database_url.replace("/rstar", f"/{name}", 1)
    engine = make_engine(url)
    try:
        assert await _tables(engine) == set()
        await upgrade(url)
        assert TABLES <= await _tables(engine)
        # The migration matches the models: every model column exists.
        async with engine.connect() as conn:
            for table in Base.metadata.sorted_tables:
                cols = {c["name"] for c in await conn.run_sync(lambda c, t=table.name: inspect(c).get_columns(t))}
                assert {c.name for c in table.columns} == cols, table.name
        await downgrade(url)
        assert await _tables(engine) <= {"alembic_version"}
        await upgrade(url)  # and up again
        assert TABLES <= await _tables(engine)
    finally:
        await engine.dispose()
        async with admin.connect() as conn:
            await conn.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
        await admin.dispose()


async def test_upserts_are_idempotent(db_engine):
    sessions = session_factory(db_engine)
    run_id = f"run-{uuid.uuid4().hex[:8]}"
    row = dict(run_id=run_id, group_id="g1", stage=1, problem_id="p1", min_version=0, max_version=1,
               n_total=32, n_correct=8, pass_rate=0.25, n_selected=16, all_equal=False, roc_mode="roc",
               roc_stats={}, kafka_topic="t", kafka_partition=0, kafka_offset=7)
    async with sessions() as s:
        await s.execute(upsert(Run, {"run_id": run_id, "name": "x"}))
        for _ in range(3):  # a redelivered group: same insert, nothing changes
            res = await s.execute(upsert(TrajectoryGroupRow, row).returning(TrajectoryGroupRow.group_id))
        await s.commit()
        assert res.first() is None  # the repeats inserted nothing
        count = (await s.execute(select(TrajectoryGroupRow).where(TrajectoryGroupRow.run_id == run_id))).scalars().all()
        assert len(count) == 1
        # DO UPDATE form: the latest value wins, still one row.
        for attempts in (4, 8, 8):
            await s.execute(upsert(Problem, {"run_id": run_id, "problem_id": "p1", "attempts": attempts},
                                   update=["attempts"]))
        await s.commit()
        probs = (await s.execute(select(Problem).where(Problem.run_id == run_id))).scalars().all()
        assert [p.attempts for p in probs] == [8]


async def test_heartbeat_of_a_restarted_instance_records_its_new_process(db_engine):
    from shared.db.models import ServiceInstance
    from shared.runtime import heartbeat_upsert

    sessions = session_factory(db_engine)
    instance = f"probe-{uuid.uuid4().hex[:8]}"
    async with sessions() as s:
        for pid, port in ((1111, 9001), (2222, 9002)):  # the same instance id, restarted
            await s.execute(heartbeat_upsert({"instance_id": instance, "service": "probe", "host": "h", "pid": pid,
                                             "port": port, "status": "up", "info": {}}))
            await s.commit()
        row = (await s.execute(select(ServiceInstance).where(ServiceInstance.instance_id == instance))).scalar_one()
    assert (row.pid, row.port) == (2222, 9002)
