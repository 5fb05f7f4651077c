"""Convergence of LRMoE against SYMI and dropless expert parallelism, with the same seed and data order.

Trains the same debug model once per policy (experiments/train.py, fork launcher), then compares validation
loss at equal steps and at equal modelled time (each step's plans priced on a GPU cluster preset as full-size
pairs), the backward pairs LRMoE cuts on the hottest rank, and SYMI-cf1's drop rate. Each policy's routing is
saved as a recorded trace.

    python experiments/convergence.py --steps 200              # the full comparison
    python experiments/convergence.py --quick                  # a short run (the main job's quick mode)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from lrmoe.experiments import train
from lrmoe.systems import get_system, system_arg, system_names_help
from lrmoe.tracking import Tracker, add_tracking_args, read_results

POLICIES = ["static-ep", "symi-cf1", "symi-dropless", "lrmoe", "lrmoe-m2-unbiased", "lrmoe-random"]
BASELINE = "static-ep"


def last_per_step(records: list[dict]) -> list[dict]:
    """One record per step (a resumed run may have logged a step twice: the later one wins)."""
    by_step = {}
    for rec in records:
        by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def summarise(curves: pd.DataFrame) -> pd.DataFrame:
    """Final validation loss per policy, its gap to dropless, and the loss at the time budget every policy
    reached (the smallest total modelled time), interpolated on the validation curve."""
    val = curves.dropna(subset=["val_loss"])
    budget = curves.groupby("policy")["time_s"].max().min()
    base = val[val.policy == BASELINE].val_loss.iloc[-1] if (val.policy == BASELINE).any() else np.nan
    rows = []
    for policy, group in curves.groupby("policy", sort=False):
        v = val[val.policy == policy]
        at_time = float(np.interp(budget, v.time_s, v.val_loss)) if len(v) > 1 else float(v.val_loss.iloc[-1])
        rows.append({
            "policy": policy, "steps": int(group.step.max()), "val_loss": float(v.val_loss.iloc[-1]),
            "vs_dropless_pct": 100 * (float(v.val_loss.iloc[-1]) / base - 1) if base == base else np.nan,
            "val_loss_at_equal_time": at_time, "modelled_ms_per_step": 1e3 * float(group.modelled_s.mean()),
            "hot_rank_bwd_cut_pct": 100 * float(group.hot_rank_bwd_cut.mean()),
            "bwd_max_over_mean": float((group.bwd_pairs_max / group.fwd_pairs_mean).mean()),
            "dropped_pct": 100 * float(group.dropped_frac.mean()),
        })
    return pd.DataFrame(rows)


def train_argv(args, policy: str, work: Path) -> list[str]:
    """experiments/train.py's arguments for one policy's run (LRMoE systems get their own slots and slack)."""
    lrmoe = get_system(policy).family == "lrmoe"
    results = work / f"{policy}.jsonl"
    return ["--preset", args.preset, "--policy", policy, "--ranks", str(args.ranks),
            "--steps", str(args.steps), "--batch", str(args.batch), "--seq-len", str(args.seq_len),
            "--eval-every", str(args.eval_every), "--seed", str(args.seed),
            "--extra-slots", str(args.lrmoe_extra_slots if lrmoe else args.extra_slots),
            "--eps", str(args.lrmoe_eps), "--aux-coef", str(args.aux_coef),
            "--ckpt-dir", str(work / "checkpoints" / policy), "--ckpt-every", "20",
            "--out", str(results), "--trace-out", str(work / f"trace_{policy}.npz"),
            *(["--resume"] if results.exists() or args.resume else []),
            *(["--overwrite"] if args.overwrite else []), "--no-wandb"]


def main(argv=None) -> pd.DataFrame:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b-debug")
    parser.add_argument("--policies", nargs="+", default=POLICIES, type=system_arg, help=system_names_help())
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--extra-slots", type=int, default=1, help="replica slots per rank for SYMI (and LRMoE)")
    parser.add_argument("--lrmoe-extra-slots", type=int, default=0,
                        help="LRMoE's replica slots per rank (default 0: the memory-constrained case, where the "
                             "backward quotas, not replicas, bound the hot rank)")
    parser.add_argument("--lrmoe-eps", type=float, default=0.0,
                        help="LRMoE's balance slack: backward cap (1 + eps) x the mean forward load")
    parser.add_argument("--aux-coef", type=float, default=0.1,
                        help="load-balancing loss weight (lower: more routing skew, more for LRMoE to trim)")
    parser.add_argument("--quick", action="store_true", help="a short run: 40 steps, batch 2")
    add_tracking_args(parser, "outputs/convergence.jsonl")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every, args.batch = 40, 10, 2
    out = Path(args.out)
    work = out.with_suffix("")  # per-policy results, checkpoints and traces
    runs = {policy: train_argv(args, policy, work) for policy in args.policies}
    for run_argv in runs.values():  # every run's arguments checked before the first one trains
        train.check_args(train.parse_args(run_argv))
    with Tracker("convergence", vars(args), results=out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        frames = []
        for policy in args.policies:
            results = work / f"{policy}.jsonl"
            done = results.exists() and any(r.get("step") == args.steps for r in read_results(results))
            if not done:
                train.main(runs[policy])
            frame = pd.DataFrame(last_per_step(read_results(results)))
            frame["time_s"] = frame.modelled_s.cumsum()
            frames.append(frame)
            for rec in frame.to_dict("records"):
                run.log({k: v for k, v in rec.items() if k not in ("run_id", "kind") and v == v}, step=None)
        curves = pd.concat(frames, ignore_index=True)
        table = summarise(curves)
        run.log_summary({"table": table.to_dict("records")})

        sns.set_theme(style="whitegrid", context="paper")
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
        val = curves.dropna(subset=["val_loss"])
        sns.lineplot(val, x="step", y="val_loss", hue="policy", marker="o", ax=axes[0])
        sns.lineplot(val.assign(time_ms=1e3 * val.time_s), x="time_ms", y="val_loss", hue="policy", marker="o",
                     ax=axes[1], legend=False)
        axes[0].set(title="validation loss at equal steps", ylabel="validation loss (nats/byte)")
        axes[1].set(title="at equal modelled time", xlabel="modelled MoE-layer time (ms)")
        fig.suptitle(f"{args.preset}, {args.ranks} ranks, seed {args.seed} (text: Python stdlib source)")
        fig.tight_layout()
        figure = run.log_figure("curves", fig)
        print(table.to_markdown(index=False, floatfmt=".3f"))
        print(f"results: {out}; figure: {figure[0]}; recorded traces in {work}")
        (work / "summary.json").write_text(json.dumps(table.to_dict("records"), indent=1))
    return table


if __name__ == "__main__":
    main()
