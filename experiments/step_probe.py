"""One training run of experiments/train.py, split into the phases of a step (the step benchmark's probe,
lrmoe.harness.step_bench, which runs it).

    python experiments/step_probe.py --out-dir DIR --probe-warmup 3 -- <train.py arguments>

Each phase is the CPU time of the rank's own thread (``time.thread_time``) inside the functions named in
:data:`PHASES`, charged to the innermost phase open (a phase nested in another is not counted twice; inside the
evaluation, everything is the evaluation's); the time a rank
spends waiting for its peers is no rank's CPU, and shows as the step's wall time less the ranks' CPU. Each rank writes
``DIR/rank<r>.json``: its phase seconds over the measured steps, its step start times (wall clock and thread
CPU; the last entry is the run's end) and, on rank 0, the losses. Run by its file path, the probe measures whatever
``lrmoe`` the interpreter imports (another checkout's, for a side-by-side run); a function a revision lacks is left
out of its phase.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import threading
import time
from pathlib import Path

from lrmoe.cli import positive_int_arg, script_parser

# phase -> the functions whose thread CPU time it holds ("module:attribute path"; patched where they are looked up)
PHASES = {
    "plan": ("lrmoe.runtime.layer:EPMoELayer._plan", "lrmoe.runtime.comm:Comm.all_gather_counts",
             "lrmoe.runtime.layer:check_layer_plan", "lrmoe.runtime.layer:make_dispatch", "lrmoe.runtime.layer:route"),
    "forward exchange": ("lrmoe.runtime.dispatch:TokenDispatcher.dispatch",
                         "lrmoe.runtime.dispatch:TokenDispatcher.combine",
                         "lrmoe.runtime.dispatch:TokenDispatcher.unpermute"),
    "expert compute": ("lrmoe.runtime.expert_compute:SwiGLUExperts.forward",
                       "lrmoe.runtime.exchange:ExpertExchange._expert_backward"),
    "backward exchange": ("lrmoe.runtime.exchange:ExpertExchange.backward",),
    "replica gradients": ("lrmoe.runtime.distributed.replica:ReplicaStore.sync_replica_grads",
                          "lrmoe.runtime.distributed.replica:ReplicaStore.collect_grad_shards"),
    "optimizer and redistribution": ("lrmoe.runtime.optim:ExpertParallelOptimizer.step",),
    "records": ("lrmoe.training.loop:step_record",),
    "evaluation": ("lrmoe.training.loop:evaluate",),
}

_local = threading.local()


class _Clock:
    """One rank's phase clock: a stack of open phases; thread CPU time goes to the innermost one."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.walls: dict[str, float] = {}  # wall seconds inside each phase's calls
        self.calls: dict[str, int] = {}
        self.stack: list[str] = []
        self.last = time.thread_time()
        self.measuring = False

    def _charge(self) -> None:
        now = time.thread_time()
        if self.stack and self.measuring:
            self.seconds[self.stack[-1]] = self.seconds.get(self.stack[-1], 0.0) + now - self.last
        self.last = now

    def enter(self, phase: str) -> None:
        self._charge()
        # inside the evaluation every call is the evaluation's (its forwards plan and exchange too)
        self.stack.append("evaluation" if "evaluation" in self.stack else phase)

    def leave(self) -> None:
        self._charge()
        self.stack.pop()


def _clock() -> _Clock:
    if not hasattr(_local, "clock"):
        _local.clock = _Clock()
    return _local.clock


def _timed(phase: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        clock = _clock()
        clock.enter(phase)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.leave()
            if clock.measuring and (phase == "evaluation" or "evaluation" not in clock.stack):
                clock.walls[phase] = clock.walls.get(phase, 0.0) + time.perf_counter() - start
                clock.calls[phase] = clock.calls.get(phase, 0) + 1
    return wrapper


def install() -> list[str]:
    """Wrap every function of :data:`PHASES` that this revision has; returns the ones it lacks."""
    missing = []
    for phase, names in PHASES.items():
        for name in names:
            module, path = name.split(":")
            try:
                owner = importlib.import_module(module)
                *outer, attr = path.split(".")
                for part in outer:
                    owner = getattr(owner, part)
                fn = getattr(owner, attr)
            except (ImportError, AttributeError):
                missing.append(name)
                continue
            setattr(owner, attr, _timed(phase, fn))
    return missing


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__)
    parser.add_argument("--out-dir", required=True, help="folder of the ranks' rows (rank<r>.json)")
    parser.add_argument("--probe-warmup", type=positive_int_arg, default=3,
                        help="steps before the phase clocks run (left out of the medians)")
    parser.add_argument("train_argv", nargs=argparse.REMAINDER, help="-- then experiments/train.py's arguments")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    train_argv = args.train_argv[1:] if args.train_argv[:1] == ["--"] else args.train_argv
    out_dir, warmup = Path(args.out_dir), args.probe_warmup
    out_dir.mkdir(parents=True, exist_ok=True)
    missing = install()
    from lrmoe.experiments import train
    from lrmoe.training import loop

    real_worker, real_get_batch = loop.worker, loop.get_batch

    def get_batch(*args, **kwargs):  # a step begins: its start time, and the clock runs from the warm-up's end
        clock = _clock()
        clock.starts.append(time.perf_counter())
        clock.cpu.append(time.thread_time())
        clock.measuring = len(clock.starts) > warmup
        clock.last = time.thread_time()
        return real_get_batch(*args, **kwargs)

    def worker(rank, args):
        clock = _clock()
        clock.starts, clock.cpu = [], []
        loop.get_batch = get_batch  # the loop looks it up at each step
        history = real_worker(rank, args)
        clock.starts.append(time.perf_counter())
        clock.cpu.append(time.thread_time())
        row = {"rank": rank, "warmup": warmup, "seconds": clock.seconds, "starts": clock.starts, "cpu": clock.cpu,
               "walls": clock.walls, "calls": clock.calls, "missing": missing}
        if rank == 0:
            row["losses"] = [r["loss"] for r in history]
        (out_dir / f"rank{rank}.json").write_text(json.dumps(row))
        return history

    loop.worker = worker  # train.py imports the worker from the loop when it launches
    train.main(train_argv)


if __name__ == "__main__":
    main()
