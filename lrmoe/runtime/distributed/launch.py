"""A fast local launcher for tests and CPU experiments: fork + gloo + file rendezvous + short timeouts.

``launch(fn, world_size, *args)`` forks ``world_size`` processes, each of which joins a gloo process group and
runs ``fn(rank, *args, **kw)`` (the ``torch.multiprocessing.spawn`` convention); it returns the list of their return
values, in rank order. It never hangs: if a rank raises, dies, waits in a collective longer than the process group's
timeout ``pg_timeout_s``, or the whole launch outlives ``timeout_s`` (None: no bound on the run's length), every
remaining rank is killed and :class:`LaunchError` is raised carrying the root cause's traceback.

A hung rank is named, not its peers: when a rank's collective fails (a peer that never arrives makes it time out), the
launcher asks every rank that has not reported where it is (``faulthandler`` dumps its Python stack into the launch
folder on SIGUSR1); the live ranks that are not inside a ``torch.distributed`` call are the ones that did not arrive,
and the error names them with their stacks. A rank that cannot answer, because it is stopped (SIGSTOP, a debugger: state
``T`` in ``/proc/<pid>/stat``) or does not answer in time, did not arrive either, and is named as such. The
process-group timeout is thus the bound on inactivity: a healthy run
of any length, whose collectives complete, is never stopped by it.

Fork is used because it starts in milliseconds (spawn re-imports torch in every child, ~50x slower). For the same
reason ``preload`` names modules the ranks would each import lazily (torch imports ``torch._dynamo``, seconds, when a
rank builds its first ``torch.optim`` optimizer): the parent imports them once, before forking, and every rank
inherits them. Fork needs two precautions, both taken here: no CUDA context may exist in the parent (it does not
survive a fork), and each child uses one intra-op thread (the machine's cores are shared by all ranks).

No rank outlives its launcher, whatever ends it (an interrupt, Ctrl-C, too: the ranks ignore SIGINT, the launcher
raises KeyboardInterrupt and kills them on its way out): each rank asks the kernel for SIGKILL when its parent dies
(:func:`die_with_parent`), a SIGTERM of the launcher kills the ranks and removes the launch folder on its way out,
and a launch folder left by a launcher killed outright (SIGKILL) is removed by the next launch.
"""

from __future__ import annotations

import importlib
import math
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from lrmoe.runtime.distributed.stacks import RankStack, arm_stack_dump, collective_of, read_stacks


class LaunchError(RuntimeError):
    """A rank of a :func:`launch` failed or timed out; the message carries its traceback. ``rank``: the root cause
    (the first of ``ranks``, every rank found at fault: e.g. all that did not arrive at a collective)."""

    def __init__(self, message: str, rank: int | None = None, ranks: list[int] | None = None):
        super().__init__(message)
        self.rank = rank
        self.ranks = ranks if ranks is not None else ([] if rank is None else [rank])


PR_SET_PDEATHSIG = 1  # prctl(2): the signal this process gets when its parent dies


