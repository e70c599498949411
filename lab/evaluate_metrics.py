"""Evaluation metrics from per-sample results (pure: no I/O, no model).

Given ``n`` sampled responses per problem, of which ``c`` are correct:

* **pass@1 (mean over samples)**: the mean over problems of ``c / n`` — the expected accuracy
  of one sample, estimated from all ``n`` (lower variance than using one sample).
* **pass@k**: the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models
  Trained on Code"): ``1 - C(n - c, k) / C(n, k)`` per problem, averaged over problems; the
  probability that at least one of ``k`` samples drawn without replacement from the ``n`` is
  correct. Needs ``k <= n`` for every problem.
* **mean response length**: mean number of response tokens over all samples.
* **tool-call well-formedness**: well-formed tool calls / all tool calls over all samples
  (``None`` when no sample made a tool call) — a "tool call" is a ``<tool_call>`` the model
  opened; well-formed means ``chat_format.parse_tool_call`` accepted it.
* **answer rate**: fraction of samples that ended with an ``<answer>`` (format compliance).
* **mixed-outcome fraction**: fraction of problems with some but not all samples correct —
  the problems that carry a GRPO signal.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SampleResult:
    problem_id: str
    correct: bool
    response_tokens: int
    tool_calls: int = 0
    well_formed_tool_calls: int = 0
    answered: bool = True

    def __post_init__(self) -> None:
        if self.response_tokens < 0 or self.tool_calls < 0 or not 0 <= self.well_formed_tool_calls <= self.tool_calls:
            raise ValueError(f"inconsistent sample result {self}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``c`` correct among ``n`` samples."""
    if not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def group_by_problem(samples: Iterable[SampleResult]) -> dict[str, list[SampleResult]]:
    groups: dict[str, list[SampleResult]] = defaultdict(list)
    for s in samples:
        groups[s.problem_id].append(s)
    return dict(groups)


def summarize(samples: Sequence[SampleResult], ks: Iterable[int] = (1,)) -> dict[str, float | int | None]:
    """All metrics as one flat dict: ``pass@1_mean``, ``pass@{k}`` for each k, lengths, rates."""
    if not samples:
        raise ValueError("no samples to evaluate")
    groups = group_by_problem(samples)
    counts = [(len(g), sum(s.correct for s in g)) for g in groups.values()]
    out: dict[str, float | int | None] = {
        "problems": len(groups),
        "samples": len(samples),
        "pass@1_mean": sum(c / n for n, c in counts) / len(counts),
    }
    for k in sorted(set(ks)):
        short = [n for n, _ in counts if n < k]
        if short:
            raise ValueError(f"pass@{k} needs at least {k} samples per problem; some have {min(short)}")
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for n, c in counts) / len(counts)
    out["mean_response_tokens"] = sum(s.response_tokens for s in samples) / len(samples)
    calls = sum(s.tool_calls for s in samples)
    out["tool_calls_per_sample"] = calls / len(samples)
    out["tool_call_well_formed_rate"] = (sum(s.well_formed_tool_calls for s in samples) / calls) if calls else None
    out["answer_rate"] = sum(s.answered for s in samples) / len(samples)
    out["mixed_outcome_fraction"] = sum(1 for n, c in counts if 0 < c < n) / len(counts)
    return out
