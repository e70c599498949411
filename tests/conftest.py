"""Fixtures shared by all tests.

``stack`` starts the embedded broker and PostgreSQL through :mod:`shared.stack` — the same code
as ``rstar stack up`` — once per test session (or uses RSTAR_KAFKA_BOOTSTRAP /
RSTAR_DATABASE_URL when set). ``topic_prefix`` isolates each test's topics on that broker.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

import pytest

from shared import stack as stack_mod


@pytest.fixture(scope="session")
def stack():
    state_dir = Path(tempfile.mkdtemp(prefix="rstar-test-stack-"))
    port = stack_mod._free_port()
    info = stack_mod.up(state_dir, kafka_port=port)
    yield info
    stack_mod.down(state_dir)


@pytest.fixture
def topic_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}."


@pytest.fixture
def settings_env(stack, topic_prefix, monkeypatch, tmp_path):
    """RSTAR_* env pointing at the test stack, with this test's topic prefix and state dir."""
    monkeypatch.setenv("RSTAR_KAFKA_BOOTSTRAP", stack.kafka_bootstrap)
    monkeypatch.setenv("RSTAR_DATABASE_URL", stack.database_url)
    monkeypatch.setenv("RSTAR_TOPIC_PREFIX", topic_prefix)
    monkeypatch.setenv("RSTAR_STATE_DIR", str(tmp_path / "state"))
    return {
        "RSTAR_KAFKA_BOOTSTRAP": stack.kafka_bootstrap,
        "RSTAR_DATABASE_URL": stack.database_url,
        "RSTAR_TOPIC_PREFIX": topic_prefix,
        "RSTAR_STATE_DIR": str(tmp_path / "state"),
    }


@pytest.fixture
async def db_engine(stack):
    from shared.db.session import make_engine

    engine = make_engine(stack.database_url)
    yield engine
    await engine.dispose()


def free_port() -> int:
    return stack_mod._free_port()
