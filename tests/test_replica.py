"""The replica substrate: shard plans, replica gradient sync and collection in both replica-gradient modes
("range", "shard"), sharded Adam, redistribution.

Distributed cases run on gloo with 2 and 4 forked ranks and tiny experts (D=3, F=2: P=18 parameters, so shards of
unequal length with 4 ranks: 5, 5, 4, 4). The byte model itself is tested in test_sync_model.py.
"""

import pytest
import torch

from lrmoe.runtime.distributed.accounting import Accountant, check_accounting, expected_step, symi_step_bytes
from lrmoe.runtime.distributed.launch import launch
from lrmoe.runtime.distributed.replica import (AdamConfig, RangeGroups, ReplicaStore, flatten_experts, hosted_experts,
                                       ring_allreduce_bytes, shard_bounds, shard_sizes, sync_plan,
                                       unflatten_experts)

E, D, F = 6, 3, 2
P = 3 * D * F

# placements of 6 experts; a row per rank, -1 an empty slot
CONTIGUOUS_4 = [[0, 0, 1], [1, 1, 2], [3, 4, 5], [5, 5, 5]]  # SYMI-like: 1 spans ranks 0-1, 5 spans 2-3
SCATTERED_4 = [[0, 1, 2], [3, 4, -1], [5, 0, 1], [2, 3, 4]]  # hosts not consecutive: 0 on ranks 0 and 2
MOVED_4 = [[5, 4, 3], [2, 2, -1], [1, 0, 0], [0, 1, 5]]
# three hosts of 0 (ranks 0, 1, 3; two slots on rank 3) so the summation order matters; 1 on ranks 0 and 2, two
# slots each, rank 1 inside its range hosting none; 2 hosted nowhere
SPREAD_4 = [[0, 1, 1], [0, 3, 4], [1, 1, 5], [0, 5, 0]]
SAME_2 = [[0, 0, 1], [1, 2, 0]]  # two slots of 0 on rank 0, one on rank 1; 3-5 hosted nowhere
PAIR_2 = [[0, 1, 2], [2, 3, 4]]  # 5 hosted nowhere: its gradient is zero
PAIR_2_NEXT = [[5, 5, 0], [1, 2, 3]]


def _weights(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, D, F, generator=g, dtype=dtype), torch.randn(E, D, F, generator=g, dtype=dtype),
            torch.randn(E, F, D, generator=g, dtype=dtype))


# -- pure helpers ----------------------------------------------------------------------------------------------
def test_shards_cover_the_vector_in_order():
    assert shard_sizes(18, 4) == [5, 5, 4, 4]
    assert shard_bounds(18, 4) == [(0, 5), (5, 10), (10, 14), (14, 18)]
    assert shard_sizes(3, 4) == [1, 1, 1, 0]
    with pytest.raises(ValueError, match="num_ranks"):
        shard_sizes(3, 0)


def test_sync_plan_spans_and_round_robin_sources():
    plan = sync_plan(torch.tensor(CONTIGUOUS_4), E)
    assert plan.span_E2.tolist() == [[0, 0], [0, 1], [1, 1], [2, 2], [2, 2], [2, 3]]
    # rank n takes shard n of e from itself if it holds e, else from the holders in turn
    assert plan.source_NE.tolist() == [[0, 0, 1, 2, 2, 2],
                                       [0, 1, 1, 2, 2, 3],
                                       [0, 0, 1, 2, 2, 2],
                                       [0, 1, 1, 2, 2, 3]]
    scattered = sync_plan(torch.tensor(SCATTERED_4), E)
    assert scattered.span_E2[0].tolist() == [0, 2]  # rank 1 sits inside the span without hosting 0
    assert scattered.source_NE[:, 0].tolist() == [0, 1, 2, 0]
    unhosted = sync_plan(torch.tensor(PAIR_2), E)
    assert unhosted.span_E2[5].tolist() == [-1, -1] and unhosted.source_NE[:, 5].tolist() == [-1, -1]
    assert hosted_experts(torch.tensor(CONTIGUOUS_4), 3) == [5]


