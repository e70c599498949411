"""Settings precedence: overrides > env > YAML (service section over flat keys) > stack file > defaults."""

from typing import ClassVar

import orjson
import pytest

from shared.settings import ServiceSettings, load_settings, service_config, stack_file


class DemoSettings(ServiceSettings):
    model_config = service_config("TOOL_EXECUTOR")
    service_name: ClassVar[str] = "tool-executor"
    workers: int = 1


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for k in ("RSTAR_KAFKA_BOOTSTRAP", "RSTAR_DATABASE_URL", "RSTAR_TOPIC_PREFIX", "RSTAR_TOOL_EXECUTOR_WORKERS"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("RSTAR_STATE_DIR", str(tmp_path))


def test_defaults_and_default_port():
    s = load_settings(DemoSettings)
    assert s.workers == 1 and s.http_port == 8102 and s.topic("rstar.scored") == "rstar.scored"


def test_precedence(monkeypatch, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("topic_prefix: 'dev.'\nworkers: 2\ntool_executor:\n  workers: 3\nreward:\n  workers: 9\n")
    assert load_settings(DemoSettings, cfg).workers == 3  # own section beats flat keys, others ignored
    assert load_settings(DemoSettings, cfg).topic_prefix == "dev."
    monkeypatch.setenv("RSTAR_TOOL_EXECUTOR_WORKERS", "4")
    monkeypatch.setenv("RSTAR_TOPIC_PREFIX", "env.")
    s = load_settings(DemoSettings, cfg)
    assert s.workers == 4 and s.topic_prefix == "env."
    assert load_settings(DemoSettings, cfg, workers=5).workers == 5
    assert load_settings(DemoSettings, cfg, workers=None).workers == 4  # unset CLI flags do not mask env


def test_stack_file_is_the_lowest_source(monkeypatch, tmp_path):
    stack_file(tmp_path).write_bytes(orjson.dumps({"kafka_bootstrap": "127.0.0.1:1", "database_url": "postgresql+asyncpg://x@/y"}))
    assert load_settings(DemoSettings).kafka_bootstrap == "127.0.0.1:1"
    monkeypatch.setenv("RSTAR_KAFKA_BOOTSTRAP", "10.0.0.1:9092")
    assert load_settings(DemoSettings).kafka_bootstrap == "10.0.0.1:9092"


def test_bad_config_files_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_settings(DemoSettings, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("workers: many\n")
    with pytest.raises(ValueError, match="workers"):
        load_settings(DemoSettings, bad)
