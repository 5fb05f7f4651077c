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
from lrmoe.config import MICRO_BATCH_BAND, cluster_preset, model_preset
from lrmoe.integrations.tracking_args import check_tracking_args

if TYPE_CHECKING:
    import pandas as pd

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
    from lrmoe.sim.ablation import skew_label
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
    from lrmoe.analysis.ablation_report import assumptions, headline, runs_table, summary
    from lrmoe.integrations.tracking import Tracker
    from lrmoe.sim.ablation import run_cells

    with Tracker("ablate", vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        table = run_cells(args, run)
        print("## All runs\n")
        print(runs_table(table))
        print("\n## Headline: LRMoE's MoE-layer time / SYMI's (simulated)\n")
        head = headline(table, args)
        print(head)
        print("\n" + assumptions(args))
        figs = plot(run)
        run.log_summary(summary(table, head, assumptions(args)))
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
