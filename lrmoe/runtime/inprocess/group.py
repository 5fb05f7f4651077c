"""An in-process ``torch.distributed`` backend: N ranks as N threads of one process, every exchange a local gather.

The ranks take turns: one lock (the *baton*) is held by the rank that computes, and a rank gives it up only where
it waits for its peers (a collective, a receive). So the ranks' code runs one rank at a time, as N processes would
run it on one core, with no data race between them and no contention for the interpreter; what a rank computes
depends only on its own data and on what its collectives return, never on the order the turns fall in. The global
CPU random generator, which every process has to itself, is saved and restored at each turn.

:class:`InProcessGroup` is the process group every rank's ``torch.distributed`` calls reach (registered as the
backend ``"inprocess"`` by :mod:`lrmoe.runtime.inprocess.launch`). Each collective is a *round*: every member
deposits its tensors; the last to arrive computes every member's outputs from all the inputs at once (sums fold in
the order of gloo's ring, so they match the distributed runtime's bit for bit), then the others resume. Sends are
copied into the receiver's mailbox and never wait; a receive waits for its message. A wait that no rank can end
(every live rank waiting, none's condition met) raises on every rank at once instead of hanging.

Supported: all_reduce (sum and product in gloo's order, max, min), all_gather, all_to_all_single (uneven splits),
broadcast, gather and scatter (torch.distributed.checkpoint's planning), barrier, send, recv, and so
batch_isend_irecv when each rank posts its send to a peer before its receive from it (as
:func:`lrmoe.runtime.distributed.comm.exchange_rows` does, in ascending peer order).
"""

from __future__ import annotations

import threading
from collections import deque

import torch
import torch.distributed as dist
from torch.futures import Future

BACKEND = "inprocess"


class PeerFailed(RuntimeError):
    """Raised in the ranks that wait when another rank has failed (its own error is the one reported)."""


class Baton:
    """The turn-taking of one launch's ranks: the lock a computing rank holds, one condition per rank on it, and
    what every waiting rank waits for (for the deadlock check)."""

    def __init__(self, world_size: int):
        self.lock = threading.Lock()
        self.turn = [threading.Condition(self.lock) for _ in range(world_size)]
        self.waiting: dict[int, object] = {}  # rank -> the condition it waits for
        self.runnable: deque[int] = deque()  # ranks whose wait may have ended, in the order they were woken
        self.alive = set(range(world_size))
        self.failure: str | None = None
        self.rng: dict[int, torch.Tensor] = {}

    def start(self, rank: int, seed_state: torch.Tensor) -> None:
        """Take the baton for the first time (the rank's thread begins its work)."""
        self.lock.acquire()
        self.rng[rank] = seed_state
        torch.set_rng_state(seed_state)

    def finish(self, rank: int, failure: str | None = None) -> None:
        """The rank is done (``failure``: its traceback): it leaves the turn-taking and gives the baton up."""
        self.alive.discard(rank)
        if failure is not None and self.failure is None:
            self.failure = failure
        self._check_deadlock()
        if self.failure is not None:
            for cond in self.turn:
                cond.notify_all()
        else:
            self._pass()
        self.lock.release()

    def wake(self, ranks) -> None:
        """Mark ``ranks`` as possibly able to go on (a round they wait for completed, a message arrived): the baton
        passes to one of them when its holder next waits (:meth:`_pass`), so no other thread wakes only to find
        the baton held."""
        self.runnable.extend(ranks)

    def _pass(self) -> None:
        """Wake the one waiting rank that takes the baton next: the first woken whose wait has ended, else any
        whose has (a rank woken before its condition held is looked at again here). Called with the lock held,
        right before the holder gives it up."""
        while self.runnable:
            r = self.runnable.popleft()
            ready = self.waiting.get(r)
            if ready is not None and ready():
                self.turn[r].notify()
                return
        for r, ready in self.waiting.items():
            if ready():
                self.turn[r].notify()
                return

    def wait_for(self, rank: int, ready) -> None:
        """Give the baton up until ``ready()`` holds (the caller holds it, and holds it again on return)."""
        if ready():
            return
        self.rng[rank] = torch.get_rng_state()
        self.waiting[rank] = ready
        try:
            while not ready():
                self._check_deadlock()
                if self.failure is not None:
                    for cond in self.turn:
                        cond.notify_all()
                    raise PeerFailed(self.failure)
                self._pass()
                self.turn[rank].wait(timeout=5.0)  # a wake-up is targeted; the timeout only re-checks failure
        finally:
            del self.waiting[rank]
        torch.set_rng_state(self.rng[rank])

    def _check_deadlock(self) -> None:
        """Record a deadlock as the launch's failure: every live rank waits, and no wait can end."""
        if self.failure is None and self.alive and set(self.waiting) == self.alive and \
                not any(ready() for ready in self.waiting.values()):
            self.failure = (f"deadlock: ranks {sorted(self.alive)} all wait for peers and none can proceed (a "
                            f"collective that not every rank of its group calls, or a receive without its send)")


