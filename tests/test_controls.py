"""The frontier's reweighted random controls (docs/protocols/frontier.md §10.2): the registry's "-random-unbiased" and
SYMI's "-unbiased" trim are uniform inclusion at the quota with kept pairs scaled by 1/p (Horvitz-Thompson), beside the
random top-k controls (uniform subset, no reweighting), on the same quotas as the systems they control."""

import pytest
import torch

from lrmoe.recal.backward_config import BackwardConfig
from lrmoe.recal.recalibrate import Recalibration, score_and_select
from lrmoe.sim.simulated_systems import work_key
from lrmoe.systems import RHOS, get_system


def same_plans(a, b) -> bool:
    """The same policy factory, compaction and optimizer: the same quotas, so only which pairs fill them differs."""
    return (a.make, a.backward.compact, a.sharded_optimizer) == (b.make, b.backward.compact, b.sharded_optimizer)


@pytest.mark.parametrize("rho", RHOS)
def test_controls_share_the_quotas_and_differ_only_in_selection(rho):
    metric, ctrl = get_system(f"lrmoe-rho{rho:g}-unbiased"), get_system(f"lrmoe-rho{rho:g}-random-unbiased")
    assert same_plans(ctrl, metric)
    assert work_key(ctrl) != work_key(metric)  # priced apart: random selection runs no metric
    assert ctrl.backward == BackwardConfig(metric="random", mode="unbiased")
    assert get_system(f"lrmoe-rho{rho:g}-random").backward == BackwardConfig(metric="random", mode="topk")
    trim, trim_hT = get_system(f"symi-dropless-rho{rho:g}"), get_system(f"symi-dropless-rho{rho:g}-unbiased")
    assert same_plans(trim_hT, trim) and trim_hT.recalibrated
    assert (trim.backward.mode, trim_hT.backward.mode) == ("topk", "unbiased")
    assert trim_hT.backward.metric == "random"


def draws(mode: str, reps: int = 4000):
    """Many backward selections of the random metric over groups of sizes 5, 8, 3 with quotas 2, 6, 3."""
    group_P = torch.tensor([0] * 5 + [1] * 8 + [2] * 3)
    quota_Q = torch.tensor([2, 6, 3])
    grad_o_PD = torch.randn(len(group_P), 4, generator=torch.Generator().manual_seed(0))
    rec = Recalibration("random", mode, group_P, quota_Q, generator=torch.Generator().manual_seed(1))
    sel = [score_and_select(rec, grad_o_PD)[1] for _ in range(reps)]
    return group_P, quota_Q, torch.stack([s.keep_P for s in sel]).double(), torch.stack([s.scale_P for s in sel])


def test_random_unbiased_is_uniform_inclusion_with_horvitz_thompson_scale():
    group_P, quota_Q, keep_RP, scale_RP = draws("unbiased")
    size_Q = torch.bincount(group_P)
    p_P = (quota_Q / size_Q).double()[group_P]
    # every draw keeps exactly the quota of every group, and scales each kept pair by 1/p = size / quota
    assert torch.equal(torch.stack([(keep_RP * (group_P == q)).sum(1) for q in range(3)], 1),
                       quota_Q.double().expand(len(keep_RP), 3))
    kept = keep_RP.bool()
    assert torch.allclose(scale_RP[kept].double(), (1 / p_P).expand_as(keep_RP)[kept], rtol=1e-6)
    assert bool((scale_RP[~kept] == 0).all())
    # uniform inclusion: each pair's frequency is quota / size (binomial sd below 0.008 at 4,000 draws)
    assert torch.allclose(keep_RP.mean(0), p_P, atol=0.03)
    # Horvitz-Thompson: the scaled sum of any per-pair value is unbiased for the full sum
    value_P = torch.linspace(-1.0, 2.0, len(group_P), dtype=torch.float64)
    estimate = (scale_RP.double() * value_P).sum(1)
    assert float(estimate.mean()) == pytest.approx(float(value_P.sum()), abs=4 * float(estimate.std()) / 4000**0.5)


def test_random_topk_keeps_a_uniform_subset_unscaled():
    group_P, quota_Q, keep_RP, scale_RP = draws("topk")
    p_P = (quota_Q / torch.bincount(group_P)).double()[group_P]
    assert torch.allclose(keep_RP.mean(0), p_P, atol=0.03)
    assert torch.equal(scale_RP.double(), keep_RP)  # kept pairs scale 1: no reweighting
