"""Micro-batches and activation checkpointing in the expert-parallel layer (gloo, 2 and 3 forked ranks, fp32)
against the dense reference layer run over the same micro-batches.

One iteration of every system of the registry: k = 3 micro-batches, each with its own forward and backward, then
one expert step. Properties: the accumulated router, expert and input gradients equal the reference's over the
same micro-batches, on the pairs each micro-batch's plan computed (capacity drops) and retained (quotas), and with
the default scale they are the gradient of the mean loss over ranks and micro-batches; every micro-batch plans
on the one placement the iteration started with (online replication: its own replicas each time); the next
placement comes from the summed counts and the next iteration plans on it. Under torch's non-reentrant checkpoint
every gradient is bitwise the run's without checkpointing, and the recomputation replays the recorded decision
(the policy is asked once per micro-batch). Tiny shapes (D=8, F=5, E=6 so that 2 and 3 ranks divide it, top-2,
8 tokens per rank and micro-batch) and skewed routing, so that the placements replicate and the quotas trim.
"""

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from lrmoe.planner.policies import initial_placement
from lrmoe.runtime.distributed.comm import all_gather_rows
from lrmoe.runtime.distributed.launch import launch
from lrmoe.runtime.distributed.replica import RangeGroups, unflatten_experts
from lrmoe.runtime.layer import EPMoELayer
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.systems import SYSTEMS, SystemContext, get_system

D, F, E, K, T, MB = 8, 5, 6, 2, 8, 3
DENSE = dict(rtol=1e-5, atol=1e-6)
SHARD = dict(rtol=1e-4, atol=1e-6)  # expert gradients pass through the fp32 shards and a different summation order
CHECKPOINTED = ["capacity-cf1", "symi-dropless", "symi-dropless-rho0.75", "online", "online-rho0.75", "lrmoe",
                "lrmoe-m1-unbiased"]


class Counting:
    """A policy wrapper that counts its plan calls (a recomputation must not plan again)."""

    def __init__(self, policy):
        self.policy, self.name, self.calls = policy, policy.name, 0
        if hasattr(policy, "placement"):
            self.placement = policy.placement

    def plan(self, counts_NE, prev_counts_E=None):
        self.calls += 1
        return self.policy.plan(counts_NE, prev_counts_E)


def skewed_reference() -> ReferenceMoE:
    ref = ReferenceMoE(D, F, E, K, "softmax_topk", seed=3, dtype=torch.float32)
    with torch.no_grad():
        ref.w_router_ED[:, 0] = torch.linspace(2.0, -1.0, E)
    return ref


def micro_batch(world: int, step: int, m: int):
    """Every rank's tokens and loss weights of micro-batch m of a step (rank n: rows n·T to (n+1)·T)."""
    g = torch.Generator().manual_seed(1000 * step + m)
    x = torch.randn(world * T, D, generator=g)
    x[:, 0] += 1.5 if m % 2 == 0 else -1.5  # the feature every token shares: skewed routing, flipped by m
    return x, torch.randn(world * T, D, generator=g)


def gathered(t_TK: torch.Tensor) -> torch.Tensor:
    return all_gather_rows(t_TK.double()).view(-1, K)


