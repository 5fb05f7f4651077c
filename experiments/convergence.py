"""Convergence of LRMoE against SYMI and dropless expert parallelism, with the same seeds and data order.

Trains the same debug model once per (system, seed) (experiments/train.py in this process, fork launcher), then compares
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

from typing import TYPE_CHECKING

# The parser needs only these light modules; the registry (torch), the analysis (pandas, SciPy) and matplotlib
# load in the functions that check, collect and draw.
from lrmoe.cli import non_negative_float_arg, non_negative_int_arg, positive_int_arg
from lrmoe.cli import SYSTEMS_HELP, run_entry, script_parser, system_arg
from lrmoe.config import model_preset
from lrmoe.integrations.tracking_args import check_tracking_args
from lrmoe.results import read_headers, read_results

if TYPE_CHECKING:
    import pandas as pd

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
# train.py's flags that name where a run's files go or how it reports, not what it computes (a run's identity
# leaves them out), and its valueless flags that change what it computes
TRAIN_NOT_IDENTITY = ("--out", "--ckpt-dir", "--trace-out", "--overwrite", "--resume", "--no-wandb", "--quiet",
                      "--ckpt-every")
TRAIN_SWITCHES = ("--activation-checkpointing",)


def check_runs(args) -> None:
    """What would fail the first run, checked before any trains: the preset, and every system in the runs' world
    (train.py checks its own arguments again when it starts). SystemExit with one message."""
    from lrmoe.systems import SystemContext, check_systems, get_system

    try:
        cfg = model_preset(args.preset)
        for lrmoe_run in (False, True):
            names = [p for p in args.policies if (get_system(p).family == "lrmoe") == lrmoe_run]
            ctx = SystemContext(num_experts=cfg.num_experts, num_ranks=args.ranks,
                                spare_slots=args.lrmoe_extra_slots if lrmoe_run else args.extra_slots,
                                eps=args.lrmoe_eps, pairs_per_rank=args.batch * args.seq_len * cfg.top_k)
            check_systems(names, ctx)
    except ValueError as exc:
        raise SystemExit(f"convergence.py: error: {exc}") from None


def train(run_argv: list[str]) -> None:
    """One training run: experiments/train.py's command line, in this process through its entry point
    (lrmoe.cli.run_entry; its ranks are processes of their own, as from the command line); a failed run is this
    script's error, naming the run."""
    from lrmoe.experiments import train as train_script  # imports torch: here, not for --help

    run_entry("convergence.py", "train.py", train_script.cli, run_argv)


def run_path(work: Path, policy: str, seed: int, seeds: list[int]) -> Path:
    """A run's results file: ``<work>/<policy>.jsonl`` for a single seed, ``<work>/seed<s>/<policy>.jsonl`` else."""
    return work / f"{policy}.jsonl" if len(seeds) == 1 else work / f"seed{seed}" / f"{policy}.jsonl"


def train_argv(args, policy: str, seed: int, results: Path) -> list[str]:
    """experiments/train.py's arguments for one run (LRMoE systems get their own slots and slack)."""
    from lrmoe.systems import get_system

    lrmoe = get_system(policy).family == "lrmoe"
    folder = results.parent
    return ["--preset", args.preset, "--policy", policy, "--ranks", str(args.ranks),
            "--steps", str(args.steps), "--batch", str(args.batch), "--seq-len", str(args.seq_len),
            "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches), "--seed", str(seed),
            "--lr-schedule", args.lr_schedule, "--warmup", str(min(args.warmup, args.steps - 1)),
            "--extra-slots", str(args.lrmoe_extra_slots if lrmoe else args.extra_slots),
            "--eps", str(args.lrmoe_eps), "--aux-coef", str(args.aux_coef), "--micro-batches", str(args.micro_batches),
            "--engine", args.engine,
            *(["--activation-checkpointing"] if args.activation_checkpointing else []),
            "--ckpt-dir", str(folder / "checkpoints" / policy), "--ckpt-every", str(args.ckpt_every),
            "--out", str(results), "--trace-out", str(folder / f"trace_{policy}.npz"),
            *(["--overwrite"] if args.overwrite else ["--resume"] if results.exists() or args.resume else []),
            "--no-wandb", *(["--quiet"] if args.quiet else [])]


def run_differences(args, policy: str, seed: int) -> list[str]:
    """How the run in the per-run file of (``policy``, ``seed``) differs from the run these arguments make (its
    stored configuration against train.py's arguments now; none where the file does not exist)."""
    from lrmoe.analysis.runs import config_differences

    results = run_path(Path(args.out_work), policy, seed, args.seeds)
    headers = read_headers(results) if results.exists() else []
    if not headers:
        return []
    return config_differences(headers[-1].get("config") or {}, train_argv(args, policy, seed, results),
                              ignore=TRAIN_NOT_IDENTITY, switches=TRAIN_SWITCHES)


