"""Fixtures of the unit tests: one tiny random model for the whole session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from lab.tiny_model import create_random_model

    return create_random_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from lab.tiny_model import load_tokenizer

    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_format(tiny_model_dir):
    """The tiny model's conversation format (its own chat template, the compact preset)."""
    from shared.formats import load_format

    return load_format(tiny_model_dir, "compact")


@pytest.fixture(scope="session")
def qwen3_format(qwen3_model):
    from shared.formats import load_format

    return load_format(qwen3_model, "rstar2")


@pytest.fixture(scope="session")
def llama3_format(llama3_model):
    from shared.formats import load_format

    return load_format(llama3_model, "rstar2")
