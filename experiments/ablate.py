"""Trace-driven ablations of LRMoE against SYMI at paper scale, on the simulator (lrmoe.sim): the planner code of
the real layer runs on synthetic routing traces for every simulated MoE layer and iteration, and the cost model
turns each plan into time, bytes and memory on a cluster preset.

Systems: static EP (dropless), capacity cf 1.0 / 1.25, SYMI-cf1, SYMI-dropless (and SYMI-dropless given LRMoE's
slot count), LRMoE, LRMoE with host-only replica-sync groups, and LRMoE minus each component: memory-aware
placement, backward replica routing (with the balanced and with an even forward split), retention quotas, and
compaction (padded packets). The recalibration metric (random / gate-only) and the selection mode (unbiased)
keep the same counts, so their rows repeat LRMoE's time by construction: their effect is on the gradient
(experiments/metric_fidelity.py).
Swept over model, routing skew (Zipf s, DESIGN.md §5), per-rank memory budget and number of ranks. Systems are
named as in ``lrmoe.systems`` (``--systems`` takes any of them).

    python experiments/ablate.py --quick            # small sweep (6 iterations, 4 layers, 8 and 16 ranks,
                                                    # 2 budgets, 4 skews): about 20 s on 2 CPU cores
    python experiments/ablate.py                    # full sweep: 100 iterations x all MoE layers x 3 rank
                                                    # counts x 4 skews x 3 budgets x 2 models (~1.5 h here)
    python experiments/ablate.py --models qwen3-30b-a3b --ranks 64 --skews 0.6 --steps 100   # one cell

Every assumption that shapes the numbers is a flag (tokens per rank, budgets, SYMI's buffer headroom, LRMoE's
eps / gamma, the most extra slots); the headline table prints them beside the ratios. Traces are synthetic.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from tqdm import tqdm

from lrmoe.config import ClusterConfig, MoEConfig, cluster_preset, model_preset
from lrmoe.placement import MemoryModel
from lrmoe.sim.cost import CostModel
from lrmoe.sim.simulator import System, simulate
from lrmoe.systems import SystemContext, check_systems, get_system, plan_twins, system_arg, system_names_help
from lrmoe.tracking import Tracker, add_tracking_args
from lrmoe.traces import generate_trace, gini, max_over_mean

MODELS = ["qwen3-30b-a3b", "glm-4.5-air"]
# Tokens per rank per micro-batch (ours). Qwen3: one 4096-token sequence per GPU. GLM-4.5-Air: its expert
# weights and gradients alone need 50 GB per GPU on one 8-GPU node, and 25 GB on two, which leaves 40 GB A100s
# room for about 1024 tokens per GPU. Both leave the 40 GB budget with no or few spare replica slots.
TOKENS = {"qwen3-30b-a3b": 4096, "glm-4.5-air": 1024}
SKEWS = [0.2, 0.4, 0.6, 0.8]  # Zipf s: Gini 0.10-0.50 before top-k (DESIGN.md §5)
# The default systems (lrmoe.systems). The metric and selection-mode variants (lrmoe-random, lrmoe-gate,
# lrmoe-m2-unbiased) have LRMoE's plan by construction: they choose *which* pairs fill the quotas, never how many,
# so their counted work (and simulated time) is LRMoE's, and the simulator runs LRMoE once for them
# (lrmoe.systems.plan_twins).
SYSTEMS = ["static-ep", "capacity-cf1", "capacity-cf1.25", "symi-cf1", "symi-dropless",
           "symi-dropless-lrmoe-slots", "lrmoe",
           "lrmoe-host-groups", "lrmoe-no-memplace", "lrmoe-no-bwd-routing", "lrmoe-even-fwd",
           "lrmoe-even-fwd-no-bwd-routing", "lrmoe-no-quotas", "lrmoe-padded",
           "lrmoe-random", "lrmoe-gate", "lrmoe-m2-unbiased",
           "online", "online-rho0.75"]  # online replication (lrmoe.online) and LRMoE's budget on top of it
CATS = ["forward", "backward", "communication", "sync"]
PLOTTED = ["static-ep", "capacity-cf1", "symi-cf1", "symi-dropless-lrmoe-slots", "lrmoe", "lrmoe-host-groups",
           "lrmoe-no-memplace", "lrmoe-no-quotas", "lrmoe-padded"]


@dataclass(frozen=True)
class Cell:
    """One point of the sweep: everything but the system."""

    model: MoEConfig
    cluster: ClusterConfig
    skew: float
    mem_gb: float
    tokens: int

    @property
    def layer_budget(self) -> float:
        """One MoE layer's share of a rank's budget (the planner's MemoryModel and the cost model's)."""
        return self.mem_gb * 1e9 / self.model.num_moe_layers


def system_context(cell: Cell, cm: CostModel, args) -> SystemContext:
    """What every system of a cell is built from: the cell's per-layer budget as a MemoryModel (the cost model's
    slot and pair bytes), at most ``--max-extra`` spare slots (default E/N), LRMoE's eps and gamma, and SYMI's
    slots sized from that memory: the spare slots that fit beside buffers for ``--symi-headroom`` x the mean load
    (SYMI-cf1: 1x, its capacity bound; lrmoe.systems)."""
    m, c = cell.model, cell.cluster
    base = m.num_experts // c.num_ranks
    return SystemContext(num_experts=m.num_experts, num_ranks=c.num_ranks,
                         spare_slots=base if args.max_extra is None else args.max_extra, eps=args.eps,
                         gamma=args.gamma, memory=MemoryModel(cell.layer_budget, cm.slot_bytes, cm.pair_bytes),
                         pairs_per_rank=cell.tokens * m.top_k, symi_headroom=args.symi_headroom,
                         ranks_per_node=c.ranks_per_node)


def build_systems(cell: Cell, names: list[str], args) -> tuple[dict[str, System], dict[str, str], dict[str, str]]:
    """The systems of one cell (each name's first plan twin only), why those that cannot run there cannot, and
    notes on those that run (e.g. SYMI left without a spare slot)."""
    m, c = cell.model, cell.cluster
    cm = CostModel(m, c, mem_budget_bytes=cell.layer_budget)
    base = m.num_experts // c.num_ranks
    if cell.layer_budget < base * cm.slot_bytes:
        why = (f"the {base} home slots ({base * cm.slot_bytes / 1e6:.0f} MB per layer) exceed the per-layer "
               f"budget ({cell.layer_budget / 1e6:.0f} MB)")
        return {}, {name: why for name in names}, {}
    ctx = system_context(cell, cm, args)
    twins = plan_twins(names)
    specs = {name: get_system(name) for name in names if name not in twins}
    notes = {name: spec.note(ctx) for name, spec in specs.items()}
    return {name: spec.simulator_system(ctx) for name, spec in specs.items()}, {}, {k: v for k, v in notes.items() if v}


def cost_kwargs(name: str, cell: Cell) -> dict:
    return {"mem_budget_bytes": cell.layer_budget, **get_system(name).cost_options()}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small sweep (used by the tests and the main job)")
    parser.add_argument("--models", nargs="+", default=MODELS)
    parser.add_argument("--cluster", default="a100-40gb-x8", help="cluster preset (its node is replicated)")
    parser.add_argument("--ranks", nargs="+", type=int, default=None, help="default 8 16 64 (quick: 8 16)")
    parser.add_argument("--skews", nargs="+", type=float, default=None, help="Zipf s (default 0.2 0.4 0.6 0.8)")
    parser.add_argument("--mem-gb", nargs="+", type=float, default=None,
                        help="per-rank budget for all MoE layers, GB (default 0.8x, 1x, 2x the device; quick 1x, 2x)")
    parser.add_argument("--tokens-per-rank", type=int, default=None, help="default per model: " + str(TOKENS))
    parser.add_argument("--steps", type=int, default=None, help="iterations (default 100; quick 6)")
    parser.add_argument("--micro-batches", type=int, default=8,
                        help="micro-batches per iteration: the sync phases run once per iteration (ours)")
    parser.add_argument("--layers", type=int, default=None, help="simulated MoE layers (default all; quick 4)")
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, type=system_arg, help=system_names_help())
    parser.add_argument("--eps", type=float, default=0.1, help="LRMoE balance slack")
    parser.add_argument("--gamma", type=float, default=0.1, help="LRMoE per-expert floor")
    parser.add_argument("--max-extra", type=int, default=None, help="most extra slots per rank (default E/N)")
    parser.add_argument("--symi-headroom", type=float, default=1.5,
                        help="SYMI-dropless reserves buffers for this x the mean load (ours)")
    parser.add_argument("--headline-mem-gb", type=float, default=None, help="budget of the headline (default 1x)")
    parser.add_argument("--seed", type=int, default=0)
    add_tracking_args(parser, "outputs/ablate.jsonl")
    args = parser.parse_args(argv)
    base = cluster_preset(args.cluster)
    device_gb = base.mem_budget_bytes / 1e9
    if args.quick:
        args.ranks = args.ranks or [8, 16]
        args.skews = args.skews or SKEWS
        args.mem_gb = args.mem_gb or [device_gb, 2 * device_gb]
        args.steps = args.steps or 6
        args.layers = args.layers or 4
    else:
        args.ranks = args.ranks or [8, 16, 64]
        args.skews = args.skews or SKEWS
        args.mem_gb = args.mem_gb or [0.8 * device_gb, device_gb, 2 * device_gb]
        args.steps = args.steps or 100
    args.headline_mem_gb = args.headline_mem_gb or device_gb
    for r in args.ranks:
        if r % base.ranks_per_node:
            raise ValueError(f"--ranks {r} is not a multiple of {args.cluster}'s {base.ranks_per_node} ranks per node")
    if args.micro_batches < 1:
        raise ValueError(f"--micro-batches must be positive, got {args.micro_batches}")
    if args.steps < 2:
        raise ValueError(f"--steps must be at least 2 (the first is warm-up), got {args.steps}")
    check_args(args)
    return args


def check_args(args) -> None:
    """What would otherwise fail cell by cell, hours into a sweep, raised once up front (ValueError naming the
    flag): the model presets, the sizes, the skews, and every system in the first cell of each model."""
    models = [model_preset(name) for name in args.models]
    if any(r < 1 for r in args.ranks):
        raise ValueError(f"--ranks must be positive, got {args.ranks}")
    if any(not v > 0 for v in args.mem_gb):
        raise ValueError(f"--mem-gb must be positive, got {args.mem_gb}")
    if any(not v >= 0 for v in args.skews):
        raise ValueError(f"--skews (Zipf s) must be non-negative, got {args.skews}")
    for name in ("tokens_per_rank", "layers", "symi_headroom"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.max_extra is not None and args.max_extra < 0:
        raise ValueError(f"--max-extra must be non-negative, got {args.max_extra}")
    base = cluster_preset(args.cluster)
    for model in models:
        for ranks in args.ranks:
            if model.num_experts % ranks:
                raise ValueError(f"--ranks {ranks} does not divide the {model.num_experts} experts of {model.name}")
        cluster = base.with_nodes(args.ranks[0] // base.ranks_per_node)
        cell = Cell(model, cluster, args.skews[0], max(args.mem_gb),
                    args.tokens_per_rank or TOKENS.get(model.name, 2048))
        cm = CostModel(model, cluster, mem_budget_bytes=cell.layer_budget)
        check_systems(args.systems, system_context(cell, cm, args))


def run_cells(args, run) -> pd.DataFrame:
    """Simulate every (cell, system); one record per pair, logged as it completes."""
    base = cluster_preset(args.cluster)
    plan = []
    for name in args.models:
        model = model_preset(name)
        layers = min(args.layers or model.num_moe_layers, model.num_moe_layers)
        tokens = args.tokens_per_rank or TOKENS.get(name, 2048)
        for ranks in args.ranks:
            cluster = base.with_nodes(ranks // base.ranks_per_node)
            for skew in args.skews:
                for mem_gb in args.mem_gb:
                    plan.append((Cell(model, cluster, skew, mem_gb, tokens), layers))
    twins = plan_twins(args.systems)  # {name: the system it shares its plans with}: simulated once
    per_cell = sum(1 for s in args.systems if s not in twins)
    total = sum(per_cell * args.steps * layers for _, layers in plan)
    rows = []
    traces = {}
    errors: list[str] = []
    with tqdm(total=total, desc="layer-steps", unit="ls", disable=None, mininterval=1.0) as bar:
        for cell, layers in plan:
            m, c = cell.model, cell.cluster
            key = (m.name, c.num_ranks, cell.skew, cell.tokens, layers)
            if key not in traces:
                traces[key] = generate_trace(args.steps, layers, c.num_ranks, m.num_experts, m.top_k, cell.tokens,
                                             skew="zipf", skew_param=cell.skew, seed=args.seed, model=m.name)
            trace = traces[key]
            per_expert = trace.counts_SLNE.sum(2).double()
            common = {"model": m.name, "cluster": c.name, "ranks": c.num_ranks, "nodes": c.num_nodes,
                      "skew": cell.skew, "mem_gb": cell.mem_gb, "tokens_per_rank": cell.tokens,
                      "layers_simulated": layers, "steps": args.steps,
                      "trace_gini": float(gini(per_expert).mean()),
                      "trace_max_over_mean": float(max_over_mean(per_expert).mean()), "trace": "synthetic zipf"}
            systems, skipped, notes = build_systems(cell, args.systems, args)
            cell_rows = {}
            for name in args.systems:
                if name in twins:
                    continue
                if name in skipped:
                    rec = {**common, "system": name, "fits": False, "note": skipped[name]}
                    bar.update(args.steps * layers)
                else:
                    system = systems[name]
                    try:
                        res = simulate(trace.counts_SLNE, system, m, c, cost_kwargs=cost_kwargs(name, cell),
                                       micro_batches=args.micro_batches, progress=bar.update)
                    except Exception as exc:  # noqa: BLE001 - one failing cell must not lose an hours-long sweep
                        why = f"error: {type(exc).__name__}: {exc}"
                        tqdm.write(f"{m.name} {c.name} s={cell.skew:g} {cell.mem_gb:g} GB {name}: {why}",
                                   file=sys.stderr)
                        errors.append(why)
                        cell_rows[name] = {**common, "system": name, "fits": False, "note": why}
                        continue
                    s = res.summary()
                    scale = m.num_moe_layers / layers  # whole model from the simulated layers
                    rec = {**common, "system": name, "fits": not s["oom"], "note": notes.get(name, ""),
                           "iter_s": s["time_s"] * scale,
                           # per MoE layer and iteration (all micro-batches)
                           **{f"{k}_ms_per_layer": s[f"{k}_s"] / layers * 1e3 for k in ["time"] + CATS},
                           "a2a_gb_per_layer": s["a2a_bytes"] / layers / 1e9,
                           "sync_gb_per_layer": s["sync_bytes"] / layers / 1e9,
                           "peak_mem_gb": s["peak_mem_bytes"] / 1e9, "oom": s["oom"], "drop_rate": s["drop_rate"],
                           "fwd_imbalance": s["fwd_imbalance"], "rho": s["rho"],
                           "slots_per_rank": s["slots_per_rank"], "layer_over_share": s["layer_over_share"]}
                cell_rows[name] = rec
            for twin, source in twins.items():
                if source in cell_rows:
                    src = cell_rows[source]
                    cell_rows[twin] = {**src, "system": twin, "note": src["note"] if "iter_s" not in src else
                                       f"same plan as {source} by construction"}
            for name in args.systems:
                rec = cell_rows.get(name)
                if rec is None:
                    continue
                for ref in ("symi-dropless", "symi-cf1", "online"):
                    other = cell_rows.get(ref, {})
                    if "iter_s" in rec and "iter_s" in other:
                        rec[f"vs_{ref.replace('-', '_')}"] = rec["iter_s"] / other["iter_s"]
                run.log(rec)
                rows.append(rec)
    table = pd.DataFrame(rows)
    table.attrs["errors"] = errors
    return table


def headline(table: pd.DataFrame, args) -> str:
    """Markdown: LRMoE ÷ SYMI-dropless and ÷ SYMI-cf1 per model, on one node and on two, across skews."""
    ranks_per_node = cluster_preset(args.cluster).ranks_per_node
    sel = table[(table.mem_gb == args.headline_mem_gb) & table.ranks.isin([ranks_per_node, 2 * ranks_per_node])]
    lines = ["| model | nodes x GPUs | Zipf s | Gini | LRMoE / SYMI-dropless | LRMoE / SYMI-cf1 | "
             "LRMoE / SYMI-dropless with LRMoE's slots | LRMoE host groups / SYMI-dropless | SYMI-cf1 drops | "
             "slots LRMoE / SYMI-dl / SYMI-cf1 | OOM |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (model, ranks, skew), cell in sel.groupby(["model", "ranks", "skew"], sort=True):
        by = {r.system: r for r in cell.itertuples()}
        lr, dl, cf = by.get("lrmoe"), by.get("symi-dropless"), by.get("symi-cf1")
        hosts, same = by.get("lrmoe-host-groups"), by.get("symi-dropless-lrmoe-slots")
        nodes = f"{ranks // ranks_per_node} x {ranks_per_node}"
        if lr is None or not hasattr(lr, "iter_s") or pd.isna(getattr(lr, "iter_s", float("nan"))):
            note = lr.note if lr is not None else "not run"
            what = "failed" if note.startswith("error") else "does not fit"
            lines.append(f"| {model} | {nodes} | {skew:g} | | {what}: {note} | | | | | | |")
            continue

        def ratio(a, b):
            return "n/a" if a is None or b is None or pd.isna(getattr(b, "iter_s", float("nan"))) else \
                f"{a.iter_s / b.iter_s:.2f}"

        def slots(r):
            return "-" if r is None or pd.isna(getattr(r, "slots_per_rank", float("nan"))) else \
                f"{r.slots_per_rank:.0f}"

        oom = ", ".join(r.system for r in (lr, dl, cf) if r is not None and getattr(r, "oom", False) is True)
        drops = "n/a" if cf is None or pd.isna(getattr(cf, "drop_rate", float("nan"))) else f"{cf.drop_rate:.1%}"
        lines.append(f"| {model} | {nodes} | {skew:g} | {lr.trace_gini:.2f} | {ratio(lr, dl)} | {ratio(lr, cf)} | "
                     f"{ratio(lr, same)} | {ratio(hosts, dl)} | {drops} | {slots(lr)} / {slots(dl)} / {slots(cf)} | "
                     f"{oom or 'none'} |")
    return "\n".join(lines)


def assumptions(args) -> str:
    c = cluster_preset(args.cluster)
    return (f"Assumptions: {args.cluster} nodes ({c.ranks_per_node} GPUs, {c.intra_bw / 1e9:.0f} GB/s intra, "
            f"{c.inter_bw / 1e9:.0f} GB/s inter per GPU, {c.peak_flops / 1e12:.0f} TFLOP/s); per-rank MoE budget "
            f"{args.headline_mem_gb:g} GB over all MoE layers; tokens per rank {args.tokens_per_rank or TOKENS}; "
            f"synthetic Zipf traces ({args.steps} iterations, first one warm-up); {args.micro_batches} micro-batches "
            f"per iteration (sync phases once per iteration); LRMoE eps={args.eps}, "
            f"gamma={args.gamma}; SYMI-dropless buffers for {args.symi_headroom}x the mean load, SYMI-cf1 for 1x; "
            f"phases serial, each set by its slowest rank; GEMM curve constants are placeholders until "
            f"calibrated (lrmoe/sim/cost.py). Ratio < 1: LRMoE faster.")


def plot(table: pd.DataFrame, run, args) -> list:
    """Time relative to SYMI-dropless vs skew per system (one panel per model and rank count), and the
    split of LRMoE's and SYMI's time into forward, backward, communication and sync."""
    figs = []
    ok = table[table["vs_symi_dropless"].notna()] if "vs_symi_dropless" in table else table.iloc[0:0]
    ok = ok[(ok.mem_gb == args.headline_mem_gb) & ok.system.isin(PLOTTED)]
    if len(ok):
        sns.set_theme(style="whitegrid", context="paper")
        grid = sns.relplot(ok, x="skew", y="vs_symi_dropless", hue="system", style="system", col="model",
                           row="ranks", kind="line", markers=True, dashes=True, height=2.6, aspect=1.3,
                           facet_kws={"sharey": False})
        grid.set_axis_labels("Zipf s (routing skew)", "time / SYMI-dropless")
        for ax in grid.axes.flat:
            ax.axhline(1.0, color="grey", lw=0.8, ls="--")
            if not ax.lines[:-1]:
                ax.text(0.5, 0.5, "does not fit", ha="center", va="center", transform=ax.transAxes)
        grid.figure.suptitle("MoE-layer time per iteration relative to SYMI-dropless (simulated)", y=1.02)
        figs += run.log_figure("ratio_vs_symi", grid.figure)
        plt.close(grid.figure)
        top = float(ok["skew"].max())
        split = table[(table.mem_gb == args.headline_mem_gb) & (table["skew"] == top) & table["iter_s"].notna()
                      & table.system.isin(["static-ep", "symi-cf1", "symi-dropless", "lrmoe", "lrmoe-host-groups"])]
        long = split.melt(id_vars=["model", "ranks", "system"], value_vars=[f"{c}_ms_per_layer" for c in CATS],
                          var_name="part", value_name="ms")
        long["part"] = long["part"].str.replace("_ms_per_layer", "")
        grid = sns.catplot(long, x="system", y="ms", hue="part", col="model", row="ranks", kind="bar",
                           height=2.6, aspect=1.5, sharey=False)
        grid.set_axis_labels("", "ms per MoE layer-iteration")
        for ax in grid.axes.flat:
            ax.tick_params(axis="x", rotation=30)
            if not ax.patches:
                ax.text(0.5, 0.5, "does not fit", ha="center", va="center", transform=ax.transAxes)
        grid.figure.suptitle(f"Where the time goes (Zipf s = {top:g})", y=1.02)
        figs += run.log_figure("time_split", grid.figure)
        plt.close(grid.figure)
    return figs


def main(argv=None) -> pd.DataFrame:
    """Run the sweep, print the tables, log everything; exits non-zero (from the command line) if a run failed."""
    args = parse_args(argv)
    with Tracker("ablate", vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        table = run_cells(args, run)
        cols = ["model", "ranks", "skew", "mem_gb", "system", "iter_s", "forward_ms_per_layer",
                "backward_ms_per_layer", "communication_ms_per_layer", "sync_ms_per_layer", "a2a_gb_per_layer",
                "peak_mem_gb", "oom", "drop_rate", "fwd_imbalance", "rho", "slots_per_rank", "vs_symi_dropless",
                "vs_symi_cf1"]
        shown = table[[c for c in cols if c in table]]
        print("## All runs\n")
        print(shown.to_markdown(index=False, floatfmt=".3g"))
        print("\n## Headline: LRMoE's MoE-layer time / SYMI's (simulated)\n")
        head = headline(table, args)
        print(head)
        print("\n" + assumptions(args))
        figs = plot(table, run, args)
        summary = {"headline": head, "assumptions": assumptions(args)}
        lr = table[(table.system == "lrmoe") & table.get("vs_symi_dropless", pd.Series(dtype=float)).notna()] \
            if "vs_symi_dropless" in table else table.iloc[0:0]
        if len(lr):
            summary.update(lrmoe_vs_symi_dropless_min=float(lr.vs_symi_dropless.min()),
                           lrmoe_vs_symi_dropless_max=float(lr.vs_symi_dropless.max()))
        run.log_summary(summary)
        print(f"\nresults: {args.out}" + (f"; figures: {', '.join(str(f) for f in figs[::2])}" if figs else ""))
    return table


if __name__ == "__main__":
    failed = main().attrs.get("errors")
    if failed:
        sys.exit(f"error: {len(failed)} simulation(s) failed (their records say why); first: {failed[0]}")
