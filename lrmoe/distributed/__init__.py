"""Distributed plumbing of the expert-parallel layer (kept out of the pure planning modules):

* :mod:`~lrmoe.distributed.comm`: the differentiable variable-size all-to-all, point-to-point exchange, torchrun setup;
* :mod:`~lrmoe.distributed.launch`: the fork + gloo launcher for tests and CPU experiments (fails fast, never hangs);
* :mod:`~lrmoe.distributed.replica`: the replica substrate: slots, replica gradient sync, sharded Adam, redistribution;
* :mod:`~lrmoe.distributed.accounting`: per-rank, per-phase counters and the formulas they must match.

The layer itself is :class:`lrmoe.layer.EPMoELayer`.
"""

from .accounting import Accountant, check_counts, expected_layer, expected_step
from .comm import DistInfo, all_gather_rows, all_to_all_rows, exchange_rows, init_process_group_from_env
from .launch import LaunchError, launch
from .replica import AdamConfig, RangeGroups, ReplicaStore, shard_sizes, sync_plan

__all__ = ["Accountant", "check_counts", "expected_layer", "expected_step", "DistInfo", "all_gather_rows",
           "all_to_all_rows", "exchange_rows", "init_process_group_from_env", "LaunchError", "launch", "AdamConfig",
           "RangeGroups", "ReplicaStore", "shard_sizes", "sync_plan"]
