"""The paper's figures, each a function of one results file (JSON lines, as the experiments write them).

Every function returns ``(figure, data)``: ``data`` is the DataFrame exactly as plotted, so the tests can check
that the plotted values are the file's. Nothing here holds a number of its own. The figures each experiment script
draws of its own run (:mod:`run_figures`, :mod:`sim_figures`, :mod:`frontier_figures`) are registered in
:data:`RUN_FIGURES`, so that ``make figures`` redraws every figure from results files alone. Systems go by the names of
:mod:`lrmoe.systems`; records written under an older name of a system are read as that system.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from lrmoe.systems import canonical
from lrmoe.results import read_results

from lrmoe.paper_figures import frontier_figures, run_figures, sim_figures, style, tq_figures
from lrmoe.paper_figures.reading import CannotDraw, script


def records(path: str | Path) -> pd.DataFrame:
    """The records of a results file, one row per record (a resumed run's repeated steps: the last wins)."""
    frame = pd.DataFrame(read_results(path))
    if frame.empty:
        raise CannotDraw(f"{path} holds no records")
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
        style.metric_lines(ax, data[data["mode"] == mode], x="rho", y="rel_w_all")
        ax.set(title=f"{mode} selection", xlabel="retention ρ", ylabel="relative error of expert grads")
    style.legend_outside(axes[0][-1], "metric")
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
    sns.lineplot(data, x="step", y="val_loss", hue="policy", marker="o", ax=axes[0], palette=colors, legend=False)
    sns.lineplot(data.assign(time_ms=data.time_s * 1e3), x="time_ms", y="val_loss", hue="policy", marker="o",
                 ax=axes[1], palette=colors)
    axes[0].set(title="equal steps", ylabel="validation loss (nats/byte)")
    axes[1].set(title="equal modelled time", xlabel="modelled MoE-layer time (ms)")
    style.legend_outside(axes[1], "policy")
    style.integer_ticks(axes[0], "x")
    fig.suptitle("Convergence: LRMoE against SYMI and dropless expert parallelism")
    fig.tight_layout()
    return fig, data


def trace_skew(path: str | Path):
    """Skew of the routing traces: Gini and hottest-expert / mean, synthetic and recorded."""
    data = records(path)[["trace", "gini_mean", "max_over_mean_mean", "source"]]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    sns.barplot(data, x="trace", y="gini_mean", hue="source", ax=axes[0], dodge=False, legend=False)
    sns.barplot(data, x="trace", y="max_over_mean_mean", hue="source", ax=axes[1], dodge=False)
    axes[0].set(xlabel="", ylabel="Gini of per-expert pairs")
    axes[1].set(xlabel="", ylabel="hottest expert / mean")
    style.legend_outside(axes[1], "source")
    for ax in axes:
        plt.setp(ax.get_xticklabels(), rotation=45, ha="right", rotation_mode="anchor")
    fig.tight_layout()
    return fig, data


MAIN_SYSTEMS = ["static-ep", "capacity-cf1", "symi-cf1", "symi-dropless", "lrmoe"]
# LRMoE minus one component each and what the component is
COMPONENTS = {"lrmoe-no-memplace": "memory-aware placement", "lrmoe-no-bwd-routing": "backward routing",
              "lrmoe-no-quotas": "retention quotas", "lrmoe-padded": "compaction"}


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


def _skew_labels(data: pd.DataFrame) -> pd.DataFrame:
    """Records of older runs carry only the Zipf parameter: their skew label is ``zipf:<s>``."""
    data = data.copy()
    if "skew_label" not in data:
        data["skew_label"] = [f"zipf:{s:g}" for s in data["skew"]]
    data["skew_label"] = data["skew_label"].fillna(pd.Series([f"zipf:{s:g}" for s in data["skew"]], index=data.index))
    return data


def layer_time(path: str | Path):
    """MoE-layer time per iteration of each main system as a ratio to SYMI-dropless in the same cell (model, GPUs,
    memory budget, skew), with the sensitivity band of the headline's systems (GEMM efficiency, half-efficiency rows,
    link bandwidth, micro-batches) as an error bar; one panel per model and GPU count at the budget where most
    cells fit; skews ordered by their measured per-rank imbalance."""
    data = _skew_labels(records(path))
    data = data[data.fits.astype(bool) & data.get("time_ms_per_layer", pd.Series(dtype=float)).notna()]
    if data.empty:
        raise ValueError(f"{path}: no simulated cell fits in memory")
    mem_gb = ablation_slice(path).mem_gb.iloc[0]
    data = data[data.mem_gb == mem_gb]
    keys = ["model", "ranks", "skew_label"]
    ref = data[data.system == "symi-dropless"].set_index(keys)["time_ms_per_layer"].rename("ref")
    data = data[data.system.isin(MAIN_SYSTEMS) & (data.system != "symi-dropless")].join(ref, on=keys)
    data = data[data.ref.notna()]
    order = "trace_rank_max_over_mean" if "trace_rank_max_over_mean" in data else "skew"
    rows = []
    for r in data.itertuples():
        lo, hi = getattr(r, "vs_symi_dropless_lo", float("nan")), getattr(r, "vs_symi_dropless_hi", float("nan"))
        rows.append({"model": r.model, "ranks": int(r.ranks), "skew_label": r.skew_label,
                     "measured": float(getattr(r, order)), "system": r.system,
                     "ratio": r.time_ms_per_layer / r.ref, "lo": lo, "hi": hi})
    table = pd.DataFrame(rows)
    panels = list(dict.fromkeys(zip(table.model, table.ranks)))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.5), squeeze=False, sharey=True)
    colors = style.palette(MAIN_SYSTEMS)
    systems = [s for s in MAIN_SYSTEMS if s in set(table.system)]
    width = 0.8 / max(len(systems), 1)
    for ax, (model, ranks) in zip(axes[0], panels):
        part = table[(table.model == model) & (table.ranks == ranks)]
        skews = part.groupby("skew_label").measured.first().sort_values().index.tolist()
        for j, system in enumerate(systems):
            rows_ = part[part.system == system].set_index("skew_label").reindex(skews)
            x = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(skews))]
            has = rows_.lo.notna() & rows_.hi.notna()
            err = [(rows_.ratio - rows_.lo).where(has, 0.0).tolist(), (rows_.hi - rows_.ratio).where(has, 0.0).tolist()]
            ax.errorbar(x, rows_.ratio.tolist(), yerr=err, fmt="o", ms=5, capsize=3, color=colors[system],
                        label=style.SYSTEM_LABELS.get(system, system))
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        measured = order == "trace_rank_max_over_mean"  # older records: the generator's parameter only
        labels = [f"{k}\n{part[part.skew_label == k].measured.iloc[0]:.2f}" if measured else k for k in skews]
        ax.set_xticks(range(len(skews)), labels, fontsize=8)
        ax.set(title=f"{model}, {ranks} GPUs, {mem_gb:g} GB", ylabel="time / SYMI-dropless",
               xlabel="skew (generator), measured per-rank max/mean" if measured else "skew (generator)")
    style.legend_outside(axes[0][-1], "system")
    fig.suptitle("MoE-layer time relative to SYMI-dropless (simulated); bars: sensitivity band")
    fig.tight_layout()
    return fig, table


