"""Trace-driven ablations of LRMoE against SYMI at paper scale, on the simulator (lrmoe.sim): the planner code of
the real layer runs on synthetic routing traces for every MoE layer and iteration, and the cost model turns each
plan into time, bytes and memory on a cluster preset.

Systems: static EP (dropless), capacity cf 1.0 / 1.25, SYMI-cf1, SYMI-dropless (and SYMI-dropless given LRMoE's
slot count), LRMoE, LRMoE with host-only replica-sync groups, and LRMoE minus each component: memory-aware
placement, backward replica routing (with the balanced and with an even forward split), retention quotas, and
compaction (padded packets). The recalibration metric (random / gate-only) and the selection mode (unbiased)
keep the same counts as LRMoE; their rows differ from LRMoE's only by what scoring and selecting cost
(lrmoe.sim.overheads, per metric and mode) and m2's extra combine column: their effect is on the gradient
(experiments/metric_fidelity.py).
Swept over model, routing skew (``--skews zipf:0.8 dirichlet:0.5``; every record and table carries the skew the
trace measurably has: per-rank max/mean under static EP, hottest expert / mean, Gini), per-rank memory budget and
number of ranks. Systems are named as in ``lrmoe.systems`` (``--systems`` takes any of them).

The fair-comparison rules of DESIGN.md §5.4: one memory model for the planners and the simulator
(:mod:`lrmoe.bytemodel.memory`); one headroom rule for every dropless system (each sizes its replica slots from its own
plans of the warm-up iteration, placed from the one before it, ``--headroom-rule planned``); every overhead on the
critical path charged (``--no-overheads`` to show each one's effect; :mod:`lrmoe.sim.overheads`); every MoE layer
simulated, quick mode included; and the headline systems priced again at the corners of the uncertain constants
(GEMM efficiency, half-efficiency rows, link bandwidth, micro-batches per iteration) for a low / high band beside
every ratio.

    python experiments/ablate.py --quick            # small sweep (3 iterations, every layer, 8 and 16 ranks,
                                                    # the headline budget, 4 skews, the headline systems and components)
    python experiments/ablate.py                    # full sweep: 100 iterations x all MoE layers x 3 rank
                                                    # counts x 4 skews x 3 budgets x 2 models
    python experiments/ablate.py --models qwen3-30b-a3b --ranks 16 --skews zipf:0.8 dirichlet:0.5   # two cells

Every assumption that shapes the numbers is a flag default, fixed once for every cell (tokens per rank, budgets,
the headroom margin, LRMoE's eps / gamma, the most extra slots, micro-batches); the headline table prints them
beside the ratios. Traces are synthetic.
"""

from __future__ import annotations

import argparse
import math
import sys

from typing import TYPE_CHECKING

# The parser needs only these light modules; the simulator, torch, pandas and matplotlib are imported by the
# functions that run the sweep, so --help and argument errors come back at once.
from lrmoe.cli import fraction_arg, non_negative_float_arg, non_negative_int_arg, positive_float_arg, positive_int_arg
from lrmoe.cli import SYSTEMS_HELP, one_of, script_parser, system_arg
from lrmoe.config import cluster_preset, model_preset
from lrmoe.config import MICRO_BATCH_BAND, SENSITIVITY, sensitivity_corners as corners
from lrmoe.integrations.tracking_args import check_tracking_args

if TYPE_CHECKING:
    import pandas as pd
    import torch

    from lrmoe.config import MoEConfig

MODELS = ["qwen3-30b-a3b", "glm-4.5-air"]
SKEW_FAMILIES = ("zipf", "dirichlet")
SKEWS = ["zipf:0.2", "zipf:0.4", "zipf:0.6", "zipf:0.8"]  # Gini 0.10-0.50 of the popularity (DESIGN.md §5.7)
# The default systems (lrmoe.systems). The metric and selection-mode variants (lrmoe-random, lrmoe-gate,
# lrmoe-m2-unbiased) have LRMoE's plan by construction: they choose *which* pairs fill the quotas, never how many,
# so they differ from LRMoE only in what their scoring and selection cost, and each is priced on its own (only
# systems that run the same work share a simulation: lrmoe.sim.simulated_systems.plan_twins).
SYSTEMS = ["static-ep", "capacity-cf1", "capacity-cf1.25", "symi-cf1", "symi-dropless",
           "symi-dropless-lrmoe-slots", "lrmoe",
           "lrmoe-host-groups", "lrmoe-no-memplace", "lrmoe-no-bwd-routing", "lrmoe-even-fwd",
           "lrmoe-even-fwd-no-bwd-routing", "lrmoe-no-quotas", "lrmoe-padded",
           "lrmoe-random", "lrmoe-gate", "lrmoe-m2-unbiased",
           "online", "online-rho0.75",  # online replication (lrmoe.planner.online) and LRMoE's budget on top of it
           "online-greedy"]  # its first rule: every copy that relieves the busiest rank, whatever the push costs
