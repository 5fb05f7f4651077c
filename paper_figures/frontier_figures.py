"""The frontier's figures as experiments/frontier.py draws them, from its results file alone: the protocol's
frontier of one regime (``--regime``, docs/protocols/frontier.md §10) and the earlier frontier from two scales."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from lrmoe.analysis import protocol
from lrmoe.analysis.claims import MARGIN
from lrmoe.analysis.frontier import describe
from lrmoe.paper_figures import style
from lrmoe.paper_figures.reading import CannotDraw, config, rows, summary

MARKERS = {"none": "s", "m2 top-k": "o", "m2 unbiased": "^", "random": "x", "m1 top-k": "o", "m1 unbiased": "^"}


def point_color(row) -> tuple | str:
    """References in their registry colour; budgeted systems shaded by rho (darker: deeper cut), LRMoE with its
    metric in reds, LRMoE with random selection in oranges, SYMI-dropless trimmed at random in blues."""
    if row.rho != row.rho:
        return style.system_color(row.policy)
    cmap = plt.cm.Blues if row.family == "symi" else plt.cm.Reds if row.uses_metric else plt.cm.Oranges
    return cmap(float(np.clip(0.4 + (1.0 - row.rho), 0.4, 0.95)))


def label_offsets(x, y, width: float = 0.2, height: float = 0.035, step: float = 8.0) -> list[float]:
    """Vertical offsets (points) for the points' labels, so that no two labels overlap: in axes-fraction units a
    label spans ``width`` to the right of its point and ``height`` in y; a label that would overlap one placed
    before moves down by ``step`` points until it is clear (about 290 points of axes height to the fraction)."""
    def span(v):
        v = np.asarray(v, dtype=float)
        return (v - np.nanmin(v)) / max(np.nanmax(v) - np.nanmin(v), 1e-12)

    nx, ny, placed, out = span(x), span(y), [], []
    for px, py in zip(nx, ny):
        dy = -2.0
        while any(abs(px - qx) < width and abs(py + dy / 290 - qy) < height for qx, qy in placed):
            dy -= step
        placed.append((px, py + dy / 290))
        out.append(dy)
    return out


def frontier(path: str | Path):
    """frontier.py's figure: the protocol's frontier where the file is a regime's, else the two-scale one."""
    return protocol_frontier(path) if config(path).get("regime") else two_scale_frontier(path)


def protocol_frontier(path: str | Path):
    """The regime's frontier: x modelled time ÷ SYMI-dropless, y loss gap to the reference, both with 95 %
    intervals (x over trace seeds, y over training seeds)."""
    points, head = rows(path), summary(path)
    if "gap_mean" not in points:
        raise CannotDraw(f"{path}: no loss axis (a --time-only run)")
    points = points.reindex(columns=list(points) + [c for c in ("time_ci_low", "gap_ci_low") if c not in points])
    regime, zipf_s, seeds = protocol.get_regime(config(path)["regime"]), head["zipf_s"], head["seeds"]
    fig, ax = plt.subplots(figsize=(8, 5))
    offsets = label_offsets(points.time_mean.to_numpy(float), points.gap_mean.to_numpy(float))
    for (_, r), dy in zip(points.iterrows(), offsets):
        d = describe(r.arm)
        color = point_color(pd.Series({**d, "policy": r.arm}))
        xerr = [[max(r.time_mean - r.time_ci_low, 0)], [max(r.time_ci_high - r.time_mean, 0)]] \
            if r.time_ci_low == r.time_ci_low else None
        yerr = [[max(r.gap_mean - r.gap_ci_low, 0)], [max(r.gap_ci_high - r.gap_mean, 0)]] \
            if r.gap_ci_low == r.gap_ci_low else None
        ax.errorbar(r.time_mean, r.gap_mean, xerr=xerr, yerr=yerr, fmt=MARKERS.get(d["selection"], "D"),
                    color=color, ms=6, capsize=2, lw=0.8)
        label = "lrmoe cap mode" if r.arm == "lrmoe" else r.arm.replace("lrmoe-", "").replace("symi-dropless-",
                                                                                               "symi-dl-")
        ax.annotate(label, (r.time_mean, r.gap_mean),
                    fontsize=6, xytext=(4, dy), textcoords="offset points")
    ax.axhline(0, color="0.5", lw=0.6)
    ax.axhline(MARGIN, color="0.3", lw=0.6, ls="--")
    ax.axvline(1, color="0.7", lw=0.6, ls=":")
    ax.set(xlabel=f"modelled MoE time per iteration ÷ SYMI-dropless (95 % interval over trace seeds; Zipf "
                  f"{zipf_s:.3f}, matched)",
           ylabel=f"validation-loss gap to the reference (%)\n(95 % interval over {seeds} seeds)",
           title=f"regime {regime.name}: {regime.description}")
    ax.title.set_fontsize(8)
    fig.tight_layout()
    return fig, points


