"""Stage-0 SFT: supervised training on chat/tool-use traces with loss masks.

``train_sft(model_dir, traces_jsonl, out_dir, ...)`` trains an HF model directory on a JSONL of
traces and writes the result as a new HF model directory (atomically, with the source's config
and tokenizer files and ``sft_summary.json``), ready for vLLM and for the RL learner as its
``model_dir``. The loss is the token-mean NLL over tokens with ``loss_mask`` 1 (the model's own
tokens; prompts and tool outputs are context only), computed by the same packed, chunked
trainer as the RL step (:meth:`services.learner.trainer.PolicyTrainer.sft_step`).

Rows (one JSON object per line), either form:

* ``{"prompt_token_ids": [...], "response_token_ids": [...], "loss_mask": [...]}`` — the
  contract with ``shared/datasets/sft_traces.py`` (extra keys such as ``problem_id`` are
  ignored). Preferred: the ids are exactly what the rollout would produce.
* ``{"text_segments": [{"text": "...", "train": true|false}, ...]}`` — tokenised here with the
  model directory's tokenizer, segment by segment without special tokens (as the rollout
  tokenises tool outputs); ``train`` gives the segment's loss mask. Everything up to the first
  ``train: true`` segment becomes the prompt.
* ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": ..., "tool_calls":
  [...]}, ...]}`` — an OpenAI-style conversation with tool calls, rendered through the model's
  conversation format (``shared.formats``: its chat template; tool calls written as the
  format's ``<tool_call>`` JSON, tool messages wrapped as the template renders them and
  masked). ``preset`` names the tool the calls must use and how the tool is described.

Schedule (defaults from the platform experiment with the ~2M-parameter model: AdamW lr 2e-3,
linear warm-up, cosine decay to 10 %): with ``steps`` the schedule spans them exactly; with only
``time_budget_s`` the cosine runs on elapsed time, so training ends at the budget with the LR at
its floor. Batches are drawn from a seeded per-epoch shuffle, ``batch_tokens`` tokens each,
packed into rows of ``row_tokens`` with position ids restarting per example.
"""

from __future__ import annotations

import functools
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.learner.packing import TrainSequence

SUMMARY_FILE = "sft_summary.json"
# Defaults for the tiny model (PLATFORM.md: lr 2e-3 with warm-up and cosine, rows of 256).
DEFAULT_LR = 2e-3
DEFAULT_WARMUP_STEPS = 50
DEFAULT_MIN_LR_RATIO = 0.1
DEFAULT_BATCH_TOKENS = 8192
DEFAULT_ROW_TOKENS = 256


class SftDataError(ValueError):
    """A malformed trace row (the message names the file and line)."""


def _row_to_sequence(row: Any, where: str, tokenizer_of: Callable[[], Any] | None,
                     fmt_of: Callable[[], Any] | None) -> TrainSequence:
    if not isinstance(row, dict):
        raise SftDataError(f"{where}: expected a JSON object")
    if "response_token_ids" in row:
        try:
            seq = TrainSequence(prompt_ids=[int(x) for x in row.get("prompt_token_ids", [])],
                                response_ids=[int(x) for x in row["response_token_ids"]],
                                loss_mask=[1 if int(m) else 0 for m in row["loss_mask"]])
        except (KeyError, TypeError, ValueError) as exc:
            raise SftDataError(f"{where}: {exc}") from exc
        return seq
    if "text_segments" in row:
        tokenizer = tokenizer_of() if tokenizer_of is not None else None
        if tokenizer is None:
            raise SftDataError(f"{where}: text_segments rows need the model directory's tokenizer")
        prompt: list[int] = []
        response: list[int] = []
        mask: list[int] = []
        for seg in row["text_segments"]:
            if not isinstance(seg, dict) or "text" not in seg or "train" not in seg:
                raise SftDataError(f"{where}: each segment needs 'text' and 'train'")
            ids = list(tokenizer.encode(seg["text"], add_special_tokens=False))
            if not response and not seg["train"]:
                prompt.extend(ids)
            else:
                response.extend(ids)
                mask.extend([1 if seg["train"] else 0] * len(ids))
        return TrainSequence(prompt_ids=prompt, response_ids=response, loss_mask=mask)
    if "messages" in row:
        if fmt_of is None:
            raise SftDataError(f"{where}: messages rows need the model directory's conversation format")
        from shared.datasets.sft_traces import ChatDataError, render_trace, steps_from_messages

        fmt = fmt_of()
        try:
            tok = render_trace(steps_from_messages(row["messages"], fmt), fmt)
        except ChatDataError as exc:
            raise SftDataError(f"{where}: {exc}") from None
        return TrainSequence(prompt_ids=tok.prompt_token_ids, response_ids=tok.response_token_ids, loss_mask=tok.loss_mask)
    raise SftDataError(f"{where}: a row needs response_token_ids+loss_mask, text_segments or messages")


