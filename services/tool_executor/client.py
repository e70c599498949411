"""Async client of the tool executor, for the rollout service.

    client = ToolExecutorClient(["http://127.0.0.1:8102", "http://10.0.0.7:8102"])
    result = await client.execute("print(1+1)", timeout_s=5)   # -> ExecutionResult
    results = await client.execute_many(["print(1)", ExecuteRequest(code="1/0")])
    await client.aclose()

- Replica choice: least outstanding requests (ties: round robin); a replica that refused a
  connection is avoided for `down_s`. Calls with a `session_id` always go to the same replica
  (hash of the id), because a session lives in the memory of the replica that ran it.
- Retries, with exponential backoff and jitter (tenacity), only when nothing ran: a `rejected`
  answer (HTTP 429, backpressure) or a connection that could not be made/was dropped before an
  answer. Results of the code (error, timeout, ...) are returned, never retried.
- When every attempt failed: `ToolExecutorUnavailable` (the rollout maps it to a tool failure).
  A request the service finds invalid (422): `ToolExecutorRequestError`.
- `execute_many` splits the items into batches of at most `max_batch_items` and keeps at most
  `batches_in_flight_per_replica` batches per replica in flight, so a burst of any size drains
  at the service's pace without being rejected whole.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
import zlib
from collections.abc import Sequence
from typing import Any

import httpx
import orjson
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from services.tool_executor.models import ExecuteRequest, ExecutionResult

__all__ = ["ToolExecutorClient", "ToolExecutorUnavailable", "ToolExecutorRequestError", "ExecutionResult", "ExecuteRequest"]


class ToolExecutorUnavailable(RuntimeError):
    """No replica ran the call after all retries (connection failures or backpressure)."""


class ToolExecutorRequestError(ValueError):
    """The service refused the request as invalid (HTTP 422); retrying cannot help."""


class _Retryable(Exception):
    pass


class ToolExecutorClient:
    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        timeout_s: float | None = None,
        memory_mb: int | None = None,
        max_attempts: int = 8,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 2.0,
        http_timeout_s: float = 300.0,
        connect_timeout_s: float = 5.0,
        max_batch_items: int = 1000,
        batches_in_flight_per_replica: int = 2,
        max_connections: int = 1024,
        down_s: float = 1.0,
    ) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls:
            raise ValueError("ToolExecutorClient needs at least one URL")
        self.urls = [u.rstrip("/") for u in self.urls]
        self.default_timeout_s = timeout_s
        self.default_memory_mb = memory_mb
        self.max_attempts = max_attempts
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.max_batch_items = max_batch_items
        self.down_s = down_s
        self.outstanding = [0] * len(self.urls)
        self._down_until = [0.0] * len(self.urls)
        self._rr = itertools.count()
        self._batch_slots = asyncio.Semaphore(batches_in_flight_per_replica * len(self.urls))
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(http_timeout_s, connect=connect_timeout_s, pool=None),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def __aenter__(self) -> "ToolExecutorClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- replica choice ------------------------------------------------------------------
    def _pick(self, session_id: str | None) -> int:
        if session_id is not None:
            return zlib.crc32(session_id.encode()) % len(self.urls)
        now = time.monotonic()
        up = [i for i in range(len(self.urls)) if self._down_until[i] <= now] or list(range(len(self.urls)))
        least = min(self.outstanding[i] for i in up)
        candidates = [i for i in up if self.outstanding[i] == least]
        return candidates[next(self._rr) % len(candidates)]

    def _request(self, item: ExecuteRequest | str | dict[str, Any], **kw: Any) -> dict[str, Any]:
        if isinstance(item, str):
            body: dict[str, Any] = {"code": item, **kw}
        elif isinstance(item, ExecuteRequest):
            body = item.model_dump(exclude_none=True)
        else:
            body = dict(item)
        if body.get("timeout_s") is None and self.default_timeout_s is not None:
            body["timeout_s"] = self.default_timeout_s
        if body.get("memory_mb") is None and self.default_memory_mb is not None:
            body["memory_mb"] = self.default_memory_mb
        return {k: v for k, v in body.items() if v is not None}

    async def _attempt(self, path: str, payload: bytes, session_id: str | None, failures: list[str]) -> httpx.Response:
        i = self._pick(session_id)
        self.outstanding[i] += 1
        try:
            resp = await self._http.post(self.urls[i] + path, content=payload, headers={"content-type": "application/json"})
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            self._down_until[i] = time.monotonic() + self.down_s
            failures.append(f"{self.urls[i]}: {exc!r}")
            raise _Retryable() from exc
        except httpx.TimeoutException as exc:
            raise ToolExecutorUnavailable(f"{self.urls[i]}{path}: no answer in time ({exc!r})") from exc
        finally:
            self.outstanding[i] -= 1
        if resp.status_code == 429 or resp.status_code in (502, 503, 504):
            failures.append(f"{self.urls[i]}: HTTP {resp.status_code}")
            raise _Retryable()
        if resp.status_code == 422:
            raise ToolExecutorRequestError(f"invalid request: {resp.json().get('detail')}")
        if resp.status_code != 200:
            raise ToolExecutorUnavailable(f"{self.urls[i]}{path}: HTTP {resp.status_code}: {resp.text[:500]}")
        return resp

    async def _post(self, path: str, body: dict[str, Any], session_id: str | None) -> httpx.Response:
        """POST with retries on backpressure and connection failures."""
        payload = orjson.dumps(body)
        failures: list[str] = []
        try:
            # The first attempt goes straight out (the common case, kept cheap); retries use
            # tenacity's exponential backoff with jitter.
            return await self._attempt(path, payload, session_id, failures)
        except _Retryable:
            if self.max_attempts <= 1:
                raise ToolExecutorUnavailable(f"tool executor unavailable: {'; '.join(failures)}") from None
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(self.max_attempts - 1),
                wait=wait_exponential_jitter(multiplier=self.backoff_initial_s, max=self.backoff_max_s, jitter=self.backoff_initial_s),
                retry=retry_if_exception_type(_Retryable),
                reraise=True,
                before_sleep=None,
            ):
                with attempt:
                    if attempt.retry_state.attempt_number == 1:
                        await asyncio.sleep(self.backoff_initial_s * random.random())
                    return await self._attempt(path, payload, session_id, failures)
        except _Retryable:
            pass
        raise ToolExecutorUnavailable(f"tool executor unavailable after {self.max_attempts} attempts: {'; '.join(failures[-3:])}")

    # -- API -----------------------------------------------------------------------------
    async def execute(
        self,
        code: str,
        *,
        stdin: str = "",
        timeout_s: float | None = None,
        memory_mb: int | None = None,
        session_id: str | None = None,
    ) -> ExecutionResult:
        body = self._request(code, stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb, session_id=session_id)
        resp = await self._post("/v1/execute", body, session_id)
        return ExecutionResult.model_validate_json(resp.content)

    async def execute_many(self, items: Sequence[ExecuteRequest | str | dict[str, Any]]) -> list[ExecutionResult]:
        """Results in the order of `items`. Items with a session_id run one after another
        per session (through `execute`); the rest go in batches."""
        bodies = [self._request(item) for item in items]
        results: list[ExecutionResult | None] = [None] * len(bodies)
        plain = [i for i, b in enumerate(bodies) if not b.get("session_id")]
        by_session: dict[str, list[int]] = {}
        for i, b in enumerate(bodies):
            if b.get("session_id"):
                by_session.setdefault(b["session_id"], []).append(i)

        async def run_batch(indices: list[int]) -> None:
            async with self._batch_slots:
                resp = await self._post("/v1/execute/batch", {"items": [bodies[i] for i in indices]}, None)
            data = orjson.loads(resp.content)["results"]
            for i, r in zip(indices, data):
                results[i] = ExecutionResult.model_validate(r)

        async def run_session(indices: list[int]) -> None:
            for i in indices:
                b = bodies[i]
                results[i] = await self.execute(
                    b["code"], stdin=b.get("stdin", ""), timeout_s=b.get("timeout_s"), memory_mb=b.get("memory_mb"), session_id=b["session_id"]
                )

        chunks = [plain[k : k + self.max_batch_items] for k in range(0, len(plain), self.max_batch_items)]
        await asyncio.gather(*(run_batch(c) for c in chunks), *(run_session(ix) for ix in by_session.values()))
        return [r for r in results if r is not None]
