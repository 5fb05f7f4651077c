"""Peak memory of a training step with and without activation checkpointing, on gloo CPU ranks.

Runs experiments/train.py (``python -m lrmoe.experiments.train``) twice, in fresh processes of their own: the same
model, data and system, once plain and once with --activation-checkpointing, both with --record-peak-rss (each step
starts from a clean slate: garbage collected, the freed heap returned to the system, the kernel's peak-RSS mark
reset; its figure is the largest rank's peak resident memory during the step minus its resident memory before it:
the activations, gradients and buffers the step adds on top of the weights and optimizer state,
lrmoe.harness.rss). The first step (warm-up: lazy allocations, optimizer state) is left out; reported are the
median, min and max over the other steps, and the ratio of the medians. Linux only.

    python experiments/checkpoint_memory.py --preset qwen3-30b-a3b-debug --batch 8 --seq-len 256 --no-wandb
    python experiments/checkpoint_memory.py --hf-config qwen3 --batch 8 --seq-len 256 --no-wandb
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from lrmoe.cli import positive_int_arg
from lrmoe.cli import SYSTEMS_HELP, script_parser, system_arg
from lrmoe.integrations.tracking import Tracker
from lrmoe.results import read_results

# train.py by its module name (as installed), in a fresh process: the peaks are of a process that has run nothing else
TRAIN = "lrmoe.experiments.train"


def train_argv(args, checkpointing: bool, out: Path) -> list[str]:
    model = ["--hf-config", args.hf_config] if args.hf_config else ["--preset", args.preset]
    return [*model, "--policy", args.policy, "--ranks", str(args.ranks), "--batch", str(args.batch),
            "--seq-len", str(args.seq_len), "--micro-batches", str(args.micro_batches), "--steps",
            str(args.steps + 1), "--seed", str(args.seed), "--cost-model", "", "--ckpt-every", "0",
            "--eval-every", str(args.steps + 1), "--eval-batches", "1", "--record-peak-rss", "--out", str(out),
            "--no-wandb", "--quiet", *(["--activation-checkpointing"] if checkpointing else [])]


def measure(args, checkpointing: bool, folder: Path) -> dict:
    """One configuration: train.py in a process of its own; the measured steps' peaks."""
    out = folder / f"checkpointing_{'on' if checkpointing else 'off'}.jsonl"
    argv = train_argv(args, checkpointing, out)
    code = subprocess.run([sys.executable, "-m", TRAIN, *argv]).returncode
    if code:
        raise SystemExit(f"checkpoint_memory.py: error: train.py {' '.join(argv)} exited with {code}")
    peaks = [r["peak_rss_mib"] for r in read_results(out) if r["step"] > 1]
    return {"activation_checkpointing": checkpointing, "median_peak_mib": statistics.median(peaks),
            "min_peak_mib": min(peaks), "max_peak_mib": max(peaks), "steps": len(peaks)}


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__, "outputs/checkpoint_memory.jsonl")
    parser.add_argument("--preset", default="qwen3-30b-a3b-debug", help="the model preset of lrmoe's own model")
    parser.add_argument("--hf-config", default=None, help="HF's architecture instead (train.py's --hf-config)")
    parser.add_argument("--policy", default="lrmoe", type=system_arg, help=f"the system trained; {SYSTEMS_HELP}")
    parser.add_argument("--ranks", type=positive_int_arg, default=2, help="gloo CPU rank processes")
    parser.add_argument("--batch", type=positive_int_arg, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=positive_int_arg, default=256, help="tokens per sequence")
    parser.add_argument("--micro-batches", type=positive_int_arg, default=1, help="micro-batches per step")
    parser.add_argument("--steps", type=positive_int_arg, default=5,
                        help="measured steps per configuration (after one warm-up)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the data order")
    return parser


def main(argv=None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("ranks", "batch", "seq_len", "micro_batches", "steps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not sys.platform.startswith("linux"):
        parser.error("the measurement reads /proc/self (Linux only)")
    rows = []
    with Tracker("checkpoint_memory", config=vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run, tempfile.TemporaryDirectory() as tmp:
        for checkpointing in (False, True):
            row = measure(args, checkpointing, Path(tmp))
            run.log(row)
            rows.append(row)
            print(f"activation checkpointing {'on ' if checkpointing else 'off'}: peak above the step's start "
                  f"{row['median_peak_mib']:.1f} MiB (median of {row['steps']} steps; "
                  f"{row['min_peak_mib']:.1f}-{row['max_peak_mib']:.1f})")
        ratio = rows[1]["median_peak_mib"] / rows[0]["median_peak_mib"]
        run.log_summary({"peak_ratio_on_over_off": ratio})
        print(f"ratio on / off: {ratio:.2f}; results: {args.out}")
    return rows


if __name__ == "__main__":
    main()