def two_scale_frontier(path: str | Path):
    """Left: the frontier (x time ÷ SYMI-dropless, y gap, error bars seed min-max). Right: equal quality."""
    table, head, target_step = rows(path), summary(path), config(path).get("target_step")
    if "time_vs_dropless" not in table or not head.get("simulated"):
        raise CannotDraw(f"{path}: no frontier table with its simulated scale")
    h, scale = head["headline"], head["simulated"]
    wanted = ("rho", "gap_pct_min", "gap_pct_max", "time_to_reach_vs_dropless")  # NaN is not logged: may be absent
    table = table.reindex(columns=list(table) + [c for c in wanted if c not in table])
    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.8), gridspec_kw={"width_ratios": [1.6, 1]})
    ax = axes[0]
    shown = table.dropna(subset=["time_vs_dropless"])
    # systems far slower than the rest (static EP) are listed in a note rather than stretching the axis
    far = shown[shown.time_vs_dropless > 1.5]
    shown = shown[shown.time_vs_dropless <= 1.5]
    nudge = {"m2 top-k": -0.006, "m1 top-k": -0.006, "random": 0.006}  # same time: spread the variants apart
    for _, r in shown.iterrows():
        x = r.time_vs_dropless + (nudge.get(r.selection, 0.0) if r.rho == r.rho and r.family == "lrmoe" else 0.0)
        err = [[max(r.gap_pct - r.gap_pct_min, 0)], [max(r.gap_pct_max - r.gap_pct, 0)]]
        ax.errorbar(x, r.gap_pct, yerr=err, fmt=MARKERS.get(r.selection, "D"), color=point_color(r), ms=6,
                    capsize=2, lw=0.8)
        ax.annotate(r.policy.replace("lrmoe-", "").replace("symi-dropless-", "symi-dl-"), (x, r.gap_pct),
                    fontsize=5.5, xytext=(4, -2), textcoords="offset points")
    if len(far):
        ax.text(0.99, 0.98, "off axis: " + ", ".join(f"{r.policy} at {r.time_vs_dropless:.2f}, gap {r.gap_pct:+.2f} %"
                                                  for _, r in far.iterrows()),
                transform=ax.transAxes, ha="right", va="top", fontsize=6)
    ax.axhline(0, color="0.5", lw=0.6)
    ax.axhline(h["max_gap_pct"], color="0.3", lw=0.6, ls="--")
    ax.axvline(1, color="0.7", lw=0.6, ls=":")
    ax.set(xlabel=f"modelled MoE time per iteration ÷ SYMI-dropless\n(simulator: {scale['model']}, "
                  f"{scale['nodes']} × 8 {scale['cluster'].split('-x')[0]}, Zipf {scale['skew']:g})",
           ylabel="validation-loss gap to dropless static EP (%)\n"
                  "(CPU training of the debug model; bars: seed min-max)",
           title="frontier (o m2 top-k, ^ m2 unbiased, x random trim, s reference;\n"
                 "LRMoE labels without 'lrmoe-'; symi-dl: SYMI-dropless, random trim)")
    ax.tick_params(labelsize=7)
    ax = axes[1]
    eq = table.dropna(subset=["time_to_reach_vs_dropless"]).sort_values("time_to_reach_vs_dropless")
    ax.barh(eq.policy, eq.time_to_reach_vs_dropless, color=[point_color(r) for _, r in eq.iterrows()])
    missing = table[table.time_to_reach_vs_dropless.isna()].policy.tolist()
    ax.axvline(1, color="0.3", lw=0.6, ls=":")
    ax.set(xlabel="modelled time to reach static EP's loss at step T ÷ SYMI-dropless's",
           title=f"equal quality (T = {target_step or 'last step'})")
    ax.tick_params(labelsize=6.5)
    if missing:
        ax.text(0.02, -0.16, "not reached on every seed: " + ", ".join(missing), transform=ax.transAxes,
                fontsize=5.5, wrap=True, va="top")
    fig.suptitle("Time against quality from two scales: time = paper-scale simulator, loss = CPU training of the "
                 "debug model (joined by system name only)", fontsize=9)
    fig.tight_layout()
    return fig, table