def run_iteration(rank: int, groups, name: str, ckpt: bool):
    """One iteration of ``name`` (k micro-batches, then the expert step) against the reference; returns every
    gradient the layer produced and what the step did."""
    world = dist.get_world_size()
    spec = get_system(name)
    ctx = SystemContext(num_experts=E, num_ranks=world, spare_slots=1, pairs_per_rank=T * K)
    policy = Counting(spec.make_policy(ctx))
    ref = skewed_reference()
    prev_E = torch.tensor([40, 30, 10, 6, 4, 2][:E], dtype=torch.long) * world  # last iteration: skewed
    placement = (policy.placement(prev_E, world, world * T * K) if hasattr(policy, "placement")
                 else initial_placement(policy, world, E, T * K))
    layer = EPMoELayer(ref.export_weights(), K, "softmax_topk", policy, placement, groups,
                       backward=spec.layer_backward(7))
    layer.prev_counts_E = prev_E
    mine = slice(rank * T, (rank + 1) * T)
    dx, plans, sel = [], [], []
    for m in range(MB):
        x, w = micro_batch(world, 0, m)
        x_local = x[mine].clone().requires_grad_(True)
        if ckpt:
            held = []
            y = checkpoint(lambda v: held.append(layer(v)) or held[-1][0], x_local, use_reentrant=False)
            info = held[0][1]
        else:
            y, info = layer(x_local)
        (y * w[mine]).sum().backward()
        dx.append(x_local.grad)
        plans.append(info.dispatch.plan)
        fwd_TK = (info.dispatch.slot_P >= 0).view(T, K)
        if info.record is not None and info.record.selected:
            sel.append((gathered(fwd_TK) > 0, gathered(info.record.keep_TK) > 0, gathered(info.record.scale_TK)))
        else:
            sel.append((gathered(fwd_TK) > 0, None, None))
    assert policy.calls == MB and layer.micro_batches == MB and not (ckpt and layer.decisions)
    for plan in plans:  # one placement for the whole iteration (online: the home slots, its own replicas)
        assert torch.equal(plan.resident_NS, placement)

    # the reference: the same micro-batches through the dense layer, on the computed and retained pairs
    for m, (fwd_TK, keep_TK, scale_TK) in enumerate(sel):
        x, w = micro_batch(world, 0, m)
        x_ref = x.clone().requires_grad_(True)
        hook = (lambda o, aux, f=fwd_TK: o * f.reshape(-1, 1).to(o.dtype)) if keep_TK is None else None
        y_ref, _ = ref(x_ref, keep_TK, scale_TK.float() if scale_TK is not None else None, pair_hook=hook)
        (y_ref * w).sum().backward()
        torch.testing.assert_close(dx[m], x_ref.grad[mine], **DENSE, msg=lambda msg: f"{name}: {msg}")
    scale = 1.0 / (world * MB)  # the gradient of the mean loss over ranks and micro-batches
    assert layer.mean_grad_scale() == scale
    layer.sync_dense_grads()
    torch.testing.assert_close(layer.w_router_ED.grad, ref.w_router_ED.grad * scale, **DENSE,
                               msg=lambda msg: f"{name}: {msg}")
    store = layer.store
    store.sync_replica_grads()
    got = unflatten_experts(store.gather_full(store.collect_grad_shards(layer.mean_grad_scale())), D, F)
    for g, want in zip(got, (ref.w_gate_EDF.grad, ref.w_up_EDF.grad, ref.w_down_EFD.grad)):
        torch.testing.assert_close(g, want * scale, **SHARD, msg=lambda msg: f"{name}: {msg}")
    grads = [layer.w_router_ED.grad.clone(), *got, *dx]

    # the step: the next placement from the iteration's summed counts, and the next iteration plans on it
    summed_E = sum(p.routed_NE for p in plans).sum(0)
    want_next = (policy.placement(summed_E, world, world * T * K) if hasattr(policy, "placement") and MB > 1
                 else plans[-1].next_placement_NS)
    after = layer.expert_step()
    assert torch.equal(after, want_next) and torch.equal(layer.prev_counts_E, summed_E)
    x, w = micro_batch(world, 1, 0)
    y, info = layer(x[mine].clone())
    (y * w[mine]).sum().backward()
    assert torch.equal(info.dispatch.plan.resident_NS, after)
    return grads, [p.placement_NS for p in plans]


def _all_systems(rank: int, names: list[str]):
    groups = RangeGroups()
    out = {}
    for name in names:
        grads, placements = run_iteration(rank, groups, name, ckpt=False)
        out[name] = placements
        if name in CHECKPOINTED:  # the same run under activation checkpointing: bitwise the same gradients
            again, _ = run_iteration(rank, groups, name, ckpt=True)
            for a, b in zip(grads, again):
                assert torch.equal(a, b), name
    return out


def test_micro_batches_accumulate_the_reference_gradients_for_every_system():
    out = launch(_all_systems, 2, list(SYSTEMS), timeout_s=600)[0]
    assert set(out) == set(SYSTEMS)
    assert len({tuple(p.flatten().tolist()) for p in out["online"]}) > 1  # replicas pushed per micro-batch


def test_micro_batches_on_three_ranks():
    """Three ranks (uneven shards, ranges of three) for one system of each policy family and both budgets."""
    out = launch(_all_systems, 3, CHECKPOINTED, timeout_s=600)[0]
    assert len({tuple(p.flatten().tolist()) for p in out["online"]}) > 1
