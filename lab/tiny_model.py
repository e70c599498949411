"""A tiny Llama-architecture model and its tokenizer, created locally (nothing is downloaded).

The embedded default of the pipeline trains its own policy from scratch (stage-0 SFT on
generated tool-use traces, see ``lab/bootstrap.py``). This module makes the
two starting artefacts:

``build_tokenizer(out_dir)``
    A byte-level BPE tokenizer (HF ``tokenizers``) trained on generated text of the chat
    format (``shared/chat_format.py``) with a 512-token vocabulary:

    * every digit is its own token and digits are never merged (the ``Digits`` pre-tokenizer
      isolates each digit before byte-level BPE runs), so copying a number from a tool
      output into ``\\boxed{}`` is a token-by-token copy, not a lookup of multi-digit chunks;
    * each tag of the conversation format (``shared/formats/tags.py``) and the ChatML markers are
      ONE token each (added tokens are matched before pre-tokenisation); ``<|im_start|>``,
      ``<|im_end|>`` and the pad token ``<|endoftext|>`` are *special* (dropped by
      ``skip_special_tokens``), the tool/answer tags are ordinary added tokens so decoded text
      keeps them;
    * EOS is ``<|im_end|>``; no BOS is prepended (prompt token ids are exactly the rendered
      prompt's tokens);
    * a chat template (:data:`CHAT_TEMPLATE`, ChatML) renders a tool message *inside* the
      assistant message (``\n<tool_response>\n...\n</tool_response>\n``, no turn switch), so a
      trajectory stays one assistant message: the tiny model goes through the same format code
      as any Hugging Face model (``shared.formats``) and its traces cost no extra turn tokens;
    * saved as ``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json`` so
      ``transformers.AutoTokenizer.from_pretrained(dir)`` and vLLM load it;
      ``clean_up_tokenization_spaces`` is off so ``decode(encode(text)) == text``.

``create_random_model(out_dir, seed=0, ...)``
    An HF-format ``LlamaForCausalLM`` directory (``config.json``, ``generation_config.json``,
    ``model.safetensors`` in float32, the tokenizer files, ``tiny_model.json`` with the build
    settings) with tied input/output embeddings (vLLM's Llama supports
    ``tie_word_embeddings``; HF drops ``lm_head.weight`` from the file). The weights are drawn
    by this module, not by the ``transformers`` initialisers, so the bytes depend only on the
    seed and the shape: every matrix ~ N(0, 0.02²), every RMSNorm weight = 1, tensors filled
    in sorted-name order from one ``torch.Generator``.

Determinism and caching: the tokenizer corpus comes from a ``random.Random`` with a fixed seed
and the BPE trainer breaks ties deterministically, so two builds produce byte-identical
files. ``create_random_model`` writes atomically (``shared.checkpoint.atomic_directory``) and,
when ``out_dir`` already holds a model built with the same settings, returns it untouched;
a directory built with different settings is an error, never silently replaced.

Shape note: vLLM's CPU attention kernels support head sizes 32, 64, 80, 96, 112, 128, ...
(not 48), so hidden 192 is split into 6 heads of 32 (same parameter count as 4 heads of 48:
about 1.87M parameters with the defaults). An unsupported head size is rejected up front.

Run ``python -m lab.tiny_model OUT_DIR`` to build a model and (with ``--vllm``) check that
vLLM loads it and generates.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from shared.formats import tags
from shared.formats.presets import PRESETS
from shared.checkpoint import atomic_directory, checkpoint_sha256, save_weights

VOCAB_SIZE = 512
PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
EOS_TOKEN = IM_END
# Special in the HF sense (skipped by decode(skip_special_tokens=True)).
_CONTROL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
# The tags the model writes and reads; ordinary added tokens so decoded text keeps them.
_TAG_TOKENS = (tags.TOOL_CALL_START, tags.TOOL_CALL_END, tags.TOOL_RESPONSE_START, tags.TOOL_RESPONSE_END,
               tags.ANSWER_START, tags.ANSWER_END)
# ChatML with the tool response inside the assistant message (see the module docstring).
# transformers renders templates with trim_blocks and lstrip_blocks; every tag here is `{%-`.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    "{{- message.content }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt and (messages | length == 0 or messages[-1].role != 'tool') %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)
# Head sizes vLLM's CPU attention backend accepts (vllm/v1/attention/backends/cpu_attn.py).
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

# Tokenizer corpus: 3000 generated documents are enough for the ~250 merges a 512 vocabulary
# leaves after the 256 byte symbols and 9 added tokens; the seed is fixed so the vocabulary
# never changes between builds.
_CORPUS_DOCS = 3000
_CORPUS_SEED = 1234
# Standard deviation of the random initial weights (the usual Llama initializer_range).
_INIT_STD = 0.02
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
BUILD_INFO_FILE = "tiny_model.json"


# --------------------------------------------------------------------------- tokenizer corpus

_PROBLEM_TEMPLATES = (
    "Compute {a} * {b} + {c}.",
    "What is {a} times {b} minus {c}?",
    "Find the remainder when {a} raised to the power {b} is divided by {c}.",
    "What is the sum of the digits of {a}^{b}?",
    "Find the greatest common divisor of {a} and {b}.",
    "Find the least common multiple of {a} and {b}.",
    "How many prime numbers are less than {a}?",
    "In how many ways can you choose {b} items from {a} distinct items?",
    "Compute the binomial coefficient C({a}, {b}).",
    "Let n = {a}. What is the value of n * {b} - {c}?",
)
_CODE_TEMPLATES = (
    "print({a} * {b} + {c})",
    "print({a} * {b} - {c})",
    "print(pow({a}, {b}, {c}))",
    "print(sum(int(d) for d in str({a} ** {b})))",
    "import math\nprint(math.gcd({a}, {b}))",
    "import math\nprint(math.lcm({a}, {b}))",
    "import math\nprint(math.comb({a}, {b}))",
    "from sympy import primepi\nprint(primepi({a}))",
    "n = {a}\nsieve = [True] * n\ncount = 0\nfor i in range(2, n):\n    if sieve[i]:\n        count += 1\n        for j in range(i * i, n, i):\n            sieve[j] = False\nprint(count)",
    "result = {a} * {b}\nresult = result + {c}\nprint(result)",
)
_REASONING = (
    "I will compute this with Python.",
    "Let me use the tool to compute the exact value.",
    "This needs exact integer arithmetic, so I will run code.",
    "The previous call failed; let me fix the code and run it again.",
    "I need to define the variable first.",
    "The tool output gives the result.",
)
_ERRORS = (
    "Traceback (most recent call last):\n  File \"<string>\", line 1, in <module>\nNameError: name '{w}' is not defined",
    "Traceback (most recent call last):\n  File \"<string>\", line 2, in <module>\nAttributeError: module 'math' has no attribute '{w}'",
    "Traceback (most recent call last):\n  File \"<string>\", line 1, in <module>\nTypeError: unsupported operand type(s) for +: 'int' and 'str'",
    "  File \"<string>\", line 1\nSyntaxError: invalid syntax",
)


# The texts the compact format renders for the tiny model (checked against shared.formats by the unit
# tests; bench/reward.py builds synthetic responses with them):
# written out here because the tokenizer has to exist before a format can be built from it.
def compact_prompt(problem: str, system: str | None) -> str:
    head = f"{IM_START}system\n{system}{IM_END}\n" if system is not None else ""
    return head + f"{IM_START}user\n{problem}{IM_END}\n{IM_START}assistant\n"


def compact_tool_call(code: str) -> str:
    return tags.TOOL_CALL_START + json.dumps({"name": "python", "arguments": {"code": code}}, ensure_ascii=False) + tags.TOOL_CALL_END


def compact_tool_response(output: str) -> str:
    return f"\n{tags.TOOL_RESPONSE_START}\n{output}\n{tags.TOOL_RESPONSE_END}\n"


def compact_answer(value: str) -> str:
    return f"{tags.ANSWER_START}The answer is \\boxed{{{value}}}{tags.ANSWER_END}"


def _corpus(n_docs: int = _CORPUS_DOCS, seed: int = _CORPUS_SEED) -> list[str]:
    """Documents shaped like rendered trajectories (prompt, reasoning, tool calls, answers)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n_docs):
        nums = {k: rng.randint(2, 10 ** rng.randint(1, 6)) for k in "abc"}
        problem = rng.choice(_PROBLEM_TEMPLATES).format(**nums)
        # The system prompt repeats in every real prompt; include it in a tenth of the documents
        # so its words get merges without crowding out code and number-formatting merges.
        doc = compact_prompt(problem, PRESETS["compact"].system) if i % 10 == 0 else f"{IM_START}user\n{problem}{IM_END}\n"
        doc += rng.choice(_REASONING) + "\n"
        if rng.random() < 0.3:
            doc += compact_tool_call(rng.choice(_CODE_TEMPLATES).format(**nums).replace("math.", "maths."))
            doc += compact_tool_response(rng.choice(_ERRORS).format(w=rng.choice(["n", "result", "x", "maths"])))
            doc += rng.choice(_REASONING) + "\n"
        doc += compact_tool_call(rng.choice(_CODE_TEMPLATES).format(**nums))
        value = str(rng.randint(0, 10 ** rng.randint(1, 12)))
        doc += compact_tool_response(value)
        doc += compact_answer(value) + IM_END
        docs.append(doc)
    return docs


