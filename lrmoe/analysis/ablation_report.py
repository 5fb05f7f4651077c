"""The ablation's tables (``experiments/ablate.py``), read from the table of its records
(:func:`lrmoe.sim.ablation.run_cells`): every run, the headline (LRMoE's time over SYMI's per model, node count and
skew, each ratio with its sensitivity band), the assumptions behind the numbers, and the run's summary.

``args`` is the script's argparse namespace (the attribute names of its flags).
"""

from __future__ import annotations

import pandas as pd

from lrmoe.config import MICRO_BATCH_BAND, SENSITIVITY, cluster_preset, model_preset

RG_TEXT = {"best": "each system in its faster mode of range and shard (column 'replica grads')",
           "range": "range (SYMI's) for every system", "shard": "shard for every system"}
# the columns of the table of every run, where the records have them
RUN_COLUMNS = ["model", "ranks", "skew_label", "trace_rank_max_over_mean", "mem_gb", "system", "iter_s",
               "forward_ms_per_layer", "backward_ms_per_layer", "communication_ms_per_layer", "sync_ms_per_layer",
               "overhead_ms_per_layer", "a2a_gb_per_layer", "peak_mem_gb", "oom", "drop_rate", "fwd_imbalance",
               "rho", "slots_per_rank", "vs_symi_dropless", "vs_symi_cf1"]


def runs_table(table: pd.DataFrame) -> str:
    """Markdown: every run, one row per (cell, system)."""
    return table[[c for c in RUN_COLUMNS if c in table]].to_markdown(index=False, floatfmt=".3g")


def ratio(a, b, col: str = "iter_s") -> str:
    """``a / b`` with the sensitivity band, as a table cell."""
    if a is None or b is None or pd.isna(getattr(a, col, float("nan"))) or pd.isna(getattr(b, col, float("nan"))):
        return "n/a"
    value = f"{getattr(a, col) / getattr(b, col):.2f}"
    ref = {"symi-dropless": "vs_symi_dropless", "symi-cf1": "vs_symi_cf1", "online": "vs_online"}.get(b.system)
    lo, hi = (getattr(a, f"{ref}_lo", float("nan")), getattr(a, f"{ref}_hi", float("nan"))) if ref else (None, None)
    if ref and not pd.isna(lo) and not pd.isna(hi):
        value += f" [{lo:.2f}–{hi:.2f}]"
    return value