def test_bad_placements_are_rejected():
    with pytest.raises(ValueError, match="valid ids"):
        sync_plan(torch.tensor([[0, 7]]), E)
    with pytest.raises(ValueError, match="long"):
        sync_plan(torch.tensor([[0.0, 1.0]]), E)
    with pytest.raises(ValueError, match="lr"):
        AdamConfig(lr=-1e-3)


def test_ring_model_and_symi_totals():
    assert ring_allreduce_bytes(1000, 1) == 0
    assert ring_allreduce_bytes(1000, 2) == 1000  # each of two ranks sends half twice
    assert ring_allreduce_bytes(1200, 4) == 1800
    assert symi_step_bytes(slots_per_rank=4, num_ranks=16, hidden=2, ffn=3, param_bytes=2) == {
        "redistribute": 4 * 16 * 36, "gradient": 4 * 16 * 36}


def test_static_ep_step_bytes_match_symi_less_the_owned_shards():
    """Without replicas every expert is held by one rank: the gradient side moves s·N·G·(N−1)/N in all."""
    N, S = 4, 2
    static = torch.arange(N * S).view(N, S)
    got = expected_step(static, static, N * S, D, F, param_bytes=4)
    G = P * 4
    assert int(got["replica_sync.sent_bytes"].sum()) == 0
    assert int(got["grad_collect.recv_bytes"].sum()) == S * N * G * (N - 1) // N
    assert int(got["grad_collect.sent_bytes"].sum()) == int(got["grad_collect.recv_bytes"].sum())
    assert int(got["redistribute.recv_bytes"].sum()) == S * N * G * (N - 1) // N


# -- distributed -----------------------------------------------------------------------------------------------
def _adam_matches_torch(rank, placement, cfg, steps, foreach):
    wg, wu, wd = _weights()
    store = ReplicaStore(wg, wu, wd, torch.tensor(placement), RangeGroups(), adam=AdamConfig(**cfg))
    params = [torch.nn.Parameter(w.clone()) for w in (wg, wu, wd)]
    opt = torch.optim.Adam(params, lr=cfg["lr"], betas=(cfg["beta1"], cfg["beta2"]), eps=cfg["eps"],
                           weight_decay=cfg["weight_decay"], foreach=foreach)
    g = torch.Generator().manual_seed(1)  # the same gradients on every rank
    lo, hi = store.bounds[rank]
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=g) * 10 for p in params]
        for p, gr in zip(params, grads):
            p.grad = gr
        opt.step()
        store.adam_step(flatten_experts(*grads)[:, lo:hi])
    return store.full_master(), flatten_experts(*[p.detach() for p in params])


@pytest.mark.parametrize("world_size,placement", [(2, PAIR_2), (4, CONTIGUOUS_4)])
def test_sharded_adam_equals_torch_adam(world_size, placement):
    cfg = dict(lr=1e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.1)
    for full, ref in launch(_adam_matches_torch, world_size, placement, cfg, 4, False):
        assert torch.equal(full, ref)  # torch's single-tensor Adam: identical arithmetic, bit for bit
    for full, ref in launch(_adam_matches_torch, world_size, placement, cfg, 4, None):
        torch.testing.assert_close(full, ref, rtol=1e-6, atol=1e-7)  # the default (foreach) implementation


def _slot_grads(world_size, slots, dtype):
    g = torch.Generator().manual_seed(2)
    return torch.randn(world_size, slots, P, generator=g, dtype=torch.float64).to(dtype)


