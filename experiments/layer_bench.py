"""Per-phase cost of the expert-parallel MoE layer: pairs computed, bytes sent and received, token-buffer bytes,
wall and CPU time, per rank and phase, for each policy, on a skewed synthetic routing trace (labelled synthetic).
The counted bytes are checked against the formulas of ``lrmoe.dist.accounting`` every iteration.

    python experiments/layer_bench.py                               # 4 forked gloo ranks (CPU)
    torchrun --nproc-per-node 4 experiments/layer_bench.py --torchrun  # NCCL on GPUs, gloo on CPU

The trace (``lrmoe.traces.generate_trace``, Zipf popularity with AR(1) drift, per-token Gumbel-top-k) fixes how
many pairs each rank routes to each expert per step; the layer replays it: tokens are random vectors, their
choices are rebuilt from the counts, and gate weights are random. One iteration = forward, backward of a random
linear loss, data-parallel sync of the router, and the experts' optimizer step with redistribution into the next
placement. Policies are chosen by name (:data:`POLICIES`).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from lrmoe.config import model_preset  # noqa: E402
from lrmoe.dist.accounting import (BYTE_PHASES, PHASES, Accountant, check_counts, expected_layer,  # noqa: E402
                                   expected_step)
from lrmoe.dist.replica import RangeGroups  # noqa: E402
from lrmoe.layer import EPMoELayer, initial_placement  # noqa: E402
from lrmoe.policies import LRMoE, Capacity, StaticEP, Symi  # noqa: E402
from lrmoe.reference import ReferenceMoE  # noqa: E402
from lrmoe.routing import RouterOutput  # noqa: E402
from lrmoe.tracking import Tracker, add_tracking_args  # noqa: E402
from lrmoe.traces import generate_trace  # noqa: E402

# name -> factory(experts per rank, spare slots per rank); a new policy is one more line here.
POLICIES = {
    "static-ep": lambda base, spare: StaticEP(),
    "capacity-cf1": lambda base, spare: Capacity(cf=1.0),
    "capacity-cf1-gate": lambda base, spare: Capacity(cf=1.0, drop_by="gate"),
    "symi-dropless": lambda base, spare: Symi(slots_per_rank=base + spare, cf=None),
    "symi-cf1": lambda base, spare: Symi(slots_per_rank=base + spare, cf=1.0),
    # LRMoE's plans retain fewer pairs for the backward: the layer refuses them until its backward hook exists.
    "lrmoe": lambda base, spare: LRMoE(extra_slots=spare),
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=4, help="ranks of the fork launcher (ignored with --torchrun)")
    p.add_argument("--torchrun", action="store_true", help="run under torchrun (one process per rank)")
    p.add_argument("--policies", nargs="+", default=["static-ep", "capacity-cf1"], choices=sorted(POLICIES))
    p.add_argument("--model", default="qwen3-30b-a3b-debug", help="model preset giving D, F, E, k and the router")
    p.add_argument("--tokens-per-rank", type=int, default=256)
    p.add_argument("--steps", type=int, default=5, help="measured iterations per policy")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured iterations before them")
    p.add_argument("--skew", default="zipf", choices=["zipf", "dirichlet"])
    p.add_argument("--skew-param", type=float, default=0.8, help="Zipf s (0.8: hottest ~15x the mean) or α")
    p.add_argument("--spare-slots", type=int, default=1, help="replica slots per rank beyond E/N (SYMI, LRMoE)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before the fork launch is abandoned")
    add_tracking_args(p, "outputs/layer_bench.jsonl")
    args = p.parse_args(argv)
    for name in ("ranks", "tokens_per_rank", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.warmup < 0 or args.spare_slots < 0:
        raise ValueError(f"--warmup and --spare-slots must be non-negative, got {args.warmup}, {args.spare_slots}")
    return args


def tokens_from_counts(counts_E: torch.Tensor, num_tokens: int, top_k: int, gen: torch.Generator):
    """Per-token choices with exactly these per-expert pair counts (each ≤ num_tokens, summing to T·k) and random
    gate weights. Pairs sorted by expert are dealt round-robin to tokens, so a token's k pairs are num_tokens
    apart in that order and (as each expert's run is at most num_tokens long) always distinct experts."""
    counts_E = counts_E.long()
    if int(counts_E.sum()) != num_tokens * top_k or int(counts_E.max()) > num_tokens:
        raise ValueError(f"counts_E must sum to tokens·k = {num_tokens * top_k} with each ≤ {num_tokens}, "
                         f"got sum {int(counts_E.sum())}, max {int(counts_E.max())}")
    experts = torch.repeat_interleave(torch.arange(counts_E.numel()), counts_E)
    idx_TK = experts.view(top_k, num_tokens).T.contiguous()
    w_TK = torch.rand(num_tokens, top_k, generator=gen, dtype=torch.float64) + 0.1
    return RouterOutput(idx_TK, (w_TK / w_TK.sum(1, keepdim=True)).float(), None)


def run_rank(rank: int, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Every policy on this rank: returns one record per (policy, measured step) with this rank's counters."""
    N = dist.get_world_size()
    cfg = model_preset(args.model)
    E, D, F, K, T = cfg.num_experts, cfg.hidden, cfg.expert_ffn, cfg.top_k, args.tokens_per_rank
    if E % N:
        raise ValueError(f"num_experts={E} of --model {args.model} is not divisible by {N} ranks")
    dtype = DTYPES[args.dtype]
    steps = args.warmup + args.steps
    trace = generate_trace(steps, 1, N, E, K, T, skew=args.skew, skew_param=args.skew_param, seed=args.seed,
                           exact=True, model=cfg.name)
    ref = ReferenceMoE.from_config(cfg, seed=args.seed, dtype=torch.float32)
    groups = RangeGroups()
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    elem = torch.tensor([], dtype=dtype).element_size()
    records = []
    for name in args.policies:
        policy = POLICIES[name](E // N, args.spare_slots)
        acc = Accountant(sync=sync)
        layer = EPMoELayer(ref.export_weights(), K, cfg.router, policy, initial_placement(policy, N, E, T * K), groups,
                           routed_scaling=cfg.routed_scaling, dtype=dtype, device=device, accountant=acc)
        gen = torch.Generator().manual_seed(args.seed * 1000 + rank)
        for step in range(steps):
            routing = tokens_from_counts(trace.counts_SLNE[step, 0, rank], T, K, gen)
            x_TD = torch.randn(T, D, generator=gen).to(device, dtype).requires_grad_(True)
            dy_TD = torch.randn(T, D, generator=gen).to(device, dtype)
            acc.reset()
            y_TD, info = layer(x_TD, routing=routing)
            (y_TD * dy_TD).sum().backward()
            layer.sync_dense_grads(1.0 / N)
            before = layer.placement_NS.clone()
            after = layer.expert_step(grad_scale=1.0 / N)
            plan = info.dispatch.plan
            want = expected_layer(plan.fwd_NG, layer.slots_per_rank, D, F, elem, plan.dropped_NE.sum(1))
            want.update(expected_step(before, after, E, D, F, elem))
            record = acc.record()
            check_counts(record, want, rank)  # raises if any counted byte or pair differs from the formula
            if step >= args.warmup:
                records.append({"policy": name, "step": step - args.warmup, "rank": rank,
                                "replica_slots": int((before >= 0).sum()), **record})
            for p in layer.dense_parameters():
                p.grad = None
    return records


def _fork_main(rank: int, args: argparse.Namespace) -> list[dict]:
    return run_rank(rank, args, torch.device("cpu"))


def summarise(raw: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per (policy, phase): mean over steps of the mean and the slowest rank; and per-policy counters."""
    rows = []
    for policy, df in raw.groupby("policy", sort=False):
        for phase in PHASES:
            if f"{phase}.wall_ms" not in df:
                continue
            per_step = df.groupby("step")
            row = {"policy": policy, "phase": phase,
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
    for policy, df in raw.groupby("policy", sort=False):
        per_step = df.groupby("step")
        wall = df[[f"{p}.wall_ms" for p in PHASES if f"{p}.wall_ms" in df]].sum(axis=1)
        routed = df["pairs_fwd"].sum() + df["pairs_dropped"].sum()
        totals.append({
            "policy": policy, "replica_slots": int(df["replica_slots"].iloc[0]),
            "pairs_fwd_max": per_step["pairs_fwd"].max().mean(), "pairs_fwd_mean": per_step["pairs_fwd"].mean().mean(),
            "fwd_imbalance": (per_step["pairs_fwd"].max() / per_step["pairs_fwd"].mean()).mean(),
            "dropped_pct": 100.0 * df["pairs_dropped"].sum() / routed,
            "token_buffer_KiB_max": per_step["token_buffer_bytes"].max().mean() / 1024,
            "iteration_ms_max": wall.groupby(df["step"]).max().mean(),
        })
    return phases, pd.DataFrame(totals)


def report(args: argparse.Namespace, records: list[dict], world_size: int) -> pd.DataFrame:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    raw = pd.DataFrame(records)
    phases, totals = summarise(raw)
    config = {**vars(args), "world_size": world_size, "trace": "synthetic"}
    with Tracker("layer_bench", config, results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        for rec in records:
            run.log({"table": "per_rank_step", **rec})
        for rec in phases.to_dict("records"):
            run.log({"table": "phase", **rec})
        for rec in totals.to_dict("records"):
            run.log({"table": "policy", **rec})
        sns.set_theme(style="whitegrid", context="paper")
        fig, axes = plt.subplots(1, 2, figsize=(11, 3.4))
        sns.barplot(phases, x="phase", y="wall_ms_max", hue="policy", ax=axes[0])
        axes[0].set(ylabel="slowest rank, ms (mean over steps)", xlabel="")
        traffic = phases.dropna(subset=["sent_KiB_max"])
        sns.barplot(traffic, x="phase", y="sent_KiB_max", hue="policy", ax=axes[1])
        axes[1].set(ylabel="KiB sent by the busiest rank", xlabel="")
        for ax in axes:
            ax.tick_params(axis="x", rotation=60)
        fig.suptitle(f"EP layer per phase: {world_size} ranks, {args.model}, {args.tokens_per_rank} tokens/rank, "
                     f"synthetic {args.skew} {args.skew_param}")
        fig.tight_layout()
        figs = run.log_figure("phases", fig)
    shown = phases.astype(object).where(phases.notna(), None)  # no "nan" for phases that move no bytes
    print(shown.to_markdown(index=False, floatfmt=".3f", missingval=""))
    print()
    print(totals.to_markdown(index=False, floatfmt=".3f"))
    print(f"results: {args.out}; figure: {figs[0]}")
    return phases


def main(argv=None):
    args = parse_args(argv)
    if args.torchrun:
        from lrmoe.dist.comm import init_process_group_from_env

        info = init_process_group_from_env()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // info.world_size))
        records = run_rank(info.rank, args, info.device)
        gathered = [None] * info.world_size if info.rank == 0 else None
        dist.gather_object(records, gathered, dst=0)
        out = report(args, [r for part in gathered for r in part], info.world_size) if info.rank == 0 else None
        dist.barrier()
        dist.destroy_process_group()
        return out
    from lrmoe.dist.launch import launch

    parts = launch(_fork_main, args.ranks, args, timeout_s=args.timeout)
    return report(args, [r for part in parts for r in part], args.ranks)


if __name__ == "__main__":
    main()