def headline(table: pd.DataFrame, args) -> str:
    """Markdown: LRMoE ÷ SYMI-dropless and ÷ SYMI-cf1 per model, on one node and on two, across skews, each ratio
    with its sensitivity band, beside the skew the traces measurably have."""
    ranks_per_node = cluster_preset(args.cluster).ranks_per_node
    sel = table[(table.mem_gb == args.headline_mem_gb) & table.ranks.isin([ranks_per_node, 2 * ranks_per_node])]
    lines = ["| model | nodes x GPUs | skew | rank max/mean | expert max/mean | Gini | LRMoE / SYMI-dropless | "
             "LRMoE / SYMI-cf1 | LRMoE / SYMI-dropless with LRMoE's slots | LRMoE host groups / SYMI-dropless | "
             "LRMoE / online | (online + budget) / online | "
             "SYMI-cf1 drops | slots LRMoE / SYMI-dl / SYMI-cf1 | replica grads LRMoE / SYMI-dl / SYMI-cf1 | OOM |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (model, ranks, label), cell in sel.groupby(["model", "ranks", "skew_label"], sort=True):
        by = {r.system: r for r in cell.itertuples()}
        lr, dl, cf = by.get("lrmoe"), by.get("symi-dropless"), by.get("symi-cf1")
        hosts, same = by.get("lrmoe-host-groups"), by.get("symi-dropless-lrmoe-slots")
        online, online_budget = by.get("online"), by.get("online-rho0.75")
        nodes = f"{ranks // ranks_per_node} x {ranks_per_node}"
        first = cell.iloc[0]
        skew = f"{label} | {first.trace_rank_max_over_mean:.2f} | {first.trace_max_over_mean:.1f} | " \
               f"{first.trace_gini:.2f}" if "trace_rank_max_over_mean" in cell else f"{label} | | |"
        if lr is None or not hasattr(lr, "iter_s") or pd.isna(getattr(lr, "iter_s", float("nan"))):
            note = lr.note if lr is not None else "not run"
            what = "failed" if note.startswith("error") else "does not fit"
            lines.append(f"| {model} | {nodes} | {skew} | {what}: {note} | | | | | | | | | |")
            continue

        def slots(r):
            return "-" if r is None or pd.isna(getattr(r, "slots_per_rank", float("nan"))) else \
                f"{r.slots_per_rank:.0f}"

        def mode(r):
            return "-" if r is None or not isinstance(getattr(r, "replica_grad", None), str) else r.replica_grad

        oom = ", ".join(r.system for r in (lr, dl, cf) if r is not None and getattr(r, "oom", False) is True)
        drops = "n/a" if cf is None or pd.isna(getattr(cf, "drop_rate", float("nan"))) else f"{cf.drop_rate:.1%}"
        lines.append(f"| {model} | {nodes} | {skew} | {ratio(lr, dl)} | {ratio(lr, cf)} | "
                     f"{ratio(lr, same)} | {ratio(hosts, dl)} | {ratio(lr, online)} | "
                     f"{ratio(online_budget, online)} | "
                     f"{drops} | {slots(lr)} / {slots(dl)} / {slots(cf)} | "
                     f"{mode(lr)} / {mode(dl)} / {mode(cf)} | {oom or 'none'} |")
    return "\n".join(lines)


def assumptions(args) -> str:
    """One paragraph: every assumption that shapes the numbers (the cluster, budget, tokens, traces, micro-batches,
    LRMoE's eps and gamma, the headroom rule, the replica-gradient mode, the overheads charged, the band)."""
    from lrmoe.sim.cells import TOKENS, charged_overheads
    from lrmoe.sim.cost import CostModel

    c = cluster_preset(args.cluster)
    cm = CostModel(model_preset(args.models[0]), c)
    rule = ("each dropless system's buffers for its own planned peak load (its plans of the warm-up iteration), "
            f"+{args.headroom_margin:g}" if args.headroom_rule == "planned" else
            f"SYMI-dropless buffers for {args.symi_headroom}x the mean load, LRMoE for 1 + eps")
    corner = ", ".join(f"{k} {lo:g}-{hi:g}" for k, (lo, hi) in SENSITIVITY.items())
    return (f"Assumptions: {args.cluster} nodes ({c.ranks_per_node} GPUs, {c.intra_bw / 1e9:.0f} GB/s intra, "
            f"{c.inter_bw / 1e9:.0f} GB/s inter per GPU, {c.peak_flops / 1e12:.0f} TFLOP/s); per-rank MoE budget "
            f"{args.headline_mem_gb:g} GB over all MoE layers (one memory model, lrmoe.bytemodel.memory); "
            f"tokens per rank "
            f"{args.tokens_per_rank or TOKENS}; synthetic traces ({args.steps} iterations, first one warm-up, every "
            f"MoE layer unless --layers); {args.micro_batches} micro-batches per iteration (sync phases once per "
            f"iteration); LRMoE eps={args.eps}, gamma={args.gamma}; headroom: {rule}; SYMI-cf1 sized for its "
            f"capacity; replica gradients: {RG_TEXT[args.replica_grad]}; "
            f"overheads charged: {', '.join(charged_overheads(args)) or 'none'}; phases serial, each set by its "
            f"slowest rank; GEMM curve {cm.gemm.source}. Band [low-high]: the ratio at every corner of {corner}, "
            f"micro-batches {MICRO_BATCH_BAND[0]}-{MICRO_BATCH_BAND[1]}. Ratio < 1: LRMoE faster.")


def summary(table: pd.DataFrame, head: str, assumed: str) -> dict:
    """The run's summary: the headline and assumptions text, and LRMoE ÷ SYMI-dropless's range over every cell."""
    out = {"headline": head, "assumptions": assumed}
    lr = table[(table.system == "lrmoe") & table.get("vs_symi_dropless", pd.Series(dtype=float)).notna()] \
        if "vs_symi_dropless" in table else table.iloc[0:0]
    if len(lr):
        out.update(lrmoe_vs_symi_dropless_min=float(lr.vs_symi_dropless.min()),
                   lrmoe_vs_symi_dropless_max=float(lr.vs_symi_dropless.max()))
    return out
