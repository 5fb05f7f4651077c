"""Distributed plumbing of the expert-parallel layer (kept out of the pure planning modules):

* :mod:`~lrmoe.runtime.distributed.comm`: the differentiable variable-size all-to-all, point-to-point exchange,
torchrun setup;
* :mod:`~lrmoe.runtime.distributed.launch`: the fork + gloo launcher for tests and CPU experiments (fails fast, never
hangs);
* :mod:`~lrmoe.runtime.distributed.torchrun`: torchrun found from its environment, and ``record`` for a script's main;
* :mod:`~lrmoe.runtime.distributed.mesh`: the expert-parallel x data-parallel device mesh (EP inside a node);
* :mod:`~lrmoe.runtime.distributed.replica`: the replica substrate: slots, replica gradient sync, sharded Adam,
redistribution;
* :mod:`~lrmoe.runtime.distributed.accounting`: per-rank, per-phase counters and the formulas they must match.

The layer itself is :class:`lrmoe.runtime.layer.EPMoELayer`.
"""

from lrmoe.runtime.distributed.accounting import Accountant, check_accounting, expected_layer, expected_step
from lrmoe.runtime.distributed.comm import (DistInfo, all_gather_rows, all_to_all_rows, exchange_rows,
                                            init_process_group_from_env)
from lrmoe.runtime.distributed.launch import LaunchError, launch
from lrmoe.runtime.distributed.replica import AdamConfig, RangeGroups, ReplicaStore, shard_sizes, sync_plan

__all__ = ["Accountant", "check_accounting", "expected_layer", "expected_step", "DistInfo", "all_gather_rows",
           "all_to_all_rows", "exchange_rows", "init_process_group_from_env", "LaunchError", "launch", "AdamConfig",
           "RangeGroups", "ReplicaStore", "shard_sizes", "sync_plan"]