def finished(args, policy: str, seed: int) -> bool:
    """A per-run file is reused only when its run reached the last step with the configuration asked for now."""
    results = run_path(Path(args.out_work), policy, seed, args.seeds)
    return (results.exists() and any(r.get("step") == args.steps for r in read_results(results))
            and not run_differences(args, policy, seed))


def check_identities(parser, args) -> None:
    """Without --overwrite, a per-run file that a run of other settings wrote is an error naming the settings
    that differ (--resume would continue, and a finished one be reported as, a run these arguments did not ask
    for); with --overwrite it is run again."""
    if args.overwrite:
        return
    for seed in args.seeds:
        for policy in args.policies:
            if diffs := run_differences(args, policy, seed):
                parser.error(f"{run_path(Path(args.out_work), policy, seed, args.seeds)} holds a run of other settings "
                             f"({'; '.join(diffs)}): pass --overwrite to run it again with these, or give this "
                             f"sweep its own --out")


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__, "outputs/convergence.jsonl")
    parser.add_argument("--preset", default="qwen3-30b-a3b-debug", help="model preset of every run (lrmoe.config)")
    parser.add_argument("--policies", nargs="+", default=None, type=system_arg,
                        help="systems trained, one run each per seed; default: the full grid (--quick: the quick "
                             "grid); " + SYSTEMS_HELP)
    parser.add_argument("--ranks", type=positive_int_arg, default=4, help="ranks of every run")
    parser.add_argument("--steps", type=positive_int_arg, default=200, help="training steps per run")
    parser.add_argument("--batch", type=positive_int_arg, default=4, help="sequences per rank per step")
    parser.add_argument("--lr-schedule", choices=("constant", "cosine"), default="cosine",
                        help="every run's schedule (train.py): 'cosine' decays to a tenth of the lr at the last "
                             "step, so the curves have flattened by then")
    parser.add_argument("--warmup", type=non_negative_int_arg, default=10, help="warm-up steps of the cosine schedule")
    parser.add_argument("--seq-len", type=positive_int_arg, default=64, help="tokens per sequence")
    parser.add_argument("--micro-batches", type=positive_int_arg, default=1, help="train.py's: micro-batches per step")
    parser.add_argument("--engine", choices=("distributed", "emulated"), default="distributed",
                        help="train.py's: gloo ranks, or the emulated engine's in-process ranks (docs/emulated.md)")
    parser.add_argument("--activation-checkpointing", action="store_true", help="train.py's: recompute activations")
    parser.add_argument("--eval-every", type=positive_int_arg, default=20, help="steps between validation losses")
    parser.add_argument("--eval-batches", type=positive_int_arg, default=4,
                        help="validation batches per rank per evaluation (the frontier protocol's 16: "
                             "docs/protocols/frontier.md §10.3)")
    parser.add_argument("--seed", type=int, default=0, help="one seed (ignored when --seeds is given)")
    parser.add_argument("--seeds", type=non_negative_int_arg, nargs="+", default=None,
                        help="several seeds, one run each")
    parser.add_argument("--target-step", type=positive_int_arg, default=None,
                        help="the equal-quality table's step T (default: the last step)")
    parser.add_argument("--extra-slots", type=non_negative_int_arg, default=1,
                        help="replica slots per rank for SYMI (and LRMoE)")
    parser.add_argument("--lrmoe-extra-slots", type=non_negative_int_arg, default=0,
                        help="LRMoE's replica slots per rank (default 0: the memory-constrained case, where the "
                             "backward quotas, not replicas, bound the hot rank)")
    parser.add_argument("--lrmoe-eps", type=non_negative_float_arg, default=0.0,
                        help="LRMoE's balance slack: backward cap (1 + eps) x the mean forward load (cap mode)")
    parser.add_argument("--aux-coef", type=float, default=0.1,
                        help="load-balancing loss weight (lower: more routing skew, more for LRMoE to trim)")
    parser.add_argument("--ckpt-every", type=non_negative_int_arg, default=20,
                        help="steps between each run's checkpoints (0: none; a killed sweep resumes from them)")
    parser.add_argument("--quick", action="store_true", help="one seed, 40 steps, batch 2, the quick grid")
    parser.add_argument("--quiet", action="store_true", help="no progress bars from the runs")
    parser.add_argument("--slim", action="store_true",
                        help="leave the per-layer load statistics (load/*, three quarters of a record) out of the "
                             "aggregate results file; the per-run files keep them")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_tracking_args(parser, args, "convergence")
    if args.quick:
        args.steps, args.eval_every, args.batch = 40, 10, 2
        args.seeds = args.seeds or [args.seed]
    args.policies = args.policies or (QUICK_POLICIES if args.quick else POLICIES)
    args.seeds = list(dict.fromkeys(args.seeds or [args.seed]))
    args.out_work = str(Path(args.out).with_suffix(""))  # per-run results, checkpoints and traces
    check_identities(parser, args)
    return args


