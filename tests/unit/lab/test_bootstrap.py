"""Bootstrap: settings hashing, a seconds-long SFT run through the learner's trainer, caching."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.bootstrap import (
    BOOTSTRAP_INFO,
    BootstrapSettings,
    bootstrap_tiny_model,
    extract_int_answer,
    run_model_code,
    sft_model_dir,
    write_training_traces,
)
from shared.datasets.sft_traces import read_traces_jsonl

# A seconds-long run: small batches, short warm-up, a high LR so the loss visibly drops (no
# copy drills: their random digits keep the mean loss high until copying is learned).
SMOKE = dict(steps=4, n_traces=40, copy_drills=0, batch_tokens=900, warmup_steps=1, lr=1e-2, row_tokens=1024,
             micro_batch_tokens=1024)


def test_digest_changes_with_what_changes_the_model(tmp_path):
    base = BootstrapSettings(seed=0, minutes=8)
    assert base.digest() == BootstrapSettings(seed=0, minutes=8, threads=2).digest()
    assert base.digest() != BootstrapSettings(seed=1, minutes=8).digest()
    assert base.digest() != BootstrapSettings(seed=0, minutes=9).digest()
    assert base.digest() != BootstrapSettings(seed=0, minutes=8, lr=1e-3).digest()
    # With a fixed step count the time budget does not matter.
    assert BootstrapSettings(steps=5, minutes=1).digest() == BootstrapSettings(steps=5, minutes=2).digest()
    assert sft_model_dir(tmp_path, base).name == f"tiny-sft-{base.digest()}"


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        BootstrapSettings(minutes=0)
    with pytest.raises(ValueError):
        BootstrapSettings(steps=0)
    with pytest.raises(ValueError):
        BootstrapSettings(copy_drills=-1)


def test_training_traces_are_fresh_train_problems(tiny_format, tmp_path):
    from shared.datasets import generate_problems

    s = BootstrapSettings(steps=1, n_traces=30, copy_drills=10)
    rows = read_traces_jsonl(write_training_traces(tmp_path / "t.jsonl", s, tiny_format))
    assert len(rows) == 40
    assert [r.problem_id for r in rows[:30]] == [p.problem_id for p in generate_problems(30, seed=0)]
    assert [r.problem_id for r in rows[30:]] == [f"drill-{i}" for i in range(10)]
    evals = {p.problem_id for p in generate_problems(200, seed=0, split="eval")}
    assert not evals & {r.problem_id for r in rows}
    for r in rows:
        assert len(r.loss_mask) == len(r.response_token_ids) and r.loss_mask[-1] == 1


def test_smoke_training_lowers_the_loss_and_is_cached(tmp_path):
    calls = []
    path = bootstrap_tiny_model(tmp_path, seed=0, log=calls.append, **SMOKE)
    assert len(calls) == SMOKE["steps"]
    info = json.loads((path / BOOTSTRAP_INFO).read_text())
    assert info["train"]["steps"] == SMOKE["steps"]
    assert info["train"]["final_loss"] < info["train"]["first_loss"] - 0.5
    assert calls[-1]["loss"] < calls[0]["loss"]
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (path / name).is_file(), name
    assert not (path / "tiny_model.json").exists()
    # The trained weights load in transformers and differ from the random init.
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(path)
    trained = load_file(path / "model.safetensors")
    init = load_file(Path(info["base_model"]) / "model.safetensors")
    assert trained.keys() == init.keys()
    assert any(not (trained[k] == init[k]).all() for k in trained)
    # Second call: reused, no training (the log callback is never called).
    again = []
    assert bootstrap_tiny_model(tmp_path, seed=0, log=again.append, **SMOKE) == path
    assert again == []
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]


def test_run_model_code_limits_and_output():
    r = run_model_code("print(2 ** 10)")
    assert r.ok and r.stdout == "1024\n"
    code = "import sys\nprint(undefined_name)"
    r = run_model_code(code)
    assert not r.ok and r.stderr.endswith("NameError: name 'undefined_name' is not defined\n")
    # Reported exactly like the in-process trace generator (which mirrors the tool executor).
    from shared.datasets.sft_traces import run_code

    assert r == run_code(code).result()
    assert 'File "<cell>", line 2' in r.stderr and "print(undefined_name)" in r.stderr
    r = run_model_code("while True:\n    pass", timeout_s=1.0)
    assert r.status == "timeout" or (not r.ok and r.stdout == "")
    r = run_model_code("x = bytearray(4 << 30)")
    assert not r.ok and "MemoryError" in r.stderr


def test_extract_int_answer(tiny_format):
    answer = tiny_format.answer_text
    assert extract_int_answer("blah " + answer("-42") + tiny_format.end_of_turn_text) == "-42"
    assert extract_int_answer("\\boxed{7} but no answer tag") is None
    assert extract_int_answer(answer("3.5")) is None
    assert extract_int_answer(answer("007")) == "7"
