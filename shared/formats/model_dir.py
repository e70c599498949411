"""What a Hugging Face model directory holds that the pipeline needs, read with light libraries
only (``json``, ``tokenizers``, ``jinja2`` through transformers' own template renderer; no torch),
so ``rstar train``, ``rstar eval`` and the rollout service can check a directory in about a
second, before a minute-long engine start.

``ModelFiles.load(path)`` reads ``config.json``, ``tokenizer.json`` (the fast tokenizer every
current chat model ships), ``tokenizer_config.json`` (special tokens, maybe the chat template),
``chat_template.jinja`` (where transformers >= 4.43 saves the template) and
``generation_config.json`` (its ``eos_token_id`` may list several ids: Qwen3's instruct models
end on ``<|im_end|>`` or ``<|endoftext|>``). Every problem is collected into one
:class:`ModelDirError` instead of failing on the first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WEIGHT_SUFFIXES = (".safetensors", ".bin")


class ModelDirError(ValueError):
    """A model directory the pipeline cannot use; the message lists every reason."""


def _read_json(path: Path, problems: list[str]) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        problems.append(f"{path.name} is not readable JSON: {exc}")
        return {}
    if not isinstance(data, dict):
        problems.append(f"{path.name} must hold a JSON object")
        return {}
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string, or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template(path: Path, tokenizer_config: dict[str, Any]) -> str | None:
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tpl = tokenizer_config.get("chat_template")
    if isinstance(tpl, str):
        return tpl
    if isinstance(tpl, list):  # named templates: [{"name": "default"|"tool_use", "template": ...}]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        return named.get("tool_use") or named.get("default")
    return None


@dataclass
class ModelFiles:
    path: Path
    config: dict[str, Any]
    tokenizer_config: dict[str, Any]
    generation_config: dict[str, Any]
    chat_template: str | None
    tokenizer: Any  # tokenizers.Tokenizer
    has_weights: bool = False
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... -> text

    @classmethod
    def load(cls, path: str | Path, *, need_weights: bool = True) -> "ModelFiles":
        root = Path(path)
        if not root.is_dir():
            raise ModelDirError(f"model directory {root} does not exist")
        problems: list[str] = []
        config = _read_json(root / "config.json", problems)
        if not (root / "config.json").is_file():
            problems.append("no config.json (not a Hugging Face model directory)")
        elif config and not config.get("architectures") and not config.get("model_type"):
            problems.append("config.json names no architectures / model_type")
        tok_cfg = _read_json(root / "tokenizer_config.json", problems)
        gen_cfg = _read_json(root / "generation_config.json", problems)
        tokenizer = None
        if not (root / "tokenizer.json").is_file():
            problems.append("no tokenizer.json (the pipeline needs a fast tokenizer; "
                            "AutoTokenizer.from_pretrained(dir).save_pretrained(dir) writes one)")
        else:
            from tokenizers import Tokenizer

            try:
                tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
            except Exception as exc:  # noqa: BLE001 - the Rust loader raises plain Exceptions
                problems.append(f"tokenizer.json does not load: {exc}")
        template = _chat_template(root, tok_cfg)
        if template is None:
            problems.append("no chat template (chat_template.jinja, or chat_template in tokenizer_config.json); "
                            "the conversation format is rendered by the model's own template")
        has_weights = any(p.suffix in WEIGHT_SUFFIXES for p in root.iterdir() if p.is_file())
        if need_weights and not has_weights:
            problems.append("no weights (*.safetensors or *.bin)")
        vocab = config.get("vocab_size")
        if tokenizer is not None and isinstance(vocab, int) and tokenizer.get_vocab_size(with_added_tokens=True) > vocab:
            problems.append(f"the tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens but the model's "
                            f"vocab_size is {vocab}: some token ids have no embedding")
        if problems:
            raise ModelDirError(f"model directory {root}: " + "; ".join(problems))
        specials = {k: t for k in ("bos_token", "eos_token", "pad_token", "unk_token")
                    if (t := _token_text(tok_cfg.get(k))) is not None}
        return cls(root, config, tok_cfg, gen_cfg, template, tokenizer, has_weights, specials)

    # ------------------------------------------------------------------ tokens

    def single_token(self, text: str) -> int | None:
        """The id of ``text`` when the vocabulary encodes it as exactly one token, else None."""
        tid = self.tokenizer.token_to_id(text)
        if tid is not None:
            return int(tid)
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return int(ids[0]) if len(ids) == 1 and self.tokenizer.decode(ids, skip_special_tokens=False) == text else None

    def eos_ids(self) -> set[int]:
        """The tokenizer's EOS, generation_config's eos ids and config.json's."""
        ids = set(_ids(self.generation_config.get("eos_token_id"))) | set(_ids(self.config.get("eos_token_id")))
        eos = self.special_tokens.get("eos_token")
        if eos is not None and (tid := self.tokenizer.token_to_id(eos)) is not None:
            ids.add(int(tid))
        return ids

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size") or self.tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def architecture(self) -> str:
        arch = self.config.get("architectures") or [self.config.get("model_type", "?")]
        return str(arch[0])
