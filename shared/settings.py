"""Settings: one pydantic-settings class per service, sharing the common fields.

Precedence, highest first: explicit overrides (CLI flags) > environment > YAML file > the
embedded stack's address file (``<state_dir>/stack.json``, written by ``rstar stack up``) >
defaults.

- Common fields come from ``RSTAR_<FIELD>`` (``RSTAR_KAFKA_BOOTSTRAP``, ``RSTAR_DATABASE_URL``,
  ``RSTAR_TOPIC_PREFIX``, ...), whatever the service.
- A service's own fields come from ``RSTAR_<SERVICE>_<FIELD>`` (e.g.
  ``RSTAR_TOOL_EXECUTOR_WORKERS``), so one environment can hold every service's settings.
- A YAML file holds flat keys, or a section named after the service (``tool_executor:``) whose
  keys override the flat ones — one file can configure the whole system.
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import orjson
import yaml
from pydantic import AliasChoices, Field
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

DEFAULT_STATE_DIR = Path(os.environ.get("RSTAR_STATE_DIR", ".rstar"))

# Default HTTP ports on loopback (DESIGN.md, "Commands and conventions").
DEFAULT_PORTS = {
    "orchestrator": 8100,
    "rollout": 8101,
    "tool-executor": 8102,
    "reward": 8103,
    "learner": 8104,
}


def _common(name: str, default: Any, description: str, **kw: Any) -> Any:
    return Field(default, validation_alias=AliasChoices(f"RSTAR_{name.upper()}", name), description=description, **kw)


def service_config(service_env: str, **kw: Any) -> SettingsConfigDict:
    """model_config for a service's settings: its own fields read ``RSTAR_<SERVICE_ENV>_*``."""
    return SettingsConfigDict(
        env_prefix=f"RSTAR_{service_env}_",
        extra="ignore",
        populate_by_name=True,
        validate_default=True,
        **kw,
    )


class ServiceSettings(BaseSettings):
    """Fields every service has. Subclass per service (see module docstring)."""

    model_config = service_config("COMMON")
    service_name: ClassVar[str] = "service"

    kafka_bootstrap: str = _common("kafka_bootstrap", "127.0.0.1:19092", "Kafka bootstrap servers, comma-separated")
    database_url: str = _common(
        "database_url",
        "postgresql+asyncpg://postgres@127.0.0.1:5432/rstar",
        "SQLAlchemy URL (postgresql+asyncpg://...)",
    )
    topic_prefix: str = _common("topic_prefix", "", "prefix for every topic name (environments, tests)")
    instance_id: str = _common(
        "instance_id",
        f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
        "unique id of this process (heartbeats, rollout_instance)",
    )
    log_level: str = _common("log_level", "INFO", "log level")
    log_json: bool = _common("log_json", True, "JSON logs (False: coloured console)")
    state_dir: Path = _common("state_dir", DEFAULT_STATE_DIR, "local state: embedded stack data, logs, caches")
    host: str = _common("host", "127.0.0.1", "HTTP bind address")
    heartbeat_s: float = _common("heartbeat_s", 5.0, "seconds between heartbeats into service_instances", gt=0)
    port: int = Field(0, description="HTTP port (0: the service's default)", ge=0, le=65535)

    @property
    def http_port(self) -> int:
        return self.port or DEFAULT_PORTS.get(self.service_name, 0)

    def topic(self, name_or_spec: Any) -> str:
        name = getattr(name_or_spec, "name", name_or_spec)
        return f"{self.topic_prefix}{name}"

    # --- sources -------------------------------------------------------------------------
    _yaml_file: ClassVar[Path | None] = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            env_settings,
            _DictSource(settings_cls, _yaml_values(settings_cls, cls._yaml_file)),
            _DictSource(settings_cls, _stack_values()),
        )


class _DictSource(PydanticBaseSettingsSource):
    def __init__(self, settings_cls: type[BaseSettings], values: dict[str, Any]):
        super().__init__(settings_cls)
        self._values = values

    def get_field_value(self, field, field_name):  # pragma: no cover - __call__ is used
        return self._values.get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return {k: v for k, v in self._values.items() if k in self.settings_cls.model_fields}


def _yaml_values(settings_cls: type[ServiceSettings], path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping, got {type(data).__name__}")
    section_key = settings_cls.service_name.replace("-", "_")
    flat = {k: v for k, v in data.items() if not isinstance(v, dict) or k in settings_cls.model_fields}
    section = data.get(section_key) or {}
    if not isinstance(section, dict):
        raise ValueError(f"config file {path}: section {section_key!r} must be a mapping")
    return {**flat, **section}


def stack_file(state_dir: Path | None = None) -> Path:
    return Path(state_dir or os.environ.get("RSTAR_STATE_DIR", DEFAULT_STATE_DIR)) / "stack.json"


def _stack_values() -> dict[str, Any]:
    """Addresses of a running embedded stack (lower precedence than env and YAML)."""
    path = stack_file()
    if not path.is_file():
        return {}
    try:
        info = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError:
        return {}
    return {k: info[k] for k in ("kafka_bootstrap", "database_url") if k in info}


S = TypeVar("S", bound=ServiceSettings)


def load_settings(settings_cls: type[S], config_file: Path | str | None = None, **overrides: Any) -> S:
    """Build settings with the precedence of the module docstring. None-valued overrides are
    ignored so CLI flags left unset do not mask the environment."""
    path = Path(config_file) if config_file else None
    bound = type(settings_cls.__name__, (settings_cls,), {"_yaml_file": path, "__module__": settings_cls.__module__})
    return bound(**{k: v for k, v in overrides.items() if v is not None})