# Quick mode simulates every MoE layer (fewer iterations instead), so it runs the headline systems and the
# components of LRMoE the figures take apart, and the metric variant lrmoe-random (its selection's price).
QUICK_SYSTEMS = ["static-ep", "capacity-cf1", "symi-cf1", "symi-dropless", "symi-dropless-lrmoe-slots", "lrmoe",
                 "lrmoe-host-groups", "lrmoe-no-memplace", "lrmoe-no-bwd-routing", "lrmoe-no-quotas", "lrmoe-padded",
                 "lrmoe-random", "online"]
CATS = ["forward", "backward", "communication", "sync", "overhead"]
# The headline's systems, priced again at every corner of the uncertain constants (the sensitivity band).
BANDED = ["lrmoe", "symi-dropless", "symi-cf1", "symi-dropless-lrmoe-slots", "online", "online-rho0.75",
          "online-greedy", "lrmoe-rho0.75", "lrmoe-rho0.75-early", "symi-dropless-rho0.75",
          "lrmoe-rho0.75-unbiased", "lrmoe-rho0.75-early-unbiased"]  # the frontier protocol's budgeted arms too
# The uncertain constants and their ranges (DESIGN.md §5.4; issue 15): GEMM efficiency 0.5-0.9 of peak,
# half-efficiency rows 32-512, links at 70-100 % of the datasheet, 1-32 micro-batches per iteration.
RG_TEXT = {"best": "each system in its faster mode of range and shard (column 'replica grads')",
           "range": "range (SYMI's) for every system", "shard": "shard for every system"}


def skew_arg(value: str) -> tuple[str, float]:
    """``family:param`` (``zipf:0.8``, ``dirichlet:0.5``), or a bare number for Zipf s."""
    family, _, param = value.rpartition(":")
    family = family or "zipf"
    try:
        number = float(param)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--skews {value!r}: expected family:number, e.g. zipf:0.8") from None
    if family not in SKEW_FAMILIES:
        raise argparse.ArgumentTypeError(f"--skews {value!r}: family must be one of {SKEW_FAMILIES}")
    if not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"--skews {value!r}: the parameter must be a finite number")
    return family, number  # its range: check_args


def skew_label(skew: tuple[str, float]) -> str:
    return f"{skew[0]}:{skew[1]:g}"


def skew_stats(counts_ILNE: torch.Tensor, warmup: int = 1) -> dict[str, float]:
    """The skew a trace measurably has, means over its iterations after warm-up and its layers: the per-rank
    max / mean of the pairs static expert parallelism would compute (expert e on rank e // (E/N)), the hottest
    expert over the mean, and the Gini coefficient of the per-expert pairs."""
    from lrmoe.traces.stats import gini, max_over_mean

    counts = counts_ILNE[warmup:] if counts_ILNE.shape[0] > warmup else counts_ILNE
    per_expert_ILE = counts.sum(2).double()
    n = counts.shape[2]
    rank_SLN = per_expert_ILE.view(*per_expert_ILE.shape[:2], n, -1).sum(-1)
    return {"rank_max_over_mean": float(max_over_mean(rank_SLN).mean()),
            "expert_max_over_mean": float(max_over_mean(per_expert_ILE).mean()),
            "gini": float(gini(per_expert_ILE).mean())}


def mode_variants(args, corners_: dict[str, dict]) -> dict[str, dict]:
    """The variants a system is priced at: the sensitivity corners, and with ``--replica-grad best`` the same in the
    shard mode (``shard`` and ``<corner>|shard``)."""
    if args.replica_grad != "best":
        return dict(corners_)
    return {**corners_, "shard": {"replica_grad": "shard"},
            **{f"{k}|shard": {**v, "replica_grad": "shard"} for k, v in corners_.items()}}



def _overhead_names() -> tuple[str, ...]:
    from lrmoe.sim.overheads import OVERHEADS

    return (*OVERHEADS, "all")


