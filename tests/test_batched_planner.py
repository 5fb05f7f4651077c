"""The batched critical-path planner (lrmoe.planner.batched): every layer's plan equals the per-layer ``plan_on``,
tensor for tensor, on many random micro-batches, with the edge cases (zero counts, one expert, one rank, a hot
expert whose pairs are all on one source, capacities below and above the demand), and for every registry system;
and the rewritten critical path (balanced fill, quotas, online replicas) equals the previous implementation
(lrmoe.planner.reference) tensor for tensor, for LRMoE, LRMoE at rho 0.75 and online replication at several shapes
and seeds, and for every registry system."""

import dataclasses

import pytest
import torch

import numpy as np

from lrmoe.planner import reference
from lrmoe.planner.batched import plan_layers, replica_index_LG
from lrmoe.planner.online import online_replicas
from lrmoe.planner.placement import replica_table
from lrmoe.planner.plan import LayerPlan
from lrmoe.planner.policies import Capacity, StaticEP, Symi, placement_popularity
from lrmoe.planner.quotas import retention_quotas
from lrmoe.planner.replica_routing import route_backward
from lrmoe.systems import SYSTEMS, SystemContext, get_system

FIELDS = [f.name for f in dataclasses.fields(LayerPlan)]


def _counts(gen: torch.Generator, n: int, e: int, case: int) -> torch.Tensor:
    if case == 0:
        return torch.zeros(n, e, dtype=torch.long)
    if case == 1:  # one hot expert, all its pairs from one source
        c = torch.zeros(n, e, dtype=torch.long)
        c[int(torch.randint(n, (1,), generator=gen)), int(torch.randint(e, (1,), generator=gen))] = 97
        return c
    skew = torch.rand(e, generator=gen) ** (1 + case)
    return (torch.rand(n, e, generator=gen) * skew * 80).long()


def _assert_equal(got: LayerPlan, want: LayerPlan, where) -> None:
    for f in FIELDS:
        a, b = getattr(got, f), getattr(want, f)
        if isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b), (where, f)
        else:
            assert a == b, (where, f)


def _check(policies, counts_LNE, placements, where):
    got = plan_layers(policies, counts_LNE, placements)
    for i, (p, plan) in enumerate(zip(policies, got)):
        _assert_equal(plan, p.plan_on(counts_LNE[i], placements[i]), (where, i, p.name))


