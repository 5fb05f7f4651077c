"""Peak memory of one training step with and without activation checkpointing, on gloo CPU ranks.

Each configuration runs in fresh ranks: the model of ``experiments/train.py`` (lrmoe's own, or HF's with
--hf-config) is built, one step warms it up, then each measured step starts from a clean slate (garbage collected,
freed heap returned to the system with ``malloc_trim``, the kernel's peak-RSS mark reset through
``/proc/self/clear_refs``) and its memory is the rank's peak resident set during the step minus its resident set
before it: the activations, gradients and buffers the step adds on top of the weights and optimizer state.
Reported: the median over the measured steps of the largest rank's figure, per configuration, and the ratio.
Linux only (``/proc``, glibc).

    python experiments/checkpoint_memory.py --preset qwen3-30b-a3b-debug --batch 8 --seq-len 256 --no-wandb
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from lrmoe.experiments import train
from lrmoe.integrations.tracking import Tracker, add_tracking_args
from lrmoe.runtime.distributed.launch import launch


def _kib(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS: resident now; VmHWM: the peak since the last reset)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _clean_slate() -> int:
    """Free what can be freed, reset the peak-RSS mark; the resident bytes now."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to VmRSS (Linux >= 4.0)
    return _kib("VmRSS")


def _rank(rank: int, train_argv: list[str], steps: int, seed: int) -> list[int]:
    args = train.parse_args(train_argv)
    torch.manual_seed(args.seed)
    _, run, _ = train.build(args, dist.get_world_size(), torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    vocab = run.cfg.vocab_size if hasattr(run, "cfg") else run.model.config.vocab_size
    extra = []
    for step in range(steps + 1):  # the first step warms up (lazy allocations, optimizer state)
        x = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=gen)
        base = _clean_slate()
        run.train_step(x[:, :-1], x[:, 1:])
        if step:
            extra.append(_kib("VmHWM") - base)
    return extra


def measure(args, checkpointing: bool) -> dict:
    """One configuration in fresh ranks: per measured step, the largest rank's peak bytes above its baseline."""
    model = ["--hf-config", args.hf_config] if args.hf_config else ["--preset", args.preset]
    argv = [*model, "--policy", args.policy, "--batch", str(args.batch), "--seq-len", str(args.seq_len),
            "--micro-batches", str(args.micro_batches), "--cost-model", "", "--seed", str(args.seed),
            *(["--activation-checkpointing"] if checkpointing else [])]
    per_rank = launch(_rank, args.ranks, argv, args.steps, args.seed, timeout_s=args.timeout)
    step_max = [max(r[i] for r in per_rank) for i in range(args.steps)]
    return {"activation_checkpointing": checkpointing, "median_peak_mib": statistics.median(step_max) / 2**20,
            "min_peak_mib": min(step_max) / 2**20, "max_peak_mib": max(step_max) / 2**20, "steps": args.steps}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-30b-a3b-debug", help="the model preset of lrmoe's own model")
    parser.add_argument("--hf-config", default=None, help="HF's architecture instead (train.py's --hf-config)")
    parser.add_argument("--policy", default="lrmoe")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="measured steps per configuration (after one warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    add_tracking_args(parser, "outputs/checkpoint_memory.jsonl")
    args = parser.parse_args(argv)
    for name in ("ranks", "batch", "seq_len", "micro_batches", "steps"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not sys.platform.startswith("linux"):
        parser.error("the measurement reads /proc/self (Linux only)")
    rows = []
    with Tracker("checkpoint_memory", config=vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                 resume=args.resume, wandb=not args.no_wandb) as run:
        for checkpointing in (False, True):
            row = measure(args, checkpointing)
            run.log(row)
            rows.append(row)
            print(f"activation checkpointing {'on ' if checkpointing else 'off'}: peak above baseline "
                  f"{row['median_peak_mib']:.1f} MiB (median of {args.steps} steps; "
                  f"{row['min_peak_mib']:.1f}-{row['max_peak_mib']:.1f})")
        ratio = rows[1]["median_peak_mib"] / rows[0]["median_peak_mib"]
        run.log_summary({"peak_ratio_on_over_off": ratio})
        print(f"ratio on / off: {ratio:.2f}; results: {args.out}")
    return rows


if __name__ == "__main__":
    main()
