"""The main job: run every experiment stage, then regenerate the figures, and write a Markdown summary.

    python experiments/reproduce.py --mode quick      # minutes on a 2-core CPU
    python experiments/reproduce.py --mode full       # the full sweeps (hours on a CPU)

Outputs go to outputs/<mode>/ in the working directory (or --out-dir): one results file (JSON lines) per stage, its
figures, the W&B offline runs and SUMMARY.md. An existing output folder is never overwritten: pass --overwrite to
start again, or --resume to skip the stages that completed and run the rest.

Each stage is a script of lrmoe.experiments, run through its entry point (its ``cli``, else its ``main``;
lrmoe.cli.run_entry) in a process forked from the job, so that the job needs no script at a path of its own and the
import graph shows what it runs. Stages run one after the other, except a ``background`` stage (the paper-scale
simulator: deterministic, one thread), which runs beside the stages after it until a ``measured`` one (a benchmark
on this machine), which waits for it: nothing runs beside a measurement. A failed stage fails the job at once and
stops a running background one.

A killed job resumes cleanly. A stage is complete only when its end marker (``<stage>.done``, holding the stage's
part of the summary) exists: it is written atomically after the stage exited cleanly. SUMMARY.md is the job's own
end marker, removed when a run starts and written (atomically) last. ``--resume`` reruns every stage without a
marker with ``--resume``: the stage's tracker then supersedes what the killed attempt left in its results file
(lrmoe.integrations.tracking) and continues from the stage's checkpoints, if it has any. So a half-written results
file is never read as complete and never read twice. A stage's process dies with the main job: no orphan keeps writing.
Each stage runs in its own process group, which the job stops whole (the stage and the ranks it started) when it
fails, is interrupted or gets SIGTERM; a SIGKILLed job's stages get the kernel's parent-death signal.

What the job writes is recorded in the folder's manifest (``.reproduce.manifest.json``, lrmoe.results.Manifest),
stage by stage: each stage's results file, marker, figures, report, work folder and W&B runs (by run id), the
figures and SUMMARY.md. --overwrite removes exactly what the manifest lists for the stages it runs (``--only``: those
alone; the figures only when 'figures' runs), never anything else, and the job refuses to start where a file it did
not write lies under a name its stages write (``<stage>.*``, ``<stage>_*``, ``<stage>/``). --resume skips a
completed stage only when it ran with the same arguments as this run would give it; else it names the difference.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from lrmoe.cli import StageFailed, run_entry, script_parser
# what a stage is and writes, and the stages' scheduling, are the library's (light modules: no torch for --help)
from lrmoe.harness.job_schedule import Running, StageProcess, run_stages
from lrmoe.harness.job_stages import (Stage, account, argv_difference, stage_complete, stage_identity, stage_label,
                                      stage_outputs)
from lrmoe.integrations.tracking_args import folder_problem
from lrmoe.results import Manifest, atomic_write_text


STAGES = [
    Stage("trace_stats", "trace_stats",
          quick=["--steps", "10", "--layers", "4"], full=["--steps", "100", "--layers", "48"]),
    # the paper-scale simulator (one thread, deterministic): beside metric fidelity, convergence and the frontier
    Stage("ablate", "ablate", quick=["--quick"], full=[], background=True),
    # the simulator again, at per-rank budgets from where the home slots just fit: where memory binds
    Stage("memory_sweep", "memory_sweep", quick=["--quick"], full=[], table="Where memory binds"),
    Stage("metric_fidelity", "metric_fidelity", quick=[], full=["--draws", "16", "--tokens", "2048"],
          table=-2),
    Stage("convergence", "convergence", quick=["--quick"],
          full=["--seeds", "0", "1", "2", "--steps", "300", "--eval-every", "15"]),
    # time (paper-scale simulator) against loss (the convergence runs): the retention budget's frontier
    Stage("frontier", "frontier", quick=["--quick", "--convergence", "{out}/convergence.jsonl"],
          full=["--convergence", "{out}/convergence.jsonl"]),
    # the real layer on synthetic traces and on the routing recorded by the convergence run's dropless policy
    Stage("layer_bench", "layer_bench",
          quick=["--trace", "{out}/convergence/trace_static-ep.npz"],
          full=["--steps", "20", "--trace", "{out}/convergence/trace_static-ep.npz"], measured=True),
    # the cost model's per-phase predictions against the layer benchmark's measured times (CPU calibration)
    Stage("validate_sim", "validate_sim", quick=["--quick", "--bench", "{out}/layer_bench.jsonl"],
          full=["--bench", "{out}/layer_bench.jsonl"], measured=True),
    # memory-constrained: no spare replica slot, so the backward quotas do the balancing
    Stage("layer_bench_constrained", "layer_bench",
          quick=["--spare-slots", "0", "--skew-param", "0.8", "--policies", "static-ep", "symi-dropless", "lrmoe",
                 "lrmoe-random"],
          full=["--spare-slots", "0", "--steps", "20", "--policies", "static-ep", "symi-dropless", "lrmoe-m1",
                "lrmoe", "lrmoe-m1-unbiased", "lrmoe-random"], measured=True),
]


def figure_outputs(out: Path) -> list[Path]:
    """The figures the job draws (its 'figures' part)."""
    from lrmoe.paper_figures.figures import names

    return [out / "figures" / f"{name}.{ext}" for name in names(out) for ext in ("png", "pdf")]


def outputs_of(out: Path, part: str, names: list[str]) -> list[Path]:
    """The names one part of the job (a stage, 'figures', 'summary') writes in ``out``."""
    if part == "figures":
        return figure_outputs(out)
    if part == "summary":
        return [out / "SUMMARY.md"]
    return stage_outputs(out, part, names)


def output_dir(out_dir: str | None, mode: str) -> Path:
    """The job's output folder: ``--out-dir``, else ``outputs/<mode>``, both relative to the working directory (the
    job's and its stages': never the package's location, which in an installed package is site-packages)."""
    return Path(out_dir) if out_dir else Path("outputs") / mode


