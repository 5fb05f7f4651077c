"""One consistent look for every figure: seaborn's paper context, fixed colours per system, PNG + PDF output."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import seaborn as sns

# A fixed colour per system so that every figure reads the same way.
SYSTEM_COLORS = {
    "static-ep": "#7f7f7f", "capacity-cf1": "#bcbd22", "capacity-cf1.0": "#bcbd22", "capacity-cf1.25": "#dbdb8d",
    "symi-cf1": "#1f77b4", "symi-dropless": "#aec7e8",
    "lrmoe": "#d62728", "lrmoe-m1": "#ff9896", "lrmoe-m2": "#d62728", "lrmoe-m2-unbiased": "#e377c2",
    "lrmoe-random": "#8c564b", "lrmoe-no-quotas": "#ff7f0e", "lrmoe-no-memplace": "#9467bd",
    "lrmoe-no-bwd-routing": "#17becf", "lrmoe-padded": "#2ca02c", "lrmoe-host-groups": "#f7b6d2",
}
METRIC_COLORS = {"m1": "#ff9896", "m2": "#d62728", "m3": "#9467bd", "gate": "#2ca02c", "random": "#8c564b"}


def apply() -> None:
    sns.set_theme(style="whitegrid", context="paper", font_scale=1.05)
    plt.rcParams.update({"figure.dpi": 110, "savefig.dpi": 200, "savefig.bbox": "tight", "legend.frameon": False})


def palette(names) -> dict:
    fallback = sns.color_palette("tab10", 10)
    return {n: SYSTEM_COLORS.get(n, METRIC_COLORS.get(n, fallback[i % 10])) for i, n in enumerate(names)}


def save(fig, out_dir: Path, name: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.png", out_dir / f"{name}.pdf"]
    for path in paths:
        fig.savefig(path)
    plt.close(fig)
    return paths
