"""Tool executor service wiring: FastAPI routes -> WorkerPool (pool.py) -> pool parents
(zygote.py). Runs under `shared.runtime` (`rstar serve tool-executor`, port 8102); no Kafka,
no database: replicas are independent (sessions live in the replica that ran them).

Routes:
- ``POST /v1/execute`` ExecuteRequest -> ExecutionResult (200; 429 with status `rejected`
  when the queue is full). Failures of the code are results, not HTTP errors.
- ``POST /v1/execute/batch`` {items: [...]} -> {results: [...]} in order. The batch is
  admitted whole if its items fit in the batch backlog (else 429, nothing run); admitted items
  never get `rejected`: each batch feeds at most as many items to the pool at once as the pool
  has slots, the rest wait inside the batch.
- ``DELETE /v1/sessions/{id}`` forgets a session.
- 422 with a reason for an invalid body, a limit above the service maximum, an oversized code
  or stdin, a batch over `max_batch_items`, or a full session.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from services.tool_executor import metrics, policy
from services.tool_executor.config import Settings
from services.tool_executor.models import BatchRequest, ExecuteRequest
from services.tool_executor.pool import CallRequest, WorkerPool, error_result, rejected_result
from services.tool_executor.sessions import SessionFull, SessionStore
from shared.logging import get_logger
from shared.runtime import RuntimeContext, Service

log = get_logger("tool_executor")

# How often expired sessions are dropped.
SESSION_SWEEP_S = 10.0


class InvalidRequest(ValueError):
    pass


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status_code=status, media_type="application/json")


def _invalid(reason: Any) -> Response:
    return _json({"detail": reason}, 422)


def _validation_detail(exc: ValidationError) -> list[dict[str, Any]]:
    return [{"loc": list(e["loc"]), "msg": e["msg"], "type": e["type"]} for e in exc.errors(include_url=False, include_input=False)]


class ToolExecutorService(Service):
    name = "tool-executor"
    needs_kafka = False
    needs_db = False

    def __init__(self, settings: Settings):
        super().__init__(settings)
        self.settings: Settings = settings
        self.pool = WorkerPool(settings)
        self.sessions = SessionStore(
            ttl_s=settings.session_ttl_s,
            max_cells=settings.session_max_cells,
            max_code_chars=settings.session_max_code_chars,
            max_sessions=settings.max_sessions,
            clock=time.monotonic,
        )
        self._session_locks: dict[str, asyncio.Lock] = {}
        self.batch_backlog = 0

    # -- lifecycle -----------------------------------------------------------------------
    async def start(self, ctx: RuntimeContext) -> None:
        await super().start(ctx)
        await self.pool.start()

    async def run(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), SESSION_SWEEP_S)
            except asyncio.TimeoutError:
                pass
            self.sessions.expire()
            metrics.SESSIONS.set(len(self.sessions))

    async def stop(self) -> None:
        await super().stop()
        await self.pool.close()

    async def ready(self) -> dict[str, bool]:
        checks = {"pool_parents_alive": self.pool.all_alive()}
        # Bool-valued like every check: an insecure pool is ready, and the key says so.
        checks["insecure_sandbox" if not self.pool.secure else "sandbox_isolated"] = True
        return checks

    def info(self) -> dict[str, Any]:
        return {"secure": self.pool.secure, "isolation": self.pool.isolation, "pool": self.pool.snapshot(), "sessions": len(self.sessions)}

    # -- calls ---------------------------------------------------------------------------
    def _prepare(self, req: ExecuteRequest) -> CallRequest:
        s = self.settings
        if len(req.code) > s.max_code_chars:
            raise InvalidRequest(f"code has {len(req.code)} characters; the maximum is {s.max_code_chars}")
        if len(req.stdin) > s.max_stdin_chars:
            raise InvalidRequest(f"stdin has {len(req.stdin)} characters; the maximum is {s.max_stdin_chars}")
        try:
            limits = policy.resolve_limits(req.timeout_s, req.memory_mb, self.pool.maxima)
        except policy.LimitError as exc:
            raise InvalidRequest(str(exc)) from exc
        return CallRequest(code=req.code, stdin=req.stdin, limits=limits)

    async def _run(self, req: ExecuteRequest, call: CallRequest, *, enqueued_at: float, admitted: bool) -> dict[str, Any]:
        if req.session_id is None:
            return await self.pool.execute(call, enqueued_at=enqueued_at, admitted=admitted)
        lock = self._session_locks.setdefault(req.session_id, asyncio.Lock())
        try:
            async with lock:  # a session's calls run one after another, in arrival order
                try:
                    plan = self.sessions.plan(req.session_id, req.code)
                except SessionFull as exc:
                    raise InvalidRequest(str(exc)) from exc
                call.replay = plan.cells
                call.extra_time_s = min(plan.extra_time_s, self.settings.max_timeout_s)
                result = await self.pool.execute(call, enqueued_at=enqueued_at, admitted=admitted)
                if result["status"] == policy.Status.OK.value:
                    self.sessions.record(req.session_id, req.code, result["duration_ms"] - plan.replayed_ms)
                return result
        finally:
            if not lock.locked() and not lock._waiters:  # type: ignore[attr-defined]
                self._session_locks.pop(req.session_id, None)

    @staticmethod
    def _finish(result: dict[str, Any]) -> dict[str, Any]:
        result["truncated"] = bool(result.get("stdout_truncated") or result.get("stderr_truncated"))
        return result

    async def execute_one(self, request: Request) -> Response:
        enqueued_at = time.monotonic()
        try:
            req = ExecuteRequest.model_validate_json(await request.body())
            call = self._prepare(req)
        except ValidationError as exc:
            return _invalid(_validation_detail(exc))
        except InvalidRequest as exc:
            return _invalid(str(exc))
        try:
            result = await self._run(req, call, enqueued_at=enqueued_at, admitted=False)
        except InvalidRequest as exc:
            return _invalid(str(exc))
        except Exception as exc:  # noqa: BLE001 - a bug here must still be an answer, not a 5xx
            log.exception("execute_failed")
            result = error_result(f"tool executor internal error: {exc!r}")
        if result["status"] == policy.Status.REJECTED.value:
            metrics.REJECTED.labels("execute").inc()
            return _json(self._finish(result), 429)
        return _json(self._finish(result))

    async def execute_batch(self, request: Request) -> Response:
        enqueued_at = time.monotonic()
        try:
            batch = BatchRequest.model_validate_json(await request.body())
        except ValidationError as exc:
            return _invalid(_validation_detail(exc))
        n = len(batch.items)
        if n > self.settings.max_batch_items:
            return _invalid(f"batch has {n} items; the maximum is {self.settings.max_batch_items} (split it)")
        calls = []
        for i, item in enumerate(batch.items):
            try:
                calls.append(self._prepare(item))
            except InvalidRequest as exc:
                return _invalid(f"items[{i}]: {exc}")
        if self.batch_backlog + n > self.settings.batch_backlog_max:
            metrics.REJECTED.labels("batch").inc()
            return _json(
                {**rejected_result(f"batch backlog full ({self.batch_backlog} items pending, limit {self.settings.batch_backlog_max})"), "results": []},
                429,
            )
        self.batch_backlog += n
        metrics.BATCH_BACKLOG.set(self.batch_backlog)
        feed = asyncio.Semaphore(max(1, self.pool.capacity))

        async def one(item: ExecuteRequest, call: CallRequest) -> dict[str, Any]:
            try:
                async with feed:
                    try:
                        return self._finish(await self._run(item, call, enqueued_at=enqueued_at, admitted=True))
                    except InvalidRequest as exc:  # a session filled up by an earlier item
                        return self._finish(error_result(str(exc)))
                    except Exception as exc:  # noqa: BLE001 - one item's failure is its result
                        log.exception("batch_item_failed")
                        return self._finish(error_result(f"tool executor internal error: {exc!r}"))
            finally:
                self.batch_backlog -= 1
                metrics.BATCH_BACKLOG.set(self.batch_backlog)

        results = await asyncio.gather(*(one(item, call) for item, call in zip(batch.items, calls)))
        return _json({"results": results})

    async def delete_session(self, session_id: str) -> Response:
        return _json({"deleted": self.sessions.drop(session_id)})

    def router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/v1/execute", self.execute_one, methods=["POST"], summary="run one call (body: ExecuteRequest)")
        router.add_api_route("/v1/execute/batch", self.execute_batch, methods=["POST"], summary="run a batch (body: BatchRequest)")
        router.add_api_route("/v1/sessions/{session_id}", self.delete_session, methods=["DELETE"])
        return router


def build_service(settings: Settings) -> ToolExecutorService:
    return ToolExecutorService(settings)