def ablation_waterfall(path: str | Path, model: str | None = None):
    """From SYMI-dropless to LRMoE at the highest measured skew, on the most memory-constrained setting where both
    fit (fewest GPUs, then smallest budget), in two panels. Left, a waterfall that adds up exactly: LRMoE's
    difference from SYMI-dropless in each category of time (forward compute, backward compute, communication,
    sync, overheads), every bar named for what it is. Right, what each LRMoE component is worth on its own: the
    time LRMoE loses without it (LRMoE minus that component, less LRMoE); these are not additive (compaction saves
    bytes only where the quotas trim) and so are not stacked."""
    data = _skew_labels(records(path))
    data = data[data.fits.astype(bool)]
    model = model or data.model.iloc[0]
    data = data[data.model == model]
    both = data.groupby(["ranks", "mem_gb"]).system.agg(lambda s: {"lrmoe", "symi-dropless"} <= set(s))
    if not both.any():
        raise ValueError(f"{path}: no setting where LRMoE and SYMI-dropless both fit for {model}")
    ranks, mem_gb = both[both].index.min()
    data = data[(data.ranks == ranks) & (data.mem_gb == mem_gb)]
    measure = "trace_rank_max_over_mean" if "trace_rank_max_over_mean" in data else "skew"
    cells = data[data.system.isin(["lrmoe", "symi-dropless"])].groupby("skew_label").system.nunique()
    data = data[data.skew_label.isin(cells[cells == 2].index)]
    top = data.sort_values(measure).skew_label.iloc[-1]
    cell = data[data.skew_label == top].set_index("system")
    cats = [c for c in ("forward", "backward", "communication", "sync", "overhead")
            if f"{c}_ms_per_layer" in cell and cell[f"{c}_ms_per_layer"].notna().all()]
    sym, lr = cell.loc["symi-dropless"], cell.loc["lrmoe"]
    steps = [("SYMI-dropless", "total", float(sym.time_ms_per_layer))]
    steps += [(c, "category", float(lr[f"{c}_ms_per_layer"] - sym[f"{c}_ms_per_layer"])) for c in cats]
    steps.append(("LRMoE", "total", float(lr.time_ms_per_layer)))
    parts = [(label, "component", float(cell.loc[system, "time_ms_per_layer"] - lr.time_ms_per_layer))
             for system, label in COMPONENTS.items() if system in cell.index]
    table = pd.DataFrame(steps + parts, columns=["step", "kind", "ms"])
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.6), gridspec_kw={"width_ratios": [3, 2]})
    level = 0.0
    for i, (label, kind, value) in enumerate(steps):
        if kind == "total":
            ax.bar(i, value, color="#1f77b4" if i == 0 else "#d62728")
            level = value
        else:
            ax.bar(i, value, bottom=level, color="#2ca02c" if value < 0 else "#ff7f0e")
            ax.annotate(f"{value:+.1f}", (i, level + max(value, 0.0)), ha="center", va="bottom", fontsize=7)
            level += value
    ax.set_xticks(range(len(steps)), [s for s, _, _ in steps], rotation=30, ha="right")
    ax.set(ylabel="ms per MoE layer per iteration", title="LRMoE - SYMI-dropless, by category (adds up)")
    if parts:
        bx.barh([p for p, _, _ in parts], [v for _, _, v in parts],
                color=["#ff7f0e" if v > 0 else "#2ca02c" for _, _, v in parts])
        bx.axvline(0.0, color="grey", lw=0.8)
        bx.set(xlabel="ms LRMoE loses without it", title="each component alone (not additive)")
    else:
        style.note(bx, "LRMoE's components were not simulated here")
    fig.suptitle(f"{model}, {ranks} GPUs, {mem_gb:g} GB, {top} (simulated)")
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
        style.integer_ticks(ax)
    style.legend_outside(axes[0][-1], "pass")
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
    "tq_protocol_pilot_claims": ("tq_protocol_pilot", tq_figures.claims),
    "tq_protocol_sweep_claims": ("tq_protocol_sweep", tq_figures.claims),
}


