"""compose.yaml is consistent with the code: every service, its port, health check and env."""

import importlib
from pathlib import Path

import yaml

from services.cli import SERVICES
from shared.settings import DEFAULT_PORTS, ServiceSettings

ROOT = Path(__file__).resolve().parents[3]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
COMMON_ENV = {f"RSTAR_{name.upper()}" for name in ServiceSettings.model_fields if name != "port"}


def _settings_cls(module: str):
    return importlib.import_module(f"services.{module}.config").Settings


def test_infrastructure_present():
    services = COMPOSE["services"]
    assert services["kafka"]["image"].startswith("apache/kafka:")
    assert services["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["migrate"]["command"] == ["rstar", "db", "upgrade"]


def test_every_service_is_defined_consistently():
    services = COMPOSE["services"]
    bootstrap = services["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"].split("//", 1)[1]
    pg = services["postgres"]["environment"]
    for name, module in SERVICES.items():
        svc = services[name]
        assert svc["command"][:3] == ["rstar", "serve", name], name
        assert svc["deploy"]["replicas"] >= 1, name
        port = DEFAULT_PORTS[name]
        assert f"127.0.0.1:{port}/readyz" in " ".join(svc["healthcheck"]["test"]), name
        env = svc["environment"]
        assert env["RSTAR_KAFKA_BOOTSTRAP"] == bootstrap, name
        assert env["RSTAR_DATABASE_URL"] == (
            f"postgresql+asyncpg://{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}@postgres:5432/{pg['POSTGRES_DB']}"
        )
        assert env["RSTAR_HOST"] == "0.0.0.0", name  # reachable from the health check and peers
        # Every RSTAR_* variable names a real setting of that service.
        cls = _settings_cls(module)
        prefix = cls.model_config["env_prefix"]
        for var in env:
            if var in COMMON_ENV:
                continue
            assert var.startswith(prefix), f"{name}: {var} is neither common nor {prefix}*"
            assert var[len(prefix):].lower() in cls.model_fields, f"{name}: {var} is not a setting of {cls.__name__}"
        assert cls.service_name == name
