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
from dataclasses import dataclass, field
from pathlib import Path

from lrmoe.cli import StageFailed, run_entry, script_parser
from lrmoe.integrations.tracking_args import folder_problem
from lrmoe.results import Manifest, atomic_write_text, read_headers


@dataclass
class Stage:
    name: str
    # the script the stage runs: its name in lrmoe.experiments (:func:`entry_point` imports it), or the entry point
    # itself (a function of the command line: a script's cli or main)
    entry: str | Callable[[list[str]], object]
    quick: list[str] = field(default_factory=list)
    full: list[str] = field(default_factory=list)
    # which Markdown table of the stage's output goes into the summary (its headline): its index, or the title of
    # the section ("## <title>") whose first table it is, where the stage prints other tables before it
    table: int | str = -1
    # runs beside the stages after it (a deterministic stage on one thread: the simulator), until a measured stage
    background: bool = False
    # times something on this machine: waits for every background stage, so that nothing runs beside it
    measured: bool = False


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


def markdown_tables(text: str, which: int | str = -1) -> str:
    """The ``which``-th Markdown table a stage printed (default the last: experiments print the headline last), or,
    for a string, the first table of the last section titled ``## <which>...`` ("" when there is none)."""
    blocks, current, sections = [], [], []
    for line in text.splitlines():
        if line.startswith("|"):
            current.append(line)
            continue
        if current:
            blocks.append(current)
            current = []
        if line.startswith("## "):
            sections.append((line[3:], len(blocks)))  # the title, and the index its first table will have
    if current:
        blocks.append(current)
    if isinstance(which, str):
        starts = [start for title, start in sections if title.startswith(which) and start < len(blocks)]
        return "\n".join(blocks[starts[-1]]) if starts else ""
    return "\n".join(blocks[which]) if len(blocks) >= abs(which) else ""


def stage_outputs(out: Path, name: str, names: list[str]) -> list[Path]:
    """What stage ``name`` (of the stages ``names``) writes in ``out``: its results file (and lock, marker,
    captured output), the files named after it (figures, report, checkpoints, cached models) and its work folder;
    not those of another stage whose name starts with this one's."""
    longer = [other for other in names if other != name and other.startswith(name)]
    named = [p for p in (*out.glob(f"{name}.*"), *out.glob(f"{name}_*"))
             if not any(p.name.startswith((f"{other}.", f"{other}_")) or p.name == other for other in longer)]
    hidden = [out / f".{name}.jsonl.{what}" for what in ("lock", "manifest.json")]
    return [*named, *hidden, out / f".{name}.stdout", out / name]


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


def account(manifest: Manifest, out: Path, stage: str, names: list[str]) -> None:
    """Record in ``manifest`` what stage ``stage`` wrote: every file under its names (the job refused to start
    where one was not its own, so any there now is the stage's) and its W&B runs (the run ids of its results
    file's headers)."""
    manifest.add(*(p for p in stage_outputs(out, stage, names) if p.exists() or p.is_symlink()), tag=stage,
                 save=False)
    for header in read_headers(out / f"{stage}.jsonl"):
        if header.get("run_id"):
            manifest.wandb_runs[header["run_id"]] = [stage, "wandb"]
    if stage in manifest.open:
        manifest.open.remove(stage)
    manifest.save()


def stage_argv(stage: Stage, mode: str, out: Path) -> list[str]:
    """The stage's own arguments in this mode."""
    return [a.format(out=out) for a in stage_identity(stage, mode)[2:]]


def stage_identity(stage: Stage, mode: str) -> list[str]:
    """What decides a stage's results: the mode and its arguments (before the folder is filled in, so that a moved
    folder is the same run). What a stage wrote is reused only for the same identity."""
    return ["--mode", mode, *(stage.quick if mode == "quick" else stage.full)]


def argv_difference(old: list[str], new: list[str]) -> str:
    """The arguments that differ between two command lines, as 'was ... ; now ...'."""
    return f"was `{' '.join(old) or '(none)'}`, now `{' '.join(new) or '(none)'}`"


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


def stage_label(stage: Stage) -> str:
    """The stage's script as its messages name it (``ablate.py``)."""
    return f"{stage.entry}.py" if isinstance(stage.entry, str) else getattr(stage.entry, "__name__", stage.name)


