"""ToolExecutorClient against real servers: replica spreading, failover, backpressure
(429 -> retry), batches larger than the server's batch limit, clear errors."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.tool_executor.client import ToolExecutorClient, ToolExecutorRequestError, ToolExecutorUnavailable
from services.tool_executor.testing import NOT_ROOT_ENV, free_port, running_server


@pytest.fixture(scope="module")
def tight_server():
    """One slot and no queue: a second concurrent call is rejected at once."""
    env = {
        "RSTAR_TOOL_EXECUTOR_WORKERS": "1",
        "RSTAR_TOOL_EXECUTOR_SLOTS_PER_WORKER": "1",
        "RSTAR_TOOL_EXECUTOR_QUEUE_MAX": "0",
        "RSTAR_TOOL_EXECUTOR_MAX_BATCH_ITEMS": "7",
        "RSTAR_TOOL_EXECUTOR_BATCH_BACKLOG_MAX": "10",
        "RSTAR_TOOL_EXECUTOR_UID_BASE": "330000",
    }
    with running_server({**env, **NOT_ROOT_ENV}) as srv:
        yield srv


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


async def test_backpressure_answers_429_at_once_never_5xx(tight_server):
    async with httpx.AsyncClient(base_url=tight_server.url, timeout=30) as http:
        responses = await asyncio.gather(*(http.post("/v1/execute", json={"code": "import time\ntime.sleep(0.3)"}) for _ in range(6)))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
    rejected = [r.json() for r in responses if r.status_code == 429]
    assert all(r["status"] == "rejected" and "retry" in r["stderr"] for r in rejected)


async def test_client_retries_rejected_calls_until_they_run(tight_server):
    async with ToolExecutorClient([tight_server.url], backoff_initial_s=0.05, max_attempts=30) as client:
        results = await asyncio.gather(*(client.execute(f"import time\ntime.sleep(0.05)\nprint({i})") for i in range(8)))
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(8)]
    assert all(r.status == "ok" for r in results)


async def test_execute_many_splits_and_drains_past_the_batch_limits(tight_server):
    codes = [f"print({i} + 1)" for i in range(40)]  # server: 7 items per batch, backlog 10
    async with ToolExecutorClient([tight_server.url], max_batch_items=7, batches_in_flight_per_replica=3, max_attempts=50, backoff_max_s=0.5) as client:
        results = await client.execute_many(codes)
    assert [r.stdout for r in results] == [f"{i + 1}\n" for i in range(40)]


async def test_failover_to_a_live_replica(tight_server):
    async with ToolExecutorClient([dead_url(), tight_server.url], max_attempts=6, backoff_initial_s=0.01) as client:
        results = [await client.execute("print('hi')") for _ in range(4)]
        assert all(r.stdout == "hi\n" for r in results)
        assert client.outstanding == [0, 0]


async def test_unavailable_when_no_replica_answers():
    async with ToolExecutorClient([dead_url(), dead_url()], max_attempts=3, backoff_initial_s=0.01, backoff_max_s=0.02) as client:
        with pytest.raises(ToolExecutorUnavailable, match="after 3 attempts"):
            await client.execute("print(1)")
        with pytest.raises(ToolExecutorUnavailable):
            await client.execute_many(["print(1)", "print(2)"])


async def test_invalid_request_is_a_request_error_not_retried(tight_server):
    async with ToolExecutorClient([tight_server.url]) as client:
        with pytest.raises(ToolExecutorRequestError, match="exceeds the service maximum"):
            await client.execute("print(1)", timeout_s=10_000)


async def test_failures_of_the_code_are_results(tight_server):
    async with ToolExecutorClient([tight_server.url], max_attempts=20) as client:
        r = await client.execute("raise ValueError('boom')")
        assert r.status == "error" and "ValueError: boom" in r.stderr and not r.ok
        r = await client.execute("while True: pass", timeout_s=0.5)
        assert r.status == "timeout"


async def test_session_items_run_in_order_through_the_client(tight_server):
    # A session's items in execute_many run in order, one after another, on the session's replica.
    async with ToolExecutorClient([tight_server.url], max_attempts=20) as client:
        await client.execute("z = 5", session_id="client-s")
        results = await client.execute_many([{"code": "z += 1", "session_id": "client-s"}, {"code": "print(z)", "session_id": "client-s"}, "print('plain')"])
    assert [r.stdout for r in results] == ["", "6\n", "plain\n"]
