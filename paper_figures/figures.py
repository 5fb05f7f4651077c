"""The paper's figures, each a function of one results file (JSON lines, as the experiments write them).

Every function returns ``(figure, data)``: ``data`` is the DataFrame exactly as plotted, so the tests can check
that the plotted values are the file's. Nothing here holds a number of its own. Systems go by the names of
:mod:`lrmoe.systems`; records written under an older name of a system are read as that system.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from lrmoe.systems import canonical
from lrmoe.tracking import read_results

from lrmoe.paper_figures import style


def records(path: str | Path) -> pd.DataFrame:
    """The records of a results file, one row per record (a resumed run's repeated steps: the last wins)."""
    frame = pd.DataFrame(read_results(path))
    if frame.empty:
        raise ValueError(f"{path} holds no records")
    for column in ("system", "policy"):  # older results files: the registry's name of each system
        if column in frame:
            frame[column] = frame[column].map(lambda n: canonical(n, strict=False) if isinstance(n, str) else n)
    return frame


def fidelity(path: str | Path):
    """Metric fidelity against retention: relative error of all expert-weight gradients, per metric and mode.
    Trained layers with real text gradients when the results hold them, else every row (random data)."""
    data = records(path)
    source = "random-init layers, random data"
    if "data" in data and (data["data"] == "text").any():
        data = data[data["data"] == "text"]
        source = "trained debug layers, real text gradients"
    data = data.groupby(["mode", "metric", "rho"], as_index=False)["rel_w_all"].mean()
    modes = list(dict.fromkeys(data["mode"]))
    fig, axes = plt.subplots(1, len(modes), figsize=(4.2 * len(modes), 3.3), sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes):
        part = data[data["mode"] == mode]
        sns.lineplot(part, x="rho", y="rel_w_all", hue="metric", marker="o", ax=ax,
                     palette=style.palette(part.metric.unique()))
        ax.set(title=f"{mode} selection", xlabel="retention ρ", ylabel="relative error of expert grads")
    fig.suptitle(f"Gradient fidelity of backward recalibration, {source} (lower is better)")
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


MAIN_SYSTEMS = ["static-ep", "capacity-cf1", "symi-cf1", "symi-dropless", "lrmoe"]
# LRMoE minus one component each and what the component is
COMPONENTS = {"lrmoe-no-memplace": "memory-aware placement", "lrmoe-no-bwd-routing": "backward routing",
              "lrmoe-no-quotas": "retention quotas", "lrmoe-padded": "compaction"}
SPLIT = ["forward_ms_per_layer", "backward_ms_per_layer", "communication_ms_per_layer", "sync_ms_per_layer"]


def ablation_slice(path: str | Path) -> pd.DataFrame:
    """The simulator's records of one (ranks, memory budget) setting: the one where most cells fit, the smaller
    budget on ties (the memory-constrained case)."""
    data = records(path)
    data = data[data.fits.astype(bool)]
    if data.empty:
        raise ValueError(f"{path}: no simulated setting fits in memory")
    score = data.groupby(["ranks", "mem_gb"]).size().reset_index(name="n")
    best = score.sort_values(["n", "mem_gb", "ranks"], ascending=[False, True, False]).iloc[0]
    return data[(data.ranks == best.ranks) & (data.mem_gb == best.mem_gb)].copy()


def layer_time(path: str | Path):
    """MoE-layer time per iteration, LRMoE against SYMI and the baselines, per model and skew, split into
    forward, backward, communication and sync (stacked)."""
    data = ablation_slice(path)
    data = data[data.system.isin(MAIN_SYSTEMS)]
    data = data[["model", "skew", "system", "ranks", "mem_gb", *SPLIT, "time_ms_per_layer"]].reset_index(drop=True)
    models = list(dict.fromkeys(data.model))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 3.6), squeeze=False)
    colors = sns.color_palette("Set2", len(SPLIT))
    for ax, model in zip(axes[0], models):
        part = data[data.model == model]
        labels = [f"{sys_}\ns={skew:g}" for skew, sys_ in zip(part['skew'], part.system)]
        bottom = None
        for color, col in zip(colors, SPLIT):
            values = part[col].to_numpy()
            ax.bar(range(len(part)), values, bottom=bottom, color=color, label=col.split("_")[0])
            bottom = values if bottom is None else bottom + values
        ax.set_xticks(range(len(part)), labels, rotation=90, fontsize=6)
        ax.set(title=f"{model}: {int(part.ranks.iloc[0])} GPUs, {part.mem_gb.iloc[0]:g} GB MoE budget",
               ylabel="ms per MoE layer per iteration")
    axes[0][0].legend(loc="upper left")
    fig.suptitle("MoE-layer time (simulated): LRMoE against SYMI and baselines, across routing skew")
    fig.tight_layout()
    return fig, data