def load_sft_jsonl(path: str | Path, tokenizer: Any = None, *, vocab_size: int | None = None,
                   tokenizer_of: Callable[[], Any] | None = None,
                   fmt_of: Callable[[], Any] | None = None) -> list[TrainSequence]:
    """Read trace rows; raises :class:`SftDataError` (with file:line) on the first bad row.

    The tokenizer (``tokenizer``, or ``tokenizer_of()`` called the first time a text row needs it)
    and the conversation format (``fmt_of()``) are only needed by text and chat rows: token-id rows
    (the bootstrap's) load nothing."""
    if tokenizer is not None:
        tokenizer_of = lambda: tokenizer  # noqa: E731
    out: list[TrainSequence] = []
    with Path(path).open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise SftDataError(f"{where}: not JSON: {exc}") from exc
            seq = _row_to_sequence(row, where, tokenizer_of, fmt_of)
            if vocab_size is not None:
                bad = [t for t in seq.prompt_ids + seq.response_ids if not 0 <= t < vocab_size]
                if bad:
                    raise SftDataError(f"{where}: token id {bad[0]} outside the vocabulary (size {vocab_size})")
            if seq.n_loss_tokens == 0:
                continue  # nothing to learn from it
            out.append(seq)
    if not out:
        raise SftDataError(f"{path}: no rows with loss tokens")
    return out


def _batches(seqs: list[TrainSequence], batch_tokens: int, seed: int):
    """Endless batches of ~batch_tokens tokens from a seeded per-epoch shuffle."""
    rng = random.Random(seed)
    epoch = 0
    while True:
        order = list(range(len(seqs)))
        rng.shuffle(order)
        batch: list[TrainSequence] = []
        n = 0
        for i in order:
            batch.append(seqs[i])
            n += len(seqs[i])
            if n >= batch_tokens:
                yield epoch, batch
                batch, n = [], 0
        if batch:
            yield epoch, batch
        epoch += 1


@dataclass
class SftSummary:
    out_dir: str
    sha256: str
    steps: int
    epochs: float
    seconds: float
    tokens: int
    loss_tokens: int
    tokens_per_s: float
    first_loss: float
    final_loss: float  # mean of the last 10 steps
    examples: int
    settings: dict[str, Any] = field(default_factory=dict)
    loss_curve: list[tuple[int, float]] = field(default_factory=list)


