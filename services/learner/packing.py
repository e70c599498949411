"""Packing sequences into micro-batches without padding between them.

Pure list manipulation (no torch, no I/O). A training sequence is ``prompt + response``;
only response tokens with ``loss_mask`` 1 are *loss tokens*. Sequences are concatenated into
rows; position ids restart at 0 for every sequence, which is how the attention of
``transformers`` (sdpa / eager / flex, ``attention_mask=None``) recognises packed sequences and
applies a block-diagonal causal mask, so no token ever attends across a sequence boundary.

Two layouts, chosen by ``row_tokens``:

* ``row_tokens = 0`` (default, long RL sequences): one row per micro-batch, holding up to
  ``micro_batch_tokens`` tokens — no padding at all.
* ``row_tokens > 0`` (short SFT examples): rows of at most ``row_tokens`` tokens, and
  ``micro_batch_tokens // row_tokens`` rows per micro-batch; only each row's tail is padded to
  the longest row (padding is a separate pseudo-sequence, never a loss token). Short rows keep
  the attention cost (quadratic in the row length) small on CPUs.

Rows are filled first-fit-decreasing by length, which leaves little slack and is deterministic
(ties broken by the sequence's index). A sequence longer than a row gets a row of its own.

For each loss token the micro-batch records the flat index of the hidden state that predicts
it (the previous position of the same row), so the trainer runs the output layer on loss
tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class TrainSequence:
    """One trajectory (or SFT example) as the trainer sees it."""

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float] | None = None  # None for SFT
    advantage: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.loss_mask) != n:
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries, response has {n} tokens")
        if self.behaviour_logprobs is not None and len(self.behaviour_logprobs) != n:
            raise ValueError(f"behaviour_logprobs has {len(self.behaviour_logprobs)} entries, response has {n} tokens")

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def n_loss_tokens(self) -> int:
        # The very first token of a sequence has no predecessor to predict it.
        start = 1 if not self.prompt_ids else 0
        return sum(1 for m in self.loss_mask[start:] if m)


@dataclass
class MicroBatch:
    """Arrays (numpy from :func:`build_micro_batch`; plain lists are accepted too)."""

    input_ids: Any  # [rows, cols] int64, rows padded to the same length
    position_ids: Any  # [rows, cols] int64
    pred_index: Any = field(default_factory=list)  # [loss tokens] flat row*cols+col of the predicting hidden state
    targets: Any = field(default_factory=list)  # [loss tokens] token ids
    behaviour: Any = field(default_factory=list)  # [loss tokens] behaviour logprobs
    advantages: Any = field(default_factory=list)  # [loss tokens]
    seq_of_token: Any = field(default_factory=list)  # [loss tokens] index into the step's sequences
    n_tokens: int = 0  # real (non-pad) tokens

    @property
    def n_loss_tokens(self) -> int:
        return len(self.targets)

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.input_ids), (len(self.input_ids[0]) if len(self.input_ids) else 0)


def plan_rows(lengths: list[int], row_capacity: int) -> list[list[int]]:
    """First-fit-decreasing: sequence indices per row, each row's total ≤ capacity (or one long sequence)."""
    if row_capacity <= 0:
        raise ValueError(f"row capacity must be > 0, got {row_capacity}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        for r, space in enumerate(free):
            if n <= space:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(max(row_capacity - n, 0))
    return rows


def plan_micro_batches(lengths: list[int], micro_batch_tokens: int, row_tokens: int = 0) -> list[list[list[int]]]:
    """Micro-batches → rows → sequence indices (see module docstring)."""
    if micro_batch_tokens <= 0:
        raise ValueError(f"micro_batch_tokens must be > 0, got {micro_batch_tokens}")
    if row_tokens <= 0:
        return [[row] for row in plan_rows(lengths, micro_batch_tokens)]
    rows = plan_rows(lengths, row_tokens)
    rows_per_mb = max(1, micro_batch_tokens // row_tokens)
    return [rows[i : i + rows_per_mb] for i in range(0, len(rows), rows_per_mb)]


def build_micro_batch(sequences: list[TrainSequence], rows: list[list[int]], pad_id: int) -> MicroBatch:
    """Concatenate the sequences of each row; pad rows to the longest; index the loss tokens.

    Vectorised with numpy: a 64K-token GRPO step packs in a few milliseconds, which matters
    next to a GPU step of well under a second.
    """
    width = max((sum(len(sequences[s]) for s in row) for row in rows), default=0)
    ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    pos = np.zeros((len(rows), width), dtype=np.int64)
    pred: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    behaviour: list[np.ndarray] = []
    advantages: list[np.ndarray] = []
    seq_of: list[np.ndarray] = []
    n_tokens = 0
    for r, row in enumerate(rows):
        col = 0
        for s in row:
            seq = sequences[s]
            p, n = len(seq.prompt_ids), len(seq.response_ids)
            if p:
                ids[r, col : col + p] = seq.prompt_ids
            if n:
                ids[r, col + p : col + p + n] = seq.response_ids
            pos[r, col : col + p + n] = np.arange(p + n)
            j = np.flatnonzero(np.asarray(seq.loss_mask, dtype=bool))
            if p == 0:
                j = j[j >= 1]  # the first token of a sequence has no predecessor
            if j.size:
                pred.append(r * width + col + p + j - 1)
                resp = np.asarray(seq.response_ids, dtype=np.int64)
                targets.append(resp[j])
                if seq.behaviour_logprobs is not None:
                    behaviour.append(np.asarray(seq.behaviour_logprobs, dtype=np.float32)[j])
                else:
                    behaviour.append(np.zeros(j.size, dtype=np.float32))
                advantages.append(np.full(j.size, seq.advantage, dtype=np.float32))
                seq_of.append(np.full(j.size, s, dtype=np.int64))
            col += p + n
        if col < width:
            pos[r, col:] = np.arange(width - col)  # padding: a pseudo-sequence of its own
        n_tokens += col

    def cat(parts: list[np.ndarray], dtype) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

    return MicroBatch(input_ids=ids, position_ids=pos, pred_index=cat(pred, np.int64),
                      targets=cat(targets, np.int64), behaviour=cat(behaviour, np.float32),
                      advantages=cat(advantages, np.float32), seq_of_token=cat(seq_of, np.int64),
                      n_tokens=n_tokens)


def pack(sequences: list[TrainSequence], micro_batch_tokens: int, pad_id: int, row_tokens: int = 0) -> list[MicroBatch]:
    plan = plan_micro_batches([len(s) for s in sequences], micro_batch_tokens, row_tokens)
    return [build_micro_batch(sequences, rows, pad_id) for rows in plan]