def _train_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            # Each digit a separate pre-token: BPE never merges across pre-tokens.
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    n_added = len(_CONTROL_TOKENS) + len(_TAG_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - n_added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _CONTROL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in _TAG_TOKENS])
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"tokenizer vocabulary has {tok.get_vocab_size()} tokens, expected {VOCAB_SIZE}: "
            "the corpus is too small for the requested number of merges"
        )
    return tok


def build_tokenizer(out_dir: str | Path) -> Path:
    """Train the tokenizer and save it (HF fast-tokenizer files) into ``out_dir``; returns it."""
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = _train_tokenizer()
    missing = [t for t in _CONTROL_TOKENS + _TAG_TOKENS if tok.token_to_id(t) is None]
    if missing:
        raise RuntimeError(f"tokenizer lacks single tokens for {missing}")
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    hf.chat_template = CHAT_TEMPLATE
    hf.save_pretrained(str(out))
    # transformers 5 no longer writes this file; older loaders still look for it.
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}, indent=2, sort_keys=True) + "\n"
    )
    return out


# --------------------------------------------------------------------------- model


def model_settings(*, seed: int, hidden: int, layers: int, heads: int, intermediate: int,
                   max_position: int) -> dict:
    return {
        "seed": seed, "hidden": hidden, "layers": layers, "heads": heads,
        "intermediate": intermediate, "max_position": max_position, "vocab_size": VOCAB_SIZE,
    }