def _sync_and_collect(rank, placement, next_placement, dtype, scale, mode="range"):
    placement, next_placement = torch.tensor(placement), torch.tensor(next_placement)
    N, S = placement.shape
    acc = Accountant()
    wg, wu, wd = _weights(dtype=dtype)
    groups = RangeGroups() if mode == "range" else None  # shard mode needs no range groups
    store = ReplicaStore(wg, wu, wd, placement, groups, adam=AdamConfig(lr=0.1), accountant=acc, replica_grad=mode)
    # the initial slots hold their experts' weights
    flat = flatten_experts(wg, wu, wd)
    for j, e in enumerate(placement[rank].tolist()):
        assert torch.equal(store.slots_SW[j].detach(), flat[e] if e >= 0 else torch.zeros(P, dtype=dtype))
    grads_NSW = _slot_grads(N, S, dtype)
    store.slots_SW.grad = grads_NSW[rank].clone()
    store.sync_replica_grads()
    shards = store.collect_grad_shards(scale)
    full_grad = store.gather_full(shards)
    store.adam_step()
    store.redistribute(next_placement)
    master = store.full_master()
    slots = store.slots_SW.detach().clone()
    elem = torch.tensor([], dtype=dtype).element_size()
    expected = expected_step(placement, next_placement, E, D, F, param_bytes=elem, replica_grad=mode)
    check_accounting(acc.record(), expected, rank)  # counted bytes = the byte model, in either mode
    return full_grad, master, slots, store.slots_SW.grad


