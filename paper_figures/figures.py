"""The paper's figures, each a function of one results file (JSON lines, as the experiments write them).

Every function returns ``(figure, data)``: ``data`` is the DataFrame exactly as plotted, so the tests can check
that the plotted values are the file's. Nothing here holds a number of its own.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from lrmoe.tracking import read_results

try:
    from . import style
except ImportError:  # run as a script from this folder
    import style


def records(path: str | Path) -> pd.DataFrame:
    """The records of a results file, one row per record (a resumed run's repeated steps: the last wins)."""
    frame = pd.DataFrame(read_results(path))
    if frame.empty:
        raise ValueError(f"{path} holds no records")
    return frame


def fidelity(path: str | Path):
    """Metric fidelity against retention: relative error of all expert-weight gradients, per metric and mode."""
    data = records(path)
    data = data.groupby(["mode", "metric", "rho"], as_index=False)["rel_w_all"].mean()
    modes = list(dict.fromkeys(data["mode"]))
    fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 3.3), sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes):
        part = data[data["mode"] == mode]
        sns.lineplot(part, x="rho", y="rel_w_all", hue="metric", marker="o", ax=ax,
                     palette=style.palette(part.metric.unique()))
        ax.set(title=f"{mode} selection", xlabel="retention ρ", ylabel="relative error of expert grads")
    fig.suptitle("Gradient fidelity of backward recalibration (lower is better)")
    fig.tight_layout()
    return fig, data


def convergence(path: str | Path):
    """Validation loss against steps and against modelled time, one line per policy."""
    data = records(path)
    data = data.dropna(subset=["val_loss"]).drop_duplicates(["policy", "step"], keep="last")
    data = data[["policy", "step", "val_loss", "time_s"]].reset_index(drop=True)
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.4), sharey=True)
    colors = style.palette(data.policy.unique())
    sns.lineplot(data, x="step", y="val_loss", hue="policy", marker="o", ax=axes[0], palette=colors)
    sns.lineplot(data.assign(time_ms=data.time_s * 1e3), x="time_ms", y="val_loss", hue="policy", marker="o",
                 ax=axes[1], palette=colors, legend=False)
    axes[0].set(title="equal steps", ylabel="validation loss (nats/byte)")
    axes[1].set(title="equal modelled time", xlabel="modelled MoE-layer time (ms)")
    fig.suptitle("Convergence: LRMoE against SYMI and dropless expert parallelism")
    fig.tight_layout()
    return fig, data


def trace_skew(path: str | Path):
    """Skew of the routing traces: Gini and hottest-expert / mean, synthetic and recorded."""
    data = records(path)[["trace", "gini_mean", "max_over_mean_mean", "source"]]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    sns.barplot(data, x="trace", y="gini_mean", hue="source", ax=axes[0], dodge=False)
    sns.barplot(data, x="trace", y="max_over_mean_mean", hue="source", ax=axes[1], dodge=False, legend=False)
    axes[0].set(xlabel="", ylabel="Gini of per-expert pairs")
    axes[1].set(xlabel="", ylabel="hottest expert / mean")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    return fig, data


# name -> (results file stem, figure function)
FIGURES = {
    "fidelity": ("metric_fidelity", fidelity),
    "convergence": ("convergence", convergence),
    "trace_skew": ("trace_stats", trace_skew),
}
