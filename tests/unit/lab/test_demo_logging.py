"""The demo's logging: vLLM's INFO lines (and the in-process services' structured logs) go to
``<state_dir>/logs/demo.log``, not to the terminal; warnings reach both."""

from __future__ import annotations

import json
import logging
import logging.config
import os
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from lab import demo


@pytest.fixture
def demo_logging(tmp_path, monkeypatch):
    """A function that runs configure_demo_logging(tmp_path) (in the test: its handlers take the
    stderr capfd replaces then), with the process's logging, structlog and environment put back
    afterwards."""
    for var in ("VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_LEVEL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(demo, "SERVICE_ENV", {})
    root, vllm = logging.getLogger(), logging.getLogger("vllm")
    saved = (root.handlers[:], root.level, vllm.handlers[:], vllm.level, vllm.propagate, structlog.get_config())
    try:
        yield lambda: demo.configure_demo_logging(tmp_path)
    finally:
        sink = structlog.get_config()["logger_factory"]()
        if isinstance(sink, demo._DemoLogSink):
            sink._file.close()
        for h in {*root.handlers, *vllm.handlers} - {*saved[0], *saved[2]}:
            h.close()
        root.handlers[:], vllm.handlers[:] = saved[0], saved[2]
        root.setLevel(saved[1])
        vllm.setLevel(saved[3])
        vllm.propagate = saved[4]
        structlog.configure(**saved[5])
        structlog.contextvars.clear_contextvars()
        os.environ.pop("VLLM_LOGGING_CONFIG_PATH", None)  # set by the function, not by monkeypatch


def test_the_vllm_logger_writes_info_to_the_demo_log_and_only_warnings_to_the_terminal(demo_logging, tmp_path, capfd):
    log_file = demo_logging()
    assert log_file == tmp_path / "logs" / "demo.log"
    vllm = logging.getLogger("vllm")
    assert not vllm.propagate
    files = [h for h in vllm.handlers if isinstance(h, logging.FileHandler)]
    streams = [h for h in vllm.handlers if type(h) is logging.StreamHandler]  # (pytest adds capture handlers)
    assert [h.baseFilename for h in files] == [str(log_file)] and files[0].level == logging.INFO
    assert [h.level for h in streams] == [logging.WARNING] and streams[0].stream is sys.stderr

    engine_log = logging.getLogger("vllm.v1.engine.core")
    engine_log.info("Initializing a V1 LLM engine probe")
    engine_log.warning("a vllm warning probe")
    out, err = capfd.readouterr()
    assert "probe" not in out  # vLLM's default stream is stdout: nothing there now
    assert "a vllm warning probe" in err and "Initializing" not in err
    text = log_file.read_text()
    assert "INFO vllm pid=" in text and "Initializing a V1 LLM engine probe" in text and "a vllm warning probe" in text


def test_the_config_file_vllm_reads_in_its_engine_processes_is_the_one_applied(demo_logging, tmp_path):
    log_file = demo_logging()
    path = os.environ["VLLM_LOGGING_CONFIG_PATH"]
    assert path == str(tmp_path / "logs" / "demo-vllm-logging.json")
    config = json.loads(Path(path).read_text())
    assert config == demo.vllm_logging_config(log_file)
    assert config["disable_existing_loggers"] is False  # vLLM's dictConfig must not mute other loggers
    assert demo.SERVICE_ENV == {"VLLM_LOGGING_CONFIG_PATH": ""}  # the services keep their own logs


def test_in_process_structured_and_stdlib_logs_go_to_the_file_warnings_also_to_the_terminal(demo_logging, capfd):
    log_file = demo_logging()
    log = structlog.get_logger("probe")
    log.info("dataset_loaded", rows=3)
    log.warning("dataset_conflicting_answers", count=1)
    logging.getLogger("some_library.probe").info("stdlib info probe")
    # vLLM re-applies its dictConfig at each engine start; the root's handlers keep working after it.
    logging.config.dictConfig(json.loads(Path(os.environ["VLLM_LOGGING_CONFIG_PATH"]).read_text()))
    logging.getLogger("some_library.probe").info("stdlib info after an engine start")
    out, err = capfd.readouterr()
    assert out == ""
    assert "dataset_conflicting_answers" in err and "dataset_loaded" not in err and "stdlib" not in err
    lines = log_file.read_text().splitlines()
    events = [json.loads(ln) for ln in lines if ln.startswith("{")]
    assert [(e["event"], e["service"], e["level"]) for e in events] == [
        ("dataset_loaded", "demo", "info"), ("dataset_conflicting_answers", "demo", "warning")]
    assert any("stdlib info probe" in ln for ln in lines) and any("after an engine start" in ln for ln in lines)


def test_a_logging_config_of_the_callers_own_is_left_alone(tmp_path, monkeypatch):
    own = tmp_path / "mine.json"
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(own))
    monkeypatch.setattr(demo, "SERVICE_ENV", {})
    root, saved = logging.getLogger(), (logging.getLogger().handlers[:], structlog.get_config())
    try:
        demo.configure_demo_logging(tmp_path)
        assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == str(own) and demo.SERVICE_ENV == {}
        assert not (tmp_path / "logs" / "demo-vllm-logging.json").exists()
    finally:
        demo_sink = structlog.get_config()["logger_factory"]()
        if isinstance(demo_sink, demo._DemoLogSink):
            demo_sink._file.close()
        for h in set(root.handlers) - set(saved[0]):
            h.close()
        root.handlers[:] = saved[0]
        structlog.configure(**saved[1])
        structlog.contextvars.clear_contextvars()


# What an engine's processes do (vllm.v1.engine.core, AsyncLLM): build LoggingConfig from the
# environment and apply it, then log.
_ENGINE_LOGGING = """
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging, init_logger
configure_logging(LoggingConfig())
log = init_logger("vllm.v1.engine.core")
log.info("engine info probe")
log.warning("engine warning probe")
"""


@pytest.mark.vllm
def test_vllm_itself_follows_the_demo_config_and_the_services_keep_its_default(demo_logging):
    pytest.importorskip("vllm")
    log_file = demo_logging()
    run = lambda env: subprocess.run([sys.executable, "-c", _ENGINE_LOGGING], capture_output=True, text=True,
                                     env={**os.environ, **env}, timeout=120)
    engine = run({})
    assert engine.returncode == 0, engine.stderr[-3000:]
    assert "probe" not in engine.stdout and "engine info probe" not in engine.stderr
    assert "engine warning probe" in engine.stderr
    text = log_file.read_text()
    assert "engine info probe" in text and "engine warning probe" in text
    service = run(demo.SERVICE_ENV)  # a service the demo starts: vLLM's default, stdout (its own log)
    assert service.returncode == 0, service.stderr[-3000:]
    assert "engine info probe" in service.stdout
    assert log_file.read_text() == text
