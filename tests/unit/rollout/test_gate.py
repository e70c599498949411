"""AdmissionGate: the async face of the scheduler (futures resolved on admission, freed on exit)."""

from __future__ import annotations

import asyncio

from services.rollout.rollouts import AdmissionGate
from services.rollout.scheduler import RolloutScheduler


def test_waiters_are_admitted_when_capacity_frees_and_cancel_is_clean():
    async def scenario():
        gate = AdmissionGate(RolloutScheduler({0: 100, 1: 100}, block_size=1))
        a = asyncio.create_task(gate.acquire("a", 100, 10, "g"))
        b = asyncio.create_task(gate.acquire("b", 100, 10, "g"))
        c = asyncio.create_task(gate.acquire("c", 100, 10, "g"))
        d = asyncio.create_task(gate.acquire("d", 100, 10, "g"))
        await asyncio.sleep(0)
        engine_a, engine_b = await a, await b
        assert {engine_a, engine_b} == {0, 1}
        assert not c.done()
        d.cancel()  # gives up while waiting: leaves the queue
        await asyncio.sleep(0)
        gate.release("a", response_tokens=50)
        assert await c == engine_a  # took the room a freed, at once
        gate.release("b")
        gate.release("c")
        assert gate.scheduler.running == 0 and gate.scheduler.waiting == 0

    asyncio.run(scenario())
