"""Convergence of LRMoE against SYMI and dropless expert parallelism, with the same seeds and data order.

Trains the same debug model once per (system, seed) (experiments/train.py, fork launcher), then compares
validation loss at equal steps, over seeds (mean and spread; the gap to dropless static EP is taken seed by seed,
with the same data order), the backward pairs LRMoE cuts on the hottest rank, SYMI-cf1's drop rate, and the
equal-quality comparison: the step and the modelled time (each step's plans priced on a GPU cluster preset as
full-size pairs) at which each system's validation curve first reaches static EP's loss at step T. Each run's
routing is saved as a recorded trace. experiments/frontier.py puts these losses against paper-scale modelled time.

    python experiments/convergence.py --steps 300 --seeds 0 1 2    # the full comparison
    python experiments/convergence.py --quick                      # one seed, 40 steps (the main job's quick mode)
    python experiments/convergence.py --steps 300 --seeds 0 1 2 --resume --slim   # a finished sweep aggregated
                                        # again (nothing retrains) without its per-layer load statistics
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
from lrmoe.integrations.tracking import Tracker, add_tracking_args, read_results

RHOS = (0.9, 0.75, 0.6, 0.5)
# the full sweep: the references, LRMoE in cap mode, and the retention budget at each rho with m2 top-k, m2
# unbiased and random selection, beside SYMI-dropless trimmed at random to the same budget (the control)
POLICIES = ["static-ep", "symi-dropless", "symi-cf1", "symi-cf1.25", "lrmoe",
            *[f"lrmoe-rho{rho:g}{sel}" for rho in RHOS for sel in ("", "-unbiased", "-random")],
            *[f"symi-dropless-rho{rho:g}" for rho in RHOS]]
# quick mode: the smallest grid that still draws the frontier: two budgets with the selection that the full sweep
# found best (m2 unbiased; top-k m2 lost to random selection at every budget on both presets) and the random-trim
# control at the same quotas
QUICK_POLICIES = ["static-ep", "symi-dropless", "symi-cf1", "lrmoe-rho0.75-unbiased", "lrmoe-rho0.5-unbiased",
                  "lrmoe-rho0.5-random"]
BASELINE = "static-ep"


def last_per_step(records: list[dict]) -> list[dict]:
    """One record per step (a resumed run may have logged a step twice: the later one wins)."""
    by_step = {}
    for rec in records:
        by_step[rec["step"]] = rec
    return [by_step[s] for s in sorted(by_step)]


def spread(values) -> dict:
    """Mean, standard deviation (0 for one value), min and max of the finite values, and how many there were."""
    v = np.asarray([x for x in values if x == x], dtype=float)
    if not len(v):
        return {"mean": np.nan, "std": np.nan, "min": np.nan, "max": np.nan, "n": 0}
    return {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
            "min": float(v.min()), "max": float(v.max()), "n": int(len(v))}


def loss_at_step(steps, val_loss, step: float) -> float:
    """The validation curve at ``step``, linearly interpolated between evaluations (NaN outside them)."""
    steps, val_loss = np.asarray(steps, float), np.asarray(val_loss, float)
    if not len(steps) or step < steps[0] or step > steps[-1]:
        return np.nan
    return float(np.interp(step, steps, val_loss))


def time_to_loss(steps, times, val_loss, target: float) -> tuple[float, float]:
    """(step, time) at which the validation curve first reaches ``target`` (loss <= target), linearly
    interpolated between the evaluation before and the one at the crossing; (NaN, NaN) if it never does.
    ``times`` is the cumulative time at each evaluation's step."""
    steps, times, val_loss = (np.asarray(a, float) for a in (steps, times, val_loss))
    for i, loss in enumerate(val_loss):
        if loss <= target:
            if i == 0 or val_loss[i - 1] == loss:
                return float(steps[i]), float(times[i])
            f = (val_loss[i - 1] - target) / (val_loss[i - 1] - loss)  # 0 at the previous evaluation, 1 at this
            return (float(steps[i - 1] + f * (steps[i] - steps[i - 1])),
                    float(times[i - 1] + f * (times[i] - times[i - 1])))
    return np.nan, np.nan