class _Round:
    """One collective call of every member of a group: their arguments, until the last arrives and completes it."""

    def __init__(self, size: int):
        self.args: list = [None] * size
        self.arrived = 0
        self.done = False
        self.left = size  # members that have not yet resumed after completion


class Hub:
    """What the members of one group share: the rounds of its collectives (the i-th call of every member is round
    i) and the mailboxes of its point-to-point messages (FIFO per sender, receiver and tag)."""

    def __init__(self, baton: Baton, global_ranks: list[int]):
        self.baton, self.global_ranks = baton, list(global_ranks)
        self.rounds: dict[int, _Round] = {}
        self.calls = [0] * len(global_ranks)
        self.mail: dict[tuple[int, int, int], deque] = {}

    def collective(self, me: int, args, complete) -> None:
        """Deposit ``args`` as member ``me``; the last member runs ``complete(all members' args)``."""
        i = self.calls[me]
        self.calls[me] += 1
        rnd = self.rounds.setdefault(i, _Round(len(self.global_ranks)))
        rnd.args[me] = args
        rnd.arrived += 1
        if rnd.arrived == len(self.global_ranks):
            complete(rnd.args)
            rnd.done = True
            self.baton.wake(r for k, r in enumerate(self.global_ranks) if k != me)
        else:
            self.baton.wait_for(self.global_ranks[me], lambda: rnd.done)
        rnd.left -= 1
        if not rnd.left:
            del self.rounds[i]

    def send(self, src: int, dst: int, tag: int, tensor: torch.Tensor) -> None:
        self.mail.setdefault((src, dst, tag), deque()).append(tensor.detach().clone())
        self.baton.wake([self.global_ranks[dst]])

    def recv(self, src: int, dst: int, tag: int, out: torch.Tensor) -> None:
        box = self.mail.setdefault((src, dst, tag), deque())
        self.baton.wait_for(self.global_ranks[dst], lambda: bool(box))
        msg = box.popleft()
        if msg.numel() != out.numel() or msg.dtype != out.dtype:
            raise RuntimeError(f"recv from rank {self.global_ranks[src]}: a message of {msg.numel()} {msg.dtype} "
                               f"arrived for a buffer of {out.numel()} {out.dtype}")
        out.copy_(msg.view_as(out))


def _done(result) -> dist.Work:
    fut = Future()
    fut.set_result(result)
    return torch._C._distributed_c10d._create_work_from_future(fut)


# gloo's ring all-reduce (its default algorithm on CPU): the buffer is cut into N chunks of equal size (the last
# ones shorter or empty), chunk c's partial sum travels the ring from rank c - 1 downwards and ends at rank c, so
# its elements are the left fold x_{c-1} + x_{c-2} + ... + x_c (ranks mod N). The chunk size follows from gloo's
# segments: at least 2N of them, a multiple of N, none over 1 MiB. Folding in the same order gives gloo's sums bit
# for bit (tests/test_emulated.py checks it against gloo).
GLOO_MAX_SEGMENT_BYTES = 1 << 20


