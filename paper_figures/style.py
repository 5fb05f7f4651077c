"""One consistent look for every figure: seaborn's paper context, a fixed colour per system, PNG + PDF output.

The registry (:mod:`lrmoe.systems`) names the systems; how figures draw them is here, keyed by system name. A system
with no entry in :data:`SYSTEM_COLOR_TABLE` still draws, in a colour derived from its name alone
(:func:`system_color`), so adding a system stays one registry entry."""

from __future__ import annotations

import zlib
from pathlib import Path

import matplotlib.pyplot as plt
import seaborn as sns
from matplotlib.colors import to_hex
from matplotlib.ticker import MaxNLocator

from lrmoe.systems import RHOS, SYSTEMS, canonical

# The colour of each registry system. Families share a hue: SYMI blues, online replication oranges, LRMoE reds;
# the budgeted variants take one colour per selection rule whatever their rho (figures shade by rho themselves).
SYSTEM_COLOR_TABLE = {
    # baselines
    "static-ep": "#7f7f7f",
    "capacity-cf1": "#bcbd22",
    "capacity-cf1.25": "#dbdb8d",
    "capacity-cf1-gate": "#8c8c1f",
    # SYMI
    "symi-cf1": "#1f77b4",
    "symi-cf1.25": "#17456e",
    "symi-dropless": "#aec7e8",
    "symi-dropless-lrmoe-slots": "#6baed6",
    **{f"symi-dropless-rho{rho:g}": "#4a90c2" for rho in RHOS},
    **{f"symi-dropless-rho{rho:g}-unbiased": "#08519c" for rho in RHOS},
    # online replication
    "online": "#e6550d",
    "online-rho0.75": "#fd8d3c",
    "online-greedy": "#a63603",
    "online-greedy-rho0.75": "#fdae6b",
    # LRMoE and its metrics
    "lrmoe": "#d62728",
    "lrmoe-m1": "#ff9896",
    "lrmoe-m3": "#c5b0d5",
    "lrmoe-gate": "#98df8a",
    "lrmoe-random": "#8c564b",
    "lrmoe-m2-unbiased": "#e377c2",
    "lrmoe-m1-unbiased": "#c49c94",
    # LRMoE minus one component each
    "lrmoe-padded": "#2ca02c",
    "lrmoe-no-quotas": "#ff7f0e",
    "lrmoe-no-bwd-routing": "#17becf",
    "lrmoe-even-fwd": "#9edae5",
    "lrmoe-even-fwd-no-bwd-routing": "#1b9e77",
    "lrmoe-no-memplace": "#9467bd",
    "lrmoe-no-placement": "#7b4173",
    "lrmoe-host-groups": "#f7b6d2",
    "lrmoe-tight": "#ad494a",
    # LRMoE's retention budget, by selection rule
    **{f"lrmoe-rho{rho:g}": "#d62728" for rho in RHOS},
    **{f"lrmoe-rho{rho:g}-unbiased": "#e377c2" for rho in RHOS},
    **{f"lrmoe-rho{rho:g}-random": "#8c564b" for rho in RHOS},
    **{f"lrmoe-rho{rho:g}-random-unbiased": "#c49a6c" for rho in RHOS},
    **{f"lrmoe-rho{rho:g}-early": "#843c39" for rho in (0.75, 0.5)},
    **{f"lrmoe-rho{rho:g}-early-unbiased": "#d6616b" for rho in (0.75, 0.5)},
}


def system_color(name: str) -> str:
    """The colour figures draw system ``name`` in (an older name: its system's). A name with no entry gets one of
    16 evenly spaced hues chosen by a checksum of the name: the same in every figure and every process."""
    name = canonical(name, strict=False)
    if name in SYSTEM_COLOR_TABLE:
        return SYSTEM_COLOR_TABLE[name]
    return to_hex(sns.color_palette("husl", 16)[zlib.crc32(name.encode()) % 16])


def is_system(name) -> bool:
    """``name`` is a registry system or an older name of one."""
    return isinstance(name, str) and canonical(name, strict=False) in SYSTEMS


# each system's label: the registry's (the simulator and the analysis tables name systems by it too)
SYSTEM_LABELS = {name: spec.label for name, spec in SYSTEMS.items()}
METRIC_COLORS = {"m1": "#ff9896", "m2": "#d62728", "m3": "#9467bd", "gate": "#2ca02c", "random": "#8c564b"}
# a marker and a dash per metric as well as a colour: lines that lie on one another (m1 and m2 often do) stay visible
METRIC_MARKERS = {"m1": "o", "m2": "X", "m3": "s", "gate": "^", "random": "D"}
METRIC_DASHES = {"m1": "", "m2": (4, 2), "m3": (1, 1.5), "gate": (6, 2, 1, 2), "random": (2, 2)}


def apply() -> None:
    sns.set_theme(style="whitegrid", context="paper", font_scale=1.05)
    plt.rcParams.update({"figure.dpi": 110, "savefig.dpi": 200, "savefig.bbox": "tight", "legend.frameon": False})


def palette(names) -> dict:
    """A colour per name: a system's own (:func:`system_color`), a metric's, else tab10's in the order given."""
    fallback = sns.color_palette("tab10", 10)
    return {n: system_color(n) if is_system(n) else METRIC_COLORS.get(n, fallback[i % 10])
            for i, n in enumerate(names)}


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
