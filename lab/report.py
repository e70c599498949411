"""`rstar report RUN`: the run's curves as PNGs and one self-contained HTML page.

Per learner step: reward, pass rate (over all 2G rollouts of the step's groups), tool-error
rate of the positives, response length, staleness — what a researcher checks first when an
RL run looks wrong.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

from sqlalchemy import select

from shared.db.models import LearnerStep, Run

PANELS = [
    ("reward_mean", "reward (mean of kept trajectories)"),
    ("pass_rate_mean", "pass rate (all 2G rollouts)"),
    ("tool_error_rate_pos", "tool-error rate of positives"),
    ("response_len_mean", "response length (tokens)"),
    ("staleness_mean", "staleness (versions, mean)"),
    ("loss", "loss"),
    ("clip_frac_high", "clip fraction (high)"),
    ("tokens_per_s", "learner tokens/s"),
]


async def load_steps(sessions, run_id: str) -> tuple[Run | None, list[LearnerStep]]:
    async with sessions() as session:
        run = (await session.execute(select(Run).where(Run.run_id == run_id))).scalar_one_or_none()
        steps = (await session.execute(
            select(LearnerStep).where(LearnerStep.run_id == run_id).order_by(LearnerStep.step))).scalars().all()
    return run, list(steps)


def render(run_id: str, steps: list[LearnerStep], out_dir: Path, extra: dict | None = None) -> Path:
    """Write ``<panel>.png`` per metric, ``curves.png`` with all of them, and ``index.html``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    xs = [s.step for s in steps]
    fig, axes = plt.subplots(2, 4, figsize=(16, 7))
    images: list[tuple[str, str]] = []
    for ax, (attr, title) in zip(axes.flat, PANELS):
        ys = [getattr(s, attr) for s in steps]
        pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        single, sax = plt.subplots(figsize=(5, 3.2))
        sax.set_title(title, fontsize=10)
        sax.set_xlabel("step")
        sax.grid(alpha=0.3)
        if pts:
            sax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3)
        single.tight_layout()
        buf = io.BytesIO()
        single.savefig(buf, format="png", dpi=90)
        (out_dir / f"{attr}.png").write_bytes(buf.getvalue())
        images.append((title, base64.b64encode(buf.getvalue()).decode()))
        plt.close(single)
    fig.suptitle(f"run {run_id}")
    fig.tight_layout()
    fig.savefig(out_dir / "curves.png", dpi=90)
    plt.close(fig)

    rows = "".join(
        f"<tr><td>{s.step}</td><td>{s.version}</td><td>{s.stage}</td><td>{_f(s.reward_mean)}</td>"
        f"<td>{_f(s.pass_rate_mean)}</td><td>{_f(s.tool_error_rate_pos)}</td><td>{_f(s.response_len_mean, 0)}</td>"
        f"<td>{_f(s.staleness_mean)}</td><td>{_f(s.loss, 4)}</td></tr>"
        for s in steps
    )
    facts = "".join(f"<li><b>{html.escape(str(k))}</b>: {html.escape(str(v))}</li>" for k, v in (extra or {}).items())
    figs = "".join(f'<figure><img src="data:image/png;base64,{b64}" alt="{html.escape(t)}"></figure>' for t, b64 in images)
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>rstar run {html.escape(run_id)}</title>
<style>body{{font-family:sans-serif;margin:2em}} figure{{display:inline-block;margin:4px}}
table{{border-collapse:collapse}} td,th{{border:1px solid #ccc;padding:2px 8px;text-align:right}}</style></head>
<body><h1>run {html.escape(run_id)}</h1><ul>{facts}</ul>{figs}
<h2>steps</h2><table><tr><th>step</th><th>version</th><th>stage</th><th>reward</th><th>pass rate</th>
<th>tool err (pos)</th><th>resp len</th><th>staleness</th><th>loss</th></tr>{rows}</table></body></html>"""
    index = out_dir / "index.html"
    index.write_text(page)
    return index


def _f(v, digits: int = 3) -> str:
    return "" if v is None else f"{v:.{digits}f}"