def _replica_grad_names() -> tuple[str, ...]:
    from lrmoe.bytemodel.sync_model import REPLICA_GRAD_MODES

    return ("best", *REPLICA_GRAD_MODES)


def build_parser():
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__, "outputs/ablate.jsonl")
    parser.add_argument("--quick", action="store_true", help="a small sweep (used by the tests and the main job)")
    parser.add_argument("--models", nargs="+", default=MODELS, help="model presets (lrmoe.config)")
    parser.add_argument("--cluster", default="a100-40gb-x8", help="cluster preset (its node is replicated)")
    parser.add_argument("--ranks", nargs="+", type=positive_int_arg, default=None, help="default 8 16 64 (quick: 8 16)")
    parser.add_argument("--skews", nargs="+", type=skew_arg, default=None,
                        help="routing skews, family:param (zipf:s, dirichlet:alpha; a bare number is Zipf s); "
                             f"default {' '.join(SKEWS)}")
    parser.add_argument("--mem-gb", nargs="+", type=positive_float_arg, default=None,
                        help="per-rank budget for all MoE layers, GB (default 0.8x, 1x, 2x the device; quick 1x)")
    parser.add_argument("--tokens-per-rank", type=positive_int_arg, default=None,
                        help="tokens per rank per micro-batch (default: the model's, lrmoe.sim.cells.TOKENS)")
    parser.add_argument("--steps", type=positive_int_arg, default=None, help="iterations (default 100; quick 3)")
    parser.add_argument("--micro-batches", type=positive_int_arg, default=8,
                        help="micro-batches per iteration: the sync phases run once per iteration (ours); the "
                             f"headline's band spans {MICRO_BATCH_BAND[0]}-{MICRO_BATCH_BAND[1]}")
    parser.add_argument("--layers", type=positive_int_arg, default=None,
                        help="simulated MoE layers (default all, quick too; fewer: their mean stands for the rest)")
    parser.add_argument("--systems", nargs="+", default=None, type=system_arg,
                        help=f"systems to price; default: {' '.join(SYSTEMS)} (quick: {' '.join(QUICK_SYSTEMS)}); "
                             f"{SYSTEMS_HELP}")
    parser.add_argument("--eps", type=non_negative_float_arg, default=0.1,
                        help="LRMoE balance slack (fraction of the mean load a rank may exceed)")
    parser.add_argument("--gamma", type=fraction_arg, default=0.1,
                        help="LRMoE per-expert floor (fraction of each expert's pairs always kept)")
    parser.add_argument("--max-extra", type=non_negative_int_arg, default=None,
                        help="most extra slots per rank (default E/N)")
    parser.add_argument("--headroom-rule", choices=["planned", "fixed"], default="planned",
                        help="planned: every dropless system sizes its buffers for its own planned peak load "
                             "(DESIGN.md §5.4); fixed: SYMI-dropless for --symi-headroom x the mean, LRMoE for 1 + eps")
    parser.add_argument("--headroom-margin", type=non_negative_float_arg, default=0.05,
                        help="planned rule: buffers for this much more than the planned peak, every system alike "
                             "(ours: later iterations route a little differently from the reference one)")
    parser.add_argument("--symi-headroom", type=positive_float_arg, default=1.5,
                        help="fixed rule only: SYMI-dropless reserves buffers for this x the mean load")
    parser.add_argument("--no-overheads", nargs="*", default=[], type=one_of(_overhead_names, "overhead"),
                        help="overheads not to charge (names of lrmoe.sim.overheads.OVERHEADS, or all), to show "
                             "their effect")
    parser.add_argument("--no-band", action="store_true", help="skip the sensitivity corners (faster)")
    parser.add_argument("--replica-grad", type=one_of(_replica_grad_names, "--replica-grad"), default="best",
                        help="replica-gradient path (DESIGN.md §3.4): 'range' (SYMI's), 'shard' (straight to the "
                             "optimizer-shard owners), or 'best': each system priced in both from the same plans and "
                             "reported in its faster mode (iter_s_range, iter_s_shard and replica_grad say which)")
    parser.add_argument("--headline-mem-gb", type=positive_float_arg, default=None,
                        help="per-rank budget of the headline, GB (default 1x the device)")
    parser.add_argument("--band-every-budget", action="store_true",
                        help="price the sensitivity corners at every budget, not the headline's alone")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic traces")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_tracking_args(parser, args, "ablate")
    try:
        validate(args)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def validate(args) -> None:
    """The defaults that depend on the cluster and mode, then :func:`check_args` (ValueError naming the flag)."""
    base = cluster_preset(args.cluster)
    device_gb = base.mem_budget_bytes / 1e9
    args.skews = args.skews or [skew_arg(s) for s in SKEWS]
    args.systems = args.systems or (QUICK_SYSTEMS if args.quick else SYSTEMS)
    if args.quick:
        args.ranks = args.ranks or [8, 16]
        args.mem_gb = args.mem_gb or [device_gb]  # the headline's budget only: the main job's 10 minutes
        args.steps = args.steps or 3
    else:
        args.ranks = args.ranks or [8, 16, 64]
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


