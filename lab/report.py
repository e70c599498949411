"""`rstar report RUN`: the run's curves as PNGs and one self-contained HTML page.

Per learner step: reward, pass rate (over all 2G rollouts of the step's groups), tool-error
rate of the positives, response length, staleness, loss, both clip fractions, the KL to the
behaviour policy and the learner's throughput — what a researcher checks first when an RL run
looks wrong.

Every curve is drawn twice: the raw value of each step as faint points and a thin line, and over
them a smoothed line (:func:`ema`, restarted at every stage boundary so a stage's change of
token budget or data shows as a step in the curve, not as a slope blurred across the
boundary). Stage boundaries are dashed vertical lines labelled with the stage that starts there.
Held-out evaluations (the demo's pass@1 before and after RL) are passed as
:class:`EvalPoint` and drawn as markers on the pass-rate panel at the step they measured.
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from sqlalchemy import select

from shared.db.models import LearnerStep, Run


@dataclass(frozen=True)
class Panel:
    key: str  # the PNG's name (<key>.png) and the HTML figure's id (panel-<key>)
    title: str
    series: tuple[tuple[str, str], ...]  # (LearnerStep attribute, legend label); one colour each


PANELS: tuple[Panel, ...] = (
    Panel("reward_mean", "reward (mean of kept trajectories)", (("reward_mean", "reward"),)),
    Panel("pass_rate_mean", "pass rate (all 2G rollouts)", (("pass_rate_mean", "train pass rate"),)),
    Panel("tool_error_rate_pos", "tool-error rate of positives", (("tool_error_rate_pos", "tool-error rate"),)),
    Panel("response_len_mean", "response length (tokens)", (("response_len_mean", "response length"),)),
    Panel("staleness_mean", "staleness (versions, mean)", (("staleness_mean", "staleness"),)),
    Panel("loss", "loss", (("loss", "loss"),)),
    # Fractions of trained tokens whose lower / upper (clip-higher) PPO clip binds.
    Panel("clip_frac", "clip fractions (of trained tokens)", (("clip_frac_low", "low clip"), ("clip_frac_high", "high clip"))),
    # k3 estimate of KL(behaviour || current policy) over the trained tokens.
    Panel("approx_kl", "KL to the behaviour policy (k3)", (("approx_kl", "KL"),)),
    Panel("tokens_per_s", "learner tokens/s", (("tokens_per_s", "tokens/s"),)),
)
# The panel the held-out evaluation points are drawn on (same unit: a fraction of correct answers).
EVAL_PANEL = "pass_rate_mean"

# Smoothing: an exponential moving average whose span is this fraction of the run's steps
# (alpha = 2 / (span + 1)), so a 40-step demo run averages over ~4 steps (alpha 0.4) and a
# 1000-step run over ~100 (alpha ~0.02): the curve's shape at any run length, not a fixed
# window that flattens a short run or leaves a long one noisy. At 10 steps or fewer the span is
# 1 step (alpha 1): the "smoothed" line is the raw one.
SMOOTHING_SPAN_FRACTION = 0.1


@dataclass(frozen=True)
class EvalPoint:
    """One held-out evaluation: ``value`` (pass@1, a fraction) of the policy at learner ``step``
    (0 = the model before any RL step)."""

    step: int
    value: float
    label: str


async def load_steps(sessions, run_id: str) -> tuple[Run | None, list[LearnerStep]]:
    async with sessions() as session:
        run = (await session.execute(select(Run).where(Run.run_id == run_id))).scalar_one_or_none()
        steps = (await session.execute(
            select(LearnerStep).where(LearnerStep.run_id == run_id).order_by(LearnerStep.step))).scalars().all()
    return run, list(steps)


# ---------------------------------------------------------------------------- pure helpers


def smoothing_alpha(n_steps: int, span_fraction: float = SMOOTHING_SPAN_FRACTION) -> float:
    """The EMA's alpha for a run of ``n_steps``: ``2 / (span + 1)`` with ``span`` =
    ``span_fraction`` of the steps, at least 1 (alpha 1: no smoothing)."""
    span = max(1.0, span_fraction * n_steps)
    return 2.0 / (span + 1.0)


def _missing(v) -> bool:
    return v is None or (isinstance(v, float) and not math.isfinite(v))


def ema(values: Sequence[float | None], alpha: float) -> list[float | None]:
    """Bias-corrected exponential moving average; ``None`` / NaN / inf are gaps.

    ``m_t = (1 − α)·m_{t−1} + α·y_t`` and ``w_t = (1 − α)·w_{t−1} + α`` from ``m_0 = w_0 = 0``;
    the output is ``m_t / w_t``, so the first value is the first point itself rather than a
    start pulled towards 0 (TensorBoard's debiasing). A gap yields ``None`` at its position and
    leaves the average as it was; the points after it go on from there."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    out: list[float | None] = []
    m = w = 0.0
    for v in values:
        if _missing(v):
            out.append(None)
            continue
        m = (1.0 - alpha) * m + alpha * float(v)
        w = (1.0 - alpha) * w + alpha
        out.append(m / w)
    return out


def stage_boundaries(steps: Sequence[int], stages: Sequence[int]) -> list[tuple[int, int]]:
    """``(first step, stage)`` wherever the stage differs from the previous step's (the run's
    first stage is not a boundary)."""
    if len(steps) != len(stages):
        raise ValueError("steps and stages differ in length")
    return [(steps[i], stages[i]) for i in range(1, len(stages)) if stages[i] != stages[i - 1]]


def smooth_by_stage(values: Sequence[float | None], stages: Sequence[int], alpha: float) -> list[float | None]:
    """:func:`ema` restarted at every stage change, so no stage's average carries into the next."""
    out: list[float | None] = []
    start = 0
    for i in range(1, len(values) + 1):
        if i == len(values) or stages[i] != stages[i - 1]:
            out.extend(ema(values[start:i], alpha))
            start = i
    return out


# ---------------------------------------------------------------------------- rendering


def _draw(ax, panel: Panel, xs: list[int], stages: list[int], columns: dict[str, list], alpha: float,
          boundaries: list[tuple[int, int]], evaluations: Sequence[EvalPoint]) -> None:
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    drawn = False
    for i, (attr, label) in enumerate(panel.series):
        ys = columns[attr]
        pts = [(x, y) for x, y in zip(xs, ys) if not _missing(y)]
        if not pts:
            continue
        drawn = True
        colour = f"C{i}"
        ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colour, alpha=0.25, linewidth=0.8,
                marker="o", markersize=2.5)
        smooth = [(x, s) for x, s in zip(xs, smooth_by_stage(ys, stages, alpha)) if s is not None]
        ax.plot([p[0] for p in smooth], [p[1] for p in smooth], color=colour, linewidth=1.8,
                label=label if len(panel.series) > 1 or panel.key == EVAL_PANEL else None)
    if panel.key == EVAL_PANEL and evaluations:
        drawn = True
        for j, ev in enumerate(evaluations):
            ax.plot([ev.step], [ev.value], linestyle="none", marker="D", markersize=7, color=f"C{3 + j}",
                    markeredgecolor="black", label=f"{ev.label}: {ev.value:.3f}", zorder=5)
    if not drawn:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    for step, stage in boundaries:
        x = step - 0.5  # between the last step of the old stage and the first of the new one
        ax.axvline(x, color="grey", linestyle="--", linewidth=1.0, alpha=0.8)
        ax.text(x, 0.98, f" stage {stage}", transform=ax.get_xaxis_transform(), fontsize=7, color="dimgrey",
                ha="left", va="top")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")


