"""The expert-parallel MoE layer, policy against policy, on the same skewed routing traces: per-rank forward and
backward time (wall and CPU), the slowest rank, bytes per phase, buffer bytes, pairs per rank, drops, and the
gradient error against the full gradient. Ends with the three LRMoE targets of DESIGN.md §5.8 (item 5), measured.

    python experiments/layer_bench.py                               # 4 forked gloo ranks (CPU), a few minutes
    python experiments/layer_bench.py --quick                       # about a minute
    python experiments/layer_bench.py --regime weak  # the frontier protocol's (docs/protocols/frontier.md §10)
    torchrun --standalone --nproc-per-node 4 experiments/layer_bench.py  # NCCL on GPUs, gloo on CPU

Traces: synthetic Zipf popularity with AR(1) drift and per-token Gumbel-top-k (``lrmoe.integrations.traces``), one per
``--skew-param``, labelled synthetic; ``--trace FILE`` adds a recorded one (one micro-batch of each step where its
metadata says a step sums several). The layer replays a trace: the
counts fix how many pairs each rank routes to each expert per step, tokens are random vectors, gate weights
random. Every policy sees the same tokens at every step, and the policies take turns inside each step, in an
order that rotates from step to step, so drifts of the machine hit them alike.

Policies by name (``--policies``, any system of ``lrmoe.systems``): the six of DESIGN.md §5.8 by default, and e.g. the
LRMoE ablations that switch one component off each (lrmoe-random, lrmoe-padded, lrmoe-no-quotas, lrmoe-no-bwd-routing,
lrmoe-no-placement), lrmoe-m3, lrmoe-m1-unbiased and capacity-cf1-gate.

One iteration = forward, backward of a random linear loss, data-parallel sync of the router, the experts'
optimizer step with redistribution into the next placement. Every policy runs the layer's recalibrated
backward (``lrmoe.runtime.exchange``); plans that keep every pair take its fast path, the autograd-equivalent one.
Before each timed iteration an untimed one computes the *full* gradient at the same weights and inputs (every
routed pair computed and kept, on the policy's placement): the reference for the gradient error. The counted
bytes and pairs are checked against the formulas of ``lrmoe.runtime.distributed.accounting`` every iteration.

Regimes (``--regime production|weak``, docs/protocols/frontier.md §10.1): the frontier protocol's system settings at
this layer's scale: the regime's replica slots per home slot (``Regime.spare_slots``), its eps and gamma, its arms as
the policies (the budget systems at its ρ grid, SYMI-dropless and SYMI's random trim, static EP as the reference;
``protocol.SWEEP_ARMS``), and one synthetic Zipf trace whose s is matched to the regime's static-EP training runs
(``--runs``): the s at which this benchmark's own trace (its ranks, experts, tokens, steps and seed) gives static
EP the runs' per-rank load, slowest rank ÷ mean (``lrmoe.analysis.skew``). The trace the layer replays is checked
against the runs (more than 5 % apart is an error), and so is every replicating system's slot count.
``experiments/validate_sim.py --regimes`` runs this and prices the same plans with the cost model.

Memory: every policy gets the same per-rank budget, sized for the E/N home slots plus ``--spare-slots`` replica
slots and the token buffers of a load of (1 + eps) times the mean. SYMI uses the spare slots as replicas;
LRMoE derives its replica slots and its memory cap from the budget (``lrmoe.planner.placement.MemoryModel``); static EP
and capacity leave them empty. The table reports each policy's counted peak against the budget.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

# The parser needs only these light modules: torch, the runtime, pandas and the skew matching load in the functions
# that measure, match and report, so --help and argument errors come back at once (tests/test_cli.py).
from lrmoe.analysis import protocol
from lrmoe.cli import fraction_arg, non_negative_float_arg, non_negative_int_arg, positive_float_arg, positive_int_arg
from lrmoe.cli import SYSTEMS_HELP, script_parser, system_arg
from lrmoe.config import REPLICA_GRAD_MODES, model_preset
from lrmoe.integrations.tracking_args import check_tracking_args
from lrmoe.results import read_records

if TYPE_CHECKING:
    import pandas as pd
    import torch

DEFAULT_POLICIES = ["static-ep", "capacity-cf1", "symi-cf1", "symi-dropless", "lrmoe-m1", "lrmoe"]


# the settings --regime fixes, and their values without it
FREE_DEFAULTS = {"policies": DEFAULT_POLICIES, "skew_param": [0.4, 0.8], "spare_slots": 1, "eps": 0.1, "gamma": 0.1}
RUNS = "paper_figures/results/frontier_protocol_pilot.jsonl"  # the runs the protocol's skew was first matched to

DTYPES = ("float32", "bfloat16", "float64")  # --dtype: torch dtypes by name (getattr(torch, name))
QUICK = {"tokens_per_rank": 128, "steps": 4, "warmup": 1, "hidden": 256, "ffn": 128}


def build_parser() -> argparse.ArgumentParser:
    """The command line (lrmoe.cli's formatter and shared flags; tests/test_cli.py)."""
    p = script_parser(__doc__, "outputs/layer_bench.jsonl")
    p.add_argument("--ranks", type=positive_int_arg, default=4,
                   help="ranks of the fork launcher (not under torchrun)")
    p.add_argument("--torchrun", action="store_true",
                   help="accepted for older command lines: torchrun is found from its environment")
    p.add_argument("--policies", nargs="+", default=None, type=system_arg,
                   help=f"systems measured; default: {' '.join(DEFAULT_POLICIES)}; with --regime, the regime's "
                        f"arms; {SYSTEMS_HELP}")
    p.add_argument("--model", default="qwen3-30b-a3b-debug", help="model preset giving E, k and the router")
    p.add_argument("--hidden", type=non_negative_int_arg, default=512, help="hidden width D (0: the preset's)")
    p.add_argument("--ffn", type=non_negative_int_arg, default=256, help="expert width F (0: the preset's)")
    p.add_argument("--tokens-per-rank", type=positive_int_arg, default=256, help="tokens per rank per iteration")
    p.add_argument("--steps", type=positive_int_arg, default=8, help="measured iterations per policy and trace")
    p.add_argument("--warmup", type=non_negative_int_arg, default=2, help="unmeasured iterations before them")
    p.add_argument("--skew", default="zipf", choices=["zipf", "dirichlet"],
                   help="family of the synthetic traces' expert popularity")
    p.add_argument("--skew-param", type=non_negative_float_arg, nargs="+", default=None,
                   help="one synthetic trace per value: Zipf s (0.8: hottest ~15x the mean at E=128) or α "
                        f"(default {' '.join(map(str, FREE_DEFAULTS['skew_param']))}; with --regime, the matched s)")
    p.add_argument("--trace", default=None, help="also replay a recorded trace (.npz of lrmoe.integrations.traces)")
    p.add_argument("--trace-layer", type=non_negative_int_arg, default=0, help="which layer of the recorded trace")
    p.add_argument("--spare-slots", type=non_negative_int_arg, default=None,
                   help="replica slots per rank beyond E/N (the memory; default 1, with --regime the regime's)")
    p.add_argument("--eps", type=non_negative_float_arg, default=None,
                   help="LRMoE's balance slack (cap = (1 + eps) x mean load; default 0.1, with --regime the regime's)")
    p.add_argument("--replica-grad", choices=REPLICA_GRAD_MODES, nargs="+", default=["range"],
                   help="replica gradients: 'range' (SYMI's range all-reduce, then collection) or 'shard' (each "
                        "host's sum straight to the optimizer-shard owners), for every system; both: every policy "
                        "runs in each mode side by side, labelled 'policy (mode)'")
    p.add_argument("--gamma", type=fraction_arg, default=None,
                   help="LRMoE's per-expert floor (default 0.1, with --regime the regime's)")
    p.add_argument("--regime", choices=list(protocol.REGIMES), default=None,
                   help="the frontier protocol's settings at this layer's scale (docs/protocols/frontier.md §10.1): "
                        "its spare slots, eps, gamma and arms, and the Zipf s matched to its static-EP runs (--runs)")
    p.add_argument("--runs", default=RUNS,
                   help="--regime: the protocol's collected runs (experiments/frontier_sweep.py) whose static-EP "
                        "slowest rank ÷ mean the trace is matched to")
    # ours: the CPU calibration of lrmoe.harness.calibrate_cpu (4 gloo ranks, fp32) prices one expert's push at
    # 27 (D=512, F=256) to 60 (D=256, F=128) pairs of the busiest rank's work (lrmoe.sim.cost.CostModel.push_cost_rows)
    p.add_argument("--push-cost-rows", type=non_negative_float_arg, default=32.0,
                   help="cost-aware online replication pushes a copy only when it relieves the busiest rank by more "
                        "than this many pairs (online-greedy: any relief)")
    p.add_argument("--buffer-load", type=positive_float_arg, default=None,
                   help="the memory budget's token buffers hold this many times the mean load (default 1 + eps); "
                        "below that LRMoE's memory cap trims the backward, and may leave no room for a replica")
    p.add_argument("--no-grad-error", action="store_true", help="skip the full-gradient reference iterations")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of the layer's weights and data")
    p.add_argument("--seed", type=int, default=0, help="seed of the traces, weights and data")
    p.add_argument("--quick", action="store_true",
                   help="small run for the main job: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                                  QUICK.items()))
    p.add_argument("--timeout", type=positive_float_arg, default=900.0,
                   help="seconds before the fork launch is abandoned")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    if args.regime is None:
        for key, value in FREE_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    else:
        try:
            apply_regime(args)
        except ValueError as exc:
            p.error(str(exc))
    check_tracking_args(p, args, "layer_bench")  # before the benchmark, not after it
    return args


def world_size(args: argparse.Namespace) -> int:
    from lrmoe.runtime.distributed.torchrun import launched_world_size

    return launched_world_size(args.ranks)


def apply_regime(args: argparse.Namespace) -> None:
    """Set the regime's settings on ``args`` (docs/protocols/frontier.md §10.1), at this benchmark's scale: spare slots,
    eps, gamma, its arms (unless --policies), one Zipf trace at the s matched to the regime's static-EP runs. A flag
    that contradicts the regime is a ValueError; the match is recorded in ``args.regime_match``."""
    from lrmoe.analysis.skew import Scale, match_zipf, runs_imbalance

    regime = protocol.get_regime(args.regime)
    cfg = model_preset(args.model)
    n, e = world_size(args), cfg.num_experts
    fixed = {"spare_slots": regime.spare_slots(e, n), "eps": regime.eps, "gamma": regime.gamma}
    for key, value in fixed.items():
        given = getattr(args, key)
        if given is not None and given != value:
            raise ValueError(f"--regime {regime.name} sets --{key.replace('_', '-')} {value:g}, not {given:g}")
        setattr(args, key, value)
    if args.skew != "zipf" or args.skew_param is not None or args.trace:
        raise ValueError(f"--regime {regime.name} replays one synthetic Zipf trace at the matched s: no --skew, "
                         "--skew-param or --trace")
    args.policies = args.policies or list(protocol.SWEEP_ARMS)
    path = Path(args.runs)
    if not path.is_file():
        raise ValueError(f"--runs {args.runs!r} is not a file")
    rows = read_records(path)  # ValueError naming the file and line of a bad record
    runs = runs_imbalance([r for r in rows if r.get("regime") == regime.name])
    # the bench's own trace: its ranks, experts, tokens, steps and seed, one layer, every token's top-k drawn
    scale = Scale(n, e, cfg.top_k, args.tokens_per_rank, layers=1, steps=args.warmup + args.steps, seed=args.seed,
                  exact=True)
    match = match_zipf(runs["rank_max_over_mean"], scale)
    args.skew_param = [round(match.zipf_s, 4)]
    args.regime_match = {"regime": regime.name, "zipf_s": args.skew_param[0], "runs": runs, "runs_file": args.runs,
                         "rhos": list(regime.rhos)}


def check_regime(args: argparse.Namespace, counts_INE: torch.Tensor, ctx) -> dict:
    """The trace the layer replays against the regime's runs (static EP's slowest rank ÷ mean within 5 %), and
    every replicating system's slots (the regime's E/N + spare on every plan): ValueError otherwise. Returns the
    trace's imbalance statistics."""
    from lrmoe.analysis.skew import check_matched, trace_imbalance
    from lrmoe.harness.layer_bench_setup import make_policy
    from lrmoe.systems import get_system

    measured = trace_imbalance(counts_INE[:, None])  # the steps the match was made on
    check_matched(args.regime_match["runs"], measured)
    want = ctx.base_slots + ctx.spare_slots
    for name in args.policies:
        policy, _ = make_policy(name, ctx)
        slots = int(policy.plan(counts_INE[0], None).placement_NS.shape[1])
        if get_system(name).family != "static-ep" and slots != want:
            raise ValueError(f"regime {args.regime} gives every replicating system {want} slots per rank; {name} "
                             f"plans {slots}")
    return measured


def report(args: argparse.Namespace, records: list[dict], world_size: int) -> pd.DataFrame:
    """The tables of the ranks' records (lrmoe.harness.layer_bench_summary) into the results file, its two figures,
    and the target trace's phases, the policies and the targets printed; returns the per-phase table."""
    import matplotlib

    from lrmoe.harness.layer_bench_summary import print_tables, tables
    from lrmoe.integrations.tracking import Tracker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    raw, phases, totals, on, goals = tables(records, args.policies, args.skew, args.skew_param)
    config = {**vars(args), "world_size": world_size, "traces": list(dict.fromkeys(raw["trace"])), "target_trace": on}
    with Tracker("layer_bench", config, results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        run.log_table("per_rank_step", records)
        run.log_table("phase", phases)
        run.log_table("policy", totals)
        run.log_table("target", goals)
        run.log_summary({f"target/{r['policy']}/{r['measured_as']}": r["measured"] for r in goals.to_dict("records")})
        from lrmoe.paper_figures import run_figures

        figs = []
        for name in ("policies", "phases"):
            fig, _ = getattr(run_figures, name)(run.results)
            figs += run.log_figure(name, fig)
            plt.close(fig)
    print_tables(phases, totals, goals, on)
    print(f"results: {args.out}; figure: {figs[0]}")
    return phases


def check_args(args: argparse.Namespace) -> None:
    """What every rank would otherwise find out on its own, checked once before any rank starts: the model preset,
    the world size against its experts, the skews and the recorded trace, every system in that world and
    memory. SystemExit with one message."""
    import torch

    from lrmoe.harness.layer_bench_setup import buffer_load, make_traces, memory_model, system_context
    from lrmoe.systems import check_systems

    N = world_size(args)
    try:
        cfg = model_preset(args.model)
        E, K = cfg.num_experts, cfg.top_k
        if E % N:
            raise ValueError(f"num_experts={E} of --model {args.model} is not divisible by {N} ranks")
        elem = torch.tensor([], dtype=getattr(torch, args.dtype)).element_size()
        D, F = args.hidden or cfg.hidden, args.ffn or cfg.expert_ffn
        for _, counts_INE, T in make_traces(args, N, E, K, cfg.name):
            memory = memory_model(E // N, args.spare_slots, T, K, D, F, elem, buffer_load(args))
            ctx = system_context(args, N, E, memory, T, K)
            check_systems(args.policies, ctx)
            if args.regime:
                args.regime_match["trace"] = check_regime(args, counts_INE, ctx)
    except (ValueError, OSError) as exc:  # argparse's form and status (2): nothing ran
        print(f"layer_bench.py: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv=None):
    """Parse the command line (--help and argparse errors before torch loads), check it, and run it; under torchrun a
    failing rank's traceback reaches torchrun's report (lrmoe.runtime.distributed.torchrun.record)."""
    args = parse_args(argv)
    from lrmoe.runtime.distributed.torchrun import record

    return record(run)(args)


def run(args: argparse.Namespace):
    """The benchmark of ``args`` (parsed): checked, measured on its ranks (torchrun's or forked ones:
    lrmoe.harness.layer_bench_rank.run_ranks), reported by rank 0."""
    from lrmoe.harness.layer_bench_rank import run_ranks

    check_args(args)
    return run_ranks(args, lambda records, world: report(args, records, world))

if __name__ == "__main__":
    main()
