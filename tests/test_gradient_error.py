"""lrmoe.harness.gradient_error: the errors are over every rank's shards together (all-reduced), as if one process
held the whole gradient, and every rank gets the same numbers."""

import math

import torch

from lrmoe.harness.gradient_error import gradient_errors
from lrmoe.runtime.distributed.launch import launch


def _shards(rank: int):
    gen = torch.Generator().manual_seed(rank)
    full_EW, full_dx = torch.randn(3, 5, generator=gen), torch.randn(4, 6, generator=gen)
    return full_EW + 0.1 * torch.randn(3, 5, generator=gen), full_EW, full_dx + 0.3, full_dx


def _errors(rank: int) -> dict:
    return gradient_errors(*_shards(rank))


def test_errors_are_taken_over_all_ranks_shards_together():
    per_rank = launch(_errors, 2, timeout_s=120)
    assert per_rank[0] == per_rank[1]
    got, full, dx, full_dx = (torch.cat(parts).double() for parts in zip(_shards(0), _shards(1)))
    want = {"grad_rel_err": float((got - full).norm() / full.norm()),
            "grad_cos": float((got * full).sum() / (got.norm() * full.norm())),
            "dx_rel_err": float((dx - full_dx).norm() / full_dx.norm())}
    for key, value in want.items():
        assert math.isclose(per_rank[0][key], value, rel_tol=1e-12), key
    # the full gradient against itself: no error
    same = launch(lambda rank: gradient_errors(_shards(rank)[1], _shards(rank)[1], _shards(rank)[3],
                                               _shards(rank)[3]), 2, timeout_s=120)[0]
    assert same["grad_rel_err"] == 0.0 and same["dx_rel_err"] == 0.0 and math.isclose(same["grad_cos"], 1.0)
