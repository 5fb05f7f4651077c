"""The expert-parallel layer on gloo (2 and 4 forked ranks) against the single-process reference layer.

Shapes are tiny (D=8, F=5, E=8, top-2, 8 tokens per rank) and in float64 unless a test says otherwise, so the
comparisons are tight. Every distributed case also checks the accounting against its formulas.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from lrmoe.runtime.distributed.accounting import Accountant, check_accounting, expected_layer, expected_step
from lrmoe.runtime.distributed.comm import all_gather_rows
from lrmoe.runtime.distributed.launch import launch
from lrmoe.runtime.distributed.replica import AdamConfig, RangeGroups, flatten_experts, unflatten_experts
from lrmoe.runtime.layer import EPMoELayer, NonFiniteError, RecalibratedPlanError, initial_placement
from lrmoe.planner.plan import LayerPlan, no_flows
from lrmoe.planner.policies import Capacity, StaticEP, Symi
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.planner.replica_routing import route_forward
from lrmoe.runtime.routing import route

D, F, E, K, T = 8, 5, 8, 2, 8


class FixedPlacement:
    """A test policy: a given placement (replicas anywhere, empty slots allowed), each expert's pairs split
    evenly over its replicas, dropless. Plans come from the planner's own LayerPlan and route_forward."""

    name = "fixed"

    def __init__(self, placement_NS):
        self.placement_NS = placement_NS

    def plan(self, counts_NE, prev_counts_E=None):
        N = counts_NE.shape[0]
        fwd_NG = route_forward(counts_NE, self.placement_NS, "even")
        return LayerPlan(placement_NS=self.placement_NS, fwd_NG=fwd_NG,
                         dropped_NE=torch.zeros(N, counts_NE.shape[1], dtype=torch.long), keep_NG=fwd_NG.clone(),
                         bwd_flows_V4=no_flows(), floor_excess_N=torch.zeros(N, dtype=torch.long), policy=self.name)


def replica_slots(num_ranks):
    """Slots per rank for the random placements: 2 or 4 spare slots beyond one per expert."""
    return 5 if num_ranks == 2 else 3


def random_placement(num_ranks, slots, seed):
    """Every expert at least once, the other slots random replicas or empty, shuffled over all ranks."""
    g = torch.Generator().manual_seed(seed)
    extra = num_ranks * slots - E
    fill = torch.randint(-1, E, (extra,), generator=g)
    flat = torch.cat([torch.arange(E), fill])[torch.randperm(num_ranks * slots, generator=g)]
    return flat.view(num_ranks, slots)


# -- helpers for the distributed cases -------------------------------------------------------------------------
def _reference(family, shared, dtype=torch.float64, seed=3):
    ref = ReferenceMoE(D, F, E, K, family, shared_ffn=4 if shared else 0, seed=seed, dtype=dtype)
    if family == "sigmoid_bias":
        with torch.no_grad():
            ref.bias_E.copy_(torch.linspace(-0.2, 0.2, E))
    return ref


def _batch(world_size, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(world_size * T, D, generator=g, dtype=torch.float64).to(dtype),
            torch.randn(world_size * T, D, generator=g, dtype=torch.float64).to(dtype))


def _reference_with_drops(ref, x_TD, keep_TK):
    """The reference layer's forward with some pairs removed from the forward (capacity drops): y = Σ over the
    kept pairs of gate · expert output, + shared. Gates are the router's, computed over all top-k pairs."""
    routed = route(x_TD @ ref.w_router_ED.T, ref.router, K,
                   bias_E=ref.bias_E if ref.router == "sigmoid_bias" else None, scaling=ref.routed_scaling)
    o_PD, _ = ref.expert_outputs(x_TD, routed.idx_TK)
    gate_TK = routed.weight_TK.to(x_TD.dtype) * keep_TK.to(x_TD.dtype)
    y = (gate_TK[..., None] * o_PD.view(-1, K, D)).sum(1)
    shared = ref.shared_output(x_TD)
    return y if shared is None else y + shared


def _expert_grads(layer):
    layer.store.sync_replica_grads()
    full = layer.store.gather_full(layer.store.collect_grad_shards())
    return unflatten_experts(full, D, F)