def die_with_parent(parent: int) -> None:
    """Make this process die when ``parent`` (the process that started it) dies, however it dies: Linux's
    parent-death signal (SIGKILL from the kernel), else a thread that polls the parent's id twice a second."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            armed = ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0
        except (OSError, AttributeError):
            pass
    if not armed:
        threading.Thread(target=_exit_when_orphaned, args=(parent,), name="lrmoe-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


FINAL_BARRIER_FAILED = 75  # a rank's exit status when its result was sent but the closing barrier failed


def _child(fn, rank: int, world_size: int, rdzv: str, pg_timeout_s: float, conn, args, kw, parent: int) -> None:
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C (sent to the whole group) is the launcher's: it kills us
    arm_stack_dump(os.path.dirname(rdzv), rank)  # the launcher may ask where this rank is
    try:
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        result = fn(rank, *args, **kw)
        payload, ok = pickle.dumps(("ok", result)), True
    except BaseException as exc:  # noqa: BLE001 - every failure is reported to the parent, then the child exits
        payload, ok = pickle.dumps(("error", (traceback.format_exc(), collective_of(exc)))), False
    try:
        conn.send_bytes(payload)
    except Exception:  # noqa: BLE001 - e.g. an unpicklable result: report that instead
        conn.send_bytes(pickle.dumps(("error", (traceback.format_exc(), None))))
        ok = False
    conn.close()
    status = 0
    if ok:
        # Stay until every rank is done: a rank that exits early breaks peers still connecting to it. The parent
        # kills this process once all results are in (or as soon as another rank fails).
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer failed (its report follows) or never arrived: the parent finds out
            status = FINAL_BARRIER_FAILED
    # Leave without running atexit handlers inherited from the parent (pytest, W&B, ...), and without a
    # destroy_process_group that could block on peers that already failed.
    os._exit(status)


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.join(timeout=5)


DEFAULT_PG_TIMEOUT_S = 300.0  # the collective timeout of a launch with no bound on its length (timeout_s None)


def launch(fn, world_size: int, *args, timeout_s: float | None = 60.0, pg_timeout_s: float | None = None,
           preload: tuple[str, ...] = (), **kw) -> list:
    """Run ``fn(rank, *args, **kw)`` on ``world_size`` forked ranks of a fresh gloo process group.

    Returns the ranks' return values in rank order (they must be picklable). ``timeout_s`` bounds the whole launch
    (None: no bound, for runs of any length); ``pg_timeout_s`` (default: ``timeout_s``, else
    :data:`DEFAULT_PG_TIMEOUT_S`) is the process group's collective timeout, the longest a rank waits for its peers
    in one collective: the launch's bound on inactivity, after which the ranks that did not arrive are named.
    ``preload``: modules imported here, before the fork, that the ranks would otherwise each import.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if timeout_s is not None and not timeout_s > 0:
        raise ValueError(f"timeout_s must be positive (or None: unbounded), got {timeout_s}")
    pg_timeout_s = (DEFAULT_PG_TIMEOUT_S if timeout_s is None or math.isinf(timeout_s) else timeout_s
                    ) if pg_timeout_s is None else pg_timeout_s
    if not (pg_timeout_s > 0 and math.isfinite(pg_timeout_s)):
        raise ValueError(f"pg_timeout_s must be a positive finite number of seconds, got {pg_timeout_s}")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise ValueError("launch forks its ranks: CUDA must not be initialised in the parent process")
    if dist.is_initialized():
        raise ValueError("launch must be called from a process that has no process group of its own")
    for name in preload:
        importlib.import_module(name)
    ctx = mp.get_context("fork")
    _remove_orphaned_folders()
    tmp = tempfile.mkdtemp(prefix=f"{_FOLDER_PREFIX}{os.getpid()}-")
    rdzv = os.path.join(tmp, "rendezvous")
    procs, conns = [], {}
    restore = terminate_on_sigterm()
    try:
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, args=(fn, rank, world_size, rdzv, pg_timeout_s, child_end, args, kw,
                                                 os.getpid()), name=f"lrmoe-rank{rank}", daemon=True)
            p.start()
            child_end.close()
            procs.append(p)
            conns[parent_end] = rank
        return _Collector(procs, conns, tmp, pg_timeout_s).collect(timeout_s)
    finally:
        _kill(procs)
        shutil.rmtree(tmp, ignore_errors=True)
        restore()


_FOLDER_PREFIX = "lrmoe-launch-"  # + the launcher's pid + "-": a launch folder names the process that owns it


def _remove_orphaned_folders() -> None:
    """Remove the launch folders of launchers that no longer run (killed by SIGKILL: nothing ran on their way out)."""
    for folder in os.scandir(tempfile.gettempdir()):
        pid = folder.name[len(_FOLDER_PREFIX):].split("-", 1)[0]
        if not (folder.name.startswith(_FOLDER_PREFIX) and pid.isdigit() and folder.is_dir(follow_symlinks=False)):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(folder.path, ignore_errors=True)
        except PermissionError:  # another user's live process
            pass


