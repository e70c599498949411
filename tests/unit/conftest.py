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