def render(run_id: str, steps: list[LearnerStep], out_dir: Path, extra: dict | None = None, *,
           evaluations: Iterable[EvalPoint] = ()) -> Path:
    """Write ``<panel>.png`` per panel, ``curves.png`` with all of them, and ``index.html``.

    ``extra``: facts listed at the top of the page; ``evaluations``: held-out pass@1 points
    drawn on the pass-rate panel (and listed on the page)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    evaluations = list(evaluations)
    xs = [s.step for s in steps]
    stages = [s.stage or 0 for s in steps]
    columns = {attr: [getattr(s, attr) for s in steps] for p in PANELS for attr, _ in p.series}
    alpha = smoothing_alpha(len(steps))
    boundaries = stage_boundaries(xs, stages)

    cols = 3
    rows_n = math.ceil(len(PANELS) / cols)
    fig, axes = plt.subplots(rows_n, cols, figsize=(5.3 * cols, 3.5 * rows_n))
    images: list[tuple[Panel, str]] = []
    for ax, panel in zip(axes.flat, PANELS):
        _draw(ax, panel, xs, stages, columns, alpha, boundaries, evaluations)
        single, sax = plt.subplots(figsize=(5.5, 3.5))
        _draw(sax, panel, xs, stages, columns, alpha, boundaries, evaluations)
        single.tight_layout()
        buf = io.BytesIO()
        single.savefig(buf, format="png", dpi=90)
        (out_dir / f"{panel.key}.png").write_bytes(buf.getvalue())
        images.append((panel, base64.b64encode(buf.getvalue()).decode()))
        plt.close(single)
    for ax in list(axes.flat)[len(PANELS):]:
        ax.set_visible(False)
    span = max(1.0, SMOOTHING_SPAN_FRACTION * len(steps))
    fig.suptitle(f"run {run_id}  (bold: EMA over ~{span:.0f} steps, alpha {alpha:.2f}; faint: per step)")
    fig.tight_layout()
    fig.savefig(out_dir / "curves.png", dpi=90)
    plt.close(fig)

    index = out_dir / "index.html"
    index.write_text(_page(run_id, steps, extra, images, evaluations, boundaries, span, alpha))
    return index


def _page(run_id: str, steps: list[LearnerStep], extra: dict | None, images: list[tuple[Panel, str]],
          evaluations: list[EvalPoint], boundaries: list[tuple[int, int]], span: float, alpha: float) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td>{s.step}</td><td>{s.version}</td><td>{s.stage}</td><td>{_f(s.reward_mean)}</td>"
        f"<td>{_f(s.pass_rate_mean)}</td><td>{_f(s.tool_error_rate_pos)}</td><td>{_f(s.response_len_mean, 0)}</td>"
        f"<td>{_f(s.staleness_mean)}</td><td>{_f(s.loss, 4)}</td><td>{_f(s.clip_frac_low, 4)}</td>"
        f"<td>{_f(s.clip_frac_high, 4)}</td><td>{_f(s.approx_kl, 5)}</td></tr>"
        for s in steps
    )
    facts = "".join(f"<li><b>{e(str(k))}</b>: {e(str(v))}</li>" for k, v in (extra or {}).items())
    evals = "".join(f"<li>{e(ev.label)}: pass@1 {ev.value:.3f} at step {ev.step}</li>" for ev in evaluations)
    stage_list = ", ".join(f"stage {stage} from step {step}" for step, stage in boundaries) or "one stage"
    figs = "".join(f'<figure id="panel-{p.key}"><img src="data:image/png;base64,{b64}" alt="{e(p.title)}">'
                   f"<figcaption>{e(p.title)}</figcaption></figure>" for p, b64 in images)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>rstar run {e(run_id)}</title>
<style>body{{font-family:sans-serif;margin:2em}} figure{{display:inline-block;margin:4px}}
figcaption{{font-size:small;text-align:center}}
table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}</style></head>
<body><h1>run {e(run_id)}</h1><ul>{facts}</ul>
<p>Bold lines: exponential moving average over ~{span:.0f} steps (alpha {alpha:.2f}), restarted at each stage
boundary; faint points: each step's value. Dashed lines: stage boundaries ({e(stage_list)}).</p>
{f'<h2>held-out evaluations</h2><ul id="evaluations">{evals}</ul>' if evals else ''}
{figs}
<h2>steps</h2><table><tr><th>step</th><th>version</th><th>stage</th><th>reward</th><th>pass rate</th>
<th>tool err (pos)</th><th>resp len</th><th>staleness</th><th>loss</th><th>clip low</th><th>clip high</th>
<th>KL (behav)</th></tr>{rows}</table></body></html>"""


def _f(v, digits: int = 3) -> str:
    return "" if v is None else f"{v:.{digits}f}"
