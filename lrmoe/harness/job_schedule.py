"""The main job's scheduling (``experiments/reproduce.py``): a stage's process and its supervision, the stages run in
order (a ``background`` stage beside the ones after it, until a ``measured`` one waits for it), each completed stage's
end marker, and what each wrote recorded in the job's manifest. Starting a stage's process is the job's own (it runs
a script's entry point): :func:`run_stages` is handed that function."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lrmoe.harness.job_stages import (Stage, account, markdown_tables, stage_argv, stage_complete, stage_identity,
                                      stage_label)
from lrmoe.results import Manifest, atomic_write_text


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


def run_stages(stages: list[Stage], only: list[str] | None, mode: str, out: Path, manifest: Manifest,
               names: list[str], start: Callable[[Stage, list[str], dict, Path], Running],
               ) -> tuple[int, dict[str, str]]:
    """Run the stages (``only``: those named) in order, each through ``start`` (its process, started), skipping a
    complete one; every stage's part of the summary by name, and the job's status: a failed stage's, after stopping
    the others (0: every stage completed). Whatever ends the run, no stage keeps running and what each wrote is
    recorded in ``manifest``."""
    from lrmoe.runtime.distributed.launch import terminate_on_sigterm

    # each stage starts its own W&B service, which dies with it: none that outlives a killed stage (one this job
    # inherited) keeps the stage's W&B run open, so the resumed stage can continue that run
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env.update(WANDB_DIR=str(out), MPLBACKEND="Agg")
    sections: dict[str, str] = {}
    background: list[Running] = []

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

    stages_run: list[Running] = []
    restore = terminate_on_sigterm()  # SIGTERM: SystemExit here, so the stages below are stopped on the way out
    try:
        for stage in stages:
            if only and stage.name not in only:
                continue
            results = out / f"{stage.name}.jsonl"
            done = out / f"{stage.name}.done"
            if stage_complete(out, stage):
                print(f"== {stage.name}: complete, skipped (--resume)")
                sections[stage.name] = done.read_text()
                continue
            done.unlink(missing_ok=True)
            if code := collect_background(wait=stage.measured):
                return code, sections
            extra = stage_argv(stage, mode, out)
            manifest.identity[stage.name] = stage_identity(stage, mode)
            manifest.open.append(stage.name)
            manifest.add(out / f"{stage.name}.jsonl", out / f".{stage.name}.stdout", out / f"{stage.name}.done",
                         tag=stage.name)
            argv = ["--out", str(results), *extra]
            if results.exists():  # an interrupted stage: its tracker supersedes what the killed attempt left
                argv.append("--resume")
            how = " (in the background: the next stages run beside it)" if stage.background else ""
            print(f"== {stage.name}{how}: {stage_label(stage)} {' '.join(argv)}", flush=True)
            run = start(stage, argv, env, out)
            stages_run.append(run)
            if stage.background:
                background.append(run)
                continue
            supervise(run, background)
            if run.ended is None:  # a background stage failed: stop this one and report that one's failure
                stop([run])
                return collect_background(wait=False), sections
            code, sections[stage.name] = finish_stage(run, out)
            if code:
                stop(background)
                return code, sections
        if code := collect_background(wait=True):
            return code, sections
    finally:  # an error, Ctrl-C or SIGTERM of the job: no stage, nor any rank of one, keeps running
        stop([run for run in stages_run if run.proc.poll() is None])
        restore()
        for run in stages_run:
            account(manifest, out, run.stage.name, names)
    return 0, sections