def per_run(curves: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """One row per (policy, seed): final validation loss, its gap to the baseline of the same seed (%), how much
    the validation loss still fell over the last 20 % of the steps (%: near 0 once the curve has flattened), and the
    run's mean hottest-rank backward cut, drop rate and modelled time per step."""
    val = curves.dropna(subset=["val_loss"]).sort_values("step")
    final = val.groupby(["policy", "seed"], sort=False).val_loss.last()
    rows = []
    for (policy, seed), group in curves.groupby(["policy", "seed"], sort=False):
        base = final.get((baseline, seed), np.nan)
        loss = float(final.get((policy, seed), np.nan))
        v = val[(val.policy == policy) & (val.seed == seed)]
        at_80 = loss_at_step(v.step, v.val_loss, 0.8 * int(group.step.max()))
        rows.append({
            "policy": policy, "seed": int(seed), "steps": int(group.step.max()), "val_loss": loss,
            "gap_pct": 100 * (loss / base - 1) if base == base else np.nan,
            "last20_drop_pct": 100 * (1 - loss / at_80) if at_80 == at_80 else np.nan,
            "hot_rank_bwd_cut_pct": 100 * float(group.hot_rank_bwd_cut.mean()),
            "bwd_max_over_mean": float((group.bwd_pairs_max / group.fwd_pairs_mean).mean()),
            "dropped_pct": 100 * float(group.dropped_frac.mean()),
            "modelled_ms_per_step": 1e3 * float(group.modelled_s.mean()),
        })
    return pd.DataFrame(rows)


def summarise(curves: pd.DataFrame, baseline: str = BASELINE) -> pd.DataFrame:
    """One row per policy over its seeds: final validation loss mean ± std (and min/max), the gap to dropless static
    EP in % (taken seed by seed, then averaged), the hottest rank's backward pairs cut, and the drop rate."""
    runs = per_run(curves, baseline)
    rows = []
    for policy, group in runs.groupby("policy", sort=False):
        loss, gap = spread(group.val_loss), spread(group.gap_pct)
        rows.append({
            "policy": policy, "seeds": loss["n"], "steps": int(group.steps.max()),
            "val_loss": loss["mean"], "val_loss_std": loss["std"], "val_loss_min": loss["min"],
            "val_loss_max": loss["max"], "gap_pct": gap["mean"], "gap_pct_std": gap["std"],
            "gap_pct_min": gap["min"], "gap_pct_max": gap["max"],
            "last20_drop_pct": float(group.last20_drop_pct.mean()),
            "hot_rank_bwd_cut_pct": float(group.hot_rank_bwd_cut_pct.mean()),
            "bwd_max_over_mean": float(group.bwd_max_over_mean.mean()),
            "dropped_pct": float(group.dropped_pct.mean()),
            "modelled_ms_per_step": float(group.modelled_ms_per_step.mean()),
        })
    return pd.DataFrame(rows)


def time_to_reach(curves: pd.DataFrame, target_step: int | None = None, baseline: str = BASELINE) -> pd.DataFrame:
    """Equal quality: per policy, the step and the modelled time (its own cumulative ``time_s``) at which its
    validation curve first reaches the baseline's loss at ``target_step`` (default: the baseline's last step),
    seed by seed against the same seed's baseline; means over the seeds that reach it, and how many did."""
    val = curves.dropna(subset=["val_loss"]).sort_values("step")
    rows = []
    for policy, group in val.groupby("policy", sort=False):
        reached = []
        for seed, run in group.groupby("seed"):
            base = val[(val.policy == baseline) & (val.seed == seed)]
            if base.empty:
                continue
            t = int(base.step.max()) if target_step is None else target_step
            target = loss_at_step(base.step, base.val_loss, t)
            reached.append((t, target, *time_to_loss(run.step, run.time_s, run.val_loss, target)))
        if not reached:
            continue
        t, target, step, time_s = zip(*reached)
        rows.append({"policy": policy, "target_step": int(max(t)), "target_loss": float(np.mean(target)),
                     "seeds_reached": int(sum(s == s for s in step)), "seeds": len(step),
                     "step_to_reach": spread(step)["mean"], "step_to_reach_max": spread(step)["max"],
                     "modelled_ms_to_reach": 1e3 * spread(time_s)["mean"]})
    return pd.DataFrame(rows)


def run_path(work: Path, policy: str, seed: int, seeds: list[int]) -> Path:
    """A run's results file: ``<work>/<policy>.jsonl`` for a single seed, ``<work>/seed<s>/<policy>.jsonl`` else."""
    return work / f"{policy}.jsonl" if len(seeds) == 1 else work / f"seed{seed}" / f"{policy}.jsonl"


def train_argv(args, policy: str, seed: int, results: Path) -> list[str]:
    """experiments/train.py's arguments for one run (LRMoE systems get their own slots and slack)."""
    lrmoe = get_system(policy).family == "lrmoe"
    folder = results.parent
    return ["--preset", args.preset, "--policy", policy, "--ranks", str(args.ranks),
            "--steps", str(args.steps), "--batch", str(args.batch), "--seq-len", str(args.seq_len),
            "--eval-every", str(args.eval_every), "--seed", str(seed),
            "--lr-schedule", args.lr_schedule, "--warmup", str(min(args.warmup, args.steps - 1)),
            "--extra-slots", str(args.lrmoe_extra_slots if lrmoe else args.extra_slots),
            "--eps", str(args.lrmoe_eps), "--aux-coef", str(args.aux_coef), "--micro-batches", str(args.micro_batches),
            *(["--activation-checkpointing"] if args.activation_checkpointing else []),
            "--ckpt-dir", str(folder / "checkpoints" / policy), "--ckpt-every", str(args.ckpt_every),
            "--out", str(results), "--trace-out", str(folder / f"trace_{policy}.npz"),
            *(["--overwrite"] if args.overwrite else ["--resume"] if results.exists() or args.resume else []),
            "--no-wandb", *(["--quiet"] if args.quiet else [])]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b-debug")
    parser.add_argument("--policies", nargs="+", default=None, type=system_arg,
                        help="default: the full grid (--quick: the quick grid). " + system_names_help())
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine",
                        help="every run's schedule (train.py): 'cosine' decays to a tenth of the lr at the last "
                             "step, so the curves have flattened by then")
    parser.add_argument("--warmup", type=int, default=10, help="warm-up steps of the cosine schedule")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=1, help="train.py's: micro-batches per step")
    parser.add_argument("--activation-checkpointing", action="store_true", help="train.py's: recompute activations")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="one seed (ignored when --seeds is given)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="several seeds, one run each")
    parser.add_argument("--target-step", type=int, default=None,
                        help="the equal-quality table's step T (default: the last step)")
    parser.add_argument("--extra-slots", type=int, default=1, help="replica slots per rank for SYMI (and LRMoE)")
    parser.add_argument("--lrmoe-extra-slots", type=int, default=0,
                        help="LRMoE's replica slots per rank (default 0: the memory-constrained case, where the "
                             "backward quotas, not replicas, bound the hot rank)")
    parser.add_argument("--lrmoe-eps", type=float, default=0.0,
                        help="LRMoE's balance slack: backward cap (1 + eps) x the mean forward load (cap mode)")
    parser.add_argument("--aux-coef", type=float, default=0.1,
                        help="load-balancing loss weight (lower: more routing skew, more for LRMoE to trim)")
    parser.add_argument("--ckpt-every", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="one seed, 40 steps, batch 2, the quick grid")
    parser.add_argument("--quiet", action="store_true", help="no progress bars from the runs")
    parser.add_argument("--slim", action="store_true",
                        help="leave the per-layer load statistics (load/*, three quarters of a record) out of the "
                             "aggregate results file; the per-run files keep them")
    add_tracking_args(parser, "outputs/convergence.jsonl")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every, args.batch = 40, 10, 2
        args.seeds = args.seeds or [args.seed]
    args.policies = args.policies or (QUICK_POLICIES if args.quick else POLICIES)
    args.seeds = list(dict.fromkeys(args.seeds or [args.seed]))
    return args


