"""The problem record every dataset yields: what the orchestrator feeds, rollout renders and
reward checks against."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# --------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class Problem:
    """One problem. ``prompt`` is the bare problem text (a dataset's own answer instruction
    stripped: the conversation format adds the preset's); ``answer`` the gold answer as a string —
    the canonical decimal string of an integer, or kept verbatim (``\\frac{3}{4}``, ``(1,2)``) for
    the reward's math-verify check."""

    problem_id: str
    prompt: str
    answer: str
    # For generated problems: the generator kind and its parameters (what the trace generator
    # needs to write solving code). None for loaded datasets.
    kind: str | None = None
    params: Mapping[str, int] | None = field(default=None, compare=False)

    def to_row(self) -> dict[str, Any]:
        """The project's own JSONL row (``id``, ``prompt``, ``answer``)."""
        return {"id": self.problem_id, "prompt": self.prompt, "answer": self.answer}


