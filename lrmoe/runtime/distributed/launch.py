"""A fast local launcher for tests and CPU experiments: fork + gloo + file rendezvous + short timeouts.

``launch(fn, world_size, *args)`` forks ``world_size`` processes, each of which joins a gloo process group and
runs ``fn(rank, *args, **kw)`` (the ``torch.multiprocessing.spawn`` convention); it returns the list of their return
values, in rank order. It never hangs: if a rank raises, dies, or the whole launch outlives ``timeout_s``, every
remaining rank is killed and :class:`LaunchError` is raised carrying the failing rank's traceback.

Fork is used because it starts in milliseconds (spawn re-imports torch in every child, ~50x slower). For the same
reason ``preload`` names modules the ranks would each import lazily (torch imports ``torch._dynamo``, seconds, when a
rank builds its first ``torch.optim`` optimizer): the parent imports them once, before forking, and every rank
inherits them. Fork needs two precautions, both taken here: no CUDA context may exist in the parent (it does not
survive a fork), and each child uses one intra-op thread (the machine's cores are shared by all ranks).

No rank outlives its launcher, whatever ends it: each rank asks the kernel for SIGKILL when its parent dies
(:func:`die_with_parent`), a SIGTERM of the launcher kills the ranks and removes the launch folder on its way out,
and a launch folder left by a launcher killed outright (SIGKILL) is removed by the next launch.
"""

from __future__ import annotations

import importlib
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


class LaunchError(RuntimeError):
    """A rank of a :func:`launch` failed or timed out; the message carries its traceback."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


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


def _child(fn, rank: int, world_size: int, rdzv: str, pg_timeout_s: float, conn, args, kw, parent: int) -> None:
    die_with_parent(parent)
    try:
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout_s))
        result = fn(rank, *args, **kw)
        payload, ok = pickle.dumps(("ok", result)), True
    except BaseException:  # noqa: BLE001 - every failure is reported to the parent, then the child exits
        payload, ok = pickle.dumps(("error", traceback.format_exc())), False
    try:
        conn.send_bytes(payload)
    except Exception:  # noqa: BLE001 - e.g. an unpicklable result: report that instead
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        ok = False
    conn.close()
    if ok:
        # Stay until every rank is done: a rank that exits early breaks peers still connecting to it. The parent
        # kills this process once all results are in (or as soon as another rank fails).
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer failed; the parent already has its report
            pass
    # Leave without running atexit handlers inherited from the parent (pytest, W&B, ...), and without a
    # destroy_process_group that could block on peers that already failed.
    os._exit(0)


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            try:
                os.kill(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.join(timeout=5)


def launch(fn, world_size: int, *args, timeout_s: float = 60.0, pg_timeout_s: float | None = None,
           preload: tuple[str, ...] = (), **kw) -> list:
    """Run ``fn(rank, *args, **kw)`` on ``world_size`` forked ranks of a fresh gloo process group.

    Returns the ranks' return values in rank order (they must be picklable). ``timeout_s`` bounds the whole launch;
    ``pg_timeout_s`` (default: ``timeout_s``) is the process group's own collective timeout; ``preload``: modules
    imported here, before the fork, that the ranks would otherwise each import.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        raise ValueError("launch forks its ranks: CUDA must not be initialised in the parent process")
    if dist.is_initialized():
        raise ValueError("launch must be called from a process that has no process group of its own")
    pg_timeout_s = timeout_s if pg_timeout_s is None else pg_timeout_s
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
        return _collect(procs, conns, world_size, timeout_s)
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


def _fail(procs, conns: dict, world_size: int, rank: int, tb: str) -> None:
    """Kill every rank and raise with the root cause: a rank that died without a report (its peers' collectives
    then break, so their errors are consequences), else ``rank``'s traceback (the first reported). Other
    reports that arrived meanwhile are noted."""
    others = []
    for conn, other in list(conns.items()):
        if conn.poll(0.05):
            try:
                status, value = pickle.loads(conn.recv_bytes())
            except EOFError:
                continue
            if status == "error":
                others.append(f"rank {other}: {value.strip().splitlines()[-1]}")
    # a peer that is dying closes its sockets (breaking our collectives) just before it exits: give it a moment
    wait([procs[r].sentinel for r in conns.values()], timeout=0.5)
    silent = [r for r in conns.values() if not procs[r].is_alive() and procs[r].exitcode not in (0, None)]
    _kill(procs)
    note = ("\nother ranks failed after it:\n  " + "\n  ".join(others)) if others else ""
    if silent:
        dead = silent[0]
        raise LaunchError(f"rank {dead} of {world_size} died with exit code {procs[dead].exitcode} without "
                          f"reporting a result; then rank {rank} failed:\n{tb}{note}", rank=dead)
    raise LaunchError(f"rank {rank} of {world_size} failed:\n{tb}{note}", rank=rank)


def _collect(procs, conns: dict, world_size: int, timeout_s: float) -> list:
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    sentinels = {p.sentinel: rank for rank, p in enumerate(procs)}
    while len(results) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            pending = sorted(set(range(world_size)) - set(results))
            _kill(procs)
            raise LaunchError(f"launch timed out after {timeout_s:.0f} s; ranks {pending} had not finished")
        ready = wait(list(conns) + list(sentinels), timeout=left)
        for obj in ready:
            if obj in conns:
                rank = conns.pop(obj)
                try:
                    status, value = pickle.loads(obj.recv_bytes())
                except EOFError:
                    procs[rank].join(timeout=5)
                    _kill(procs)
                    raise LaunchError(f"rank {rank} of {world_size} died with exit code {procs[rank].exitcode} "
                                      f"without reporting a result", rank=rank) from None
                if status == "error":
                    _fail(procs, conns, world_size, rank, value)
                results[rank] = value
        for obj in ready:
            if obj in sentinels:
                rank = sentinels.pop(obj)
                conn = next((c for c, r in conns.items() if r == rank), None)
                if rank in results or conn is None or conn.poll(0.5):
                    continue  # finished, or its report is in the pipe and is read on the next pass
                _kill(procs)
                raise LaunchError(f"rank {rank} of {world_size} died with exit code {procs[rank].exitcode} "
                                  f"without reporting a result", rank=rank)
    return [results[r] for r in range(world_size)]
