"""One consistent look for every figure: seaborn's paper context, fixed colours per system (the registry's,
:mod:`lrmoe.systems`), PNG + PDF output."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import seaborn as sns

from lrmoe.systems import ALIASES, SYSTEMS

# A fixed colour and label per system so that every figure reads the same way (older names: their system's).
SYSTEM_COLORS = {name: spec.color for name, spec in SYSTEMS.items()}
SYSTEM_COLORS.update({old: SYSTEM_COLORS[new] for old, new in ALIASES.items()})
SYSTEM_LABELS = {name: spec.label for name, spec in SYSTEMS.items()}
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
