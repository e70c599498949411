"""The locally built tokenizer and random model: vocabulary rules, loading, determinism."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.formats import ToolResult
from shared.formats import tags
from shared.checkpoint import checkpoint_sha256
from lab.tiny_model import (
    EOS_TOKEN,
    IM_END,
    IM_START,
    compact_answer,
    compact_prompt,
    compact_tool_call,
    compact_tool_response,
    VOCAB_SIZE,
    build_tokenizer,
    create_random_model,
)


def test_vocabulary_size_and_eos(tokenizer):
    assert len(tokenizer) == VOCAB_SIZE
    assert tokenizer.eos_token == EOS_TOKEN == IM_END
    assert tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)


def test_each_digit_is_one_token_and_digits_never_merge(tokenizer):
    for d in "0123456789":
        assert len(tokenizer.encode(d, add_special_tokens=False)) == 1
    digit_ids = {tokenizer.convert_tokens_to_ids(d) for d in "0123456789"}
    for text in ("1234567890", " 98765", "x=31415926;", "\\boxed{271828}", "(12, 34)"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        pieces = [tokenizer.decode([i]) for i in ids]
        digits_in_text = sum(ch.isdigit() for ch in text)
        assert sum(i in digit_ids for i in ids) == digits_in_text, pieces
        # No token other than a single-digit token contains a digit.
        assert all(not any(ch.isdigit() for ch in p) or len(p) == 1 for p in pieces), pieces


def test_no_vocabulary_entry_has_more_than_one_digit(tokenizer):
    for token, _ in tokenizer.get_vocab().items():
        text = tokenizer.convert_tokens_to_string([token])
        has_digit = any(ch in "0123456789" for ch in text)
        assert not has_digit or (len(text) == 1 and text in "0123456789"), token


TAGS = (IM_START, IM_END, tags.TOOL_CALL_START, tags.TOOL_CALL_END, tags.TOOL_RESPONSE_START, tags.TOOL_RESPONSE_END,
        tags.ANSWER_START, tags.ANSWER_END)


def test_chat_format_tags_are_single_tokens(tokenizer):
    def tid(tok):
        ids = tokenizer.encode(tok, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    ids = {t: tid(t) for t in TAGS}
    assert None not in ids.values() and len(set(ids.values())) == len(TAGS)
    # Tags stay single tokens inside running text too.
    text = compact_tool_call("print(1)") + compact_tool_response("1") + compact_answer("1") + IM_END
    enc = tokenizer.encode(text, add_special_tokens=False)
    for tag in TAGS[1:]:
        assert ids[tag] in enc


def test_the_chat_template_renders_the_compact_format_the_corpus_was_written_in(tiny_format):
    """The tokenizer's corpus spells the format out; the model's template must render the same text."""
    from shared.formats import get_preset

    fmt = tiny_format
    assert fmt.prompt_text("Compute 2 + 2.") == compact_prompt("Compute 2 + 2.", get_preset("compact").system)
    assert fmt.prompt_text("Repeat 12", bare=True) == compact_prompt("Repeat 12", None)
    assert fmt.tool_response_text(ToolResult("ok", "4\n")) == compact_tool_response("4\n")
    assert fmt.tool_call_text("print(1)") == compact_tool_call("print(1)")
    assert fmt.answer_text("7") == compact_answer("7")
    assert fmt.end_of_turn_text == IM_END and fmt.stop_strings == []
    assert fmt.stop_token_ids == [fmt.model.single_token(tags.TOOL_CALL_END), fmt.model.single_token(IM_END)]


def test_no_bos_is_added(tokenizer):
    prompt = compact_prompt("Compute 2 + 2.", "Solve.")
    ids = tokenizer.encode(prompt)
    assert tokenizer.decode(ids) == prompt
    assert ids[0] == tokenizer.convert_tokens_to_ids(IM_START)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_round_trip_arbitrary_text(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_round_trip_chat_text(tokenizer):
    text = (compact_prompt("What is 123 * 456 - 7?", "Solve.") + "Let me compute.\n"
            + compact_tool_call("a = 123\nprint(a * 456 - 7)")
            + compact_tool_response("Traceback (most recent call last):\n  NameError: name 'x'")
            + compact_answer("56081") + IM_END)
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_tokenizer_build_is_deterministic(tmp_path):
    a = build_tokenizer(tmp_path / "a")
    b = build_tokenizer(tmp_path / "b")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_model_build_is_deterministic_and_seeded(tiny_model_dir, tmp_path):
    same = create_random_model(tmp_path / "same", seed=0)
    other = create_random_model(tmp_path / "other", seed=1)
    assert checkpoint_sha256(same) == checkpoint_sha256(tiny_model_dir)
    assert (other / "model.safetensors").read_bytes() != (same / "model.safetensors").read_bytes()


def test_existing_directory_is_reused_or_refused(tiny_model_dir):
    before = checkpoint_sha256(tiny_model_dir)
    assert create_random_model(tiny_model_dir, seed=0) == tiny_model_dir
    assert checkpoint_sha256(tiny_model_dir) == before
    with pytest.raises(FileExistsError):
        create_random_model(tiny_model_dir, seed=5)


def test_unsupported_head_size_is_refused(tmp_path):
    with pytest.raises(ValueError, match="head size 48"):
        create_random_model(tmp_path / "m", heads=4)
    assert not (tmp_path / "m").exists()


def test_random_model_loads_with_transformers(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.dtype == torch.float32
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    n_params = sum(p.numel() for p in model.parameters())
    assert 1.5e6 < n_params < 3e6
    info = json.loads((tiny_model_dir / "tiny_model.json").read_text())
    assert info["parameters"] == n_params
    ids = torch.tensor([tokenizer.encode(compact_prompt("Compute 1 + 1.", "Solve."))])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], VOCAB_SIZE)
    # A random init predicts close to uniformly: mean logprob near -ln(512).
    logp = torch.log_softmax(logits, -1)
    assert abs(float(logp.mean()) + math.log(VOCAB_SIZE)) < 0.5


@pytest.mark.vllm
def test_vllm_loads_the_model_and_its_logprobs_match_transformers(tiny_model_dir, tokenizer):
    """Starts a real vLLM CPU engine (in a subprocess: engines spawn processes of their own)."""
    pytest.importorskip("vllm")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "lab.tiny_model", str(tiny_model_dir), "--vllm"],
        capture_output=True, text=True, env=env, timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VLLM_SMOKE ")]
    assert lines, proc.stdout[-4000:]
    result = json.loads(lines[-1].removeprefix("VLLM_SMOKE "))
    assert result["generated_tokens"] == 16
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    from shared.formats import load_format

    prompt = load_format(tiny_model_dir, "compact").prompt_ids("Compute 12 * 34 + 5.")
    ids = torch.tensor([prompt + result["token_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].double(), -1)
    hf = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(result["token_ids"])]
    assert max(abs(a - b) for a, b in zip(hf, result["logprobs"])) < 1e-3