# "script.name" -> figure function: the figure each experiment script draws of its own run (``Tracker.log_figure``
# names it <results stem>_<name>), redrawn from every results file that script wrote
RUN_FIGURES = {
    "ablate.ratio_vs_symi": sim_figures.ratio_vs_symi,
    "ablate.time_split": sim_figures.time_split,
    "memory_sweep.time_vs_memory": sim_figures.time_vs_memory,
    "validate_sim.ratios": sim_figures.ratios,
    "validate_sim.predicted_vs_measured": sim_figures.predicted_vs_measured,
    "frontier.frontier": frontier_figures.frontier,
    "convergence.curves": run_figures.curves,
    "bench_planner.planner_time": run_figures.planner_time,
    "bench_scoring.select_time": run_figures.select_time,
    "bench_step.phases": run_figures.step_phases,
    "layer_bench.policies": run_figures.policies,
    "layer_bench.phases": run_figures.phases,
    "metric_fidelity.fidelity": run_figures.fidelity_grid,
    "trace_stats.skew": run_figures.skew,
}


def names(results: Path) -> list[str]:
    """The names of every figure :func:`draw_all` may draw from ``results`` (a paper figure whether or not its file
    is there; a script's own for each results file that script wrote), so that a job can claim them before drawing."""
    found = list(FIGURES)
    for source in sorted(results.glob("*.jsonl")):
        writer = script(source)
        found += [f"{source.stem}_{key.split('.')[1]}" for key in RUN_FIGURES if key.split(".")[0] == writer]
    return found


def _draw(draw, source: Path, out: Path, name: str, made: dict, skipped: dict, **save) -> None:
    try:
        fig, _ = draw(source)
    except CannotDraw as exc:  # the file predates the figure's records, or is another mode's
        skipped[name] = str(exc)
        print(f"skip {name}: {exc}")
        return
    made[name] = style.save(fig, out, name, **save)
    print(f"{name}: {made[name][0]}")


def draw_all(results: Path, out: Path, only: list[str] | None = None,
             skipped: dict[str, str] | None = None) -> dict[str, list[Path]]:
    """Every figure of :data:`FIGURES` whose results file is in ``results``, and every figure of
    :data:`RUN_FIGURES` of each results file there that its script wrote (PNG + PDF into ``out``); a figure whose
    file is missing, or lacks what it plots, is skipped with a note (into ``skipped``: {name: why}). {name: paths
    written}."""
    skipped = {} if skipped is None else skipped
    made: dict[str, list[Path]] = {}
    for name, (stem, draw) in FIGURES.items():
        if only and name not in only:
            continue
        style.apply()
        source = results / f"{stem}.jsonl"
        if not source.exists():
            skipped[name] = f"{source} not found"
            print(f"skip {name}: {source} not found")
            continue
        _draw(draw, source, out, name, made, skipped)
    sources = {}
    for source in sorted(results.glob("*.jsonl")):
        sources.setdefault(script(source), []).append(source)
    for key, draw in RUN_FIGURES.items():
        if only and key not in only:
            continue
        writer, suffix = key.split(".")
        for source in sources.get(writer, []):
            matplotlib.rcdefaults()  # as the script draws it: matplotlib's look unless the figure sets its own
            _draw(draw, source, out, f"{source.stem}_{suffix}", made, skipped, dpi=150)
    return made