def out_dir_problem(out: Path) -> str | None:
    """Why the job could not write in ``out`` (None: it can)."""
    if out.exists() and not out.is_dir():
        return f"--out-dir {out} is a file, not a folder"
    return folder_problem("--out-dir", out, out)


def entry_point(stage: Stage) -> Callable[[list[str]], object]:
    """The function a stage runs: its script's ``cli`` where it has one (it returns an exit status), else its
    ``main``. The scripts are imported here, in the stage's process, so that the job's --help loads none of them and
    the import graph shows which scripts the job runs (named in the import contracts)."""
    if callable(stage.entry):
        return stage.entry
    from lrmoe.experiments import (ablate, convergence, frontier, layer_bench, memory_sweep, metric_fidelity,
                                   trace_stats, validate_sim)

    scripts = {module.__name__.rsplit(".", 1)[-1]: module for module in (
        ablate, convergence, frontier, layer_bench, memory_sweep, metric_fidelity, trace_stats, validate_sim)}
    if stage.entry not in scripts:
        raise ValueError(f"stage {stage.name}: no script named {stage.entry!r} (the job runs {', '.join(scripts)})")
    module = scripts[stage.entry]
    return getattr(module, "cli", module.main)


def start_stage(stage: Stage, argv: list[str], env: dict, out: Path) -> Running:
    """Start one stage: its script's command line ``argv`` through its entry point, in a process forked from the
    job, in a process group of its own (the job stops it whole, with the ranks it starts); its stdout captured into
    ``out/.<stage>.stdout`` (the summary takes its tables), stderr (progress bars, errors) passed through. A process
    of its own, as from the command line: a background stage runs beside the next ones, and a stage's state (torch's
    threads, its modules' caches) never reaches the next."""
    stdout = out / f".{stage.name}.stdout"
    sys.stdout.flush()  # the job's output so far is the job's: none of it may reach the stage's captured stdout
    sys.stderr.flush()
    ready_r, ready_w = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the stage: never returns into the job's code
        os.close(ready_r)
        _stage_process(stage, argv, env, stdout, parent, ready_w)
    os.close(ready_w)
    os.read(ready_r, 1)  # its own process group exists (or it has died): stop() can reach it from now on
    os.close(ready_r)
    return Running(stage, StageProcess(pid), stdout, time.time())


def _stage_process(stage: Stage, argv: list[str], env: dict, stdout: Path, parent: int, ready: int) -> None:
    """The forked stage's side: its own session (process group), death with the job, the job's signal handlers
    undone, its environment, its stdout to the capture file (the job's working directory stays its own: the
    stages' paths are the job's, and committed inputs are found from the package); then the stage's entry point
    (lrmoe.cli.run_entry: a failure is one line naming the stage, or its traceback), and ``os._exit`` with its
    status: nothing of the job's (its ``finally`` blocks, its exit handlers) runs here."""
    code = 1
    try:
        os.setsid()
        os.write(ready, b"1")
        os.close(ready)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the job's SIGTERM handler is the job's, not the stage's
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if sys.platform.startswith("linux"):
            from lrmoe.runtime.distributed.launch import die_with_parent

            die_with_parent(parent)
        os.environ.clear()
        os.environ.update(env)
        fd = os.open(stdout, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.close(fd)
        run_entry("reproduce.py", stage_label(stage), entry_point(stage), argv)
        code = 0
    except StageFailed as exc:  # the stage's own status, which the job exits with
        print(exc.code, file=sys.stderr)
        code = exc.status
    except BaseException:  # noqa: BLE001 - the stage's traceback, as a script's would be, then its status
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing more to say
                pass
        os._exit(code)


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__)
    parser.add_argument("--mode", choices=["quick", "full"], default="quick",
                        help="quick: every stage at a small size (minutes); full: the paper's sizes")
    parser.add_argument("--out-dir", default=None,
                        help="folder of the job's results (default: outputs/<mode> in the working directory)")
    parser.add_argument("--overwrite", action="store_true",
                        help="remove what an earlier run of the job wrote in the output folder first (nothing else)")
    parser.add_argument("--resume", action="store_true",
                        help="skip the stages that completed; redo the others, superseding what they left")
    parser.add_argument("--only", nargs="+", help="run only these stages ('figures': the figures)")
    return parser