def check_args(args) -> None:
    """What would otherwise fail cell by cell, hours into a sweep, raised once up front (ValueError naming the
    flag): the model presets, the sizes, and every system in the first cell of each model."""
    from lrmoe.sim.cells import TOKENS, Cell, system_context
    from lrmoe.sim.cost import CostModel
    from lrmoe.systems import check_systems

    models = [model_preset(name) for name in args.models]
    if any(r < 1 for r in args.ranks):
        raise ValueError(f"--ranks must be positive, got {args.ranks}")
    if any(not v > 0 for v in args.mem_gb):
        raise ValueError(f"--mem-gb must be positive, got {args.mem_gb}")
    bad = [skew_label(s) for s in args.skews if not s[1] >= 0 or (s[0] == "dirichlet" and not s[1] > 0)]
    if bad:
        raise ValueError(f"--skews {bad}: Zipf s must be non-negative, Dirichlet alpha positive")
    for name in ("tokens_per_rank", "layers", "symi_headroom"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    if not args.headroom_margin >= 0:
        raise ValueError(f"--headroom-margin must be non-negative, got {args.headroom_margin}")
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


def _record(common: dict, name: str, res, layers: int, model: MoEConfig, note: str, banded: bool,
            replica_grad: str = "range") -> dict:
    """One system's record: whole-model seconds per iteration, per-layer ms by category, bytes, memory, and (for
    the headline's systems) the seconds at every sensitivity corner; with ``replica_grad="best"`` in the faster of the
    two replica-gradient modes (both recorded)."""
    s = res.summary()
    scale = model.num_moe_layers / layers  # whole model from the simulated layers (1 when all are simulated)
    mode, suffix = replica_grad, ""
    if replica_grad == "best":
        by_mode = {"range": s["time_s"], "shard": res.time_s("shard")}
        mode = min(by_mode, key=by_mode.get)
        suffix = "|shard" if mode == "shard" else ""
        s = {**s, "time_s": by_mode[mode], **{f"{k}_s": v for k, v in res.category_s(suffix[1:] or None).items()}}
    rec = {**common, "system": name, "fits": not s["oom"], "note": note,
           "iter_s": s["time_s"] * scale,
           # per MoE layer and iteration (all micro-batches)
           **{f"{k}_ms_per_layer": s[f"{k}_s"] / layers * 1e3 for k in ["time"] + CATS},
           "a2a_gb_per_layer": s["a2a_bytes"] / layers / 1e9,
           "sync_gb_per_layer": s["sync_bytes"] / layers / 1e9,
           "peak_mem_gb": s["peak_mem_bytes"] / 1e9, "oom": s["oom"], "drop_rate": s["drop_rate"],
           "fwd_imbalance": s["fwd_imbalance"], "rho": s["rho"],
           "slots_per_rank": s["slots_per_rank"], "layer_over_share": s["layer_over_share"], "replica_grad": mode}
    if replica_grad == "best":  # both modes, whole model, and the sync phases per layer in each
        for m_, v in (("range", None), ("shard", "shard")):
            rec[f"iter_s_{m_}"] = res.time_s(v) * scale
            rec[f"sync_ms_per_layer_{m_}"] = res.category_s(v)["sync"] / layers * 1e3
    if banded:  # the corners in the system's own mode
        band = {}
        corner_names = [v for v in res.variant_ILH if v != "shard" and not v.endswith("|shard")]
        for variant in [None, *corner_names]:
            for mb in (res.micro_batches, *MICRO_BATCH_BAND):
                key = f"{variant or 'base'}|mb={mb}"
                priced = (variant + suffix if variant else suffix[1:] or None)
                band[key] = res.time_s(priced, mb) * scale
        rec["iter_s_corners"] = band
    return rec


def run_cells(args, run) -> pd.DataFrame:
    """Simulate every (cell, system); one record per pair, logged as it completes."""
    import pandas as pd
    from tqdm import tqdm

    from lrmoe.sim.cells import TOKENS, Cell, build_systems, charged_overheads, cost_kwargs
    from lrmoe.sim.simulator import simulate
    from lrmoe.sim.simulated_systems import plan_twins
    from lrmoe.traces.synthetic import generate_trace

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
    variants = mode_variants(args, {} if args.no_band else corners())
    modes_only = mode_variants(args, {})
    rows = []
    traces = {}
    errors: list[str] = []
    with tqdm(total=total, desc="layer-steps", unit="ls", disable=None, mininterval=1.0) as bar:
        for cell, layers in plan:
            m, c = cell.model, cell.cluster
            key = (m.name, c.num_ranks, cell.skew, cell.tokens, layers)
            if key not in traces:  # one iteration more than simulated: the first is the planners' reference
                traces[key] = generate_trace(args.steps + 1, layers, c.num_ranks, m.num_experts, m.top_k,
                                             cell.tokens, skew=cell.skew[0], skew_param=cell.skew[1],
                                             seed=args.seed, model=m.name)
            counts_ILNE = traces[key].counts_ILNE
            measured = skew_stats(counts_ILNE[1:])
            common = {"model": m.name, "cluster": c.name, "ranks": c.num_ranks, "nodes": c.num_nodes,
                      "skew": cell.skew[1], "skew_family": cell.skew[0], "skew_label": skew_label(cell.skew),
                      "mem_gb": cell.mem_gb, "tokens_per_rank": cell.tokens, "layers_simulated": layers,
                      "steps": args.steps, "micro_batches": args.micro_batches,
                      "trace_gini": measured["gini"], "trace_max_over_mean": measured["expert_max_over_mean"],
                      "trace_rank_max_over_mean": measured["rank_max_over_mean"],
                      "trace": f"synthetic {cell.skew[0]}", "headroom_rule": args.headroom_rule,
                      "headroom_margin": args.headroom_margin, "overheads": list(charged_overheads(args))}
            # every system sizes its slots from its plans of the simulation's warm-up iteration (which no summary
            # includes), placed from the iteration before it
            systems, skipped, notes, headrooms = build_systems(cell, args.systems, args,
                                                               (counts_ILNE[0], counts_ILNE[1]))
            common.update({f"planned_headroom_{k}": v for k, v in headrooms.items()})
            cell_rows = {}
            for name in args.systems:
                if name in twins:
                    continue
                if name in skipped:
                    rec = {**common, "system": name, "fits": False, "note": skipped[name]}
                    bar.update(args.steps * layers)
                else:
                    banded = name in BANDED and (args.band_every_budget or cell.mem_gb == args.headline_mem_gb)
                    try:
                        res = simulate(counts_ILNE[1:], systems[name], m, c,
                                       cost_kwargs=cost_kwargs(name, cell, args), micro_batches=args.micro_batches,
                                       progress=bar.update, variants=variants if banded else modes_only)
                    except Exception as exc:  # noqa: BLE001 - one failing cell must not lose an hours-long sweep
                        why = f"error: {type(exc).__name__}: {exc}"
                        tqdm.write(f"{m.name} {c.name} {skew_label(cell.skew)} {cell.mem_gb:g} GB {name}: {why}",
                                   file=sys.stderr)
                        errors.append(why)
                        cell_rows[name] = {**common, "system": name, "fits": False, "note": why}
                        continue
                    rec = _record(common, name, res, layers, m, notes.get(name, ""), banded, args.replica_grad)
                cell_rows[name] = rec
            for twin, source in twins.items():
                if source in cell_rows:
                    src = cell_rows[source]
                    cell_rows[twin] = {**src, "system": twin, "note": src["note"] if "iter_s" not in src else
                                       f"same plan as {source} by construction"}
                    cell_rows[twin].pop("iter_s_corners", None)
            for name in args.systems:
                rec = cell_rows.get(name)
                if rec is None:
                    continue
                for ref in ("symi-dropless", "symi-cf1", "online"):
                    other = cell_rows.get(ref, {})
                    if "iter_s" in rec and "iter_s" in other:
                        rec[f"vs_{ref.replace('-', '_')}"] = rec["iter_s"] / other["iter_s"]
                        lo_hi = band(rec, other)
                        if lo_hi is not None:
                            rec[f"vs_{ref.replace('-', '_')}_lo"], rec[f"vs_{ref.replace('-', '_')}_hi"] = lo_hi
                run.log(rec)
                rows.append(rec)
    table = pd.DataFrame(rows)
    table.attrs["errors"] = errors
    return table


def band(rec: dict, ref: dict) -> tuple[float, float] | None:
    """(lowest, highest) ratio of ``rec``'s time to ``ref``'s over the sensitivity corners both were priced at
    (each corner on both sides alike), the base point included; None without corners."""
    a, b = rec.get("iter_s_corners"), ref.get("iter_s_corners")
    if not a or not b:
        return None
    ratios = [a[k] / b[k] for k in a if k in b and b[k] > 0]
    return (min(ratios), max(ratios)) if ratios else None


def _ratio(a, b, col: str = "iter_s") -> str:
    """``a / b`` with the sensitivity band, as a table cell."""
    import pandas as pd

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
    import pandas as pd

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
        lines.append(f"| {model} | {nodes} | {skew} | {_ratio(lr, dl)} | {_ratio(lr, cf)} | "
                     f"{_ratio(lr, same)} | {_ratio(hosts, dl)} | {_ratio(lr, online)} | "
                     f"{_ratio(online_budget, online)} | "
                     f"{drops} | {slots(lr)} / {slots(dl)} / {slots(cf)} | "
                     f"{mode(lr)} / {mode(dl)} / {mode(cf)} | {oom or 'none'} |")
    return "\n".join(lines)


def assumptions(args) -> str:
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


def plot(run) -> list:
    """Time relative to SYMI-dropless vs skew per system (one panel per model and rank count), and the split of
    LRMoE's and SYMI's time into categories, drawn from the results file (lrmoe.paper_figures.sim_figures)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lrmoe.paper_figures import sim_figures
    from lrmoe.paper_figures.reading import CannotDraw

    figs = []
    for name, draw in (("ratio_vs_symi", sim_figures.ratio_vs_symi), ("time_split", sim_figures.time_split)):
        try:
            fig, _ = draw(run.results)
        except CannotDraw:  # no plotted system has a ratio at the headline budget: nothing to draw
            return figs
        figs += run.log_figure(name, fig)
        plt.close(fig)
    return figs


def main(argv=None) -> pd.DataFrame:
    """Run the sweep, print the tables, log everything; exits non-zero (from the command line) if a run failed."""
    args = parse_args(argv)
    import pandas as pd

    from lrmoe.integrations.tracking import Tracker

    with Tracker("ablate", vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        table = run_cells(args, run)
        cols = ["model", "ranks", "skew_label", "trace_rank_max_over_mean", "mem_gb", "system", "iter_s",
                "forward_ms_per_layer", "backward_ms_per_layer", "communication_ms_per_layer", "sync_ms_per_layer",
                "overhead_ms_per_layer", "a2a_gb_per_layer", "peak_mem_gb", "oom", "drop_rate", "fwd_imbalance",
                "rho", "slots_per_rank", "vs_symi_dropless", "vs_symi_cf1"]
        shown = table[[c for c in cols if c in table]]
        print("## All runs\n")
        print(shown.to_markdown(index=False, floatfmt=".3g"))
        print("\n## Headline: LRMoE's MoE-layer time / SYMI's (simulated)\n")
        head = headline(table, args)
        print(head)
        print("\n" + assumptions(args))
        figs = plot(run)
        summary = {"headline": head, "assumptions": assumptions(args)}
        lr = table[(table.system == "lrmoe") & table.get("vs_symi_dropless", pd.Series(dtype=float)).notna()] \
            if "vs_symi_dropless" in table else table.iloc[0:0]
        if len(lr):
            summary.update(lrmoe_vs_symi_dropless_min=float(lr.vs_symi_dropless.min()),
                           lrmoe_vs_symi_dropless_max=float(lr.vs_symi_dropless.max()))
        run.log_summary(summary)
        print(f"\nresults: {args.out}" + (f"; figures: {', '.join(str(f) for f in figs[::2])}" if figs else ""))
    return table


def cli(argv=None) -> int:
    """The command line: :func:`main`, then its exit status: 1, with one line naming the first failure, where a
    simulation failed (the sweep goes on past it; its record says why), else 0."""
    failed = main(argv).attrs.get("errors")
    if failed:
        print(f"ablate.py: error: {len(failed)} simulation(s) failed (their records say why); first: {failed[0]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
