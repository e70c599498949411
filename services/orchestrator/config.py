"""Orchestrator settings (``RSTAR_ORCHESTRATOR_<FIELD>``, an ``orchestrator:`` YAML section, or
flat keys; common fields from ``RSTAR_*``, see :mod:`shared.settings`)."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from shared.settings import ServiceSettings, service_config

# Default of ``learner_timeout_s``; `rstar train`, which has no orchestrator settings, shows
# learner presence with it.
LEARNER_TIMEOUT_S = 60.0


class Settings(ServiceSettings):
    model_config = service_config("ORCHESTRATOR")
    service_name: ClassVar[str] = "orchestrator"

    tick_s: float = Field(0.5, gt=0, description="seconds between control passes over the active runs")
    max_dispatch_per_tick: int = Field(256, ge=1, description="cap on tasks sent in one pass (smooths bursts)")
    learner_timeout_s: float = Field(
        LEARNER_TIMEOUT_S, gt=0, description="a run with no learner heartbeat this recent gets no new or re-dispatched tasks "
        "(12 of the default 5 s heartbeats: a learner busy in a long step still beats, its step runs in a thread)")