def terminate_on_sigterm():
    """While a launch runs, SIGTERM raises SystemExit (status 143) in the launcher, so its ``finally`` kills the ranks
    and removes the launch folder (Python's default would end the process on the spot). Returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is not signal.SIG_DFL:  # the program handles SIGTERM itself
        return lambda: None

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _last_line(tb: str) -> str:
    return tb.strip().splitlines()[-1] if tb.strip() else "(no message)"


def _indented(frames) -> str:
    return "".join(f"\n    {frame}" for frame in frames)


class _Collector:
    """The parent's side of a launch: reads the ranks' reports until every result is in, and on a failure kills
    every rank and raises with the root cause (:meth:`fail`)."""

    def __init__(self, procs, conns: dict, folder: str, pg_timeout_s: float):
        self.procs, self.conns, self.folder, self.pg_timeout_s = procs, conns, folder, pg_timeout_s
        self.world_size = len(procs)
        self.results: dict[int, object] = {}
        self.stopped: set[int] = set()  # the ranks found stopped when asked where they are

    def collect(self, timeout_s: float | None) -> list:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while len(self.results) < self.world_size:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.timed_out(timeout_s)
            ready = wait(list(self.conns) + list(sentinels), timeout=left)
            for obj in ready:
                if obj in self.conns:
                    rank = self.conns.pop(obj)
                    try:
                        status, value = pickle.loads(obj.recv_bytes())
                    except EOFError:
                        self.died(rank)
                    if status == "error":
                        self.fail({rank: value})
                    self.results[rank] = value
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels.pop(obj)
                    if rank in self.results:
                        self.procs[rank].join(timeout=5)  # its sentinel closes a moment before its status is known
                        if self.procs[rank].exitcode == FINAL_BARRIER_FAILED:  # a peer failed, or never arrived
                            self.fail({rank: (f"rank {rank} returned its result; then its closing barrier failed",
                                              "barrier")})
                        continue
                    conn = next((c for c, r in self.conns.items() if r == rank), None)
                    if conn is None or conn.poll(0.5):
                        continue  # its report is in the pipe and is read on the next pass
                    self.died(rank)
        return [self.results[r] for r in range(self.world_size)]

    def died(self, rank: int):
        self.procs[rank].join(timeout=5)
        _kill(self.procs)
        raise LaunchError(f"rank {rank} of {self.world_size} died with exit code {self.procs[rank].exitcode} "
                          f"without reporting a result", rank=rank) from None

    def fail(self, reports: dict[int, tuple[str, str | None]]):
        """Kill every rank and raise with the root cause of ``reports`` (rank -> (traceback, the collective it
        failed in or None), the first to arrive first): a rank that died without a report (its peers' collectives
        then break, so their errors are consequences); else a rank that failed outside a collective; else, when
        every failure arose in a collective, the live ranks that were not in one: they never arrived. Reports that
        arrive meanwhile are noted."""
        for conn, other in list(self.conns.items()):
            if conn.poll(0.05):
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except EOFError:
                    continue
                del self.conns[conn]
                if status == "error":
                    reports[other] = value
                else:
                    self.results[other] = value
        unreported = list(self.conns.values())
        # a peer that is dying closes its sockets (breaking our collectives) just before it exits: give it a moment
        wait([self.procs[r].sentinel for r in unreported], timeout=0.5)
        silent = [r for r in unreported if not self.procs[r].is_alive() and self.procs[r].exitcode not in (0, None)]
        first = next(iter(reports))
        outside = [r for r, (_, collective) in reports.items() if collective is None]
        cause = outside[0] if outside else first
        others = [f"rank {r}: {_last_line(tb)}" for r, (tb, _) in reports.items() if r != cause]
        note = ("\nother ranks failed after it:\n  " + "\n  ".join(others)) if others else ""
        tb = reports[cause][0]
        if silent:
            _kill(self.procs)
            dead = silent[0]
            raise LaunchError(f"rank {dead} of {self.world_size} died with exit code {self.procs[dead].exitcode} "
                              f"without reporting a result; then rank {cause} failed:\n{tb}{note}", rank=dead)
        if not outside:
            alive = [r for r in unreported if self.procs[r].is_alive()]
            stacks = self.stacks(alive)
            missing = [r for r in alive if r not in stacks or stacks[r].collective is None]  # silent ones too
            if missing:
                _kill(self.procs)
                waited = "".join(f"\n  rank {r} in {collective}: {_last_line(t)}"
                                 for r, (t, collective) in sorted(reports.items()))
                raise LaunchError(f"{_ranks(missing)} of {self.world_size} did not arrive at a collective: "
                                  f"{_ranks(list(reports))} failed waiting (the collective timeout is "
                                  f"{self.pg_timeout_s:g} s):{waited}\n{self.places(stacks, missing)}"
                                  f"\n\nrank {first}'s traceback:\n{reports[first][0]}", rank=missing[0],
                                  ranks=missing)
        _kill(self.procs)
        calls = sorted({collective for _, collective in reports.values() if collective not in (None, "barrier")})
        mismatch = (f" (the ranks failed in different collectives, {', '.join(calls)}: do they call the same "
                    f"collectives in the same order?)" if len(calls) > 1 else "")
        raise LaunchError(f"rank {cause} of {self.world_size} failed{mismatch}:\n{tb}{note}", rank=cause)

    def timed_out(self, timeout_s: float):
        """The whole launch outlived ``timeout_s``: kill every rank and raise, saying where each unfinished rank
        is, and naming those not in a collective when others wait in one (they are the ones that did not arrive)."""
        pending = sorted(set(range(self.world_size)) - set(self.results))
        stacks = self.stacks([r for r in pending if self.procs[r].is_alive()])
        _kill(self.procs)
        waiting = [r for r, stack in stacks.items() if stack.collective is not None]
        missing = [r for r in pending if r not in waiting]
        blame = (f"; {_ranks(missing)} did not arrive at the collective {_ranks(waiting)} wait in"
                 if waiting and missing else "")
        raise LaunchError(f"launch timed out after {timeout_s:g} s; ranks {pending} had not finished{blame}\n"
                          f"{self.places(stacks, pending)}", rank=missing[0] if waiting and missing else None,
                          ranks=missing if waiting else pending)

    def stacks(self, ranks: list[int]) -> dict[int, RankStack]:
        """The stacks of ``ranks`` that answer; a stopped rank cannot, and is not waited for."""
        self.stopped = {r for r in ranks if _stopped(self.procs[r].pid)}  # before the ranks are killed
        asked = {r: self.procs[r].pid for r in ranks if r not in self.stopped}
        return read_stacks(asked, self.folder, entry=_child.__name__)

    def places(self, stacks: dict[int, RankStack], ranks: list[int]) -> str:
        """Where each of ``ranks`` is, with the stack of each that is not in a collective."""
        lines = []
        for r in ranks:
            stack = stacks.get(r)
            if stack is None and r in self.stopped:
                lines.append(f"rank {r}: stopped (process {self.procs[r].pid} in state T: SIGSTOP or a debugger)")
            elif stack is None:
                lines.append(f"rank {r}: did not answer the request for its stack")
            elif stack.collective is not None:
                lines.append(f"rank {r}: waits in {stack.collective}")
            else:
                lines.append(f"rank {r}: not in a collective, at {stack.where}; its stack, most recent call first:"
                             f"{_indented(stack.frames)}")
        return "\n".join(lines)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, SIGTSTP, a tracer: state T or t in /proc/<pid>/stat; Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _ranks(ranks: list[int]) -> str:
    """Ranks named in rank order, whatever order their reports arrived in."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"
