"""The main job: run every experiment stage, then regenerate the figures, and write a Markdown summary.

    python experiments/reproduce.py --mode quick      # minutes on a 2-core CPU
    python experiments/reproduce.py --mode full       # the full sweeps (hours on a CPU)

Outputs go to outputs/<mode>/: one results file (JSON lines) per stage, its figures, the W&B offline runs and
SUMMARY.md. An existing output folder is never overwritten: pass --overwrite to start again, or --resume to
skip the stages that completed and run the rest.

A killed job resumes cleanly. A stage is complete only when its end marker (``<stage>.done``, holding the stage's
part of the summary) exists: it is written atomically after the stage exited cleanly. SUMMARY.md is the job's own
end marker, removed when a run starts and written (atomically) last. ``--resume`` reruns every stage without a
marker with ``--resume``: the stage's tracker then supersedes what the killed attempt left in its results file
(lrmoe.tracking) and continues from the stage's checkpoints, if it has any. So a half-written results file is
never read as complete and never read twice. A stage's process dies with the main job: no orphan keeps writing.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from lrmoe.tracking import atomic_write_text

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Stage:
    name: str
    script: str
    quick: list[str] = field(default_factory=list)
    full: list[str] = field(default_factory=list)
    table: int = -1  # which Markdown table of the stage's output goes into the summary (its headline)


STAGES = [
    Stage("trace_stats", "experiments/trace_stats.py",
          quick=["--steps", "10", "--layers", "4"], full=["--steps", "100", "--layers", "48"]),
    Stage("metric_fidelity", "experiments/metric_fidelity.py", quick=[], full=["--draws", "16", "--tokens", "2048"],
          table=-2),
    Stage("ablate", "experiments/ablate.py", quick=["--quick"], full=[]),
    Stage("convergence", "experiments/convergence.py", quick=["--quick"],
          full=["--seeds", "0", "1", "2", "--steps", "300", "--eval-every", "15"]),
    # time (paper-scale simulator) against loss (the convergence runs): the retention budget's frontier
    Stage("frontier", "experiments/frontier.py", quick=["--quick", "--convergence", "{out}/convergence.jsonl"],
          full=["--convergence", "{out}/convergence.jsonl"]),
    # the real layer on synthetic traces and on the routing recorded by the convergence run's dropless policy
    Stage("layer_bench", "experiments/layer_bench.py",
          quick=["--trace", "{out}/convergence/trace_static-ep.npz"],
          full=["--steps", "20", "--trace", "{out}/convergence/trace_static-ep.npz"]),
    # the cost model's per-phase predictions against the layer benchmark's measured times (CPU calibration)
    Stage("validate_sim", "experiments/validate_sim.py", quick=["--quick", "--bench", "{out}/layer_bench.jsonl"],
          full=["--bench", "{out}/layer_bench.jsonl"]),
    # memory-constrained: no spare replica slot, so the backward quotas do the balancing
    Stage("layer_bench_constrained", "experiments/layer_bench.py",
          quick=["--spare-slots", "0", "--skew-param", "0.8", "--policies", "static-ep", "symi-dropless", "lrmoe",
                 "lrmoe-random"],
          full=["--spare-slots", "0", "--steps", "20", "--policies", "static-ep", "symi-dropless", "lrmoe-m1",
                "lrmoe", "lrmoe-m1-unbiased", "lrmoe-random"]),
]


def markdown_tables(text: str, which: int = -1) -> str:
    """The ``which``-th Markdown table a stage printed (default the last: experiments print the headline last)."""
    blocks, current = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
        elif current:
            blocks.append(current)
            current = []
    if current:
        blocks.append(current)
    return "\n".join(blocks[which]) if len(blocks) >= abs(which) else ""


def _die_with(parent: int) -> None:
    """Run in a stage's process before it starts: have the kernel SIGKILL it when the main job dies (Linux's
    parent-death signal), so a killed job leaves no stage writing into its folder."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the main job died before the signal was armed
        os._exit(1)


