"""Placement off the critical path (lrmoe.runtime.placement_ahead): the layer places on a background thread from the
counts it already has, plans the rest with ``plan_on``, and training is bit for bit what ``policy.plan`` gives.

Planner level, every registry system: ``plan`` equals ``plan_on`` on the two placements, field by field, on random
counts with the edge cases (zero counts, a single hot expert, one rank). Layer level, 3 forked gloo ranks, several
steps of one and of two micro-batches with an SGD step on the router between them (so the routing, the counts and
the placements change every step): with the placement computed ahead every plan, every placement the weights move
to, every gradient and every weight equals the run that places inside ``policy.plan``, and the background results
were the ones used.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from lrmoe.planner.plan import LayerPlan, SplitPolicy
from lrmoe.planner.policies import placement_popularity
from lrmoe.runtime.distributed.launch import launch
from lrmoe.runtime.distributed.replica import RangeGroups
from lrmoe.runtime.layer import EPMoELayer
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.systems import SYSTEMS, SystemContext, get_system

D, F, E, K, T = 8, 5, 6, 2, 8
MICRO_BATCHES = (1, 2, 1)  # per step
PLAN_FIELDS = [f.name for f in dataclasses.fields(LayerPlan) if f.name != "next_placement_NS"]
# one system of every policy family and option that changes the plan (the rest differ only in the backward)
FAMILIES = ["static-ep", "capacity-cf1", "symi-cf1", "symi-dropless", "symi-dropless-rho0.75", "online",
            "online-rho0.75", "lrmoe", "lrmoe-rho0.75", "lrmoe-tight", "lrmoe-rho0.5-early"]


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is not None and b is not None and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _random_counts(gen: torch.Generator, n: int, e: int, case: int) -> torch.Tensor:
    if case == 0:
        return torch.zeros(n, e, dtype=torch.long)
    if case == 1:  # one hot expert
        c = torch.zeros(n, e, dtype=torch.long)
        c[:, int(torch.randint(e, (1,), generator=gen))] = torch.randint(0, 50, (n,), generator=gen)
        return c
    skew = torch.rand(e, generator=gen) ** 4
    return (torch.rand(n, e, generator=gen) * skew * 60).long()


@pytest.mark.parametrize("name", list(SYSTEMS))
def test_plan_is_plan_on_the_two_placements_for_every_system(name):
    gen = torch.Generator().manual_seed(len(name))
    for n, e in [(1, 6), (3, 6), (2, 8), (4, 16)]:
        ctx = SystemContext(num_experts=e, num_ranks=n, spare_slots=1, pairs_per_rank=16, push_cost_rows=0.0)
        policy = get_system(name).make_policy(ctx)
        assert isinstance(policy, SplitPolicy)
        for case in range(5):
            counts = _random_counts(gen, n, e, min(case, 2))
            prev = None if case == 3 else _random_counts(gen, n, e, 2 if case != 4 else 0).sum(0)
            total = int(counts.sum())
            want = policy.plan(counts, prev)
            placement = policy.placement(placement_popularity(prev, e), n, total)
            got = policy.plan_on(counts, placement, policy.placement(counts.sum(0), n, total))
            for f in PLAN_FIELDS + ["next_placement_NS"]:
                assert _same(getattr(got, f), getattr(want, f)), (name, n, e, case, f)


def skewed_reference() -> ReferenceMoE:
    ref = ReferenceMoE(D, F, E, K, "softmax_topk", seed=3, dtype=torch.float32)
    with torch.no_grad():
        ref.w_router_ED[:, 0] = torch.linspace(2.0, -1.0, E)
    return ref


def batch(world: int, step: int, m: int):
    g = torch.Generator().manual_seed(1000 * step + m)
    x = torch.randn(world * T, D, generator=g)
    x[:, 0] += 1.5 if (step + m) % 2 == 0 else -1.5  # skewed routing that flips: placements change every step
    return x, torch.randn(world * T, D, generator=g)


def train(rank: int, groups, name: str, ahead: bool):
    """Steps of ``name`` with or without the placement ahead: every plan, placement, gradient and weight."""
    world = dist.get_world_size()
    spec = get_system(name)
    ctx = SystemContext(num_experts=E, num_ranks=world, spare_slots=1, pairs_per_rank=T * K, push_cost_rows=0.0)
    policy = spec.make_policy(ctx)
    placement = policy.placement(torch.ones(E, dtype=torch.float64), world, world * T * K)
    layer = EPMoELayer(skewed_reference().export_weights(), K, "softmax_topk", policy, placement, groups,
                       backward=spec.layer_backward(7), placement_ahead=ahead)
    mine = slice(rank * T, (rank + 1) * T)
    out = {"plans": [], "placements": [], "grads": []}
    for step, micro_batches in enumerate(MICRO_BATCHES):
        for m in range(micro_batches):
            x, w = batch(world, step, m)
            x_local = x[mine].clone().requires_grad_(True)
            y, info = layer(x_local)
            (y * w[mine]).sum().backward()
            out["plans"].append({f: getattr(info.dispatch.plan, f) for f in PLAN_FIELDS})
            out["grads"].append(x_local.grad)
        layer.sync_dense_grads()
        out["grads"].append(layer.w_router_ED.grad.clone())
        with torch.no_grad():
            layer.w_router_ED -= 0.5 * layer.w_router_ED.grad
            layer.w_router_ED.grad = None
        out["placements"].append(layer.expert_step().clone())
    out["weights"] = [t.detach().clone() for t in (layer.w_router_ED, layer.store.slots_SW)]
    out["hits"] = None if layer.placement_ahead is None else layer.placement_ahead.hits
    return out


def _compare(rank: int, names: list[str]):
    groups = RangeGroups()
    hits = {}
    for name in names:
        old, new = train(rank, groups, name, ahead=False), train(rank, groups, name, ahead=True)
        assert len(old["plans"]) == len(new["plans"])
        for i, (a, b) in enumerate(zip(old["plans"], new["plans"])):
            for f in PLAN_FIELDS:
                assert _same(a[f], b[f]), (name, i, f)
        for key in ("placements", "grads", "weights"):
            for i, (a, b) in enumerate(zip(old[key], new[key])):
                assert torch.equal(a, b), (name, key, i)
        hits[name] = new["hits"]
    return hits


def test_training_with_the_placement_ahead_is_bit_identical_on_three_ranks():
    hits = launch(_compare, 3, FAMILIES, timeout_s=600)[0]
    # every step after the first takes its placement from the background job, every expert step its next one
    want = {"current": sum(MICRO_BATCHES[1:]), "next": len(MICRO_BATCHES)}
    assert all(h == want for h in hits.values()), hits


@pytest.mark.slow
def test_training_with_the_placement_ahead_is_bit_identical_for_every_system():
    launch(_compare, 3, list(SYSTEMS), timeout_s=3000)
