"""`make demo`: the smallest real round trip that exists so far (replaced by the end-to-end RL
run once every service has landed): start the embedded stack, send a TrajectoryGroup through
the broker and read it back through a consumer group, record it in PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

from shared import stack, topics
from shared.db.models import TrajectoryGroupRow
from shared.db.session import make_engine, session_factory, upsert
from shared.events import new_id
from shared.kafka import ConsumerLoop, EventProducer, ensure_topics
from shared.settings import DEFAULT_STATE_DIR
from shared.testing import sample_group


async def _round_trip(info: stack.StackInfo) -> dict:
    prefix = f"demo-{new_id()[:6]}."
    await ensure_topics(info.kafka_bootstrap, prefix)
    producer = EventProducer(info.kafka_bootstrap)
    await producer.start()
    engine = make_engine(info.database_url)
    sessions = session_factory(engine)
    group = sample_group(n=32, n_tokens=2048, run_id="demo")
    name = prefix + topics.TRAJECTORIES.name
    got: list = []

    async def handler(env, rec):
        g = env.payload
        async with sessions() as s:
            await s.execute(upsert(TrajectoryGroupRow, dict(
                run_id=g.run_id, group_id=g.group_id, stage=g.stage, problem_id=g.problem_id,
                min_version=0, max_version=0, n_total=len(g.trajectories), n_correct=0, pass_rate=0.0,
                n_selected=0, all_equal=True, roc_mode="none", roc_stats={}, kafka_topic=rec.topic,
                kafka_partition=rec.partition, kafka_offset=rec.offset)))
            await s.commit()
        got.append(g)

    t0 = time.perf_counter()
    await producer.send(name, group, key=group.group_id)
    loop = ConsumerLoop(info.kafka_bootstrap, name, "demo", handler, producer, expect=type(group))
    task = asyncio.create_task(loop.run())
    while not got:
        await asyncio.sleep(0.05)
    loop.stop()
    await task
    await producer.stop()
    await engine.dispose()
    return {"round_trip_ok": got[0] == group, "round_trip_s": round(time.perf_counter() - t0, 2),
            "tokens": sum(len(t.response_token_ids) for t in group.trajectories)}


def main() -> None:
    info = stack.up(Path(DEFAULT_STATE_DIR))
    print(f"embedded stack: kafka {info.kafka_bootstrap}, database {info.database_url}")
    result = asyncio.run(_round_trip(info))
    print(json.dumps(result))