def _llama_config(settings: dict, token_ids: dict[str, int]):
    from transformers import LlamaConfig

    hidden, heads = settings["hidden"], settings["heads"]
    if hidden % heads:
        raise ValueError(f"hidden size {hidden} is not divisible by {heads} heads")
    head_dim = hidden // heads
    if head_dim not in VLLM_CPU_HEAD_SIZES:
        raise ValueError(
            f"head size {head_dim} (= {hidden} / {heads}) is not supported by vLLM's CPU attention "
            f"(supported: {VLLM_CPU_HEAD_SIZES}); choose heads so that hidden / heads is one of them"
        )
    return LlamaConfig(
        vocab_size=settings["vocab_size"],
        hidden_size=hidden,
        intermediate_size=settings["intermediate"],
        num_hidden_layers=settings["layers"],
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        max_position_embeddings=settings["max_position"],
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        initializer_range=_INIT_STD,
        tie_word_embeddings=True,
        bos_token_id=token_ids[PAD_TOKEN],
        eos_token_id=token_ids[EOS_TOKEN],
        pad_token_id=token_ids[PAD_TOKEN],
        dtype="float32",
        architectures=["LlamaForCausalLM"],
    )


def random_state_dict(config, seed: int) -> dict:
    """Seeded N(0, 0.02²) matrices and unit norms for any HF causal-LM config (tied output dropped)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, param in sorted(model.state_dict().items()):
        if name == "lm_head.weight":  # tied to model.embed_tokens.weight
            continue
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(param.shape, dtype=torch.float32)
        else:
            tensors[name] = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, _INIT_STD, generator=gen)
    return tensors


def create_random_model(out_dir: str | Path, seed: int = 0, hidden: int = 192, layers: int = 4,
                        heads: int = 6, intermediate: int = 512, max_position: int = 4096) -> Path:
    """Write a randomly initialised HF Llama model directory (float32) to ``out_dir``.

    Reuses ``out_dir`` if it already holds a model built with the same settings; raises
    ``FileExistsError`` if it holds anything else.
    """
    from transformers import GenerationConfig

    out = Path(out_dir)
    settings = model_settings(seed=seed, hidden=hidden, layers=layers, heads=heads,
                              intermediate=intermediate, max_position=max_position)
    if out.exists():
        info_path = out / BUILD_INFO_FILE
        if info_path.is_file() and json.loads(info_path.read_text()).get("settings") == settings:
            return out
        raise FileExistsError(f"{out} exists and is not a tiny model built with {settings}")
    with atomic_directory(out) as tmp:
        build_tokenizer(tmp)
        vocab = json.loads((tmp / "tokenizer.json").read_text())
        token_ids = {t["content"]: t["id"] for t in vocab["added_tokens"]}
        config = _llama_config(settings, token_ids)
        config.save_pretrained(str(tmp))
        GenerationConfig(
            bos_token_id=config.bos_token_id,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
        ).save_pretrained(str(tmp))
        tensors = random_state_dict(config, seed)
        save_weights(tensors, tmp)
        n_params = sum(t.numel() for t in tensors.values())
        (tmp / BUILD_INFO_FILE).write_text(
            json.dumps({"settings": settings, "parameters": n_params}, indent=2, sort_keys=True) + "\n"
        )
    return out


def load_tokenizer(model_dir: str | Path):
    """The HF tokenizer of a model directory (``AutoTokenizer``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def _vllm_smoke(model_dir: Path) -> dict:
    """Start a vLLM engine on ``model_dir`` and sample a few tokens with logprobs."""
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from shared.formats import load_format

    fmt = load_format(model_dir, "compact")
    llm = LLM(model=str(model_dir), dtype="float32", block_size=32, enable_prefix_caching=True,
              max_model_len=1024, seed=0)
    ids = fmt.prompt_ids("Compute 12 * 34 + 5.")
    outs = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(max_tokens=16, temperature=1.0, logprobs=0, detokenize=False, seed=0),
    )
    out = outs[0].outputs[0]
    return {
        "generated_tokens": len(out.token_ids),
        "token_ids": list(out.token_ids),
        "logprobs": [float(next(iter(lp.values())).logprob) for lp in out.logprobs],
    }


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm", action="store_true", help="check that vLLM loads and samples from it")
    args = parser.parse_args()
    path = create_random_model(args.out_dir, seed=args.seed)
    print(json.dumps({"model_dir": str(path), "sha256": checkpoint_sha256(path)}))
    if args.vllm:
        # vLLM logs to stdout too: the result line is prefixed so callers can find it.
        print("VLLM_SMOKE " + json.dumps(_vllm_smoke(path)), flush=True)