def cosine_lr(lr: float, progress: float, warmup_fraction_done: float, min_lr_ratio: float) -> float:
    if warmup_fraction_done < 1.0:
        return lr * warmup_fraction_done
    p = min(max(progress, 0.0), 1.0)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def train_sft(
    model_dir: str | Path,
    traces_jsonl: str | Path,
    out_dir: str | Path,
    *,
    steps: int | None = None,
    time_budget_s: float | None = None,
    lr: float = DEFAULT_LR,
    warmup_steps: int = DEFAULT_WARMUP_STEPS,
    min_lr_ratio: float = DEFAULT_MIN_LR_RATIO,
    batch_tokens: int = DEFAULT_BATCH_TOKENS,
    row_tokens: int = DEFAULT_ROW_TOKENS,
    micro_batch_tokens: int | None = None,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    seed: int = 0,
    device: str = "auto",
    threads: int = 0,
    preset: str = "rstar2",
    log: Callable[[dict[str, float]], None] | None = None,
) -> SftSummary:
    """Train ``model_dir`` on the traces; write the result to ``out_dir`` (must not exist)."""
    import torch

    from services.learner.checkpoints import config_dtype, weights_state_dict
    from services.learner.engine import pad_token_id
    from services.learner.trainer import PolicyTrainer, TrainerConfig, load_model, resolve_device
    from shared.checkpoint import atomic_directory, checkpoint_sha256, copy_model_files, save_weights

    if steps is None and time_budget_s is None:
        raise ValueError("give steps, time_budget_s, or both")
    if steps is not None and steps < 1:
        raise ValueError("steps must be ≥ 1")
    model_dir, out = Path(model_dir), Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} exists; SFT output directories are never overwritten")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    model = load_model(model_dir, resolve_device(device))
    vocab = model.get_input_embeddings().weight.shape[0]

    @functools.cache
    def tokenizer_of():  # loaded only when a text row needs it
        if not ((model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file()):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))

    @functools.cache
    def fmt_of():  # built only when a chat-message row needs it
        from shared.formats import load_format

        return load_format(model_dir, preset)

    seqs = load_sft_jsonl(traces_jsonl, vocab_size=vocab, tokenizer_of=tokenizer_of, fmt_of=fmt_of)
    cfg = TrainerConfig(lr=lr, warmup_steps=0, weight_decay=weight_decay, grad_clip=grad_clip,
                        micro_batch_tokens=micro_batch_tokens or batch_tokens, row_tokens=row_tokens)
    trainer = PolicyTrainer(model, cfg, pad_id=pad_token_id(model_dir))
    budget = float(time_budget_s) if time_budget_s is not None else math.inf
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    step = 0
    examples_seen = 0
    for epoch, batch in _batches(seqs, batch_tokens, seed):
        elapsed = time.perf_counter() - t0
        if (steps is not None and step >= steps) or elapsed >= budget:
            break
        progress = max(step / steps if steps else 0.0, elapsed / budget if math.isfinite(budget) else 0.0)
        warm = (step + 1) / warmup_steps if warmup_steps else 1.0
        trainer.set_lr(cosine_lr(lr, progress, min(warm, 1.0), min_lr_ratio))
        metrics = trainer.sft_step(batch)
        step += 1
        examples_seen += len(batch)
        record = {"step": float(step), "epoch": float(epoch), "elapsed_s": time.perf_counter() - t0, **metrics}
        history.append(record)
        if log is not None:
            log(record)
    seconds = time.perf_counter() - t0
    if not history:
        raise RuntimeError("the budget ended before the first step")
    tokens = int(sum(h["tokens"] for h in history))
    tail = history[-10:]
    settings = dict(steps=steps, time_budget_s=time_budget_s, lr=lr, warmup_steps=warmup_steps,
                    min_lr_ratio=min_lr_ratio, batch_tokens=batch_tokens, row_tokens=row_tokens,
                    weight_decay=weight_decay, grad_clip=grad_clip, seed=seed, model_dir=str(model_dir), preset=preset,
                    traces=str(traces_jsonl))
    summary = SftSummary(
        out_dir=str(out), sha256="", steps=step, epochs=round(examples_seen / len(seqs), 3),
        seconds=seconds, tokens=tokens, loss_tokens=int(sum(h["loss_tokens"] for h in history)),
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0, first_loss=history[0]["loss"],
        final_loss=sum(h["loss"] for h in tail) / len(tail), examples=len(seqs), settings=settings,
        loss_curve=[(int(h["step"]), round(h["loss"], 4)) for h in history],
    )
    with atomic_directory(out) as tmp:
        copy_model_files(model_dir, tmp)
        save_weights(weights_state_dict(model, config_dtype(model_dir)), tmp)
        (tmp / SUMMARY_FILE).write_text(json.dumps(asdict(summary), indent=1))
    summary.sha256 = checkpoint_sha256(out)
    return summary
