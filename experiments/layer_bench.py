"""The expert-parallel MoE layer, policy against policy, on the same skewed routing traces: per-rank forward and
backward time (wall and CPU), the slowest rank, bytes per phase, buffer bytes, pairs per rank, drops, and the
gradient error against the full gradient. Ends with the three LRMoE targets of DESIGN.md §5.8 (item 5), measured.

    python experiments/layer_bench.py                               # 4 forked gloo ranks (CPU), a few minutes
    python experiments/layer_bench.py --quick                       # about a minute
    python experiments/layer_bench.py --regime weak                 # the frontier protocol's settings (DESIGN.md §10)
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

Regimes (``--regime production|weak``, DESIGN.md §10.1): the frontier protocol's system settings at this layer's
scale: the regime's replica slots per home slot (``Regime.spare_slots``), its eps and gamma, its arms as the policies
(the budget systems at its ρ grid, SYMI-dropless and SYMI's random trim, static EP as the reference;
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
import os
import sys
from dataclasses import replace
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
                   help="the frontier protocol's settings at this layer's scale (DESIGN.md §10.1): its spare slots, "
                        "eps, gamma and arms, and the Zipf s matched to its static-EP runs (--runs)")
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
    """Set the regime's settings on ``args`` (DESIGN.md §10.1), at this benchmark's scale: spare slots, eps, gamma,
    its arms (unless --policies), one Zipf trace at the s matched to the regime's static-EP runs. A flag that
    contradicts the regime is a ValueError; the match is recorded in ``args.regime_match``."""
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


# -- pieces --------------------------------------------------------------------------------------------------
def tokens_from_counts(counts_E: torch.Tensor, num_tokens: int, top_k: int, gen: torch.Generator):
    """Per-token choices with exactly these per-expert pair counts (each ≤ num_tokens, summing to T·k) and random
    gate weights. Pairs sorted by expert are dealt round-robin to tokens, so a token's k pairs are num_tokens
    apart in that order and (as each expert's run is at most num_tokens long) always distinct experts."""
    import torch

    from lrmoe.runtime.routing import RouterOutput

    counts_E = counts_E.long()
    if int(counts_E.sum()) != num_tokens * top_k or int(counts_E.max()) > num_tokens:
        raise ValueError(f"counts_E must sum to tokens·k = {num_tokens * top_k} with each ≤ {num_tokens}, "
                         f"got sum {int(counts_E.sum())}, max {int(counts_E.max())}")
    experts = torch.repeat_interleave(torch.arange(counts_E.numel()), counts_E)
    idx_TK = experts.view(top_k, num_tokens).T.contiguous()
    w_TK = torch.rand(num_tokens, top_k, generator=gen, dtype=torch.float64) + 0.1
    return RouterOutput(idx_TK, (w_TK / w_TK.sum(1, keepdim=True)).float(), None)


def phase_sum(record: dict, phases, unit: str) -> float:
    return sum(record.get(f"{p}.{unit}", 0.0) for p in phases)


def run_rank(rank: int, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Every trace and policy on this rank: one record per (trace, policy, measured step) with its counters."""
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from lrmoe.bytemodel.layout import BACKWARD_PHASES, FORWARD_PHASES, STEP_PHASES
    from lrmoe.harness.gradient_error import full_gradient, gradient_errors
    from lrmoe.harness.layer_bench_setup import buffer_load, make_policy, make_traces, memory_model, system_context
    from lrmoe.runtime.distributed.accounting import Accountant, check_accounting, expected_layer, expected_step
    from lrmoe.runtime.distributed.replica import RangeGroups
    from lrmoe.runtime.layer import EPMoELayer, initial_placement
    from lrmoe.runtime.reference import ReferenceMoE

    N = dist.get_world_size()
    cfg = model_preset(args.model)
    cfg = replace(cfg, hidden=args.hidden or cfg.hidden, expert_ffn=args.ffn or cfg.expert_ffn)
    E, D, F, K = cfg.num_experts, cfg.hidden, cfg.expert_ffn, cfg.top_k
    if E % N:
        raise ValueError(f"num_experts={E} of --model {args.model} is not divisible by {N} ranks")
    dtype = getattr(torch, args.dtype)
    elem = torch.tensor([], dtype=dtype).element_size()
    base = E // N
    ref = ReferenceMoE(D, F, E, K, cfg.router, seed=args.seed, dtype=torch.float32)
    groups = RangeGroups()
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    records = []
    for label, counts_INE, T in make_traces(args, N, E, K, cfg.name):
        memory = memory_model(base, args.spare_slots, T, K, D, F, elem, buffer_load(args))
        ctx = system_context(args, N, E, memory, T, K)
        layers = {}
        modes = list(dict.fromkeys(args.replica_grad))
        for name in args.policies:
            for mode in modes:
                policy, backward = make_policy(name, ctx)
                acc = Accountant(sync=sync)
                layer = EPMoELayer(ref.export_weights(), K, cfg.router, policy,
                                   initial_placement(policy, N, E, T * K), groups, routed_scaling=cfg.routed_scaling,
                                   dtype=dtype, device=device, accountant=acc, backward=backward, replica_grad=mode)
                layers[name if len(modes) == 1 else f"{name} ({mode})"] = (policy, backward, acc, layer, mode)
        # a progress bar on rank 0 (the ranks run in step): every policy per step
        for step in tqdm(range(args.warmup + args.steps), desc=label, unit="step", disable=rank != 0):
            gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
            routing = tokens_from_counts(counts_INE[step, rank], T, K, gen)
            x_TD = torch.randn(T, D, generator=gen).to(device, dtype)
            dy_TD = torch.randn(T, D, generator=gen).to(device, dtype)
            names = list(layers)
            shift = step % len(names)
            for name in names[shift:] + names[:shift]:  # the policies take turns, the first one rotating
                policy, backward, acc, layer, mode = layers[name]
                errors = {}
                if not args.no_grad_error:
                    full_shards, full_dx = full_gradient(layer, policy, routing, x_TD, dy_TD, 1.0 / N)
                acc.reset()
                x = x_TD.clone().requires_grad_(True)
                y_TD, info = layer(x, routing=routing)
                (y_TD * dy_TD).sum().backward()
                layer.sync_dense_grads(1.0 / N)
                before = layer.placement_NS.clone()
                after = layer.expert_step(grad_scale=1.0 / N)
                plan = info.dispatch.plan
                want = expected_layer(plan, D, F, elem, backward.metric, backward.compact)
                want.update(expected_step(before, after, E, D, F, elem, replica_grad=mode))
                record = acc.record()
                check_accounting(record, want, rank)  # raises if any counted byte or pair differs from the formula
                if not args.no_grad_error:
                    errors = gradient_errors(layer.store.grad_shards_EW, full_shards, x.grad, full_dx)
                for p in layer.dense_parameters():
                    p.grad = None
                if step < args.warmup:
                    continue
                slots = int((before >= 0).sum())
                records.append({
                    "trace": label, "policy": name, "replica_grad": mode, "step": step - args.warmup, "rank": rank,
                    "replica_slots": slots, "slots_per_rank": layer.slots_per_rank,
                    "fwd_wall_ms": phase_sum(record, FORWARD_PHASES, "wall_ms"),
                    "bwd_wall_ms": phase_sum(record, BACKWARD_PHASES, "wall_ms"),
                    "fwd_cpu_ms": phase_sum(record, FORWARD_PHASES, "cpu_ms"),
                    "bwd_cpu_ms": phase_sum(record, BACKWARD_PHASES, "cpu_ms"),
                    "step_wall_ms": phase_sum(record, STEP_PHASES, "wall_ms"),
                    "memory_bytes": layer.slots_per_rank * memory.slot_bytes + record.get("token_buffer_bytes", 0)
                    + record.get("bwd_buffer_bytes", 0),
                    "budget_bytes": memory.budget_bytes, "floor_excess": int(plan.floor_excess_N[rank]),
                    **errors, **record})
    return records


def _fork_main(rank: int, args: argparse.Namespace) -> list[dict]:
    import torch

    return run_rank(rank, args, torch.device("cpu"))


# -- summaries -----------------------------------------------------------------------------------------------
FWD_BYTES = ("dispatch_a2a", "combine_a2a")
BWD_BYTES = ("combine_a2a_bwd", "bwd_index_a2a", "dispatch_a2a_bwd")


def summarise(raw: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per (trace, policy, phase): the slowest rank and the mean over ranks, mean over steps; and per (trace,
    policy): medians over steps of the per-rank times, the slowest rank, bytes, pairs, memory, errors."""
    import pandas as pd

    from lrmoe.bytemodel.layout import BYTE_PHASES, PHASES

    rows = []
    for (trace, policy), df in raw.groupby(["trace", "policy"], sort=False):
        per_step = df.groupby("step")
        for phase in PHASES:
            if f"{phase}.wall_ms" not in df or df[f"{phase}.wall_ms"].isna().all():
                continue
            row = {"trace": trace, "policy": policy, "phase": phase,
                   "wall_ms_mean": per_step[f"{phase}.wall_ms"].mean().mean(),
                   "wall_ms_max": per_step[f"{phase}.wall_ms"].max().mean(),
                   "cpu_ms_mean": per_step[f"{phase}.cpu_ms"].mean().mean()}
            if phase in BYTE_PHASES:
                row["sent_KiB_mean"] = per_step[f"{phase}.sent_bytes"].mean().mean() / 1024
                row["sent_KiB_max"] = per_step[f"{phase}.sent_bytes"].max().mean() / 1024
                row["recv_KiB_max"] = per_step[f"{phase}.recv_bytes"].max().mean() / 1024
            rows.append(row)
    phases = pd.DataFrame(rows)
    totals = []
    for (trace, policy), df in raw.groupby(["trace", "policy"], sort=False):
        df = df.assign(layer_wall_ms=df["fwd_wall_ms"] + df["bwd_wall_ms"],
                       layer_cpu_ms=df["fwd_cpu_ms"] + df["bwd_cpu_ms"],
                       bwd_bytes=sum(df.get(f"{p}.sent_bytes", 0) for p in BWD_BYTES),
                       fwd_bytes=sum(df.get(f"{p}.sent_bytes", 0) for p in FWD_BYTES),
                       buffer_bytes=df["token_buffer_bytes"] + df.get("bwd_buffer_bytes", 0))
        per_step = df.groupby("step")
        routed = df["pairs_fwd"].sum() + df["pairs_dropped"].sum()
        row = {
            "trace": trace, "policy": policy, "replica_slots": int(df["replica_slots"].iloc[0]),
            "fwd_ms": per_step["fwd_wall_ms"].mean().median(), "bwd_ms": per_step["bwd_wall_ms"].mean().median(),
            "fwd_cpu_ms": per_step["fwd_cpu_ms"].mean().median(),
            "bwd_cpu_ms": per_step["bwd_cpu_ms"].mean().median(),
            "slowest_ms": per_step["layer_wall_ms"].max().median(),
            "slowest_cpu_ms": per_step["layer_cpu_ms"].max().median(),
            "step_ms": per_step["step_wall_ms"].max().median(),
            "fwd_imbalance": (per_step["pairs_fwd"].max() / per_step["pairs_fwd"].mean()).median(),
            "bwd_pairs_max": per_step["pairs_retained"].max().median(),
            "bwd_pairs_mean": per_step["pairs_retained"].mean().median(),
            "bwd_max_over_fwd_mean": (per_step["pairs_retained"].max() / per_step["pairs_fwd"].mean()).median(),
            "retained_pct": 100.0 * df["pairs_retained"].sum() / max(df["pairs_fwd"].sum(), 1),
            "dropped_pct": 100.0 * df["pairs_dropped"].sum() / routed,
            "fwd_a2a_KiB": per_step["fwd_bytes"].sum().median() / 1024,
            "bwd_a2a_KiB": per_step["bwd_bytes"].sum().median() / 1024,
            "buffer_KiB_max": per_step["buffer_bytes"].max().median() / 1024,
            "memory_over_budget": (per_step["memory_bytes"].max() / df["budget_bytes"].iloc[0]).median(),
        }
        for key in ("grad_rel_err", "grad_cos", "dx_rel_err"):
            if key in df:
                row[key] = per_step[key].first().median()  # all ranks hold the same all-reduced value
        totals.append(row)
    return phases, pd.DataFrame(totals)


TARGETS = [  # (name, DESIGN.md §5.8's words, how it is measured, bound)
    ("bwd_balance", "slowest rank carries <= 1.1 x the mean backward pairs", "bwd_pairs_max / bwd_pairs_mean", 1.1),
    ("bwd_bytes", "backward all-to-all bytes <= 0.7 x SYMI-dropless's", "bwd_a2a_KiB / symi-dropless's", 0.7),
    ("cpu_time", "slowest-rank layer CPU time <= 0.75 x SYMI-dropless's", "slowest_cpu_ms / symi-dropless's",
     0.75),
]


def targets(totals: pd.DataFrame, trace: str) -> pd.DataFrame:
    """The LRMoE targets of DESIGN.md §5.8 on ``trace``, for every LRMoE variant that ran (SYMI-dropless present)."""
    import pandas as pd

    df = totals[totals["trace"] == trace].set_index("policy")
    rows = []
    for policy in [p for p in df.index if p.startswith("lrmoe")]:
        me = df.loc[policy]
        mode = policy[policy.index(" ("):] if " (" in policy else ""  # "lrmoe (shard)": SYMI-dropless in that mode
        reference = f"symi-dropless{mode}"
        symi = df.loc[reference] if reference in df.index else None
        values = {"bwd_balance": me["bwd_pairs_max"] / me["bwd_pairs_mean"],
                  "bwd_bytes": me["bwd_a2a_KiB"] / symi["bwd_a2a_KiB"] if symi is not None else float("nan"),
                  "cpu_time": me["slowest_cpu_ms"] / symi["slowest_cpu_ms"] if symi is not None else float("nan")}
        for name, words, how, bound in TARGETS:
            v = values[name]
            rows.append({"trace": trace, "policy": policy, "target": words, "measured_as": how,
                         "measured": v, "bound": bound, "met": bool(v <= bound) if v == v else None})
    return pd.DataFrame(rows)


def target_trace(labels: list[str], skew_params: list[float], skew: str) -> str:
    """The trace the targets are read on: Zipf 0.8 when it ran, else the most skewed synthetic one."""
    for label in labels:
        if label == f"synthetic {skew} 0.8":
            return label
    synthetic = [lab for lab in labels if lab.startswith("synthetic")]
    return synthetic[-1] if synthetic else labels[0]


def report(args: argparse.Namespace, records: list[dict], world_size: int) -> pd.DataFrame:
    import matplotlib
    import pandas as pd

    from lrmoe.integrations.tracking import Tracker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    raw = pd.DataFrame(records)
    counted = [c for c in raw if c.endswith("_bytes") or c.startswith("pairs_")]
    raw[counted] = raw[counted].fillna(0)  # a phase a policy never ran moved no bytes
    labels = list(dict.fromkeys(raw["trace"]))
    order = {"policy": {name: i for i, name in enumerate(args.policies)},
             "trace": {name: i for i, name in enumerate(labels)}}
    raw = raw.sort_values(["trace", "policy", "step", "rank"], kind="stable",
                          key=lambda c: c.map(order[c.name]) if c.name in order else c)
    phases, totals = summarise(raw)
    on = target_trace(labels, args.skew_param, args.skew)
    goals = targets(totals, on)
    config = {**vars(args), "world_size": world_size, "traces": labels, "target_trace": on}
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
    shown = phases[phases["trace"] == on]
    shown = shown.astype(object).where(shown.notna(), None)  # no "nan" for phases that move no bytes
    print(f"Per phase on {on} (all traces in the results file):")
    print(shown.to_markdown(index=False, floatfmt=".3f", missingval=""))
    print()
    print(totals.to_markdown(index=False, floatfmt=".3f"))
    print()
    print(f"LRMoE targets on {on} (benchmarks, not tests):")
    print(goals.to_markdown(index=False, floatfmt=".3f") if len(goals) else "(no LRMoE policy ran)")
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
    """The benchmark of ``args`` (parsed): checked, measured on its ranks, reported by rank 0."""
    from lrmoe.runtime.distributed.torchrun import torchrun_env

    check_args(args)
    if torchrun_env() is not None:  # one of torchrun's ranks
        import torch
        import torch.distributed as dist

        from lrmoe.runtime.distributed.comm import init_process_group_from_env

        info = init_process_group_from_env()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.world_size))
        records = run_rank(info.rank, args, info.device)
        gathered = [None] * info.world_size if info.rank == 0 else None
        dist.gather_object(records, gathered, dst=0)
        out = report(args, [r for part in gathered for r in part], info.world_size) if info.rank == 0 else None
        dist.barrier()
        dist.destroy_process_group()
        return out
    from lrmoe.runtime.distributed.launch import launch

    parts = launch(_fork_main, args.ranks, args, timeout_s=args.timeout)
    return report(args, [r for part in parts for r in part], args.ranks)


if __name__ == "__main__":
    main()