@pytest.mark.parametrize("world_size,placement,next_placement", [
    (2, PAIR_2, PAIR_2_NEXT), (4, CONTIGUOUS_4, MOVED_4), (4, SCATTERED_4, CONTIGUOUS_4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["range", "shard"])
def test_gradient_sync_adam_and_redistribution(world_size, placement, next_placement, dtype, mode):
    scale = 0.25  # a placement-independent constant (e.g. 1 / data-parallel ranks)
    out = launch(_sync_and_collect, world_size, placement, next_placement, dtype, scale, mode)
    place, nxt = torch.tensor(placement), torch.tensor(next_placement)
    grads_NSW = _slot_grads(world_size, place.shape[1], dtype).float()
    # each expert's gradient = scale x the sum of the gradients of all its slots, on every rank
    expected = torch.zeros(E, P)
    for n in range(world_size):
        for j, e in enumerate(place[n].tolist()):
            if e >= 0:
                expected[e] += grads_NSW[n, j]
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for full_grad, master, slots, slot_grad in out:
        torch.testing.assert_close(full_grad, expected * scale, **tol)
        assert torch.equal(master, out[0][1])
    # after the redistribution every slot holds exactly the updated weights of its new expert, empty slots zero
    master = out[0][1]
    for n, (_, _, slots, slot_grad) in enumerate(out):
        assert slot_grad is None
        for j, e in enumerate(nxt[n].tolist()):
            want = master[e].to(dtype) if e >= 0 else torch.zeros(P, dtype=dtype)
            assert torch.equal(slots[j], want), (n, j, e)
    # and the update moved the weights (Adam's first step moves each weight by about lr)
    initial = flatten_experts(*_weights()).float()
    hosted = sorted({e for row in placement for e in row if e >= 0})
    moved = (master[hosted] - initial[hosted]).abs()
    assert moved.min() > 0.05 or dtype == torch.bfloat16


def _folded_gradient(placement, dtype):
    """Each expert's gradient as both modes define it: every host sums its slots (fp32, in slot order) and sends
    the sum in the slots' dtype; the sums are added in fp32 in ascending host rank. [E, P] fp32."""
    place = torch.tensor(placement)
    grads_NSW = _slot_grads(place.shape[0], place.shape[1], dtype)
    full = torch.zeros(E, P)
    for e in range(E):
        acc = None
        for n in range(place.shape[0]):
            slots = (place[n] == e).nonzero().flatten().tolist()
            if slots:
                part = grads_NSW[n, slots].to(torch.float32).sum(0).to(dtype).to(torch.float32)
                acc = part.clone() if acc is None else acc + part
        if acc is not None:
            full[e] = acc
    return full


@pytest.mark.parametrize("world_size,placement,next_placement", [
    (2, SAME_2, PAIR_2), (2, PAIR_2, PAIR_2_NEXT), (4, SPREAD_4, MOVED_4), (4, SCATTERED_4, SPREAD_4)])
def test_shard_mode_is_bit_identical_to_range_mode_and_to_torch_adam(world_size, placement, next_placement):
    """fp32: after a step the gradient shards, master weights and redistributed slots of the two modes are equal
    bit for bit (one summation order), and equal torch.optim.Adam (single-tensor) on the full gradient."""
    scale = 0.25
    out = {mode: launch(_sync_and_collect, world_size, placement, next_placement, torch.float32, scale, mode)
           for mode in ("range", "shard")}
    for (g_r, m_r, s_r, _), (g_s, m_s, s_s, _) in zip(out["range"], out["shard"]):
        assert torch.equal(g_r, g_s) and torch.equal(m_r, m_s) and torch.equal(s_r, s_s)
    full = _folded_gradient(placement, torch.float32) * scale
    assert torch.equal(out["shard"][0][0], full)
    params = [torch.nn.Parameter(w.clone()) for w in _weights()]
    for p_, g_ in zip(params, unflatten_experts(full, D, F)):
        p_.grad = g_.contiguous()
    torch.optim.Adam(params, lr=0.1, foreach=False).step()
    assert torch.equal(out["shard"][0][1], flatten_experts(*[p_.detach() for p_ in params]))


@pytest.mark.parametrize("world_size,placement", [(2, SAME_2), (4, SPREAD_4)])
def test_shard_mode_in_bf16_differs_from_range_mode_by_one_rounding(world_size, placement):
    """bf16 slots: the range all-gather rounds the reduced gradient to bf16, the shard owner keeps the fp32 sum."""
    out = {mode: launch(_sync_and_collect, world_size, placement, placement, torch.bfloat16, 1.0, mode)
           for mode in ("range", "shard")}
    full = _folded_gradient(placement, torch.bfloat16)
    torch.testing.assert_close(out["shard"][0][0], full, rtol=0, atol=0)
    torch.testing.assert_close(out["range"][0][0], full.to(torch.bfloat16).float(), rtol=0, atol=0)


def test_store_checks_the_mode_and_needs_no_groups_in_either():
    """Without shared groups the world is the EP group, in both modes (the range mode creates no group)."""
    def body(rank):
        wg, wu, wd = _weights()
        place = torch.tensor(PAIR_2)
        with pytest.raises(ValueError, match="replica_grad"):
            ReplicaStore(wg, wu, wd, place, None, replica_grad="ring")
        out = []
        for mode in ("range", "shard"):
            store = ReplicaStore(wg, wu, wd, place, None, replica_grad=mode)
            store.sync_replica_grads()  # no backward ran: every gradient is zero
            out.append(store.collect_grad_shards())
        return out

    for shards in launch(body, 2):
        assert all(s.shape == (E, 9) and not s.any() for s in shards)


@pytest.mark.slow
def test_shard_mode_syncs_scattered_replicas_faster_on_cpu():
    """4 gloo ranks, LRMoE's scattered placement: one exchange for all experts beats per-expert collectives over
    the ranges (replica sync + gradient collection, median of the slowest rank)."""
    from lrmoe.harness.replica_sync_timing import VARIANTS, example_placements, time_replica_grad

    placement = example_placements(4, 16, extra_slots=2)["lrmoe"]
    res = time_replica_grad(placement, 16, 64, 32, repeats=15)
    assert set(res) == set(VARIANTS) and all(r["median_ms"] > 0 for r in res.values())
    assert res["shard"]["median_ms"] < res["range"]["median_ms"]


def test_range_groups_are_none_by_default_and_every_consecutive_range_on_request():
    """The replica sync creates no group (RangeGroups() holds none); all_ranges=True creates the N(N-1)/2 range
    groups, each of the range's size, for timing the backend's all-reduce."""
    def body(rank):
        import torch.distributed as dist
        assert len(RangeGroups()) == 0
        groups = RangeGroups(all_ranges=True)
        sizes = {}
        for lo in range(4):
            for hi in range(lo + 1, 4):
                if lo <= rank <= hi:
                    sizes[(lo, hi)] = dist.get_world_size(groups.get(lo, hi))
        with pytest.raises(ValueError, match="no range group"):
            groups.get(2, 2)
        with pytest.raises(ValueError, match="all_ranges"):
            RangeGroups().get(0, 1)
        return len(groups), sizes

    out = launch(body, 4)
    assert all(n == 6 for n, _ in out)  # N(N-1)/2
    assert out[1][1] == {(0, 1): 2, (0, 2): 3, (0, 3): 4, (1, 2): 2, (1, 3): 3}
