"""One consistent look for every figure: seaborn's paper context, fixed colours per system (the registry's,
:mod:`lrmoe.systems`), PNG + PDF output."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import seaborn as sns
from matplotlib.ticker import MaxNLocator

from lrmoe.systems import ALIASES, SYSTEMS

# A fixed colour and label per system so that every figure reads the same way (older names: their system's).
SYSTEM_COLORS = {name: spec.color for name, spec in SYSTEMS.items()}
SYSTEM_COLORS.update({old: SYSTEM_COLORS[new] for old, new in ALIASES.items()})
SYSTEM_LABELS = {name: spec.label for name, spec in SYSTEMS.items()}
METRIC_COLORS = {"m1": "#ff9896", "m2": "#d62728", "m3": "#9467bd", "gate": "#2ca02c", "random": "#8c564b"}
# a marker and a dash per metric as well as a colour: lines that lie on one another (m1 and m2 often do) stay visible
METRIC_MARKERS = {"m1": "o", "m2": "X", "m3": "s", "gate": "^", "random": "D"}
METRIC_DASHES = {"m1": "", "m2": (4, 2), "m3": (1, 1.5), "gate": (6, 2, 1, 2), "random": (2, 2)}


def apply() -> None:
    sns.set_theme(style="whitegrid", context="paper", font_scale=1.05)
    plt.rcParams.update({"figure.dpi": 110, "savefig.dpi": 200, "savefig.bbox": "tight", "legend.frameon": False})


def palette(names) -> dict:
    fallback = sns.color_palette("tab10", 10)
    return {n: SYSTEM_COLORS.get(n, METRIC_COLORS.get(n, fallback[i % 10])) for i, n in enumerate(names)}


def metric_lines(ax, data, x: str, y: str, metric: str = "metric") -> None:
    """One line per metric (the mean of ``y`` at each ``x``) in its colour, marker and dash, labelled for a
    legend; m1's marker is drawn larger so that it shows around m2's where the two coincide."""
    colors = palette(data[metric].unique())
    for name, part in data.groupby(metric, sort=False):
        line = part.groupby(x)[y].mean()
        dash = METRIC_DASHES.get(name, "")
        ax.plot(line.index, line.to_numpy(), color=colors[name], label=name, marker=METRIC_MARKERS.get(name, "o"),
                markersize=11 if name == "m1" else 7, linestyle=(0, dash) if dash else "-")


def legend_outside(ax, title: str | None = None) -> None:
    """The axes' legend beside it, on the right, with a title: never over the data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), title=title, frameon=False)


def integer_ticks(ax, axis: str = "y") -> None:
    """Ticks at whole numbers only, for an axis of counts."""
    getattr(ax, f"{axis}axis").set_major_locator(MaxNLocator(integer=True))


def note(ax, text: str) -> None:
    """An empty panel that says why it is empty."""
    ax.set_axis_off()
    ax.text(0.5, 0.5, text, ha="center", va="center", wrap=True, transform=ax.transAxes, color="0.3")


def save(fig, out_dir: Path, name: str, dpi: float | None = None) -> list[Path]:
    """The figure as PNG and PDF (``dpi``: the scripts' own, else the theme's), tightly cropped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.png", out_dir / f"{name}.pdf"]
    for path in paths:
        fig.savefig(path, bbox_inches="tight", **({"dpi": dpi} if dpi else {}))
    plt.close(fig)
    return paths
