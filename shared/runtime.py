"""The service runtime every service shares: settings → logging → Kafka/DB clients → FastAPI
app with ``/healthz``, ``/readyz``, ``/metrics`` → the service's own loop, heartbeats into
``service_instances``, graceful shutdown on SIGTERM/SIGINT.

A service is a :class:`Service` subclass: its ``start`` builds what it needs from the
:class:`RuntimeContext`, ``run`` does the work until ``stop`` is called. The runtime owns all
infrastructure clients so services stay thin and look alike.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, Gauge, generate_latest
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from shared.db.models import ServiceInstance
from shared.db.session import make_engine, ping, session_factory
from shared.kafka import EventProducer, ensure_topics
from shared.logging import configure_logging, get_logger
from shared.settings import ServiceSettings

UP = Gauge("rstar_service_up", "1 while the service runs", ["service"])
READY = Gauge("rstar_service_ready", "1 while /readyz is ready", ["service"])

# /readyz probes each dependency with this timeout so a dead broker never hangs the probe.
READY_PROBE_TIMEOUT_S = 2.0


@dataclass
class RuntimeContext:
    settings: ServiceSettings
    producer: EventProducer | None = None
    engine: AsyncEngine | None = None
    sessions: async_sessionmaker[AsyncSession] | None = None
    log: Any = field(default_factory=lambda: get_logger("service"))

    def topic(self, spec_or_name: Any) -> str:
        return self.settings.topic(spec_or_name)


class Service:
    """Base class; override what you need."""

    name: str = "service"
    needs_kafka: bool = True
    needs_db: bool = True

    def __init__(self, settings: ServiceSettings):
        self.settings = settings
        self.ctx: RuntimeContext | None = None
        self._stop = asyncio.Event()

    async def start(self, ctx: RuntimeContext) -> None:
        self.ctx = ctx

    async def run(self) -> None:
        await self._stop.wait()

    def request_stop(self) -> None:
        self._stop.set()

    async def stop(self) -> None:
        self._stop.set()

    def router(self) -> APIRouter | None:
        return None

    async def ready(self) -> dict[str, bool]:
        """Service-specific readiness checks (merged into /readyz)."""
        return {}

    def info(self) -> dict[str, Any]:
        """Extra fields for the heartbeat row and /healthz."""
        return {}


async def _probe_kafka(bootstrap: str) -> bool:
    """A real Kafka request (metadata), not just a TCP connect."""
    from aiokafka import AIOKafkaClient

    client = AIOKafkaClient(bootstrap_servers=bootstrap, request_timeout_ms=int(READY_PROBE_TIMEOUT_S * 1000))
    try:
        await asyncio.wait_for(client.bootstrap(), READY_PROBE_TIMEOUT_S)
        return True
    except Exception:
        return False
    finally:
        try:
            await client.close()
        except Exception:
            pass


def build_app(service: Service, settings: ServiceSettings, ctx: RuntimeContext) -> FastAPI:
    app = FastAPI(title=f"rstar {service.name}", version="0.1.0")

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok", "service": service.name, "instance": settings.instance_id, **service.info()}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        checks: dict[str, bool] = {}
        if service.needs_kafka:
            checks["kafka"] = await _probe_kafka(settings.kafka_bootstrap)
        if service.needs_db and ctx.engine is not None:
            checks["database"] = await ping(ctx.engine, READY_PROBE_TIMEOUT_S)
        checks.update(await service.ready())
        ok = all(checks.values())
        READY.labels(service.name).set(1 if ok else 0)
        return JSONResponse({"ready": ok, "checks": checks}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    router = service.router()
    if router is not None:
        app.include_router(router)
    return app


async def _heartbeat(service: Service, ctx: RuntimeContext, stop: asyncio.Event) -> None:
    s = ctx.settings
    log = get_logger("heartbeat")
    while not stop.is_set():
        try:
            async with ctx.sessions() as session:
                row = {
                    "instance_id": s.instance_id,
                    "service": service.name,
                    "host": socket.gethostname(),
                    "pid": os.getpid(),
                    "port": s.http_port,
                    "status": "up",
                    "info": service.info(),
                }
                stmt = heartbeat_upsert(row)
                await session.execute(stmt)
                await session.commit()
        except Exception as exc:  # noqa: BLE001 - the database may be away; keep serving
            log.warning("heartbeat_failed", error=repr(exc))
        try:
            await asyncio.wait_for(stop.wait(), s.heartbeat_s)
        except asyncio.TimeoutError:
            pass


def heartbeat_upsert(row: dict[str, Any]):
    """The statement a service's heartbeat runs (public: tests write a service's heartbeat as it
    does, e.g. a learner's, which the orchestrator reads to know a run is being trained)."""
    from sqlalchemy import func
    from sqlalchemy.dialects.postgresql import insert as pg_insert

    stmt = pg_insert(ServiceInstance).values(row)
    return stmt.on_conflict_do_update(
        index_elements=["instance_id"],
        # A restarted instance keeps its instance_id but not its process: host and pid follow it.
        set_={"status": "up", "info": stmt.excluded.info, "port": stmt.excluded.port, "host": stmt.excluded.host,
              "pid": stmt.excluded.pid, "last_heartbeat": func.now()},
    )


async def run_service(service: Service, settings: ServiceSettings, *, install_signals: bool = True) -> None:
    """Run ``service`` until SIGTERM/SIGINT (or ``service.request_stop()``)."""
    log = get_logger(service.name)
    ctx = RuntimeContext(settings=settings, log=log)
    stopping = asyncio.Event()

    if install_signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: (stopping.set(), service.request_stop()))

    if service.needs_kafka:
        await ensure_topics(settings.kafka_bootstrap, settings.topic_prefix)
        ctx.producer = EventProducer(settings.kafka_bootstrap, client_id=f"{service.name}-{settings.instance_id}")
        await ctx.producer.start(stopping)
    if service.needs_db:
        ctx.engine = make_engine(settings.database_url)
        ctx.sessions = session_factory(ctx.engine)

    app = build_app(service, settings, ctx)
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.http_port, log_level="warning", lifespan="off")
    )
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # we own signals

    await service.start(ctx)
    UP.labels(service.name).set(1)
    log.info("service_started", port=settings.http_port, instance=settings.instance_id)
    tasks = [asyncio.create_task(server.serve(), name="http"), asyncio.create_task(service.run(), name="service")]
    if service.needs_db:
        tasks.append(asyncio.create_task(_heartbeat(service, ctx, stopping), name="heartbeat"))
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t.exception() is not None:
                log.error("task_failed", task=t.get_name(), error=repr(t.exception()))
                raise t.exception()
    finally:
        stopping.set()
        service.request_stop()
        await service.stop()
        server.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)
        if ctx.sessions is not None:
            try:
                async with ctx.sessions() as session:
                    from sqlalchemy import update

                    await session.execute(
                        update(ServiceInstance).where(ServiceInstance.instance_id == settings.instance_id).values(status="stopped")
                    )
                    await session.commit()
            except Exception:  # noqa: BLE001
                pass
        if ctx.producer is not None:
            await ctx.producer.stop()
        if ctx.engine is not None:
            await ctx.engine.dispose()
        UP.labels(service.name).set(0)
        log.info("service_stopped")


def serve(service: Service, settings: ServiceSettings) -> None:
    configure_logging(service.name, settings.log_level, json=settings.log_json, instance_id=settings.instance_id)
    asyncio.run(run_service(service, settings))
