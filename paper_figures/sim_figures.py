"""The simulator's and the cost model's figures as their scripts draw them (ablate, memory_sweep, validate_sim),
from the results file alone; each function returns ``(figure, data)`` like :mod:`figures`."""

from __future__ import annotations

import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from lrmoe.paper_figures import style
from lrmoe.paper_figures.reading import CannotDraw, config, rows, summary
from lrmoe.sim.memory_sweep import binding_range

# ablate's systems on the ratio figure, and those whose time is split by category
ABLATE_PLOTTED = ["static-ep", "capacity-cf1", "symi-cf1", "symi-dropless-lrmoe-slots", "lrmoe", "lrmoe-host-groups",
                  "lrmoe-no-memplace", "lrmoe-no-quotas", "lrmoe-padded"]
SPLIT = ["static-ep", "symi-cf1", "symi-dropless", "lrmoe", "lrmoe-host-groups"]
# memory_sweep's bands: the two references and early selection (more would make the lines illegible)
BANDED = ("symi-dropless", "online", "lrmoe-rho0.75-early-unbiased")


def _headline_cells(path: str | Path) -> pd.DataFrame:
    table, mem_gb = rows(path), config(path).get("headline_mem_gb")
    if "vs_symi_dropless" not in table or mem_gb is None:
        raise CannotDraw(f"{path}: no ratios to SYMI-dropless at a headline budget")
    ok = table[table["vs_symi_dropless"].notna()]
    ok = ok[(ok.mem_gb == mem_gb) & ok.system.isin(ABLATE_PLOTTED)]
    if ok.empty:
        raise CannotDraw(f"{path}: no plotted system has a ratio at the headline budget {mem_gb:g} GB")
    return ok


def ratio_vs_symi(path: str | Path):
    """ablate: time relative to SYMI-dropless against skew per system, one panel per model and rank count."""
    ok = _headline_cells(path)
    sns.set_theme(style="whitegrid", context="paper")
    grid = sns.relplot(ok, x="skew_label", y="vs_symi_dropless", hue="system", style="system", col="model",
                       row="ranks", kind="line", markers=True, dashes=True, height=2.6, aspect=1.3,
                       facet_kws={"sharey": False})
    grid.set_axis_labels("routing skew (generator parameter)", "time / SYMI-dropless")
    for ax in grid.axes.flat:
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        if not ax.lines[:-1]:
            ax.text(0.5, 0.5, "does not fit", ha="center", va="center", transform=ax.transAxes)
    grid.figure.suptitle("MoE-layer time per iteration relative to SYMI-dropless (simulated)", y=1.02)
    return grid.figure, ok


def time_split(path: str | Path):
    """ablate: the split of each main system's time into forward, backward, communication, sync and overheads at
    the most skewed cell (as measured), headline budget."""
    ok, table, mem_gb = _headline_cells(path), rows(path), config(path)["headline_mem_gb"]
    cats = [c for c in table if c.endswith("_ms_per_layer") and c != "time_ms_per_layer"]
    top = ok.sort_values("trace_gini")["skew_label"].iloc[-1]
    split = table[(table.mem_gb == mem_gb) & (table["skew_label"] == top) & table["iter_s"].notna()
                  & table.system.isin(SPLIT)]
    long = split.melt(id_vars=["model", "ranks", "system"], value_vars=cats, var_name="part", value_name="ms")
    long["part"] = long["part"].str.replace("_ms_per_layer", "")
    sns.set_theme(style="whitegrid", context="paper")
    grid = sns.catplot(long, x="system", y="ms", hue="part", col="model", row="ranks", kind="bar",
                       height=2.6, aspect=1.5, sharey=False)
    grid.set_axis_labels("", "ms per MoE layer-iteration")
    for ax in grid.axes.flat:
        ax.tick_params(axis="x", rotation=30)
        if not ax.patches:
            ax.text(0.5, 0.5, "does not fit", ha="center", va="center", transform=ax.transAxes)
    grid.figure.suptitle(f"Where the time goes ({top})", y=1.02)
    return grid.figure, long


