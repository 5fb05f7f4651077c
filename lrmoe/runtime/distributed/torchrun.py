"""torchrun as the way in: a script that launches ranks finds out from its environment whether torchrun started it,
and then runs as one of torchrun's ranks; otherwise it forks its own (:mod:`lrmoe.runtime.distributed.launch`).

torchrun (``torch.distributed.run``; ``srun torchrun ...`` under SLURM, docs/cluster.md) sets ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and ``TORCHELASTIC_RUN_ID`` in every rank it starts;
:func:`torchrun_env` reads them (all or none: a partial set is an error, not a guess). :func:`record` wraps a
script's ``main`` in torch's ``elastic.multiprocessing.errors.record`` under torchrun, so a rank's exception
reaches torchrun's error report, and torchrun ends every rank when one fails (its agents stop their ranks; the
ranks of other nodes lose their peers' sockets and fail in their next collective).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Mapping

__all__ = ["TORCHRUN_VARS", "TorchrunEnv", "launched_world_size", "record", "torchrun_env"]

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


@dataclass(frozen=True)
class TorchrunEnv:
    """Where torchrun put this process."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int  # the ranks of this node
    run_id: str

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """This process's torchrun environment, or None when torchrun did not start it. ValueError when only some of
    :data:`TORCHRUN_VARS` are set, or they do not make sense together."""
    env = os.environ if environ is None else environ
    present = [name for name in TORCHRUN_VARS if name in env]
    if not present:
        return None
    missing = [name for name in TORCHRUN_VARS if name not in env]
    if missing:
        raise ValueError(f"the environment sets {present} but not {missing}: run the script under torchrun (which "
                         f"sets all of {list(TORCHRUN_VARS)}), or unset them to use the fork launcher")
    try:
        found = TorchrunEnv(int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]),
                            int(env["LOCAL_WORLD_SIZE"]), env["TORCHELASTIC_RUN_ID"])
    except ValueError:
        raise ValueError(f"torchrun's variables must be integers: "
                         f"{ {name: env[name] for name in TORCHRUN_VARS[:4]} }") from None
    if not (0 <= found.rank < found.world_size and 0 <= found.local_rank < found.local_world_size
            and found.local_world_size <= found.world_size):
        raise ValueError(f"inconsistent torchrun environment: {found}")
    return found


def launched_world_size(fork_ranks: int, environ: Mapping[str, str] | None = None) -> int:
    """The ranks of this run: torchrun's ``WORLD_SIZE`` under torchrun, else the fork launcher's ``fork_ranks``."""
    env = torchrun_env(environ)
    return fork_ranks if env is None else env.world_size


def record(main):
    """``main`` wrapped in ``torch.distributed.elastic.multiprocessing.errors.record`` when it runs under torchrun
    (the rank's exception is written to torchrun's error file, which its failure report prints); as it is
    otherwise (a fork-launched run, a test calling ``main``)."""
    from torch.distributed.elastic.multiprocessing.errors import record as elastic_record

    recorded = elastic_record(main)

    @functools.wraps(main)
    def run(*args, **kwargs):
        return (recorded if torchrun_env() is not None else main)(*args, **kwargs)

    return run
