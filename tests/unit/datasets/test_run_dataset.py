"""A run's dataset settings (``dataset.fields / on_bad_row / dedupe``) reach the loader through
``dataset_for``, which keeps (train, eval) lists and hands back each split's report."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from services.orchestrator.run_config import DatasetConfig, RunConfig
from services.orchestrator.runtime import dataset_for
from shared.datasets import ProblemSetError


def _cfg(**dataset) -> RunConfig:
    return RunConfig.model_validate({"model": "unused", "dataset": dataset,
                                     "stages": [{"stage": 1, "steps": 1, "max_tokens": 64, "max_turns": 1}]})


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_dataset_config_defaults_and_validation():
    d = DatasetConfig(kind="file", paths=["x.jsonl"])
    assert (d.fields, d.on_bad_row, d.dedupe) == ({}, "error", True)
    with pytest.raises(ValidationError, match="needs answer"):
        DatasetConfig(kind="file", paths=["x"], fields={"prompt": "q"})
    with pytest.raises(ValidationError):
        DatasetConfig(kind="file", paths=["x"], fields={"prompt": "q", "answer": "a", "solution": "s"})
    with pytest.raises(ValidationError, match="kind 'file' only"):
        DatasetConfig(fields={"prompt": "q", "answer": "a"})
    with pytest.raises(ValidationError):
        DatasetConfig(kind="file", paths=["x"], on_bad_row="ignore")


def test_dataset_for_loads_files_with_the_run_settings(tmp_path):
    train = _jsonl(tmp_path / "train.jsonl", [
        {"q": {"text": "What is 1+1?"}, "gold": "2", "key": "a"},
        {"q": {"text": "what is 1+1?"}, "gold": "2", "key": "b"},  # a duplicate
        {"q": {"text": "Half of 3?"}, "gold": "\\frac{3}{2}", "key": "c"},
        {"q": {"text": "No answer."}, "key": "d"},  # a bad row
    ])
    held = _jsonl(tmp_path / "eval.jsonl", [{"q": {"text": "What is 2+2?"}, "gold": 4, "key": "e"}])
    fields = {"prompt": "q.text", "answer": "gold", "id": "key"}

    reports: dict = {}
    tr, ev = dataset_for(_cfg(kind="file", paths=[train], eval_paths=[held], fields=fields, on_bad_row="skip"),
                         reports=reports)
    assert isinstance(tr, list) and isinstance(ev, list)
    assert [(p.problem_id, p.answer) for p in tr] == [("a", "2"), ("c", "\\frac{3}{2}")]
    assert [(p.problem_id, p.prompt, p.answer) for p in ev] == [("e", "What is 2+2?", "4")]
    assert (reports["train"].duplicates, reports["train"].skipped, reports["eval"].problems) == (1, 1, 1)
    assert reports["train"].answer_kinds == {"integer": 1, "fraction": 1}

    tr, _ = dataset_for(_cfg(kind="file", paths=[train], fields=fields, on_bad_row="skip", dedupe=False))
    assert [p.problem_id for p in tr] == ["a", "b", "c"]

    with pytest.raises(ProblemSetError, match=r"train.jsonl:4: gold: missing"):
        dataset_for(_cfg(kind="file", paths=[train], fields=fields))


def test_dataset_for_generated_is_unchanged():
    tr, ev = dataset_for(_cfg(kind="generated", n_train=5, n_eval=3, seed=1))
    assert (len(tr), len(ev)) == (5, 3)