def ablation_waterfall(path: str | Path, model: str | None = None):
    """From SYMI-dropless to LRMoE at the highest skew, on the most memory-constrained setting where both fit
    (fewest GPUs, then smallest budget): what each LRMoE component saves (the time of LRMoE minus that component,
    less LRMoE's), and the rest (placement and forward routing differences, and the overlap of components that
    only pay off together: compaction saves bytes only where quotas trim, so their savings double-count)."""
    data = records(path)
    data = data[data.fits.astype(bool)]
    model = model or data.model.iloc[0]
    data = data[data.model == model]
    both = data.groupby(["ranks", "mem_gb"]).system.agg(lambda s: {"lrmoe", "symi-dropless"} <= set(s))
    if not both.any():
        raise ValueError(f"{path}: no setting where LRMoE and SYMI-dropless both fit for {model}")
    ranks, mem_gb = both[both].index.min()
    data = data[(data.ranks == ranks) & (data.mem_gb == mem_gb)]
    cell = data[data["skew"] == data["skew"].max()]
    time = cell.set_index("system")["time_ms_per_layer"]
    steps = [("SYMI-dropless", float(time["symi-dropless"]))]
    saved = 0.0
    for system, label in COMPONENTS.items():
        if system in time:
            delta = float(time[system] - time["lrmoe"])
            steps.append((label, -delta))
            saved += delta
    steps.append(("rest", float(time["lrmoe"] - time["symi-dropless"]) + saved))
    steps.append(("LRMoE", float(time["lrmoe"])))
    table = pd.DataFrame(steps, columns=["step", "ms"])
    fig, ax = plt.subplots(figsize=(7, 3.4))
    level = 0.0
    for i, (label, value) in enumerate(steps):
        if i in (0, len(steps) - 1):
            ax.bar(i, value, color="#1f77b4" if i == 0 else "#d62728")
            level = value
        else:
            ax.bar(i, value, bottom=level, color="#2ca02c" if value < 0 else "#ff7f0e")
            level += value
    ax.set_xticks(range(len(steps)), [s for s, _ in steps], rotation=30, ha="right")
    ax.set(ylabel="ms per MoE layer per iteration",
           title=f"Ablation waterfall, {model}, {ranks} GPUs, {mem_gb:g} GB, Zipf s={cell['skew'].iloc[0]:g} "
                 "(simulated)")
    fig.tight_layout()
    return fig, table


def bytes_memory(path: str | Path):
    """All-to-all and sync traffic, and peak memory per rank, per system and skew."""
    data = ablation_slice(path)
    data = data[data.system.isin(MAIN_SYSTEMS)]
    data = data[["model", "skew", "system", "a2a_gb_per_layer", "sync_gb_per_layer", "peak_mem_gb"]].reset_index(
        drop=True)
    cols = ["a2a_gb_per_layer", "sync_gb_per_layer", "peak_mem_gb"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    colors = style.palette(MAIN_SYSTEMS)
    for ax, col in zip(axes, cols):
        sns.lineplot(data, x="skew", y=col, hue="system", style="model", marker="o", ax=ax, palette=colors,
                     legend=col == cols[-1])
        ax.set(xlabel="Zipf s", ylabel=col.replace("_", " "))
    axes[-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1, 1))
    fig.suptitle("Bytes and memory (simulated)")
    fig.tight_layout()
    return fig, data


def rank_load(path: str | Path, trace: str | None = None):
    """Per-rank load of the real layer (layer_bench.py, gloo ranks, no spare replica slot): pairs computed in the
    forward and pairs kept for the backward, median over the measured steps, per policy, on the most skewed
    synthetic trace."""
    data = records(path)
    data = data[data.get("table", "per_rank_step") == "per_rank_step"] if "table" in data else data
    if trace is None:
        synthetic = sorted(t for t in data.trace.unique() if t.startswith("synthetic"))
        trace = synthetic[-1] if synthetic else data.trace.iloc[0]
    data = data[data.trace == trace]
    data = data.astype({"rank": int}).groupby(["policy", "rank"], as_index=False)[["pairs_fwd", "pairs_bwd"]].median()
    long = data.melt(id_vars=["policy", "rank"], value_vars=["pairs_fwd", "pairs_bwd"], var_name="pass",
                     value_name="pairs")
    long["pass"] = long["pass"].map({"pairs_fwd": "forward (computed)", "pairs_bwd": "backward (kept)"})
    policies = list(dict.fromkeys(data.policy))
    fig, axes = plt.subplots(1, len(policies), figsize=(2.6 * len(policies), 3.2), sharey=True, squeeze=False)
    for ax, policy in zip(axes[0], policies):
        sns.barplot(long[long.policy == policy], x="rank", y="pairs", hue="pass", ax=ax,
                    legend=policy == policies[-1])
        ax.set(title=policy, xlabel="rank")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"Per-rank load before and after recalibration (real layer, gloo ranks, no spare slot, {trace})")
    fig.tight_layout()
    return fig, data


# name -> (results file stem, figure function)
FIGURES = {
    "fidelity": ("metric_fidelity", fidelity),
    "convergence": ("convergence", convergence),
    "trace_skew": ("trace_stats", trace_skew),
    "layer_time": ("ablate", layer_time),
    "ablation_waterfall": ("ablate", ablation_waterfall),
    "bytes_memory": ("ablate", bytes_memory),
    "rank_load": ("layer_bench_constrained", rank_load),
}