def _check_accounting(layer, acc, dispatch, next_placement=None, replica_grad="range"):
    plan = dispatch.plan
    elem = torch.tensor([], dtype=layer.store.dtype).element_size()
    want = expected_layer(plan, D, F, elem)
    if next_placement is not None:
        want.update(expected_step(plan.placement_NS, next_placement, E, D, F, elem, replica_grad=replica_grad))
    check_accounting(acc.record(), want, layer.rank)


def _compare(rank, family, shared, policy, placement, seed, tol):
    """One iteration of the EP layer against the reference on the whole batch: y, dx, router, shared and every
    expert's gradient. Returns the drop mask of the local pairs."""
    world = dist.get_world_size()
    ref = _reference(family, shared)
    acc = Accountant()
    layer = EPMoELayer(ref.export_weights(), K, family, policy, placement, RangeGroups(), accountant=acc)
    x, w = _batch(world, seed)
    mine = slice(rank * T, (rank + 1) * T)
    x_local = x[mine].clone().requires_grad_(True)
    y, info = layer(x_local)
    (y * w[mine]).sum().backward()
    keep_TK = all_gather_rows((info.dispatch.slot_P >= 0).view(T, K)).view(world * T, K)
    x_ref = x.clone().requires_grad_(True)
    y_ref = _reference_with_drops(ref, x_ref, keep_TK)
    (y_ref * w).sum().backward()
    torch.testing.assert_close(y, y_ref[mine], **tol)
    torch.testing.assert_close(x_local.grad, x_ref.grad[mine], **tol)
    layer.sync_dense_grads(1.0)
    for p, name in zip(layer.dense_parameters(), ["w_router_ED", "w_shared_gate_DF", "w_shared_up_DF",
                                                    "w_shared_down_FD"]):
        torch.testing.assert_close(p.grad, getattr(ref, name).grad, **tol)
    # expert gradients travel through the fp32 shards
    for got, want in zip(_expert_grads(layer), (ref.w_gate_EDF.grad, ref.w_up_EDF.grad, ref.w_down_EFD.grad)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    _check_accounting(layer, acc, info.dispatch)
    assert info.counts_E.sum() == world * T * K
    return info.dispatch.slot_P, info.dispatch.plan, info.gate_TK.detach()


TIGHT = dict(rtol=1e-10, atol=1e-12)


def _dropless_cases(rank, family):
    world = dist.get_world_size()
    shared = family == "sigmoid_bias"  # the GLM family has a shared expert
    static = initial_placement(StaticEP(), world, E)
    _compare(rank, family, shared, StaticEP(), static, seed=1, tol=TIGHT)
    for seed in (11, 12):  # random placements: replicas on one rank or several, empty slots
        placement = random_placement(world, replica_slots(world), seed)
        _compare(rank, family, shared, FixedPlacement(placement), placement, seed=seed, tol=TIGHT)
    return True


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("family", ["softmax_topk", "sigmoid_bias"])
def test_dropless_layer_equals_the_reference(world_size, family):
    assert launch(_dropless_cases, world_size, family) == [True] * world_size


def test_random_placements_have_replicas_on_one_and_several_ranks():
    """The placements the dropless test uses do exercise both replica layouts and empty slots."""
    used = [random_placement(world, replica_slots(world), seed) for world in (2, 4) for seed in (11, 12)]
    assert all(set(range(E)) <= set(p.flatten().tolist()) for p in used)
    rows = [[e for e in r if e >= 0] for p in used for r in p.tolist()]
    assert any(len(r) > len(set(r)) for r in rows)  # two replicas of one expert on one rank
    assert any(int((p == e).any(1).sum()) > 1 for p in used for e in range(E))  # replicas on several ranks
    assert any(bool((p == -1).any()) for p in used)  # empty slots


def _capacity_case(rank, drop_by):
    world = dist.get_world_size()
    policy = Capacity(cf=0.6, drop_by=drop_by)
    placement = initial_placement(policy, world, E)
    slot_P, plan, gate_TK = _compare(rank, "softmax_topk", False, policy, placement, seed=5, tol=TIGHT)
    return slot_P, plan.dropped_NE, gate_TK


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("drop_by", ["position", "gate"])
def test_capacity_policy_drops_exactly_the_planned_pairs(world_size, drop_by):
    out = launch(_capacity_case, world_size, drop_by)
    dropped_NE = out[0][1]
    assert int(dropped_NE.sum()) > 0
    x, _ = _batch(world_size, 5)
    ref = _reference("softmax_topk", False)
    idx_TK = route(x @ ref.w_router_ED.T, "softmax_topk", K).idx_TK
    for n, (slot_P, _, gate_TK) in enumerate(out):
        idx_P, gate_P = idx_TK[n * T:(n + 1) * T].reshape(-1), gate_TK.reshape(-1)
        for e in range(E):
            pairs = (idx_P == e).nonzero().flatten()  # token order
            dropped = slot_P[pairs] < 0
            assert int(dropped.sum()) == int(dropped_NE[n, e])  # exactly the planned number
            if not dropped.any():
                continue
            if drop_by == "position":  # ... and the last ones of the group
                assert dropped[-int(dropped.sum()):].all()
            else:  # ... and none kept with a lower gate
                assert gate_P[pairs[dropped]].max() <= gate_P[pairs[~dropped]].min() if (~dropped).any() else True


def _training_steps(rank, steps, replica_grad="range"):
    """SYMI-dropless over several steps: the placement follows the counts, the weights move by redistribution,
    and the layer stays equal to the reference trained by torch.optim.Adam on the whole batch, with the replica
    gradients reduced in either mode (the bytes of each checked against the closed form)."""
    world = dist.get_world_size()
    S = 6  # 12 slots for 8 experts: 4 replicas that follow the counts
    policy = Symi(slots_per_rank=S, cf=None)
    ref = _reference("softmax_topk", False, dtype=torch.float32)
    acc = Accountant()
    cfg = AdamConfig(lr=1e-2)
    layer = EPMoELayer(ref.export_weights(), K, "softmax_topk", policy, initial_placement(policy, world, E),
                       RangeGroups(), adam=cfg, accountant=acc, replica_grad=replica_grad)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=cfg.lr, foreach=False)
    dense_opt = torch.optim.Adam(layer.dense_parameters(), lr=cfg.lr, foreach=False)
    placements = []
    mine = slice(rank * T, (rank + 1) * T)
    for step in range(steps):
        acc.reset()
        x, w = _batch(world, 100 + step, dtype=torch.float32)
        y, info = layer(x[mine].clone().requires_grad_(True))
        (y * w[mine]).sum().backward()
        y_ref, _ = ref(x)
        (y_ref * w).sum().backward()
        torch.testing.assert_close(y, y_ref[mine].detach(), rtol=1e-5, atol=1e-5)
        layer.sync_dense_grads(1.0)
        dense_opt.step()
        dense_opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        before = layer.placement_NS.clone()
        after = layer.expert_step(grad_scale=1.0)
        placements.append(after.clone())
        _check_accounting(layer, acc, info.dispatch, next_placement=after, replica_grad=replica_grad)
        assert torch.equal(info.dispatch.plan.placement_NS, before)
    master = layer.store.full_master()
    want = flatten_experts(ref.w_gate_EDF.detach(), ref.w_up_EDF.detach(), ref.w_down_EFD.detach())
    torch.testing.assert_close(master, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(layer.w_router_ED.detach(), ref.w_router_ED.detach(), rtol=1e-4, atol=1e-5)
    return placements


@pytest.mark.parametrize("replica_grad", ["range", "shard"])
def test_symi_training_steps_follow_the_reference_through_redistribution(replica_grad):
    placements = launch(_training_steps, 2, 3, replica_grad)[0]
    assert len({tuple(p.flatten().tolist()) for p in placements}) > 1  # the placement did change


def _errors(rank):
    world = dist.get_world_size()
    ref = _reference("softmax_topk", False)
    placement = initial_placement(StaticEP(), world, E)
    layer = EPMoELayer(ref.export_weights(), K, "softmax_topk", StaticEP(), placement, RangeGroups())
    x = torch.randn(T, D, dtype=torch.float64)
    with pytest.raises(ValueError, match="x_TD must have shape"):
        layer(x[:, :3])
    with pytest.raises(ValueError, match="dtype"):
        layer(x.float())
    moved = FixedPlacement(torch.flip(placement, [0]).contiguous())
    with pytest.raises(ValueError, match="differs from the placement the slots hold"):
        layer(x, policy=moved)
    with pytest.raises(RecalibratedPlanError, match="backward hook"):
        layer(x, policy=HalfRetention())
    return True


class HalfRetention:
    """Static EP whose plan keeps half of each group's pairs for the backward (what LRMoE's quotas produce)."""

    def plan(self, counts_NE, prev_counts_E=None):
        plan = StaticEP().plan(counts_NE, prev_counts_E)
        return dataclasses.replace(plan, keep_NG=plan.fwd_NG // 2, policy="half-retention")


def test_layer_errors_name_the_problem():
    assert launch(_errors, 2) == [True, True]


def _non_finite(rank, where):
    """A NaN in one rank's input (``where`` "input") or in the gradient into one rank's output ("grad"): every rank
    raises NonFiniteError naming the layer and that rank, and no weight has moved."""
    world = dist.get_world_size()
    ref = _reference("softmax_topk", True)
    layer = EPMoELayer(ref.export_weights(), K, "softmax_topk", StaticEP(), initial_placement(StaticEP(), world, E),
                       RangeGroups())
    layer.name = "layer 7"
    slots, router = layer.store.slots_SW.detach().clone(), layer.w_router_ED.detach().clone()
    x = torch.randn(T, D, dtype=torch.float64)
    if where == "input" and rank == 1:
        x[3, 2] = float("nan")
    try:
        y, _ = layer(x)
        grad = torch.ones_like(y)
        if rank == 0:
            grad[1, 0] = float("inf")
        y.backward(grad)
        layer.sync_dense_grads()
        layer.expert_step()
        message = "no error"
    except NonFiniteError as exc:
        message = str(exc)
    assert torch.equal(layer.store.slots_SW.detach(), slots) and torch.equal(layer.w_router_ED.detach(), router)
    return message


@pytest.mark.parametrize("where,bad_rank", [("input", 1), ("grad", 0)])
def test_a_nan_on_one_rank_raises_on_every_rank_before_any_weight_moves(where, bad_rank):
    messages = launch(_non_finite, 2, where)
    for rank, message in enumerate(messages):
        assert "layer 7" in message and f"rank {bad_rank}" in message and f"this is rank {rank}" in message, message


# -- the benchmark script --------------------------------------------------------------------------------------
BENCH = ["--tokens-per-rank", "32", "--steps", "2", "--warmup", "1", "--skew-param", "0.8", "--no-wandb", "--overwrite"]


def _bench_script():
    from pathlib import Path

    return str(Path(__file__).resolve().parent.parent / "experiments" / "layer_bench.py")


@pytest.mark.script
@pytest.mark.timeout(600)
def test_layer_bench_under_the_fork_launcher(tmp_path):
    from _scripts import load_experiment

    from lrmoe.results import read_results

    bench = load_experiment("layer_bench")
    out = tmp_path / "bench.jsonl"
    phases = bench.main(["--ranks", "2", "--policies", "static-ep", "capacity-cf1", "symi-dropless",
                         "--out", str(out), *BENCH])
    assert {"dispatch_a2a", "replica_sync"} <= set(phases["phase"])
    assert set(phases["policy"]) == {"static-ep", "capacity-cf1", "symi-dropless"}
    records = read_results(out)
    per_rank = [r for r in records if r["table"] == "per_rank_step"]
    assert len(per_rank) == 3 * 2 * 2  # policies x steps x ranks
    assert (tmp_path / "bench_phases.png").exists() and (tmp_path / "bench_phases.pdf").exists()
    # the dropless policies compute every routed pair; the capacity policy drops some
    dropped = {r["policy"]: 0 for r in per_rank}
    for r in per_rank:
        dropped[r["policy"]] += r["pairs_dropped"]
    assert dropped["static-ep"] == dropped["symi-dropless"] == 0 < dropped["capacity-cf1"]


@pytest.mark.slow  # 12 s: make test-all; torchrun's environment is tested fast in test_dist_comm
@pytest.mark.script
@pytest.mark.timeout(600)
def test_layer_bench_under_torchrun(tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "bench.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           _bench_script(), "--policies", "static-ep", "--out", str(out), *BENCH],
                          capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| static-ep" in proc.stdout and out.exists()
