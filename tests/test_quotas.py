"""Quotas: caps (budget and cap modes), per-expert floor, and retention quotas with their excess report."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lrmoe.planner.quotas import budget_caps, budget_level, expert_floor, memory_cap_pairs, rank_caps, retention_quotas

# --- caps and floor -------------------------------------------------------------------------------------------

def test_rank_caps_hand_cases():
    # mean 25, eps 0.1 -> ceil(27.5) = 28; the memory cap lowers rank 1 to 20
    loads = torch.tensor([10, 20, 30, 40])
    assert rank_caps(loads, 0.1).tolist() == [28, 28, 28, 28]
    assert rank_caps(loads, 0.1, torch.tensor([100, 20, 100, 100])).tolist() == [28, 20, 28, 28]
    assert rank_caps(loads, 0.1, 5).tolist() == [5, 5, 5, 5]
    # eps = 0 with a fractional mean (1.5) rounds up, so a balanced load keeps everything; 1.1 · 10 stays 11
    assert rank_caps(torch.tensor([1, 2]), 0.0).tolist() == [2, 2]
    assert rank_caps(torch.tensor([10, 10]), 0.1).tolist() == [11, 11]


def test_budget_caps_hand_cases():
    # mean 25: rho 0.75 -> ceil(18.75) = 19, rho 0.6 -> 15 exactly (0.6 read as 3/5, not the float below it)
    loads = torch.tensor([10, 20, 30, 40])
    assert budget_caps(loads, 0.75).tolist() == [19, 19, 19, 19]
    assert budget_caps(loads, 0.6).tolist() == [15, 15, 15, 15]
    assert budget_caps(loads, 1.0, torch.tensor([100, 12, 100, 100])).tolist() == [25, 12, 25, 25]
    # 0.6 · 50 is 30.000000000000004 in floats; the budget is 30. 0.1 · 30 stays 3
    assert budget_level(50, 1, 0.6) == 30 and budget_level(30, 1, 0.1) == 3
    assert budget_level(7, 2, 0.5) == 2 and budget_level(0, 4, 0.5) == 0


def test_expert_floor():
    # ceil(0.3 · 10) is 3 (not 4 from 3.0000000000000004); never more than the expert's pairs
    assert expert_floor(torch.tensor([10, 7, 0, 1]), 0.3).tolist() == [3, 3, 0, 1]
    assert expert_floor(torch.tensor([10]), 1.0).tolist() == [10]


def test_memory_cap_pairs():
    # (1000 - 3 · 100) / 64 = 10.9 -> 10; a budget below the slots gives 0
    assert memory_cap_pairs(1000, 3, 100, 64).tolist() == 10
    assert memory_cap_pairs(torch.tensor([1000., 200.]), 3, 100, 64).tolist() == [10, 0]


@pytest.mark.parametrize("call, match", [
    (lambda: rank_caps(torch.tensor([1, 2]), -0.1), "eps"),
    (lambda: rank_caps(torch.tensor([1, 2]), float("inf")), "eps"),
    (lambda: rank_caps(torch.tensor([1, 2]), 0.1, torch.tensor([-1, 3])), "mem_cap_pairs_N"),
    (lambda: budget_caps(torch.tensor([1, 2]), 0.0), "rho"),
    (lambda: budget_caps(torch.tensor([1, 2]), 1.2), "rho"),
    (lambda: budget_caps(torch.tensor([1, 2]), 0.5, -3), "mem_cap_pairs_N"),
    (lambda: expert_floor(torch.tensor([1]), 1.5), "gamma"),
    (lambda: expert_floor(torch.tensor([1]), -0.5), "gamma"),
    (lambda: memory_cap_pairs(100, 1, 10, 0), "pair_buffer_bytes"),
])
def test_caps_reject(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- retention quotas -----------------------------------------------------------------------------------------

def test_retention_quotas_hand_case():
    # N=2 ranks, one slot each: expert 0 on rank 0, expert 1 on rank 1.
    # fwd: source 0 sends 30 pairs to slot 0, source 1 sends 10 to slot 0 and 10 to slot 1
    # loads [40, 10], mean 25 -> cap 25 (eps 0); rank 0 trims 15 over its groups 30 : 10 -> 11 and 4
    fwd = torch.tensor([[30, 0], [10, 10]])
    expert = torch.tensor([0, 1])
    cap = rank_caps(fwd.sum(0), 0.0)
    keep, excess = retention_quotas(fwd, expert, cap, 0.0)
    assert cap.tolist() == [25, 25]
    assert keep.tolist() == [[19, 0], [6, 10]] and excess.tolist() == [0, 0]
    # gamma 0.9: expert 0 must keep ceil(0.9 · 40) = 36, all on rank 0: only 4 can go, 11 above the cap remain
    keep, excess = retention_quotas(fwd, expert, cap, 0.9)
    assert int(keep[:, 0].sum()) == 36 and excess.tolist() == [11, 0]


def test_retention_quotas_counts_moved_pairs_as_kept():
    # 2 ranks × 2 slots, expert 0 on slots 0 and 2. Source 1's 10 pairs moved from slot 0 to slot 2 (its home):
    # they land on rank 1 and are never trimmed; rank 0 keeps 20 staying pairs within its cap
    fwd = torch.tensor([[20, 0, 0, 0], [10, 0, 0, 0]])
    flows = torch.tensor([[1, 0, 2, 10]])
    keep, excess = retention_quotas(fwd, torch.tensor([0, 1, 0, 2]), torch.tensor([20, 20]), 0.0, flows)
    assert keep.tolist() == fwd.tolist() and excess.tolist() == [0, 0]
    with pytest.raises(ValueError, match="above its cap"):
        retention_quotas(fwd, torch.tensor([0, 1, 0, 2]), torch.tensor([20, 5]), 0.0, flows)


@st.composite
def quota_inputs(draw):
    N = draw(st.integers(1, 4))
    S = draw(st.integers(1, 3))
    E = draw(st.integers(1, N * S))
    expert = draw(st.lists(st.integers(-1, E - 1), min_size=N * S, max_size=N * S))
    fwd = [[draw(st.integers(0, 30)) if e >= 0 else 0 for e in expert] for _ in range(N)]
    cap = draw(st.lists(st.integers(0, 60), min_size=N, max_size=N))
    gamma = draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))
    return torch.tensor(fwd).view(N, N * S), torch.tensor(expert), torch.tensor(cap), gamma


@settings(max_examples=200, deadline=None)
@given(quota_inputs())
def test_retention_quotas_properties(inputs):
    fwd, expert, cap, gamma = inputs
    N, G = fwd.shape
    S = G // N
    keep, excess = retention_quotas(fwd, expert, cap, gamma)
    assert bool((keep >= 0).all()) and bool((keep <= fwd).all())  # quotas <= counts
    load = keep.sum(0).view(N, S).sum(1)
    fwd_load = fwd.sum(0).view(N, S).sum(1)
    # over-cap ranks end exactly at their cap plus what the floor forced; the others keep everything
    assert torch.equal(load, torch.minimum(fwd_load, cap) + excess)
    assert bool((excess >= 0).all())
    under = fwd_load <= cap
    assert torch.equal(keep.view(N, N, S)[:, under], fwd.view(N, N, S)[:, under])  # under-cap ranks untouched
    hosted = expert >= 0
    per_expert = lambda x: torch.zeros(int(expert.max()) + 1, dtype=torch.long).index_add_(  # noqa: E731
        0, expert[hosted], x.sum(0)[hosted])
    assert bool((per_expert(keep) >= expert_floor(per_expert(fwd), gamma)).all())  # the floor holds
    if gamma == 0.0:
        assert bool((excess == 0).all())
    again = retention_quotas(fwd, expert, cap, gamma)
    assert torch.equal(again[0], keep) and torch.equal(again[1], excess)  # same input, same quotas


def test_retention_quotas_rejects():
    fwd = torch.tensor([[1, 2], [3, 4]])
    with pytest.raises(ValueError, match="cap_N"):
        retention_quotas(fwd, torch.tensor([0, 1]), torch.tensor([1, 2, 3]), 0.1)
    with pytest.raises(ValueError, match="expert_G"):
        retention_quotas(fwd, torch.tensor([0]), torch.tensor([1, 2]), 0.1)
    with pytest.raises(ValueError, match="gamma"):
        retention_quotas(fwd, torch.tensor([0, 1]), torch.tensor([1, 2]), 2.0)