def protocol_claims(curves: pd.DataFrame) -> pd.DataFrame | None:
    """The claim table of docs/protocols/frontier.md §10.4 over these runs (each run's endpoint: the mean validation
    loss over its last three evaluations; the reference: the mean of static EP and SYMI-dropless, seed by seed; whole
    seeds only), or None without both references. Claims whose arms did not run are listed as "not run"."""
    from lrmoe.analysis.claims import claim_table, gap_table
    from lrmoe.analysis.protocol import REFERENCES, endpoint

    val = curves.dropna(subset=["val_loss"]).sort_values("step")
    last = int(curves.step.max())
    rows = [{"seed": int(seed), "arm": policy, "endpoint": endpoint(run.step, run.val_loss, last_step=last)}
            for (policy, seed), run in val.groupby(["policy", "seed"], sort=False)]
    if not all(any(r["arm"] == ref for r in rows) for ref in REFERENCES):
        return None
    return claim_table(gap_table(rows))


def plot(run):
    """Validation loss at equal steps and at equal modelled time, drawn from the results file
    (lrmoe.paper_figures.run_figures.curves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lrmoe.paper_figures.run_figures import curves

    fig, _ = curves(run.results)
    paths = run.log_figure("curves", fig)
    plt.close(fig)
    return paths


def main(argv=None) -> pd.DataFrame:
    args = parse_args(argv)
    import pandas as pd

    from lrmoe.analysis.runs import last_per_step, per_run, summarise, time_to_reach
    from lrmoe.integrations.tracking import Tracker

    out = Path(args.out)
    work = Path(args.out_work)
    runs = {(policy, seed): train_argv(args, policy, seed, run_path(work, policy, seed, args.seeds))
            for seed in args.seeds for policy in args.policies}
    check_runs(args)  # before the first run trains
    with Tracker("convergence", vars(args), results=out, seed=args.seeds[0], overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        frames = []
        for (policy, seed), run_argv in runs.items():
            results = run_path(work, policy, seed, args.seeds)
            if not finished(args, policy, seed):
                train(run_argv)
            frame = pd.DataFrame(last_per_step(read_results(results)))
            frame["seed"] = seed
            frame["time_s"] = frame.modelled_s.cumsum()
            frames.append(frame)
            for rec in frame.to_dict("records"):
                run.log({k: v for k, v in rec.items() if k not in ("run_id", "kind") and v == v
                         and not (args.slim and k.startswith("load/"))}, step=None)
        curves = pd.concat(frames, ignore_index=True)
        table, reach = summarise(curves), time_to_reach(curves, args.target_step)
        claims = protocol_claims(curves)
        run.log_summary({"table": table.to_dict("records"), "per_run": per_run(curves).to_dict("records"),
                         "time_to_reach": reach.to_dict("records"),
                         "claims": None if claims is None else claims.to_dict("records")})
        figure = plot(run)
        print("Equal quality: the step and modelled time at which each system first reaches static EP's "
              "validation loss at step T (mean over the seeds that reach it)\n")
        print(reach.to_markdown(index=False, floatfmt=".3f"))
        print(f"\nFinal validation loss over seeds {args.seeds}; gap to dropless static EP seed by seed (%)\n")
        print(table[["policy", "seeds", "steps", "val_loss", "val_loss_std", "gap_pct", "gap_pct_min", "gap_pct_max",
                     "last20_drop_pct", "hot_rank_bwd_cut_pct", "dropped_pct", "modelled_ms_per_step"]]
              .to_markdown(index=False, floatfmt=".3f"))
        if claims is not None:
            print("\nClaims (docs/protocols/frontier.md §10.4; endpoint: mean of the last three evaluations; gaps to "
                  "the mean of static EP and SYMI-dropless; estimates in points, 95 % intervals, Holm-adjusted p)\n")
            cols = ["claim", "seeds", "estimate", "ci_low", "ci_high", "bound_high", "p_holm", "word"]
            print(claims[[c for c in cols if c in claims.columns]].to_markdown(index=False, floatfmt=".3f"))
        print(f"results: {out}; figure: {figure[0]}; recorded traces in {work}")
        (work / "summary.json").write_text(json.dumps(table.to_dict("records"), indent=1))
    return table


if __name__ == "__main__":
    main()