class StageProcess:
    """A stage's process: forked from the job, it runs the stage's entry point and exits with its status. It reads
    like :class:`subprocess.Popen` (``pid``, ``poll``, ``wait``, ``returncode``: negative for a signal), which the
    scheduling below uses."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


@dataclass
class Running:
    """A started stage: its process, its captured stdout (a file: a background stage's output may outgrow a pipe
    that nobody reads while it runs), when it started and, once :func:`supervise` has seen it end, when it ended (a
    background stage is collected only at a later stage boundary, which must not count as its time)."""

    stage: Stage
    proc: StageProcess
    stdout: Path
    started: float
    ended: float | None = None


def note_ends(runs: list[Running]) -> None:
    """Note the end time of every stage in ``runs`` whose process has exited."""
    for run in runs:
        if run.ended is None and run.proc.poll() is not None:
            run.ended = time.time()


def supervise(foreground: Running | None, background: list[Running], every_s: float = 0.2) -> None:
    """Poll until ``foreground`` has ended (None: every background stage has), or until a background stage has
    failed, noting each stage's end as it happens."""
    awaited = background if foreground is None else [foreground]
    while True:
        note_ends([*awaited, *background])
        if any(b.ended is not None and b.proc.returncode for b in background):
            return
        if all(r.ended is not None for r in awaited):
            return
        time.sleep(every_s)


def stop(runs: list[Running]) -> None:
    """Kill the stages in ``runs``, each with its whole process group (the ranks it started too); their output is
    dropped: they did not complete."""
    for run in runs:
        try:
            os.killpg(run.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        run.proc.wait()
        run.stdout.unlink(missing_ok=True)


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


def finish_stage(run: Running, out: Path) -> tuple[int, str]:
    """Wait for a started stage; print its output. On success write its end marker (its part of the summary).
    Returns (exit status, summary section)."""
    code = run.proc.wait()
    note_ends([run])
    text = run.stdout.read_text()
    run.stdout.unlink(missing_ok=True)
    print(text, end="", flush=True)
    if code:
        print(f"error: stage {run.stage.name} failed with exit status {code}", file=sys.stderr)
        return code, ""
    section = (f"{markdown_tables(text, run.stage.table)}\n\n({run.ended - run.started:.0f} s; results: "
               f"{run.stage.name}.jsonl)")
    atomic_write_text(out / f"{run.stage.name}.done", section)
    return 0, section


def stage_complete(out: Path, stage: Stage) -> bool:
    """A stage is complete when its end marker and its results file both exist."""
    return (out / f"{stage.name}.done").is_file() and (out / f"{stage.name}.jsonl").is_file()


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
    # each stage starts its own W&B service, which dies with it: none that outlives a killed stage (one this job
    # inherited) keeps the stage's W&B run open, so the resumed stage can continue that run
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env.update(WANDB_DIR=str(out), MPLBACKEND="Agg")
    summary = [f"# lrmoe reproduction ({args.mode} mode)", ""]
    sections: dict[str, str] = {}
    background: list[Running] = []
    started = time.time()

    def collect_background(wait: bool) -> int:
        """Finish the background stages that ended (with ``wait``: every one, once it has); the first failure's
        status (0: none), after stopping the others: a failed stage fails the job at once, never half-way later."""
        if wait:
            supervise(None, background)
        note_ends(background)
        for run in [b for b in background if b.ended is not None]:
            background.remove(run)
            code, sections[run.stage.name] = finish_stage(run, out)
            if code:
                stop(background)
                return code
        return 0

    from lrmoe.runtime.distributed.launch import terminate_on_sigterm

    stages_run: list[Running] = []
    restore = terminate_on_sigterm()  # SIGTERM: SystemExit here, so the stages below are stopped on the way out
    try:
        for stage in stages:
            if args.only and stage.name not in args.only:
                continue
            results = out / f"{stage.name}.jsonl"
            done = out / f"{stage.name}.done"
            if stage_complete(out, stage):
                print(f"== {stage.name}: complete, skipped (--resume)")
                sections[stage.name] = done.read_text()
                continue
            done.unlink(missing_ok=True)
            if code := collect_background(wait=stage.measured):
                return code
            extra = stage_argv(stage, args.mode, out)
            manifest.identity[stage.name] = stage_identity(stage, args.mode)
            manifest.open.append(stage.name)
            manifest.add(out / f"{stage.name}.jsonl", out / f".{stage.name}.stdout", out / f"{stage.name}.done",
                         tag=stage.name)
            argv = ["--out", str(results), *extra]
            if results.exists():  # an interrupted stage: its tracker supersedes what the killed attempt left
                argv.append("--resume")
            how = " (in the background: the next stages run beside it)" if stage.background else ""
            print(f"== {stage.name}{how}: {stage_label(stage)} {' '.join(argv)}", flush=True)
            run = start_stage(stage, argv, env, out)
            stages_run.append(run)
            if stage.background:
                background.append(run)
                continue
            supervise(run, background)
            if run.ended is None:  # a background stage failed: stop this one and report that one's failure
                stop([run])
                return collect_background(wait=False)
            code, sections[stage.name] = finish_stage(run, out)
            if code:
                stop(background)
                return code
        if code := collect_background(wait=True):
            return code
    finally:  # an error, Ctrl-C or SIGTERM of the job: no stage, nor any rank of one, keeps running
        stop([run for run in stages_run if run.proc.poll() is None])
        restore()
        for run in stages_run:
            account(manifest, out, run.stage.name, names)
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