def line_style(name: str) -> str:
    """Solid: the full backward; dashed: late selection at rho; dotted: early selection at rho."""
    return ":" if "early" in name else "--" if "rho" in name else "-"


def time_vs_memory(path: str | Path):
    """memory_sweep: time per iteration against the budget per system (a system is drawn only where it fits; the
    sensitivity band where the corners were priced, for :data:`BANDED` alone, so that the lines stay legible), and
    slots per rank against the budget, one column per model and skew, each up to a little past where memory stops
    binding (the tables carry every budget: nothing changes beyond)."""
    table = rows(path)
    table = table[table["system"].notna()] if "system" in table else table.iloc[0:0]
    ok = table[table["fits"].astype(bool) & table["iter_s"].notna()] if "iter_s" in table else table.iloc[0:0]
    panels = sorted(ok.groupby(["model", "skew_label"]).groups) if len(ok) else []
    if not panels:
        raise CannotDraw(f"{path}: no simulated system fits at any budget")
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 6.4), squeeze=False)
    colors = style.palette(list(dict.fromkeys(table["system"])))
    bind = {(r["model"], r["skew"]): r for r in binding_range(table.to_dict("records"))}
    for col, (model, skew) in enumerate(panels):
        cell = ok[(ok.model == model) & (ok.skew_label == skew)]
        for name, df in cell.groupby("system", sort=False):
            df = df.sort_values("mem_gb")
            line = {"color": colors[name], "linestyle": line_style(name), "label": name}
            axes[0, col].plot(df.mem_gb, df.iter_s, marker=".", **line)
            if name in BANDED and "iter_s_corners" in df and df["iter_s_corners"].notna().all():
                mb = [{k: v for k, v in c.items() if k.endswith(f"|mb={m}")} for c, m in  # this run's micro-batches
                      zip(df.iter_s_corners, df.micro_batches)]
                lo, hi = [min(c.values()) for c in mb], [max(c.values()) for c in mb]
                axes[0, col].fill_between(df.mem_gb, lo, hi, color=colors[name], alpha=0.10, lw=0)
            axes[1, col].step(df.mem_gb, df.slots_per_rank, where="post", **line)
        lo, hi = cell.mem_gb.min(), bind[(model, skew)]["binds_to_gb"] or cell.mem_gb.max()
        right = min(cell.mem_gb.max(), hi + 0.5 * (hi - lo) + 1.0)  # flat beyond: the tables go on to the top
        title = f"{model}, {skew}\n(flat from {right:.0f} to {cell.mem_gb.max():.0f} GB)"
        axes[0, col].set(title=title, ylabel="s per iteration (MoE layers)", xlim=(lo - 0.5, right))
        axes[1, col].set(xlabel="per-rank MoE budget (GB)", ylabel="filled slots per rank", xlim=(lo - 0.5, right))
    style.legend_outside(axes[0, -1], title="system")
    fig.suptitle("Memory pressure (simulated): a system appears from the budget at which it fits; bands ("
                 + ", ".join(BANDED) + "): GEMM efficiency, half-efficiency rows and link bandwidth at their corners",
                 fontsize=9)
    fig.tight_layout()
    return fig, ok