def plot(curves: pd.DataFrame, args):
    """Validation loss (mean over seeds, band: spread) at equal steps and at equal modelled time."""
    sns.set_theme(style="whitegrid", context="paper")
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    val = curves.dropna(subset=["val_loss"])
    sns.lineplot(val, x="step", y="val_loss", hue="policy", errorbar=("pi", 100), ax=axes[0])
    sns.lineplot(val.assign(time_ms=1e3 * val.time_s), x="time_ms", y="val_loss", hue="policy", errorbar=None,
                 ax=axes[1], legend=False)
    axes[0].set(title="validation loss at equal steps (band: seed min-max)", ylabel="validation loss (nats/byte)")
    axes[1].set(title="at equal modelled time (seed mean)", xlabel="modelled MoE-layer time (ms)")
    axes[0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"{args.preset}, {args.ranks} ranks, seeds {args.seeds} (text: Python stdlib source)")
    fig.tight_layout()
    return fig


def main(argv=None) -> pd.DataFrame:
    args = parse_args(argv)
    out = Path(args.out)
    work = out.with_suffix("")  # per-run results, checkpoints and traces
    runs = {(policy, seed): train_argv(args, policy, seed, run_path(work, policy, seed, args.seeds))
            for seed in args.seeds for policy in args.policies}
    for run_argv in runs.values():  # every run's arguments checked before the first one trains
        train.check_args(train.parse_args(run_argv))
    with Tracker("convergence", vars(args), results=out, seed=args.seeds[0], overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        frames = []
        for (policy, seed), run_argv in runs.items():
            results = run_path(work, policy, seed, args.seeds)
            done = results.exists() and any(r.get("step") == args.steps for r in read_results(results))
            if not done:
                train.main(run_argv)
            frame = pd.DataFrame(last_per_step(read_results(results)))
            frame["seed"] = seed
            frame["time_s"] = frame.modelled_s.cumsum()
            frames.append(frame)
            for rec in frame.to_dict("records"):
                run.log({k: v for k, v in rec.items() if k not in ("run_id", "kind") and v == v
                         and not (args.slim and k.startswith("load/"))}, step=None)
        curves = pd.concat(frames, ignore_index=True)
        table, reach = summarise(curves), time_to_reach(curves, args.target_step)
        run.log_summary({"table": table.to_dict("records"), "per_run": per_run(curves).to_dict("records"),
                         "time_to_reach": reach.to_dict("records")})
        figure = run.log_figure("curves", plot(curves, args))
        print("Equal quality: the step and modelled time at which each system first reaches static EP's "
              "validation loss at step T (mean over the seeds that reach it)\n")
        print(reach.to_markdown(index=False, floatfmt=".3f"))
        print(f"\nFinal validation loss over seeds {args.seeds}; gap to dropless static EP seed by seed (%)\n")
        print(table[["policy", "seeds", "steps", "val_loss", "val_loss_std", "gap_pct", "gap_pct_min", "gap_pct_max",
                     "last20_drop_pct", "hot_rank_bwd_cut_pct", "dropped_pct", "modelled_ms_per_step"]]
              .to_markdown(index=False, floatfmt=".3f"))
        print(f"results: {out}; figure: {figure[0]}; recorded traces in {work}")
        (work / "summary.json").write_text(json.dumps(table.to_dict("records"), indent=1))
    return table


if __name__ == "__main__":
    main()
