"""The figures each experiment script draws of its own run, from its results file alone: the scripts call these on
the file they have just written, and ``make figures`` redraws them from the committed files (DESIGN.md §7: the
figures sit above every script's data). Each function returns ``(figure, data)`` like :mod:`figures`."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import seaborn as sns

from lrmoe.config import model_preset
from lrmoe.paper_figures.reading import CannotDraw, config, rows, summary



def select_time(path: str | Path):
    """bench_scoring: scoring + selection time per metric and mode against the 10 ms target."""
    table = rows(path, need=("metric", "mode", "select_ms", "pairs", "groups"))
    args, target = config(path, need=("width", "device", "threads")), summary(path, need=("target_ms",))["target_ms"]
    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(6, 3))
    sns.barplot(table, x="metric", y="select_ms", hue="mode", ax=ax)
    ax.axhline(target, color="k", ls="--", lw=0.8, label="target")
    ax.set(ylabel="scoring + selection (ms)", title=f"{table['pairs'][0]:,} pairs × D={args['width']}, "
           f"{table['groups'][0]:,} groups, {args['device']}, {args['threads']} CPU thread(s)")
    fig.tight_layout()
    return fig, table


def skew(path: str | Path):
    """trace_stats: Gini and hottest expert ÷ mean of each generated (and recorded) trace."""
    table = rows(path, need=("trace", "gini_mean", "max_over_mean_mean"))
    model = model_preset(config(path, need=("model",))["model"])
    sns.set_theme(style="whitegrid", context="paper")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    sns.barplot(table, x="trace", y="gini_mean", ax=axes[0], color="C0")
    sns.barplot(table, x="trace", y="max_over_mean_mean", ax=axes[1], color="C1")
    axes[0].set(ylabel="Gini of per-expert pairs", xlabel="")
    axes[1].set(ylabel="hottest expert / mean", xlabel="")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
    fig.suptitle(f"Routing skew of synthetic traces ({model.name}: E={model.num_experts}, top-{model.top_k})")
    fig.tight_layout()
    return fig, table


def planner_time(path: str | Path):
    """bench_planner: planner time per layer against N · E, the old plan and the batched critical path."""
    frame = rows(path, need=("policy", "E", "NE", "old_ms", "critical_path_ms"))
    target = summary(path, need=("target_ms",))["target_ms"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    styles = dict(zip(sorted(frame["E"].unique()), ["-", "--", ":", "-."]))
    colors = {name: f"C{i}" for i, name in enumerate(frame["policy"].unique())}
    for ax, (column, title) in zip(axes, [("old_ms", "old plan, per layer"),
                                          ("critical_path_ms", "critical path, batched, per layer")]):
        for (name, E), group in frame.groupby(["policy", "E"], sort=False):
            group = group.sort_values("NE")
            ax.plot(group["NE"], group[column], marker="o", ms=4, color=colors[name], ls=styles.get(E, "-"),
                    label=f"{name}, E={E}")
        ax.axhline(target, color="k", ls="--", lw=1, label=f"target ({target} ms)")
        ax.set(xscale="log", yscale="log", xlabel="N · E (ranks × experts)", title=title)
    axes[0].set_ylabel("ms per layer and micro-batch (median)")
    axes[1].legend(fontsize=5, ncol=2)
    fig.suptitle("Planner time, one CPU thread")
    fig.tight_layout()
    return fig, frame


def step_phases(path: str | Path):
    """bench_step: seconds per training step by phase, this checkout's code beside the baseline's (when run), per
    engine and system, with the dense single-process floor."""
    from lrmoe.harness.step_bench import PHASE_ORDER

    frame = rows(path, need=("engine", "system", "phase_s", "step_s"))
    runs = frame[frame["engine"] != "floor"]
    floor = frame[frame["engine"] == "floor"]["step_s"]
    bars = []
    for _, r in runs.iterrows():
        for side, column in (("now", "phase_s"), ("baseline", "baseline_phase_s")):
            if column in r and isinstance(r[column], dict):
                bars.append((f"{r['system']} ({r['engine']} {r['ranks']}) {side}", r[column]))
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(bars) + 1.5))
    left = [0.0] * len(bars)
    for k, phase in enumerate(PHASE_ORDER):
        widths = [b[1].get(phase, 0.0) for b in bars]
        ax.barh(range(len(bars)), widths, left=left, color=f"C{k}", label=phase)
        left = [a + w for a, w in zip(left, widths)]
    if len(floor):
        ax.axvline(float(floor.iloc[0]), color="k", ls="--", lw=1,
                   label="floor: dense, one process, the emulated runs' tokens")
    ax.set_yticks(range(len(bars)), [b[0] for b in bars], fontsize=6)
    ax.invert_yaxis()
    ax.set(xlabel="seconds per step by phase (thread CPU: the ranks' sum on the emulated engine, the mean rank's on "
                  "the distributed one)", title="One training step by phase (evaluation at one per 15 steps)")
    ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    return fig, runs


def curves(path: str | Path):
    """convergence: validation loss (mean over seeds, band: spread) at equal steps and at equal modelled time."""
    val = rows(path, need=("policy", "step", "val_loss", "time_s")).dropna(subset=["val_loss"])
    args = config(path, need=("preset", "ranks", "seeds"))
    sns.set_theme(style="whitegrid", context="paper")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    sns.lineplot(val, x="step", y="val_loss", hue="policy", errorbar=("pi", 100), ax=axes[0])
    sns.lineplot(val.assign(time_ms=1e3 * val.time_s), x="time_ms", y="val_loss", hue="policy", errorbar=None,
                 ax=axes[1], legend=False)
    axes[0].set(title="validation loss at equal steps (band: seed min-max)", ylabel="validation loss (nats/byte)")
    axes[1].set(title="at equal modelled time (seed mean)", xlabel="modelled MoE-layer time (ms)")
    axes[0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"{args['preset']}, {args['ranks']} ranks, seeds {args['seeds']} (text: Python stdlib source)")
    fig.tight_layout()
    return fig, val


def fidelity_grid(path: str | Path):
    """metric_fidelity: recalibrated against full expert-weight gradients per setting, metric and mode."""
    table = rows(path, need=("preset", "weights", "data", "layer", "rho", "rel_w_mean", "metric", "mode"))
    sns.set_theme(style="whitegrid", context="paper")
    trained = table["weights"].str.startswith("trained")
    table["setting"] = (table["preset"].str.replace("-debug", "") + " / " + table["weights"] + " / "
                        + table["data"] + table["layer"].map(lambda i: f" / L{i}").where(trained, ""))
    grid = sns.relplot(table, x="rho", y="rel_w_mean", hue="metric", style="metric", col="mode", row="setting",
                       kind="line", markers=True, height=2.2, aspect=1.9, facet_kws={"sharey": False})
    grid.set_titles("{row_name} | {col_name}")
    grid.set_axis_labels("retention ρ", "expert-gradient rel. error")
    grid.figure.suptitle("Recalibrated vs full expert weight gradients (random-init layers on random data, "
                         "trained layers on text)", y=1.02)
    return grid.figure, table


def bench_trace(path: str | Path) -> str:
    """The trace layer_bench reads its targets on (its configuration's, else its target table's)."""
    args = config(path)
    if args.get("target_trace"):
        return args["target_trace"]
    try:
        return str(rows(path, "target")["trace"].iloc[0])
    except CannotDraw:
        raise CannotDraw(f"{path}: names no target trace (written before layer_bench logged it, without LRMoE "
                         "targets)") from None


def policies(path: str | Path):
    """layer_bench: per policy and trace, the slowest rank's CPU time, backward bytes, backward imbalance and
    gradient error."""
    totals = rows(path, "policy", need=("policy", "trace"))
    args = config(path, need=("world_size", "model", "hidden", "ffn", "tokens_per_rank", "spare_slots"))
    sns.set_theme(style="whitegrid", context="paper")
    fig, axes = plt.subplots(1, 4, figsize=(17, 3.6))
    for ax, (col, ylabel) in zip(axes, [("slowest_cpu_ms", "slowest rank layer CPU ms (median)"),
                                       ("bwd_a2a_KiB", "backward all-to-all KiB (all ranks)"),
                                       ("bwd_max_over_fwd_mean", "slowest rank bwd pairs / mean fwd"),
                                       ("grad_rel_err", "expert-gradient error vs full")]):
        if col in totals:
            sns.barplot(totals, x="policy", y=col, hue="trace", ax=ax, legend=ax is axes[0])
            ax.set(ylabel=ylabel, xlabel="")
            ax.tick_params(axis="x", rotation=60)
    sns.move_legend(axes[0], "lower left", frameon=True)
    fig.suptitle(f"EP layer, {args['world_size']} ranks, {args['model']} D={args['hidden']} F={args['ffn']}, "
                 f"{args['tokens_per_rank']} tokens/rank, {args['spare_slots']} spare slot(s)/rank")
    fig.tight_layout()
    return fig, totals


def phases(path: str | Path):
    """layer_bench: the slowest rank's time in each phase per policy, on the target trace."""
    table, on = rows(path, "phase", need=("trace", "phase", "wall_ms_max", "policy")), bench_trace(path)
    shown = table[table["trace"] == on]
    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(11, 3.4))
    sns.barplot(shown, x="phase", y="wall_ms_max", hue="policy", ax=ax)
    ax.set(ylabel="slowest rank, ms (mean over steps)", xlabel="", title=on)
    ax.tick_params(axis="x", rotation=60)
    fig.tight_layout()
    return fig, shown
