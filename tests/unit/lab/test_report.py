"""`rstar report`: the smoothing, stage boundaries and the rendered files (no database: the
steps are hand-made stand-ins for ``LearnerStep`` rows)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from lab.report import (PANELS, EvalPoint, _draw, ema, render, smooth_by_stage, smoothing_alpha,
                        stage_boundaries)


def test_ema_of_known_values_is_bias_corrected():
    # m = 0.5, 1.75, 3.375 over weights w = 0.5, 0.75, 0.875
    assert ema([1.0, 3.0, 5.0], 0.5) == pytest.approx([1.0, 1.75 / 0.75, 3.375 / 0.875])


def test_ema_of_a_constant_is_the_constant_from_the_first_point():
    assert ema([2.0] * 5, 0.1) == pytest.approx([2.0] * 5)  # no pull towards 0 at the start


def test_ema_skips_gaps_and_goes_on_from_the_last_average():
    out = ema([1.0, None, math.nan, math.inf, 3.0], 0.5)
    assert out[1:4] == [None, None, None]
    assert out[0] == 1.0 and out[4] == pytest.approx(1.75 / 0.75)  # as if the gaps were not there


def test_ema_with_alpha_one_is_the_raw_curve_and_bad_alphas_are_refused():
    assert ema([3.0, -1.0, 4.0], 1.0) == [3.0, -1.0, 4.0]
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            ema([1.0], bad)


def test_smoothing_alpha_follows_the_run_length():
    assert smoothing_alpha(40) == pytest.approx(2 / 5)  # span 4 steps
    assert smoothing_alpha(1000) == pytest.approx(2 / 101)  # span 100
    assert smoothing_alpha(5) == 1.0 and smoothing_alpha(0) == 1.0  # span below 1: raw


def test_stage_boundaries_are_the_first_steps_of_each_new_stage():
    assert stage_boundaries([1, 2, 3, 4, 5, 6], [0, 0, 1, 1, 1, 2]) == [(3, 1), (6, 2)]
    assert stage_boundaries([5, 9], [1, 0]) == [(9, 0)]  # a change either way
    assert stage_boundaries([1, 2, 3], [0, 0, 0]) == [] and stage_boundaries([], []) == []
    with pytest.raises(ValueError):
        stage_boundaries([1, 2], [0])


def test_smoothing_restarts_at_a_stage_boundary():
    values, stages = [0.0, 0.0, 10.0, 10.0], [0, 0, 1, 1]
    assert smooth_by_stage(values, stages, 0.5) == pytest.approx([0.0, 0.0, 10.0, 10.0])
    assert ema(values, 0.5)[2] < 10.0  # one average across the boundary would blur the jump


def _step(step, stage, **over):
    row = dict(step=step, version=step, stage=stage, loss=0.1 / step, clip_frac_low=0.001 * step,
               clip_frac_high=0.002 * step, is_weight_mean=1.0, is_weight_max=1.5, approx_kl=1e-3 * step,
               entropy=1.0, grad_norm=0.5, tokens_per_s=1000.0 + step, staleness_mean=0.5, reward_mean=0.1 * step,
               pass_rate_mean=0.3 + 0.02 * step, response_len_mean=100.0 + step, tool_error_rate_pos=0.0,
               optimizer_reset=False, metrics={})
    row.update(over)
    return SimpleNamespace(**row)


STEPS = [_step(1, 0), _step(2, 0, approx_kl=None), _step(3, 0), _step(4, 1), _step(5, 1, clip_frac_low=None),
         _step(6, 1)]
EVALS = [EvalPoint(0, 0.25, "held-out pass@1 before RL"), EvalPoint(6, 0.4, "held-out pass@1 of version 6")]


def test_render_writes_every_panel_the_figure_and_a_page_that_shows_them(tmp_path):
    index = render("run-x", STEPS, tmp_path / "rep", {"pass@1 before (SFT)": "0.250"}, evaluations=EVALS)
    assert index == tmp_path / "rep" / "index.html"
    for name in ["curves.png", *(f"{p.key}.png" for p in PANELS)]:
        assert (tmp_path / "rep" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert {"clip_frac", "approx_kl", "pass_rate_mean", "reward_mean"} <= {p.key for p in PANELS}
    page = index.read_text()
    for p in PANELS:
        assert f'id="panel-{p.key}"' in page and p.title in page
    assert page.count("data:image/png;base64,") == len(PANELS)
    assert "held-out pass@1 before RL: pass@1 0.250 at step 0" in page
    assert "held-out pass@1 of version 6: pass@1 0.400 at step 6" in page
    assert "stage 1 from step 4" in page and "pass@1 before (SFT)" in page
    assert "<th>clip low</th><th>clip high</th>" in page and "<th>KL (behav)</th>" in page


def test_render_without_steps_still_writes_the_report(tmp_path):
    index = render("empty", [], tmp_path / "rep")
    assert (tmp_path / "rep" / "curves.png").exists() and "one stage" in index.read_text()


def _axes():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    return fig, ax


def _columns(steps):
    return {attr: [getattr(s, attr) for s in steps] for p in PANELS for attr, _ in p.series}


def test_a_panel_draws_faint_raw_points_a_smoothed_line_per_series_and_the_stage_boundary():
    import matplotlib.pyplot as plt

    clip = next(p for p in PANELS if p.key == "clip_frac")
    xs, stages = [s.step for s in STEPS], [s.stage for s in STEPS]
    fig, ax = _axes()
    _draw(ax, clip, xs, stages, _columns(STEPS), 0.5, stage_boundaries(xs, stages), EVALS)
    lines = [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 0 and list(ln.get_xdata()) != [3.5, 3.5]]
    raw = [ln for ln in lines if (ln.get_alpha() or 1.0) < 0.5]
    smooth = [ln for ln in lines if (ln.get_alpha() or 1.0) == 1.0]
    assert len(raw) == 2 and len(smooth) == 2  # low and high
    assert list(raw[0].get_xdata()) == [1, 2, 3, 4, 6]  # step 5's missing low clip fraction: no point
    assert smooth[1].get_ydata()[3] == pytest.approx(0.008)  # restarted at stage 1's first step
    assert any(list(ln.get_xdata()) == [3.5, 3.5] for ln in ax.get_lines())  # the boundary line
    assert any("stage 1" in t.get_text() for t in ax.texts)
    assert not any(ln.get_marker() == "D" for ln in ax.get_lines())  # evaluations: pass-rate panel only
    plt.close(fig)


def test_the_pass_rate_panel_marks_the_held_out_evaluations_at_their_steps():
    import matplotlib.pyplot as plt

    panel = next(p for p in PANELS if p.key == "pass_rate_mean")
    xs, stages = [s.step for s in STEPS], [s.stage for s in STEPS]
    fig, ax = _axes()
    _draw(ax, panel, xs, stages, _columns(STEPS), 0.5, [], EVALS)
    marks = [(list(ln.get_xdata()), list(ln.get_ydata())) for ln in ax.get_lines() if ln.get_marker() == "D"]
    assert marks == [([0], [0.25]), ([6], [0.4])]
    assert any("before RL" in t.get_text() for t in ax.get_legend().get_texts())
    plt.close(fig)
