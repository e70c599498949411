"""Stage-0 SFT on generated tool-use traces (the orchestrator's JSONL contract) with the tiny model."""

import json
import subprocess
import sys

import pytest
import torch

from services.learner.sft import SftDataError, load_sft_jsonl, train_sft
from shared.checkpoint import verify_checkpoint


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from lab.tiny_model import create_random_model

    return create_random_model(tmp_path_factory.mktemp("sft") / "tiny", seed=0, hidden=64, layers=2, heads=2,
                               intermediate=128)


@pytest.fixture(scope="module")
def traces(tiny, tmp_path_factory):
    from shared.datasets import generated as data, sft_traces
    from shared.formats import load_format

    problems = data.generate_problems(24, seed=1, split="train")
    path = tmp_path_factory.mktemp("traces") / "traces.jsonl"
    return sft_traces.write_traces_jsonl(sft_traces.make_traces(problems, seed=1), load_format(tiny, "compact"), path)


def test_train_sft_lowers_the_loss_and_writes_a_loadable_model(tiny, traces, tmp_path):
    out = tmp_path / "sft"
    summary = train_sft(tiny, traces, out, steps=25, lr=3e-3, warmup_steps=3, batch_tokens=2048, row_tokens=256,
                        device="cpu")
    assert summary.steps == 25 and summary.tokens > 0 and summary.epochs > 1
    assert summary.final_loss < summary.first_loss - 1.0
    verify_checkpoint(out, summary.sha256)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(out))
    assert json.loads((out / "sft_summary.json").read_text())["steps"] == 25
    with pytest.raises(FileExistsError):
        train_sft(tiny, traces, out, steps=1)
    # the trained model predicts a trace's model tokens better than the random one
    seq = load_sft_jsonl(traces)[0]
    ids = torch.tensor([seq.prompt_ids + seq.response_ids])
    base = AutoModelForCausalLM.from_pretrained(str(tiny))
    with torch.no_grad():
        nll = [torch.nn.functional.cross_entropy(m(ids).logits[0, :-1], ids[0, 1:]).item() for m in (model, base)]
    assert nll[0] < nll[1]


def test_text_segment_rows_are_tokenised_with_the_model_tokenizer(tiny, tmp_path):
    from lab.tiny_model import load_tokenizer

    tok = load_tokenizer(tiny)
    path = tmp_path / "seg.jsonl"
    path.write_text(json.dumps({"text_segments": [
        {"text": "Compute 2+3.", "train": False},
        {"text": "<tool_call>", "train": True},
        {"text": "5", "train": False},
        {"text": "<answer>5</answer>", "train": True},
    ]}) + "\n")
    (seq,) = load_sft_jsonl(path, tok)
    assert seq.prompt_ids == tok.encode("Compute 2+3.", add_special_tokens=False)
    n_call = len(tok.encode("<tool_call>", add_special_tokens=False))
    assert seq.loss_mask[:n_call] == [1] * n_call and 0 in seq.loss_mask


def test_bad_rows_name_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt_token_ids": [1], "response_token_ids": [2, 3], "loss_mask": [1, 1]}\n{"oops": 1}\n')
    with pytest.raises(SftDataError, match="bad.jsonl:2"):
        load_sft_jsonl(p)
    p.write_text('{"prompt_token_ids": [1], "response_token_ids": [2, 999], "loss_mask": [1, 1]}\n')
    with pytest.raises(SftDataError, match="outside the vocabulary"):
        load_sft_jsonl(p, vocab_size=512)
    p.write_text('{"prompt_token_ids": [1], "response_token_ids": [2, 3], "loss_mask": [1]}\n')
    with pytest.raises(SftDataError):
        load_sft_jsonl(p)


def test_cli_runs_sft(tiny, traces, tmp_path):
    out = tmp_path / "cli-out"
    proc = subprocess.run([sys.executable, "-m", "services.learner.cli", "sft", str(tiny), str(traces), str(out),
                           "--steps", "2", "--device", "cpu", "--batch-tokens", "1024"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and (out / "model.safetensors").is_file()


def test_chat_message_rows_train_an_external_model_through_its_format(qwen3_model, tmp_path):
    """`rstar learner sft` on a Qwen3 directory: OpenAI-style rows with tool calls are rendered by
    the Qwen3 chat template; the tool turn is masked; the checkpoint keeps tokenizer and template."""
    from shared.formats import load_format

    fmt = load_format(qwen3_model, "rstar2")
    call = {"type": "function", "function": {"name": fmt.preset.tool_name,
                                              "arguments": json.dumps({"code": "print(6*7)", "input": ""})}}
    row = {"messages": [{"role": "user", "content": "What is 6*7?"},
                        {"role": "assistant", "content": "Compute it.", "tool_calls": [call]},
                        {"role": "tool", "content": "Tool call success\nstdout: 42"},
                        {"role": "assistant", "content": "<answer>\\boxed{42}</answer>"}]}
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps(row) + "\n")
    [seq] = load_sft_jsonl(path, fmt_of=lambda: fmt)
    tool_ids = [i for i, m in zip(seq.response_ids, seq.loss_mask) if not m]
    assert fmt.decode(tool_ids) == fmt.tool_response_text("Tool call success\nstdout: 42")
    assert fmt.decode(seq.response_ids).endswith("<answer>\\boxed{42}</answer><|im_end|>")
    assert fmt.decode(seq.prompt_ids).endswith("<|im_start|>user\nWhat is 6*7?<|im_end|>\n<|im_start|>assistant\n")
    out = tmp_path / "sft"
    summary = train_sft(qwen3_model, path, out, steps=2, lr=1e-3, warmup_steps=1, batch_tokens=1024, device="cpu")
    assert summary.steps == 2
    assert load_format(out, "rstar2").describe() == fmt.describe()  # tokenizer and template travel along
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "x"}]}) + "\n")
    with pytest.raises(SftDataError, match=r"bad.jsonl:1: the conversation must end with an assistant message"):
        load_sft_jsonl(bad, fmt_of=lambda: fmt)