def run_stage(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    """Run one stage's command, its stdout captured (the summary takes its tables), stderr passed through."""
    die = functools.partial(_die_with, os.getpid()) if sys.platform.startswith("linux") else None
    return subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=None, text=True, preexec_fn=die)


def stage_complete(out: Path, stage: Stage) -> bool:
    """A stage is complete when its end marker and its results file both exist."""
    return (out / f"{stage.name}.done").is_file() and (out / f"{stage.name}.jsonl").is_file()


def main(argv=None, stages: list[Stage] | None = None) -> int:
    """Run the main job (``stages``: default :data:`STAGES`); returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["quick", "full"], default="quick")
    parser.add_argument("--out-dir", default=None, help="default: outputs/<mode>")
    parser.add_argument("--overwrite", action="store_true", help="delete an existing output folder first")
    parser.add_argument("--resume", action="store_true",
                        help="skip the stages that completed; redo the others, superseding what they left")
    parser.add_argument("--only", nargs="*", help="run only these stages")
    args = parser.parse_args(argv)
    stages = STAGES if stages is None else stages
    out = Path(args.out_dir or ROOT / "outputs" / args.mode)
    if out.exists() and any(out.iterdir()):
        if args.overwrite:
            shutil.rmtree(out)
        elif not args.resume:
            sys.exit(f"error: {out} holds the results of an earlier run; pass --overwrite to replace them or "
                     f"--resume to finish the stages that did not complete")
    out.mkdir(parents=True, exist_ok=True)
    (out / "SUMMARY.md").unlink(missing_ok=True)  # the job's end marker: present only once this run completes
    # each stage starts its own W&B service, which dies with it: none that outlives a killed stage (one this job
    # inherited) keeps the stage's W&B run open, so the resumed stage can continue that run
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env.update(WANDB_DIR=str(out), MPLBACKEND="Agg", PYTHONPATH=str(ROOT))
    summary = [f"# lrmoe reproduction ({args.mode} mode)", ""]
    started = time.time()
    for stage in stages:
        if args.only and stage.name not in args.only:
            continue
        results = out / f"{stage.name}.jsonl"
        done = out / f"{stage.name}.done"
        if stage_complete(out, stage):
            print(f"== {stage.name}: complete, skipped (--resume)")
            summary += [f"## {stage.name}", "", done.read_text(), ""]
            continue
        done.unlink(missing_ok=True)
        extra = [a.format(out=out) for a in (stage.quick if args.mode == "quick" else stage.full)]
        cmd = [sys.executable, str(ROOT / stage.script), "--out", str(results), *extra]
        if results.exists():  # an interrupted stage: its tracker supersedes what the killed attempt left
            cmd.append("--resume")
        print(f"== {stage.name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.time()
        proc = run_stage(cmd, env)
        print(proc.stdout, end="", flush=True)
        if proc.returncode:
            print(f"error: stage {stage.name} failed with exit status {proc.returncode}", file=sys.stderr)
            return proc.returncode
        section = f"{markdown_tables(proc.stdout, stage.table)}\n\n({time.time() - t0:.0f} s; results: {results.name})"
        atomic_write_text(done, section)
        summary += [f"## {stage.name}", "", section, ""]
    if not args.only or "figures" in args.only:
        from lrmoe.paper_figures import make_all

        print("== figures", flush=True)
        made = make_all.make_all(out, out / "figures")
        summary += ["## figures", "", *[f"* {name}: {paths[0].relative_to(out)}" for name, paths in made.items()], ""]
    summary.append(f"Total wall time: {time.time() - started:.0f} s.")
    atomic_write_text(out / "SUMMARY.md", "\n".join(summary) + "\n")
    print("\n".join(summary))
    print(f"\nOutputs in {out}: SUMMARY.md, one results file per stage, figures (PNG + PDF); "
          f"W&B offline runs in {out / 'wandb'} (upload with `wandb sync {out / 'wandb'}/offline-run-*`).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