@pytest.mark.parametrize("policy_of", [
    lambda n, e: StaticEP(), lambda n, e: Capacity(1.0), lambda n, e: Capacity(0.5, "gate"),
    lambda n, e: Capacity(2.0), lambda n, e: Symi(max(1, e // n) + 1), lambda n, e: Symi(max(1, e // n) + 2, 1.0),
    lambda n, e: Symi(max(1, e // n) + 1, 0.7)], ids=["static", "cap1", "cap0.5-gate", "cap2", "symi", "symi-cf1",
                                                       "symi-cf0.7"])
def test_vectorised_layers_equal_the_per_layer_plans(policy_of):
    gen = torch.Generator().manual_seed(11)
    for n, e in [(1, 1), (1, 5), (4, 4), (3, 12), (8, 16), (16, 64)]:
        policy = policy_of(n, e)
        layers = 6
        counts_LNE = torch.stack([_counts(gen, n, e, i % 5) for i in range(layers)])
        placements = [policy.placement(_counts(gen, n, e, 2 + i % 3).sum(0).double() + (i == 0), n,
                                       int(counts_LNE[i].sum())) for i in range(layers)]
        _check([policy] * layers, counts_LNE, placements, (n, e))


def test_every_registry_system_batched_equals_its_per_layer_plans():
    gen = torch.Generator().manual_seed(5)
    for n, e in [(1, 4), (2, 8), (4, 16)]:
        ctx = SystemContext(num_experts=e, num_ranks=n, spare_slots=1, pairs_per_rank=40, push_cost_rows=0.0)
        for name in SYSTEMS:
            policy = get_system(name).make_policy(ctx)
            counts_LNE = torch.stack([_counts(gen, n, e, i) for i in range(4)])
            placements = [policy.placement(placement_popularity(None if i == 0 else _counts(gen, n, e, 3).sum(0), e),
                                           n, int(counts_LNE[i].sum())) for i in range(4)]
            _check([policy] * 4, counts_LNE, placements, (name, n, e))


def test_mixed_policies_keep_their_layer_order_and_errors_name_the_layer():
    policies = [StaticEP(), Symi(3), Capacity(1.0), Symi(3)]
    counts = torch.randint(0, 9, (4, 2, 4))
    placements = [p.placement(torch.ones(4), 2, int(c.sum())) for p, c in zip(policies, counts)]
    _check(policies, counts, placements, "mixed")
    bad = [pl.clone() for pl in placements]
    bad[3][bad[3] == 2] = 0  # expert 2 loses its slots in layer 3
    counts[3, 0, 2] = 1
    with pytest.raises(ValueError, match="layer 1: expert 2 has"):  # layer 3 is the second of the Symi group
        plan_layers(policies, counts, bad)
    with pytest.raises(ValueError, match="non-negative"):
        plan_layers(policies, -counts, placements)


def test_replica_index_is_the_replica_tables():
    gen = torch.Generator().manual_seed(2)
    placements = torch.randint(-1, 5, (7, 3, 4), generator=gen)
    replicas_LE, replica_LG = replica_index_LG(placements.reshape(7, -1), 5)
    for i in range(7):
        table = replica_table(placements[i], 5)
        assert torch.equal(replicas_LE[i], table.replicas_E) and torch.equal(replica_LG[i], table.replica_G)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_on_the_device_the_plans_are_the_hosts():
    gen = torch.Generator().manual_seed(3)
    policy = Symi(5, 1.0)
    counts = torch.stack([_counts(gen, 8, 32, i % 5) for i in range(8)])
    placements = [policy.placement(_counts(gen, 8, 32, 3).sum(0).double(), 8, int(c.sum())) for c in counts]
    got = plan_layers([policy] * 8, counts.cuda(), placements)
    for i, plan in enumerate(got):
        assert plan.fwd_NG.is_cuda
        _assert_equal(plan, policy.plan_on(counts[i], placements[i]), i)


def test_chunks_of_layers_give_the_same_plans(monkeypatch):
    import lrmoe.planner.batched as batched

    gen = torch.Generator().manual_seed(9)
    policy = Symi(3, 1.0)
    counts = torch.stack([_counts(gen, 4, 8, i % 5) for i in range(7)])
    placements = [policy.placement(_counts(gen, 4, 8, 3).sum(0).double(), 4, int(c.sum())) for c in counts]
    monkeypatch.setattr(batched, "CPU_CHUNK_ELEMENTS", 2 * 4 * 12)  # two layers a chunk, the last one alone
    _check([policy] * 7, counts, placements, "chunked")


def _zipf_counts(gen: torch.Generator, n: int, e: int, pairs_per_rank: int, s: float) -> torch.Tensor:
    """A skewed micro-batch: every source draws ``pairs_per_rank`` pairs from one Zipf(s) popularity (shuffled)."""
    weight = (1.0 / torch.arange(1, e + 1, dtype=torch.float64) ** s)[torch.randperm(e, generator=gen)]
    return torch.stack([torch.bincount(torch.multinomial(weight, pairs_per_rank, True, generator=gen), minlength=e)
                        for _ in range(n)])


SHAPES = [(2, 8), (4, 16), (8, 32), (16, 64), (32, 128), (64, 256)]


@pytest.mark.parametrize("name", ["lrmoe", "lrmoe-rho0.75", "lrmoe-tight", "online-greedy", "online",
                                  "online-greedy-rho0.75"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_lrmoe_and_online_critical_path_equal_the_previous_planner_and_batched(name, seed):
    """plan_on (rewritten) == the previous implementation's, and plan_layers == plan_on, layer by layer, on skewed
    micro-batches at several sizes; plan == the previous plan too."""
    gen = torch.Generator().manual_seed(seed)
    for n, e in SHAPES:
        pairs = 8 * (64 if n < 32 else 16)
        ctx = SystemContext(num_experts=e, num_ranks=n, spare_slots=1 + seed % 2, pairs_per_rank=pairs,
                            push_cost_rows=0.0 if name.startswith("online-greedy") else 4.0)
        policy = get_system(name).make_policy(ctx)
        layers = 3
        counts_LNE = torch.stack([_zipf_counts(gen, n, e, pairs, 0.4 + 0.5 * i) for i in range(layers)])
        prev_LE = torch.stack([_zipf_counts(gen, n, e, pairs, 0.9).sum(0) for _ in range(layers)])
        placements = [policy.placement(placement_popularity(prev_LE[i], e), n, int(counts_LNE[i].sum()))
                      for i in range(layers)]
        for i in range(layers):
            _assert_equal(policy.plan_on(counts_LNE[i], placements[i]),
                          reference.plan_on(policy, counts_LNE[i], placements[i]), (name, n, e, i))
        _assert_equal(policy.plan(counts_LNE[0], prev_LE[0]), reference.plan(policy, counts_LNE[0], prev_LE[0]),
                      (name, n, e, "plan"))
        _check([policy] * layers, counts_LNE, placements, (name, n, e))


def test_every_registry_system_equals_the_previous_planner():
    gen = torch.Generator().manual_seed(8)
    for n, e in [(1, 4), (2, 8), (4, 16), (8, 64)]:
        ctx = SystemContext(num_experts=e, num_ranks=n, spare_slots=2, pairs_per_rank=64, push_cost_rows=1.0)
        for name in SYSTEMS:
            policy = get_system(name).make_policy(ctx)
            for case in range(5):
                counts = _counts(gen, n, e, case)
                prev = None if case == 0 else _counts(gen, n, e, 3).sum(0)
                _assert_equal(policy.plan(counts, prev), reference.plan(policy, counts, prev), (name, n, e, case))


def test_quotas_equal_the_previous_quotas():
    """Random forwards, caps and floors (the floor's second pass included), with and without backward flows, some
    ranks under their caps: the rewritten quotas (no transposed copies) are the previous ones."""
    rng = np.random.default_rng(4)
    floors = 0
    for _ in range(400):
        n, s = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        g, e = n * s, int(rng.integers(1, 2 * n * s + 1))
        expert_G = torch.from_numpy(rng.integers(-1, e, g))
        fwd_NG = torch.from_numpy(rng.integers(0, 30, (n, g))) * (expert_G >= 0)
        if rng.random() < 0.3:
            fwd_NG[:, torch.from_numpy(rng.random(g) < 0.5)] = 0
        load_N = fwd_NG.sum(0).view(n, s).sum(1)
        cap_N = (load_N - torch.from_numpy(rng.integers(-5, 40, n))).clamp(min=0)
        gamma = float(rng.choice([0.0, 0.1, 0.5, 0.9, 1.0]))
        placement = expert_G.view(n, s)
        flows = route_backward(fwd_NG, placement, cap_N) if rng.random() < 0.5 and bool((expert_G >= 0).all()) \
            else None
        got = retention_quotas(fwd_NG, expert_G, cap_N, gamma, flows)
        want = reference.retention_quotas(fwd_NG, expert_G, cap_N, gamma, flows)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        floors += bool((got[1] > 0).any())
    assert floors > 10  # the floor's second pass ran


def test_online_replicas_equal_the_previous_greedy():
    rng = np.random.default_rng(6)
    for _ in range(300):
        n = int(rng.choice([1, 2, 4, 8, 16, 32]))
        e, spare = n * int(rng.integers(1, 6)), int(rng.integers(0, 4))
        per_node = None if rng.random() < 0.4 else int(rng.choice([d for d in (1, 2, 4, 8) if n % d == 0]))
        counts = (rng.random(e) ** float(rng.integers(1, 6)) * rng.integers(1, 5000)).astype(np.int64)
        if rng.random() < 0.2:
            counts[:] = counts[0]  # ties everywhere
        cost = float(rng.choice([0.0, 0.0, 1.0, 10.0, 100.0]))
        counts_E = torch.from_numpy(counts)
        assert torch.equal(online_replicas(counts_E, n, spare, per_node, cost),
                           reference.online_replicas(counts_E, n, spare, per_node, cost)), (n, e, spare, per_node)
