"""The in-process launcher: ``launch_inprocess(fn, world_size, *args)`` runs ``fn(rank, *args, **kw)`` on N threads
of this process, each with a process group of the ``"inprocess"`` backend (:mod:`lrmoe.runtime.inprocess.group`),
and returns their results in rank order: the fork launcher's contract
(:func:`lrmoe.runtime.distributed.launch.launch`), without processes, sockets or a rendezvous.

``torch.distributed`` keeps its bookkeeping (the default group, the group names and ranks) in one module-level
object, ``torch.distributed.distributed_c10d._world``, which torch documents as an extension point to override.
While a launch runs it is replaced by a view that gives each rank's thread a world of its own (and any other
thread, the caller's included, the world it had), and torch's C++ group registry is made thread-local; both are
restored when the launch ends. So every rank calls the same ``torch.distributed`` functions the distributed
runtime calls, on its own default group, and code written for processes runs unchanged. One launch runs at a
time in a process.
"""

from __future__ import annotations

import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lrmoe.runtime.distributed.launch import LaunchError
from lrmoe.runtime.inprocess.group import BACKEND, Cluster, PeerFailed

_MAPS = ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config", "tags_to_pg", "pg_to_tag")


class _RankWorld(c10d._World):
    """One rank's ``torch.distributed`` bookkeeping: torch's world object with its module-level maps made its own."""

    def __init__(self):
        super().__init__()
        self._own = {name: {} for name in _MAPS}
        self._count = 0

    pg_map = property(lambda self: self._own["pg_map"])
    pg_names = property(lambda self: self._own["pg_names"])
    pg_group_ranks = property(lambda self: self._own["pg_group_ranks"])
    pg_backend_config = property(lambda self: self._own["pg_backend_config"])
    tags_to_pg = property(lambda self: self._own["tags_to_pg"])
    pg_to_tag = property(lambda self: self._own["pg_to_tag"])

    @property
    def group_count(self) -> int:
        return self._count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._count = value


class _ThreadWorlds:
    """Stands in for ``c10d._world`` during a launch: the calling thread's rank world, else the world outside."""

    def __init__(self, outside):
        object.__setattr__(self, "_outside", outside)
        object.__setattr__(self, "_local", threading.local())

    def _mine(self):
        return getattr(self._local, "world", None) or self._outside

    def __getattr__(self, name):
        return getattr(self._mine(), name)

    def __setattr__(self, name, value):
        setattr(self._mine(), name, value)


_local = threading.local()  # in a rank's thread: .cluster (the launch it belongs to)
_one_launch = threading.Lock()
STOP_S = 30.0  # how long a timed-out launch waits for its ranks to stop at their next wait


def _create_group(opts, backend_options=None):
    cluster = getattr(_local, "cluster", None)
    if cluster is None:
        raise RuntimeError(f"the {BACKEND!r} backend serves the ranks of lrmoe.runtime.inprocess.launch_inprocess")
    return cluster.group(opts, backend_options)


if BACKEND.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(BACKEND, _create_group, extended_api=True, devices=["cpu"])


def _rank_main(cluster: Cluster, rank: int, rng: torch.Tensor, worlds: _ThreadWorlds, fn, args, kw,
               results: dict, started: set) -> None:
    _local.cluster = cluster
    worlds._local.world = _RankWorld()
    baton = cluster.baton
    baton.start(rank, rng)
    started.add(rank)
    failure = None
    try:
        dist.init_process_group(BACKEND, store=dist.HashStore(), rank=rank, world_size=cluster.world_size)
        results[rank] = fn(rank, *args, **kw)
    except PeerFailed:
        pass
    except BaseException:  # noqa: BLE001 - reported by the launcher, which raises it
        failure = f"rank {rank} of {cluster.world_size} failed:\n{traceback.format_exc()}"
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the rank's own result or failure is what counts
            pass
        worlds._local.world = None
        baton.finish(rank, failure)


def _stop(cluster: Cluster, threads: list[threading.Thread], started: set[int], timeout_s: float) -> str:
    """End a launch past its timeout: the launch's failure set, the waiting ranks woken, every rank's thread joined
    (each stops at its next wait, the computing one too, for at most ``STOP_S``); what happened, naming the rank
    that held the turn (the slow one: alive, started and not waiting for its peers) and any that did not stop."""
    baton = cluster.baton
    waiting = set(baton.waiting)  # read before the failure wakes them
    alive = [r for r, t in enumerate(threads) if t.is_alive()]
    slow = [r for r in alive if r in started and r not in waiting]
    if baton.failure is None:  # set without the baton, which the slow rank holds while it computes
        baton.failure = f"launch timed out after {timeout_s:g} s"
    if baton.lock.acquire(timeout=1.0):
        for cond in baton.turn:
            cond.notify_all()
        baton.lock.release()
    deadline = time.monotonic() + STOP_S
    for t in threads:
        t.join(timeout=max(deadline - time.monotonic(), 0.0))
    what = f"launch_inprocess timed out after {timeout_s:g} s: "
    what += (f"rank(s) {slow} held the turn (computing, not waiting for their peers)" if slow else
             "no rank held the turn")
    if others := [r for r in alive if r not in slow]:
        what += f"; ranks {others} {'waited for them' if slow else 'had not finished'}"
    if stuck := [r for r, t in enumerate(threads) if t.is_alive()]:
        what += f"; ranks {stuck} did not stop within {STOP_S:g} s"
    return what


def launch_inprocess(fn, world_size: int, *args, timeout_s: float = 60.0, **kw) -> list:
    """Run ``fn(rank, *args, **kw)`` on ``world_size`` in-process ranks and return their results in rank order.

    The ranks run one at a time (see :mod:`lrmoe.runtime.inprocess.group`), on one intra-op thread each turn as the
    fork launcher's ranks do. A rank that raises ends the launch: :class:`LaunchError` carries its traceback (the
    ranks waiting for it stop at their next wait). ``timeout_s`` bounds the whole launch; a launch that outlives it
    ends with a LaunchError naming the rank that held the turn (computing, not waiting for its peers), once every
    rank has stopped at its next wait (:func:`_stop`, at most ``STOP_S`` more). The exception hook each rank's
    ``init_process_group`` installs (torch's, prefixing "[rankN]:") is the caller's again when the launch ends.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if not _one_launch.acquire(blocking=False):
        raise ValueError("launch_inprocess runs one launch at a time in a process")
    threads_before = torch.get_num_threads()
    outside = c10d._world
    worlds = _ThreadWorlds(outside)
    cluster = Cluster(world_size)
    results: dict[int, object] = {}
    started: set[int] = set()  # the ranks that have had their first turn
    rng = torch.get_rng_state()
    hook = sys.excepthook  # torch's init_process_group wraps it in a per-rank one, process-wide
    try:
        torch.set_num_threads(1)
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        c10d._world = worlds
        threads = [threading.Thread(target=_rank_main, name=f"lrmoe-rank{r}", daemon=True,
                                    args=(cluster, r, rng.clone(), worlds, fn, args, kw, results, started))
                   for r in range(world_size)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        for t in threads:
            t.join(timeout=max(deadline - time.monotonic(), 0.0))
        if any(t.is_alive() for t in threads):
            raise LaunchError(_stop(cluster, threads, started, timeout_s))
        if cluster.baton.failure is not None:
            raise LaunchError(cluster.baton.failure)
        return [results[r] for r in range(world_size)]
    finally:
        sys.excepthook = hook
        c10d._world = outside
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        torch.set_num_threads(threads_before)
        _one_launch.release()
