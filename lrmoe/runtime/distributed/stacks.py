"""Where a rank is: its Python stack on request, and whether it waits inside a ``torch.distributed`` call.

A launcher whose rank failed in a collective (a timeout, or a peer's closed connection) needs the rank(s) that never
arrived, not the ones that waited for them. Each rank arms :func:`arm_stack_dump` when it starts: on
:data:`STACK_SIGNAL` the interpreter's ``faulthandler`` writes every thread's stack into a file of the launch folder,
from the signal handler itself, so a rank blocked in C code (a gloo wait, a sleep) answers too. :func:`read_stacks`
asks the given ranks and parses the answers; a rank whose innermost frame lies outside ``torch.distributed`` did not
arrive at the collective its peers wait in. :func:`collective_of` says the same of an exception a rank raised.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import time
import traceback
from dataclasses import dataclass

import torch.distributed as dist

STACK_SIGNAL = signal.SIGUSR1  # a launcher's request to its rank: dump your Python stack into the launch folder
_DIST_DIR = os.path.dirname(dist.__file__) + os.sep  # torch.distributed's source folder
_FRAME = re.compile(r'File "(?P<path>.*)", line (?P<line>\d+) in (?P<name>.*)')


def stack_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"stack-rank{rank}.txt")


def arm_stack_dump(folder: str, rank: int) -> None:
    """In a rank: on :data:`STACK_SIGNAL`, write every thread's stack into this rank's file of ``folder``."""
    out = open(stack_file(folder, rank), "w")  # stays open for the process's life: faulthandler writes to its fd
    faulthandler.register(STACK_SIGNAL, file=out, all_threads=True)


def _dist_call(frames_outer_first: list[tuple[str, str]]) -> str | None:
    """The outermost ``torch.distributed`` function of a stack (frames as (file, function), outermost first), past
    torch's logging wrappers; None when no frame is in ``torch.distributed``."""
    inside = [name for path, name in frames_outer_first if path.startswith(_DIST_DIR)]
    if not inside:
        return None
    return next((name for name in inside if not name.startswith("_") and name != "wrapper"), inside[0])


def collective_of(exc: BaseException) -> str | None:
    """The ``torch.distributed`` call ``exc`` was raised in (e.g. "all_reduce"), or None when it was raised outside
    one: a rank whose collective failed had arrived at it."""
    return _dist_call([(f.filename, f.name) for f in traceback.extract_tb(exc.__traceback__)])


@dataclass(frozen=True)
class RankStack:
    """One rank's main-thread stack: ``frames`` innermost first ('File "...", line N in f'), ``collective`` the
    ``torch.distributed`` call it waits in (None: it is elsewhere, e.g. it never arrived)."""

    frames: tuple[str, ...]
    collective: str | None

    @property
    def where(self) -> str:
        """Its innermost frame, or a note that the stack is unknown."""
        return self.frames[0] if self.frames else "an unknown place (its stack was empty)"


def parse_stack(dump: str, entry: str) -> RankStack | None:
    """The main thread's stack in a ``faulthandler`` dump: the thread whose frames include the function ``entry``,
    cut below it; None while the dump holds no such thread (e.g. it is still being written: other threads, such as
    a planner's background worker, may come first)."""
    threads = [[line.strip() for line in block.splitlines() if _FRAME.search(line)]
               for block in re.split(r"\n\s*\n", dump) if "most recent call first" in block]
    main = next((t for t in threads if any(line.endswith(f" in {entry}") for line in t)), None)
    if main is None:
        return None
    ends = [i for i, line in enumerate(main) if line.endswith(f" in {entry}")]
    main = main[:ends[-1] + 1]  # the frames that started the process are noise
    parsed = [_FRAME.search(line) for line in main]
    in_dist = parsed[0]["path"].startswith(_DIST_DIR)  # the innermost frame: where the rank is blocked
    collective = _dist_call([(m["path"], m["name"]) for m in reversed(parsed)]) if in_dist else None
    return RankStack(tuple(main), collective)


def read_stacks(pids: dict[int, int], folder: str, entry: str, wait_s: float = 5.0) -> dict[int, RankStack]:
    """Ask each rank (``pids``: rank -> process id; each armed by :func:`arm_stack_dump`, its main thread started in
    the function ``entry``) for its stack and wait at most ``wait_s`` for the answers. A rank that did not answer,
    has exited or is not armed yet (its file is missing: the signal's default action would end it) is left out."""
    sizes = {}
    for rank, pid in pids.items():
        if not os.path.exists(stack_file(folder, rank)):
            continue
        sizes[rank] = os.path.getsize(stack_file(folder, rank))
        try:
            os.kill(pid, STACK_SIGNAL)
        except ProcessLookupError:
            sizes.pop(rank)
    stacks: dict[int, RankStack] = {}
    deadline = time.monotonic() + wait_s
    while len(stacks) < len(sizes) and time.monotonic() < deadline:
        time.sleep(0.05)  # a dump takes microseconds once the rank runs (a loaded machine may delay it)
        for rank, before in sizes.items():
            if rank in stacks:
                continue
            with open(stack_file(folder, rank)) as f:
                text = f.read()
            if len(text) > before and (stack := parse_stack(text[before:], entry)) is not None:
                stacks[rank] = stack
    return stacks