def main(argv=None, stages: list[Stage] | None = None) -> int:
    """Run the main job (``stages``: default :data:`STAGES`); returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    stages = STAGES if stages is None else stages
    names = [stage.name for stage in stages] + ["figures"]
    unknown = [name for name in args.only or [] if name not in names]
    if unknown:
        parser.error(f"--only: no stage named {', '.join(unknown)}; the stages are {', '.join(names)}")
    if args.overwrite and args.resume:
        parser.error("--overwrite and --resume contradict each other; choose one")
    out = output_dir(args.out_dir, args.mode)
    if problem := out_dir_problem(out):
        parser.error(problem)
    try:
        manifest = Manifest(out, "reproduce")
    except ValueError as exc:
        parser.error(str(exc))
    for killed in list(manifest.open):  # a stage of a killed job: what lies under its names it wrote
        account(manifest, out, killed, names)
    selected = [stage for stage in stages if not args.only or stage.name in args.only]
    parts = [st.name for st in selected] + [p for p in ("figures",) if not args.only or p in args.only] + ["summary"]
    foreign = [p for part in parts for p in manifest.foreign(outputs_of(out, part, names))] if out.is_dir() else []
    if foreign:
        parser.error(f"{out} holds {', '.join(str(p.relative_to(out)) for p in foreign[:5])}"
                     f"{' ...' if len(foreign) > 5 else ''}, named like this job's outputs but not written by it: "
                     f"move them away or choose another --out-dir (nothing was removed)")
    earlier = [p for p in (manifest._abs(rel) for rel in manifest.files) if p.exists() or p.is_symlink()]
    if earlier and not (args.overwrite or args.resume):
        parser.error(f"{out} holds the results of an earlier run ({earlier[0].relative_to(out)}, ...); pass "
                     f"--overwrite to replace them or --resume to finish the stages that did not complete")
    if args.resume:
        for stage in selected:
            stored = manifest.identity.get(stage.name)
            wanted = stage_identity(stage, args.mode)
            if (out / f"{stage.name}.jsonl").exists() and stored is not None and stored != wanted:
                parser.error(f"--resume: stage {stage.name} ran with other arguments "
                             f"({argv_difference(stored, wanted)}); pass --overwrite to redo it")
    if args.overwrite:
        removed = manifest.remove(tags=parts)
        print(f"--overwrite: removed {len(removed)} file(s) and folder(s) the job's earlier run wrote", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "SUMMARY.md").unlink(missing_ok=True)  # the job's end marker: present only once this run completes
    summary = [f"# lrmoe reproduction ({args.mode} mode)", ""]
    started = time.time()
    code, sections = run_stages(stages, args.only, args.mode, out, manifest, names, start_stage)
    if code:
        return code
    for stage in stages:
        if stage.name not in sections and stage_complete(out, stage):  # --only: the other stages' last results
            sections[stage.name] = (out / f"{stage.name}.done").read_text()
        if stage.name in sections:
            summary += [f"## {stage.name}", "", sections[stage.name], ""]
    if not args.only or "figures" in args.only:
        from lrmoe.paper_figures import figures

        print("== figures", flush=True)
        manifest.add(*figure_outputs(out), tag="figures")  # before drawing: a killed drawing's files are the job's
        made = figures.draw_all(out, out / "figures")
        manifest.add(*(p for paths in made.values() for p in paths), tag="figures")
        summary += ["## figures", "", *[f"* {name}: {paths[0].relative_to(out)}" for name, paths in made.items()], ""]
    summary.append(f"Total wall time: {time.time() - started:.0f} s.")
    manifest.add(out / "SUMMARY.md", tag="summary")
    atomic_write_text(out / "SUMMARY.md", "\n".join(summary) + "\n")
    print("\n".join(summary))
    print(f"\nOutputs in {out}: SUMMARY.md, one results file per stage, figures (PNG + PDF); "
          f"W&B offline runs in {out / 'wandb'} (upload with `wandb sync {out / 'wandb'}/offline-run-*`).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
