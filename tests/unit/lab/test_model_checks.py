"""A model directory the pipeline cannot use is refused by `rstar eval`, `rstar train` and
`rstar model inspect` with every reason, before any engine starts (the commands exit at once)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import yaml


def rstar(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_model_inspect_shows_the_format_of_real_families(qwen3_model, llama3_model):
    q = rstar("model", "inspect", str(qwen3_model))
    assert q.returncode == 0, q.stderr
    info = json.loads(q.stdout.strip().splitlines()[-1])
    assert info["architecture"] == "Qwen3ForCausalLM" and info["tool_call_detection"] == "token"
    assert info["tools_block"] == "template" and set(info["end_tokens"]) == {"<|im_end|>", "<|endoftext|>"}
    ll = json.loads(rstar("model", "inspect", str(llama3_model)).stdout.strip().splitlines()[-1])
    assert ll["tool_call_detection"] == "text" and ll["tools_block"] == "system prompt"
    assert set(ll["end_tokens"]) == {"<|eot_id|>", "<|end_of_text|>"}


def test_unusable_directories_fail_with_every_reason_before_an_engine(qwen3_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(qwen3_model, broken)
    (broken / "tokenizer.json").unlink()
    cfg = json.loads((qwen3_model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (broken / "tokenizer_config.json").write_text(json.dumps(cfg))
    (broken / "chat_template.jinja").unlink(missing_ok=True)
    for args in (["model", "inspect", str(broken)], ["eval", str(broken), "--dataset", str(tmp_path / "x.jsonl")]):
        out = rstar(*args)
        assert out.returncode == 2, out.stderr
        assert "no tokenizer.json" in out.stderr and "no chat template" in out.stderr
        assert "vllm" not in out.stderr.lower()  # nothing of an engine start
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"model": str(broken), "stages": [{"stage": 1, "steps": 1, "max_tokens": 8, "max_turns": 1}]}))
    out = rstar("train", str(run), "--no-wait")
    assert out.returncode == 2 and "cannot start" in out.stderr and "no chat template" in out.stderr
    out = rstar("model", "inspect", str(tmp_path / "missing"))
    assert out.returncode == 2 and "does not exist" in out.stderr


def test_learner_traces_are_rendered_through_the_models_format(qwen3_model, tmp_path):
    from shared.datasets.sft_traces import read_traces_jsonl
    from shared.formats import load_format

    out = rstar("learner", "traces", str(qwen3_model), str(tmp_path / "t.jsonl"), "--problems", "5", "--preset", "rstar2")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1])["traces"] == 5
    fmt = load_format(qwen3_model, "rstar2")
    rows = read_traces_jsonl(tmp_path / "t.jsonl")
    assert len(rows) == 5
    for r in rows:
        assert fmt.decode(r.prompt_token_ids).startswith("<|im_start|>system\nA conversation between User and Assistant.")
        text = fmt.decode(r.response_token_ids)
        assert '"name": "execute_python_code_with_standard_io"' in text and "Tool call success" in text
        assert r.response_token_ids[-1] == fmt.end_of_turn_id and r.loss_mask[-1] == 1
    bad = rstar("learner", "traces", str(tmp_path), str(tmp_path / "u.jsonl"))
    assert bad.returncode == 2 and "no config.json" in bad.stderr
