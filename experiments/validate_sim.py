"""How far to trust the simulator: the cost model's per-phase predictions for the exact plans of a measured
``layer_bench.py`` run, against the times measured per phase, on a CPU "cluster" calibrated on this machine.

    python experiments/validate_sim.py --quick                       # runs a small layer_bench itself, < 1 min
    python experiments/validate_sim.py --bench outputs/layer_bench.jsonl
    python experiments/validate_sim.py --bench B.jsonl --calibration C.json   # reuse a calibration file
    python experiments/validate_sim.py --regimes production weak    # the frontier protocol's measured points

1. *Calibrate* (:mod:`lrmoe.harness.calibrate_cpu`): on as many forked gloo ranks as the benchmark had, at its D and F,
   time the layer's grouped-GEMM SwiGLU (forward and backward) vs rows, ``all_to_all_single`` vs bytes, and Adam;
   fit the cost model's GEMM curve, an all-to-all latency + bytes/bandwidth line and a memory bandwidth. Written
   as a JSON file with its provenance beside the results file; :func:`lrmoe.sim.cost.cpu_gloo_preset` reads it.
2. *Replay the plans* the benchmark ran, checked against every pair and byte it counted, and 3. *predict and
   compare* them per phase and rank, on the CPU clock (the headline) and the wall clock, each phase's time its
   slowest rank's median over steps (a collective by the wall clock: its fastest rank):
   :mod:`lrmoe.harness.sim_validation`, whose doc gives the statistics. Error = predicted / measured - 1 per
   (trace, policy, phase) cell, then its median over cells per phase and over all cells (target 4 of DESIGN.md §5.8:
   median |error| <= 20 %).

Measured points of the frontier protocol (``--regimes``, docs/protocols/frontier.md §10): per regime, ``layer_bench.py
--regime R`` (the regime's arms at its settings, the skew matched to its training runs), one calibration for all, and
the same replay and prediction, now of every phase the model prices; the table: per arm, the slowest rank's CPU time per
step (forward + backward, the bench's headline; also the covered phases alone, and the iteration with the optimizer
step), median over steps, ÷ SYMI-dropless's, measured beside modelled on the same plans, their difference, and where
the time goes per group of phases. A Markdown report beside the results file.

Phases the cost model does not cover, excluded and listed in the output: route, plan, permute, unpermute,
recalibrate, bwd_index_a2a, unpermute_bwd (and shared_fwd / shared_bwd, which the model covers but the layer does
not time). Times on this machine are noisy (2 cores shared by 4 ranks and whatever else runs): every number is a
median, the per-cell spread is large, and two runs of the same command differ by several points of error.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

# The parser needs only these light modules; the validation harness (lrmoe.harness.sim_validation and
# lrmoe.harness.sim_validation_run: torch, the simulator) and pandas load in the functions that calibrate, compare and
# report.
from lrmoe.analysis.protocol import REGIMES
from lrmoe.cli import positive_int_arg
from lrmoe.cli import run_entry, script_parser
from lrmoe.integrations.tracking_args import check_tracking_args

if TYPE_CHECKING:
    import pandas as pd

QUICK_BENCH = ["--quick", "--no-grad-error"]
REGIME_STEPS, REGIME_WARMUP = 32, 2  # --regimes: per arm; about 4 minutes a regime at layer_bench's default size
FULL_BENCH = ["--no-grad-error", "--policies", "static-ep", "capacity-cf1", "symi-cf1", "symi-dropless", "lrmoe-m1",
              "lrmoe-m2", "lrmoe-padded"]


def regimes_main(args) -> pd.DataFrame:
    """--regimes: run layer_bench at each regime's settings, calibrate once, price the same plans, report."""
    from tqdm import tqdm

    from lrmoe.harness.sim_validation import read_bench
    from lrmoe.harness.sim_validation_run import log_regime_points, regime_points, regime_report
    from lrmoe.integrations.reports import write_report
    from lrmoe.integrations.tracking import Tracker

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    benches = {r: read_bench(bench_path(args, r) if args.reuse_benches else run_bench(args, out.parent, r))
               for r in tqdm(args.regimes, desc="regimes", unit="regime")}
    shapes = {json.dumps({k: c[k] for k in ("model", "hidden", "ffn", "tokens_per_rank", "dtype", "world_size",
                                            "spare_slots")}, sort_keys=True) for c, _ in benches.values()}
    if len(shapes) != 1:
        raise SystemExit(f"validate_sim.py: error: the regimes' benches differ in shape ({shapes}): one calibration "
                         "cannot price them")
    first = next(iter(benches.values()))[0]
    cal_path, cal = calibration_file(args, first)
    table, groups, infos = regime_points(benches, cal_path, cal)
    config_out = {**vars(args), "benches": {r: str(bench_path(args, r)) for r in benches},
                  "calibration": str(cal_path)}
    with Tracker("validate_sim", config_out, results=out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        log_regime_points(run, table, groups, infos, cal, cal_path)
        import matplotlib.pyplot as plt

        from lrmoe.paper_figures.sim_figures import ratios

        fig, _ = ratios(run.results)
        figs = run.log_figure("ratios", fig)
        plt.close(fig)
    text = regime_report(table, groups, infos, cal_path, first, figs[0].name,
                         {r: REGIMES[r].description for r in infos})
    if isinstance(args.reuse_benches, str):  # a re-pricing: say whose measurements these are
        names = ", ".join(f"`{bench_path(args, r).name}`" for r in benches)
        source = Path(args.reuse_benches).name
        text = text.replace("\n", f"\n\nRe-priced: the measured side is the benchmarks of `{source}` ({names}), "
                            "measured earlier; the modelled side is the cost model of this commit.\n", 1)
    report = write_report(out, text)
    print(text)
    print(f"results: {out}; figure: {figs[0]}; report: {report}")
    return table


# -- the script --------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    p = script_parser(__doc__, "outputs/validate_sim.jsonl")
    p.add_argument("--bench", default=None, help="a layer_bench results file (default: run a small one first)")
    p.add_argument("--calibration", default=None,
                   help="reuse this CPU calibration file (default: measure, and write <out>_cpu_calibration.json)")
    p.add_argument("--quick", action="store_true", help="small benchmark and calibration, about a minute")
    p.add_argument("--seed", type=int, default=0, help="seed of the benchmark and the calibration")
    p.add_argument("--regimes", nargs="+", choices=list(REGIMES), default=None,
                   help="measured points of the frontier protocol: layer_bench --regime R for each (its arms at its "
                        "settings), one calibration, and per regime every arm's slowest-rank CPU time ÷ "
                        "SYMI-dropless's, measured beside modelled for the same plans (a Markdown report beside --out)")
    p.add_argument("--steps", type=positive_int_arg, default=REGIME_STEPS,
                   help="--regimes: measured iterations per arm (--quick: layer_bench's quick size)")
    p.add_argument("--runs", default=None,
                   help="--regimes: the protocol's collected runs the skew is matched to (default: layer_bench's)")
    p.add_argument("--reuse-benches", nargs="?", const=True, default=False, metavar="RESULTS",
                   help="--regimes: price the benchmarks an earlier run wrote beside its results file RESULTS "
                        "(default --out; <results>_layer_bench_<regime>.jsonl) instead of measuring again, e.g. "
                        "to re-price a committed measured point after a change to the cost model")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    outputs = {}
    if args.regimes:
        if args.bench:
            p.error("--regimes runs its own benchmarks: no --bench")
        args.regimes = list(dict.fromkeys(args.regimes))
        if args.reuse_benches:
            missing = [str(bench_path(args, r)) for r in args.regimes if not bench_path(args, r).is_file()]
            if missing:
                p.error(f"--reuse-benches: no earlier benchmark {', '.join(missing)}")
        else:
            outputs = {f"the {r} benchmark": bench_path(args, r) for r in args.regimes}
        if not args.calibration:
            outputs["the calibration"] = calibration_path(args)
    check_tracking_args(p, args, "validate_sim", outputs=outputs, report=bool(args.regimes))
    from lrmoe.harness.sim_validation import read_bench

    try:  # the inputs, read before anything is calibrated or measured
        if args.bench:
            read_bench(args.bench)
        for regime in (args.regimes or []) if args.reuse_benches else []:
            read_bench(bench_path(args, regime))
        if args.calibration:
            path = Path(args.calibration)
            if not path.is_file():
                raise ValueError(f"--calibration {str(path)!r} is not a file")
            json.loads(path.read_text())
    except (ValueError, KeyError, OSError, UnicodeDecodeError) as exc:
        p.error(f"{type(exc).__name__}: {exc}" if isinstance(exc, KeyError) else str(exc))
    return args


def bench_path(args, regime: str | None = None) -> Path:
    """Where the layer benchmark this script runs writes its results: beside --out, named for it (and the regime);
    with --reuse-benches RESULTS, where an earlier run wrote them beside RESULTS."""
    out = Path(args.reuse_benches if isinstance(args.reuse_benches, str) else args.out)
    return out.with_name(f"{out.stem}_layer_bench{f'_{regime}' if regime else ''}.jsonl")


def calibration_path(args) -> Path:
    out = Path(args.out)
    return out.with_name(f"{out.stem}_cpu_calibration.json")


def run_bench(args, out_dir: Path, regime: str | None = None) -> Path:
    """Run layer_bench (small, or at a regime's settings) into the output folder; returns its results file."""
    path = bench_path(args, regime)
    if regime:
        argv = ["--regime", regime, "--no-grad-error",
                *(["--quick"] if args.quick else ["--steps", str(args.steps), "--warmup", str(REGIME_WARMUP)]),
                *(["--runs", args.runs] if args.runs else [])]
    else:
        argv = QUICK_BENCH if args.quick else FULL_BENCH
    argv = [*argv, "--seed", str(args.seed), "--out", str(path)]
    argv += ["--overwrite"] if args.overwrite else ["--resume"] if args.resume else []
    argv += ["--no-wandb"] if args.no_wandb else []
    print(f"== layer_bench {' '.join(argv)}", flush=True)
    from lrmoe.experiments import layer_bench  # imports torch: here, not for --help

    # in this process, through its entry point (lrmoe.cli.run_entry); its ranks are processes of their own
    run_entry("validate_sim.py", "layer_bench.py", layer_bench.main, argv)
    return path


def calibration_file(args, config: dict) -> tuple[Path, dict]:
    """--calibration, else a calibration measured for the bench of ``config`` and written beside --out."""
    from lrmoe.harness.sim_validation_run import calibration_file as calibrated

    return calibrated(args.calibration, config, calibration_path(args), quick=args.quick, seed=args.seed,
                      overwrite=args.overwrite or args.resume)


def main(argv=None) -> pd.DataFrame:
    args = parse_args(argv)
    from lrmoe.harness.sim_validation import read_bench
    from lrmoe.harness.sim_validation_run import log_phase_validation, phase_validation, print_phase_report
    from lrmoe.integrations.tracking import Tracker

    if args.regimes:
        return regimes_main(args)
    out = Path(args.out)
    if out.exists() and not (args.overwrite or args.resume):  # fail before any benchmark runs
        raise FileExistsError(f"results file {out} exists; pass --overwrite to replace it or --resume to append")
    out.parent.mkdir(parents=True, exist_ok=True)
    bench_path = Path(args.bench) if args.bench else run_bench(args, out.parent)
    config, raw = read_bench(bench_path)
    cal_path, cal = calibration_file(args, config)
    v = phase_validation(config, raw, cal_path, cal)
    config_out = {**vars(args), "bench": str(bench_path), "calibration": str(cal_path)}
    with Tracker("validate_sim", config_out, results=out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        log_phase_validation(run, v, config, bench_path, cal_path)
        import matplotlib.pyplot as plt

        from lrmoe.paper_figures.sim_figures import predicted_vs_measured

        fig, _ = predicted_vs_measured(run.results)
        figs = run.log_figure("predicted_vs_measured", fig)
        plt.close(fig)
    print_phase_report(v, raw, cal_path, cal, out, figs[0])
    return v.table


if __name__ == "__main__":
    main()