def ring_chunk(numel: int, element_size: int, world_size: int) -> int:
    """Elements per chunk of gloo's ring all-reduce of ``numel`` elements over ``world_size`` ranks."""
    per_segment_max = max(1, GLOO_MAX_SEGMENT_BYTES // element_size)
    segments = max(-(-numel // per_segment_max), 2 * world_size)
    segments = -(-segments // world_size) * world_size
    return segments // world_size * -(-numel // segments)


def ring_reduce(tensors: list[torch.Tensor], op) -> torch.Tensor:
    """The members' tensors reduced as gloo's ring all-reduce reduces them (sum and product in its order; max and
    min are exact in any order)."""
    op = getattr(op, "op", op)  # a ReduceOp object, or its RedOpType
    N = len(tensors)
    flat = [t.reshape(-1) for t in tensors]
    if op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN):
        acc = flat[0].clone()
        for t in flat[1:]:
            (torch.maximum if op == dist.ReduceOp.MAX else torch.minimum)(acc, t, out=acc)
        return acc.view_as(tensors[0])
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.PRODUCT):
        raise NotImplementedError(f"the in-process backend reduces by sum, product, max or min (as gloo), not {op}")
    n = flat[0].numel()
    chunk = ring_chunk(n, flat[0].element_size(), N)
    acc = torch.empty_like(flat[0])
    for c in range(N):
        lo, hi = min(c * chunk, n), min((c + 1) * chunk, n)
        if lo >= hi:
            continue
        part = acc[lo:hi]
        part.copy_(flat[(c - 1) % N][lo:hi])
        for j in range(1, N):
            x = flat[(c - 1 - j) % N][lo:hi]
            part.add_(x) if op == dist.ReduceOp.SUM else part.mul_(x)
    return acc.view_as(tensors[0])


def _offsets(splits: list[int], total: int, size: int) -> tuple[list[int], list[int]]:
    if not splits:
        if total % size:
            raise ValueError(f"all_to_all_single without split sizes needs rows divisible by {size}, got {total}")
        splits = [total // size] * size
    starts = [sum(splits[:k]) for k in range(size)]
    return list(splits), starts


class InProcessGroup(dist.ProcessGroup):
    """One rank's view of one group of an in-process launch (see the module doc)."""

    def __init__(self, hub: Hub, rank: int, size: int):
        super().__init__(rank, size)
        self.hub, self.me = hub, rank

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def group_name(self) -> str:
        return f"inprocess:{','.join(map(str, self.hub.global_ranks))}"

    # -- collectives ---------------------------------------------------------------------------------------------
    def allreduce(self, tensor_list, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def complete(args):
            for k in range(len(tensor_list)):
                total = ring_reduce([a[k] for a in args], op)
                for a in args:
                    a[k].copy_(total)

        self.hub.collective(self.me, tensor_list, complete)
        return _done(tensor_list)

    def allgather(self, output_tensors, input_tensors, opts=None):
        def complete(args):
            for outs, _ in args:
                for k, out_list in enumerate(outs):
                    for q, out in enumerate(out_list):
                        out.copy_(args[q][1][k])

        self.hub.collective(self.me, (output_tensors, input_tensors), complete)
        return _done(output_tensors)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        size = self.size()

        def complete(args):
            ins = [(inp, *_offsets(isp, inp.shape[0], size)) for _, inp, _, isp in args]
            for r, (out, _, osp, _) in enumerate(args):
                osplits, ostarts = _offsets(osp, out.shape[0], size)
                for q, (inp, isplits, istarts) in enumerate(ins):
                    if isplits[r] != osplits[q]:
                        raise RuntimeError(f"all_to_all_single: rank {q} sends {isplits[r]} rows to rank {r}, "
                                           f"which expects {osplits[q]}")
                    if osplits[q]:
                        out[ostarts[q]:ostarts[q] + osplits[q]].copy_(inp[istarts[r]:istarts[r] + isplits[r]])

        self.hub.collective(self.me, (output, input, list(output_split_sizes), list(input_split_sizes)), complete)
        return _done([output])

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def broadcast(self, tensor_list, opts=None):
        root = opts.rootRank if opts is not None else 0

        def complete(args):
            for k in range(len(tensor_list)):
                for a in args:
                    if a is not args[root]:
                        a[k].copy_(args[root][k])

        self.hub.collective(self.me, tensor_list, complete)
        return _done(tensor_list)

    def gather(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0

        def complete(args):  # the root's output lists receive every member's inputs
            for k, out_list in enumerate(args[root][0]):
                for q, out in enumerate(out_list):
                    out.copy_(args[q][1][k])

        self.hub.collective(self.me, (output_tensors, input_tensors), complete)
        return _done(output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0

        def complete(args):  # member q receives entry q of each of the root's input lists
            for q, (outs, _) in enumerate(args):
                for k, out in enumerate(outs):
                    out.copy_(args[root][1][k][q])

        self.hub.collective(self.me, (output_tensors, input_tensors), complete)
        return _done(output_tensors)

    def barrier(self, opts=None):
        self.hub.collective(self.me, None, lambda args: None)
        return _done(None)

    # -- point to point --------------------------------------------------------------------------------------------
    def send(self, tensors, dst, tag=0):
        for t in tensors:
            self.hub.send(self.me, dst, tag, t)
        return _done(None)

    def recv(self, tensors, src, tag=0):
        for t in tensors:
            self.hub.recv(src, self.me, tag, t)
        return _done(tensors)


class Cluster:
    """One launch: its baton and the hubs of its groups, found by the groups' names (the same on every rank)."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.baton = Baton(world_size)
        self.hubs: dict[str, Hub] = {}

    def group(self, opts, backend_options=None) -> InProcessGroup:
        """The backend's creator (torch's extended API): this rank's member of the named group."""
        ranks = list(opts.global_ranks_in_group) or list(range(self.world_size))
        hub = self.hubs.get(opts.group_id)
        if hub is None:
            hub = self.hubs[opts.group_id] = Hub(self.baton, ranks)
        elif hub.global_ranks != ranks:
            raise RuntimeError(f"group {opts.group_id!r} created with ranks {ranks} and {hub.global_ranks}")
        return InProcessGroup(hub, opts.group_rank, opts.group_size)
