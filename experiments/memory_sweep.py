"""Where memory binds: every system simulated at a grid of per-rank MoE budgets, from the smallest that holds the
E/N home slots beside the buffers of the mean load up to 80 GB (lrmoe.sim.memory_sweep.budget_grid: one point per
replica slot's worth of memory while systems can still gain one, then coarse ones). Per budget, each system's
slots per rank, peak memory, time per iteration (with the sensitivity band) and whether it fits; then the budget
range where memory binds, each system's out-of-memory line, and each placement (LRMoE's, online's, SYMI's) without
and with the retention budget rho side by side.

    python experiments/memory_sweep.py                 # both models on two 8-GPU nodes, both frontier regimes
    python experiments/memory_sweep.py --quick         # the main job's: Qwen3, the weak regime, three budgets
    python experiments/memory_sweep.py --resume        # continue a killed sweep from its last finished group
    python experiments/memory_sweep.py --skews zipf:0.2 zipf:0.8   # the earlier record's skews instead

Skews: by default (``--regimes``) the frontier protocol's regimes (docs/protocols/frontier.md §10.1), each at the Zipf s
matched to its static-EP training runs (``--runs``, default the protocol's sweep) by lrmoe.analysis.skew.regime_zipf,
the skew the frontier's time axis uses (over the sweep's 16 seeds: production 0.146, weak 0.419); only the skew is the
regime's (the slots stay memory-sized: that is what the sweep varies). The headline's quality column is each arm's
gap claim in that regime, decided from the same runs (lrmoe.analysis.claims.arm_quality), and a third headline row
names the fastest arm whose claim holds: LRMoE's time at equal quality where memory binds. ``--skews`` takes
family:param values instead: the earlier record ran Zipf 0.2 (low skew: Gini 0.10, hottest expert 2.1x the mean) and
Zipf 0.8 (high skew: Gini 0.50, 14.6x; DESIGN.md §5.7). Each (model, skew) is one run of experiments/ablate.py
(its command line, in this process), over every budget of the grid (the same systems, memory model, headroom rule,
overheads and sensitivity corners, priced at every budget), on fewer layers (``--layers``: their mean stands for the
rest) and iterations than the ablation to afford the grid; its results file goes to ``--work-dir``, and with
``--resume`` a finished one is read, not run again. Traces are synthetic.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING

# The parser needs only these light modules; the simulator (torch), the analysis (pandas, SciPy) and matplotlib load
# in the functions that sweep, judge and draw.
from lrmoe.analysis import protocol
from lrmoe.cli import non_negative_int_arg, positive_float_arg, positive_int_arg
from lrmoe.cli import SYSTEMS_HELP, run_entry, script_parser, system_arg
from lrmoe.config import cluster_presets, model_presets
from lrmoe.integrations.tracking_args import check_tracking_args, foreign_results, output_problem
from lrmoe.results import read_records, read_results

if TYPE_CHECKING:
    import pandas as pd

    from lrmoe.integrations.tracking import Tracker

SYSTEMS = ["static-ep", "symi-cf1", "symi-dropless", "symi-dropless-rho0.75", "lrmoe", "lrmoe-rho0.75",
           "lrmoe-rho0.75-unbiased", "lrmoe-rho0.75-early", "lrmoe-rho0.75-early-unbiased", "online", "online-rho0.75",
           "online-greedy"]
MODELS = ["qwen3-30b-a3b", "glm-4.5-air"]
# the collected runs whose static-EP arm the regimes' skews match and whose claims give each arm's quality: the
# sweep's, as the frontier's time axis (experiments/frontier.py --regime); without --runs, the committed file
RUNS = "frontier_protocol_sweep.jsonl"  # in lrmoe.paper_figures.RESULTS_DIR


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    p = script_parser(__doc__, "outputs/memory_sweep.jsonl")
    p.add_argument("--quick", action="store_true",
                   help="a small sweep for the main job (Qwen3 at the weak regime's matched skew, 3 budgets)")
    p.add_argument("--models", nargs="+", default=MODELS, choices=model_presets(), help="model presets to sweep")
    p.add_argument("--cluster", default="a100-40gb-x8", choices=cluster_presets(),
                   help="cluster preset (its node is replicated)")
    p.add_argument("--nodes", type=positive_int_arg, default=2, help="nodes of the cluster (ranks: nodes x its node's)")
    p.add_argument("--skews", nargs="+", default=None, type=skew_text,
                   help="routing skews, family:param as experiments/ablate.py takes them, instead of --regimes")
    p.add_argument("--regimes", nargs="+", choices=list(protocol.REGIMES), default=None,
                   help="the frontier regimes' matched Zipf skews (from --runs); default every regime (quick: weak)")
    p.add_argument("--runs", default=None,
                   help="the protocol's collected runs that --regimes match their skew to (default: the committed "
                        f"sweep, paper_figures/results/{RUNS} of the checkout)")
    p.add_argument("--max-gb", type=positive_float_arg, default=80.0, help="largest per-rank MoE budget")
    p.add_argument("--step-gb", type=positive_float_arg, default=None,
                   help="budget step while systems gain replicas (default: one replica slot's worth per model)")
    p.add_argument("--coarse-step-gb", type=positive_float_arg, default=10.0,
                   help="budget step beyond that, up to --max-gb")
    p.add_argument("--saturate-load", type=positive_float_arg, default=1.5,
                   help="the fine steps end where E/N spare slots fit beside buffers for this x the mean load (>= 1)")
    p.add_argument("--mem-gb", nargs="+", type=positive_float_arg, default=None,
                   help="these budgets instead of the grid")
    p.add_argument("--systems", nargs="+", type=system_arg, default=SYSTEMS, help=f"systems to price; {SYSTEMS_HELP}")
    p.add_argument("--layers", type=positive_int_arg, default=4,
                   help="simulated MoE layers per cell (their mean stands for all)")
    p.add_argument("--steps", type=positive_int_arg, default=3, help="iterations per cell (the first is warm-up)")
    p.add_argument("--micro-batches", type=positive_int_arg, default=8, help="micro-batches per iteration")
    p.add_argument("--no-band", action="store_true", help="skip the sensitivity corners")
    p.add_argument("--seed", type=non_negative_int_arg, default=0, help="seed of the synthetic traces")
    p.add_argument("--work-dir", default=None,
                   help="experiments/ablate.py's results file of each (model, skew) goes here (default: beside --out, "
                        "the folder named for it: outputs/memory_sweep for outputs/memory_sweep.jsonl)")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    from lrmoe.analysis.claims import arm_quality
    from lrmoe.analysis.skew import regime_zipf

    check_tracking_args(p, args, "memory_sweep", report=True)  # never over a results file or a user's notes
    if args.regimes and args.skews:
        p.error("--regimes and --skews are exclusive")
    if not (args.regimes or args.skews):
        args.regimes = ["weak"] if args.quick else list(protocol.REGIMES)
    args.regime_of = {}  # skew -> (regime, its label)
    args.quality = {}  # regime label -> arm -> its quality claim under the protocol (lrmoe.analysis.claims.arm_quality)
    if args.regimes:
        try:
            runs = runs_file(args.runs)
            rows = read_records(runs)
            if not rows:
                raise ValueError(f"{runs} holds no collected runs (experiments/frontier_sweep.py writes them)")
            for name in args.regimes:
                s = regime_zipf(rows, name).zipf_s
                label = f"{name}, zipf:{s:.3f}"
                args.regime_of[f"zipf:{s!r}"] = (name, label)
                args.quality[label] = arm_quality(rows, name)
        except (ValueError, KeyError) as exc:
            p.error(f"--runs: {exc}")
        args.skews = list(args.regime_of)
    if args.quick:
        args.models = ["qwen3-30b-a3b"] if args.models == MODELS else args.models
        args.layers, args.steps, args.no_band = min(args.layers, 2), 2, True
    if args.steps < 2:
        p.error(f"--steps must be at least 2 (the first is warm-up), got {args.steps}")
    if not args.saturate_load >= 1:
        p.error(f"--saturate-load must be at least 1, got {args.saturate_load}")
    args.work_dir = str(work_dir(args.out, args.work_dir))
    if problem := output_problem("--work-dir", Path(args.work_dir) / "x.jsonl", replace=True):
        p.error(problem.replace("/x.jsonl", ""))
    for model in args.models:
        for skew in args.skews:
            group = group_path(args, model, skew)
            if not group.is_file():
                continue
            if not (args.resume or args.overwrite):
                p.error(f"{group} exists; pass --resume to reuse or continue it, or --overwrite to redo it")
            if problem := foreign_results(group, "ablate"):  # only the ablation's own results are reused or redone
                p.error(problem.replace("--out", "--work-dir"))
    return args


def runs_file(runs: str | None) -> Path:
    """The collected runs ``--regimes`` reads: ``--runs`` as given (relative to the working directory), else the
    committed sweep, found from the package (lrmoe.paper_figures.RESULTS_DIR), never from the working directory.
    ValueError naming the file when it is not there (an install without the checkout's committed results)."""
    from lrmoe.paper_figures import RESULTS_DIR

    if runs is not None:
        if not Path(runs).is_file():
            raise ValueError(f"{runs!r} is not a file")
        return Path(runs)
    path = RESULTS_DIR / RUNS
    if not path.is_file():
        raise ValueError(f"the committed runs {path} are not there (they come with a checkout of the repository, "
                         "not with an installed package): pass --runs FILE, or --skews instead of --regimes")
    return path


def work_dir(out: str, given: str | None) -> Path:
    """``--work-dir`` as given, else the folder beside ``--out`` named for it (``outputs/memory_sweep`` for
    ``outputs/memory_sweep.jsonl``): under the main job, inside the job's output folder (experiments/reproduce.py
    counts ``<stage>/`` among the stage's outputs)."""
    if given is not None:
        return Path(given)
    out = Path(out)
    return out.with_suffix("") if out.suffix else out.with_name(f"{out.name}_groups")


def skew_text(value: str) -> str:
    """A ``--skews`` value as ablate.py takes it (``family:number``, zipf or dirichlet; a bare number is Zipf s),
    checked here so that a bad one fails before any group runs."""
    family, _, param = value.rpartition(":")
    try:
        number = float(param)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: expected family:number, e.g. zipf:0.8") from None
    if (family or "zipf") not in ("zipf", "dirichlet") or not math.isfinite(number):
        raise argparse.ArgumentTypeError(f"{value!r}: expected zipf:<s> or dirichlet:<alpha> with a finite number")
    return value


def group_path(args, model: str, skew: str) -> Path:
    """The ablation results file of one (model, skew) group, in ``--work-dir``."""
    return Path(args.work_dir) / f"{Path(args.out).stem}_{model}_{skew.replace(':', '')}.jsonl"


def ablate_argv(args, model: str, skew: str, mem_gb: list[float], out: Path) -> list[str]:
    """experiments/ablate.py's arguments for one (model, skew) over its budgets: its defaults (memory model, headroom
    rule, overheads), the sensitivity corners priced at every budget."""
    return ["--models", model, "--cluster", args.cluster, "--ranks", str(args.nodes * 8), "--skews", skew,
            "--mem-gb", *[f"{b:g}" for b in mem_gb], "--steps", str(args.steps), "--layers", str(args.layers),
            "--micro-batches", str(args.micro_batches), "--systems", *args.systems, "--band-every-budget",
            "--seed", str(args.seed), "--no-wandb", "--out", str(out), *(["--no-band"] if args.no_band else []),
            *(["--overwrite"] if args.overwrite and out.exists() else ["--resume"] if out.exists() else [])]


def finished(path: Path) -> bool:
    """Whether an ablation results file holds a finished run (its summary, written last)."""
    try:
        return bool(read_results(path, "summary"))
    except FileNotFoundError:
        return False


def simulate_group(args, model: str, skew: str, out: Path) -> list[dict]:
    """One (model, skew) over its budgets: experiments/ablate.py's command line, in this process through its entry
    point (lrmoe.cli.run_entry), unless its results file is finished; its records. A failed simulation fails the
    sweep, naming the ablation run."""
    if args.overwrite or not finished(out):  # (parse_args checked that an existing one is the ablation's)
        from lrmoe.experiments import ablate
        from lrmoe.sim.memory_sweep import budgets

        run_entry("memory_sweep.py", "ablate.py", ablate.cli,
                  ablate_argv(args, model, skew, budgets(args, model), out))
    return [r for r in read_results(out) if "system" in r]


def plot(run: Tracker) -> list:
    """Time per iteration and slots per rank against the budget, drawn from the results file
    (lrmoe.paper_figures.sim_figures.time_vs_memory); none where no system fits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lrmoe.paper_figures import sim_figures
    from lrmoe.paper_figures.reading import CannotDraw

    try:
        fig, _ = sim_figures.time_vs_memory(run.results)
    except CannotDraw:
        return []
    paths = run.log_figure("time_vs_memory", fig)
    plt.close(fig)
    return paths


def main(argv=None) -> pd.DataFrame:
    args = parse_args(argv)
    import pandas as pd
    from tqdm import tqdm

    from lrmoe.analysis.memory_sweep_report import report
    from lrmoe.integrations.reports import write_report
    from lrmoe.integrations.tracking import Tracker
    from lrmoe.sim.memory_sweep import budgets

    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    groups = [(m, skew) for m in args.models for skew in args.skews]
    config = {**vars(args), "budgets": {m: budgets(args, m) for m in args.models}}
    with Tracker("memory_sweep", config, results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        records = []
        for model, skew in tqdm(groups, desc="model x skew", disable=None):
            out = group_path(args, model, skew)
            for rec in simulate_group(args, model, skew, out):
                rec = {k: v for k, v in rec.items() if k not in ("kind", "run_id", "step")}
                if skew in args.regime_of:  # the regime names the skew in every table and panel
                    rec["regime"], rec["skew_label"] = args.regime_of[skew]
                run.log(rec)
                records.append(rec)
        text = report(records, run, args)
        print(text)
        write_report(run.results, text + "\n")
        figs = plot(run)
        print(f"\nresults: {args.out}" + (f"; figure: {figs[0]}" if figs else ""))
    return pd.DataFrame(records)


if __name__ == "__main__":
    main()