def ratios(path: str | Path):
    """validate_sim --regimes: per regime, each arm's measured layer time ÷ SYMI-dropless's (the per-step ratios'
    quartiles) beside the cost model's for the same plans."""
    table, infos = rows(path, "regime_ratio"), summary(path).get("regimes")
    if not infos:
        raise CannotDraw(f"{path}: no regimes in its summary")
    style.apply()
    layer = table[table["span"] == "layer"]
    regimes = list(dict.fromkeys(layer["regime"]))
    fig, axes = plt.subplots(1, len(regimes), figsize=(6.0 * len(regimes) + 2.0, 4.4), sharey=True, squeeze=False)
    for ax, regime in zip(axes[0], regimes):
        df = layer[layer["regime"] == regime].reset_index(drop=True)
        y = range(len(df))
        # the quartiles are the per-step ratios', the point the ratio of the medians: it may lie outside them
        ax.hlines(list(y), df["measured_ratio_q25"], df["measured_ratio_q75"], color="0.4", lw=1.2,
                  label="measured, quartiles of the per-step ratio")
        ax.scatter(df["measured_ratio"], y, marker="o", s=26, color="black", zorder=3,
                   label="measured (CPU, medians)")
        ax.scatter(df["modelled_ratio"], y, marker="D", s=28, color="#d62728", zorder=3,
                   label="modelled (cost model, same plans)")
        ax.axvline(1, color="0.6", lw=0.8, ls=":")
        ax.set_yticks(list(y), df["policy"])
        info = infos[regime]
        ax.set(xlabel="÷ SYMI-dropless's",
               title=f"regime {regime}: Zipf s {info['zipf_s']:.3f}\nstatic EP slowest rank ÷ mean "
                     f"{info['trace']['rank_max_over_mean']:.3f} (runs {info['runs']['rank_max_over_mean']:.3f})")
        ax.title.set_fontsize(9)
    axes[0][0].invert_yaxis()  # the axes share y: inverting one inverts all
    style.legend_outside(axes[0][-1])
    fig.supxlabel("slowest-rank layer CPU time (forward + backward) ÷ SYMI-dropless's, median over steps", fontsize=9)
    fig.tight_layout()
    return fig, layer


def predicted_vs_measured(path: str | Path):
    """validate_sim: predicted against measured ms of every (trace, policy, phase) cell on the primary clock, and
    the error per phase on both clocks."""
    cells, table, head = rows(path, "cell"), rows(path, "phase"), summary(path)
    shape = head.get("bench_shape")
    if shape is None:
        raise CannotDraw(f"{path}: its summary does not name the bench's shape (written before it was logged)")
    clock, target, clocks = head["clock"], head["target"], list(dict.fromkeys(cells["clock"]))
    title = (f"cost model vs measured layer: {shape['ranks']} gloo ranks, {shape['model']} D={shape['hidden']} "
             f"F={shape['ffn']}, {shape['tokens_per_rank']} tokens/rank")
    sns.set_theme(style="whitegrid", context="paper")
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.1, 1]})
    mine = cells[cells["clock"] == clock]
    sns.scatterplot(mine, x="measured_ms", y="predicted_ms", hue="phase", style="phase", ax=ax, s=40)
    positive = pd.concat([mine["measured_ms"], mine["predicted_ms"]])
    positive = positive[positive > 0]
    xs = [float(positive.min()) * 0.7, float(positive.max()) * 1.4]
    ax.plot(xs, xs, color="black", lw=1, label="predicted = measured")
    for f in (1 + target, 1 - target):
        ax.plot(xs, [x * f for x in xs], color="grey", lw=0.8, ls="--")
    ax.set(xscale="log", yscale="log", xlim=xs, ylim=xs, xlabel=f"measured ms, {clock} clock (median over steps)",
           ylabel="predicted ms (cost model)", title=f"each (trace, policy, phase); dashed: ±{target:.0%}")
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    with warnings.catch_warnings():  # seaborn's boxplot uses an argument matplotlib deprecates
        warnings.simplefilter("ignore", DeprecationWarning)
        sns.boxplot(cells, x="phase", y="error", hue="clock", hue_order=clocks, order=list(table["phase"]),
                    ax=bx, fliersize=2)
    bx.axhspan(-target, target, color="green", alpha=0.1)
    bx.axhline(0, color="black", lw=0.8)
    bx.set(ylabel="predicted / measured - 1", xlabel="", title="prediction error per phase")
    bx.tick_params(axis="x", rotation=50)
    fig.suptitle(title)
    fig.tight_layout()
    return fig, mine
