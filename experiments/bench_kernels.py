"""Benchmark the kernels of ``lrmoe.kernels``: compaction and the variable-size grouped GEMM.

CPU part (always; the torch path, which the layers use on CPU):
  * compaction: pack / unpack bandwidth as a fraction of a plain copy of the same bytes;
  * grouped GEMM: forward, dX and dW throughput as a fraction of one dense matmul of the same FLOPs;
  * a small check that the interpreted Triton kernels agree with the torch path.
GPU part (only when CUDA is available; compiled Triton):
  * compaction: effective bandwidth as a fraction of the HBM peak (goal >= 0.8) and of a device copy;
  * grouped GEMM in bf16: Triton throughput against torch's grouped_mm (goal >= 0.9) and a dense matmul;
  * correctness of the bf16 paths against torch.
Every ratio compares two measurements of the same run (interleaved repeats, medians).

    python experiments/bench_kernels.py                        # -> outputs/bench_kernels.jsonl
    python experiments/bench_kernels.py --quick --overwrite    # smaller shapes, fewer repeats
"""

from __future__ import annotations

import argparse

# The parser needs only these light modules; torch and the kernels load in the functions that measure
# (lrmoe.harness.kernel_bench: the measurements; lrmoe.harness.kernel_bench_run: the run, its summary and tables).
from lrmoe.cli import positive_float_arg, positive_int_arg
from lrmoe.cli import script_parser
from lrmoe.integrations.tracking_args import check_tracking_args


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__, "outputs/bench_kernels.jsonl")
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats")
    parser.add_argument("--repeats", type=positive_int_arg, default=None,
                        help="timed repeats per measurement, median reported (default 11; --quick 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic routing and weights")
    parser.add_argument("--threads", type=positive_int_arg, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--skip-gpu", action="store_true", help="CPU part only, even with a GPU")
    parser.add_argument("--hbm-peak-gbs", type=positive_float_arg, default=None,
                        help="HBM peak in GB/s (default: from the GPU name via the cluster presets)")
    return parser


def main(argv=None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_tracking_args(parser, args, "bench_kernels")
    from lrmoe.harness.kernel_bench import interpret_without_gpu

    interpret_without_gpu()
    import torch

    from lrmoe.harness.kernel_bench_run import report, run_parts, summarise
    from lrmoe.integrations.tracking import Tracker

    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (5 if args.quick else 11)
    gpu = torch.cuda.is_available() and not args.skip_gpu
    log: list[dict] = []
    with Tracker("bench_kernels", config=vars(args), results=args.out, overwrite=args.overwrite,
                 resume=args.resume, seed=args.seed, wandb=not args.no_wandb) as run:
        run_parts(run, log, seed=args.seed, repeats=repeats, quick=args.quick, gpu=gpu,
                  hbm_peak_gbs=args.hbm_peak_gbs)
        summary = summarise(log, gpu)
        run.log_summary(summary)
    report(log, summary, gpu)
    return log


if __name__ == "__main__":
    main()
