"""The cost model: hand-computed times on a tiny case, bytes equal to the layer's own accounting formulas,
monotonicity (more bytes or rows, never less time), compaction, out-of-memory detection, the sanity relation of
DESIGN.md §5, and the calibration seams."""

import dataclasses
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lrmoe.config import ClusterConfig, MoEConfig, cluster_preset, model_preset
from lrmoe.runtime.distributed.accounting import expected_layer, expected_step
from lrmoe.bytemodel.layout import STEP_PHASES
from lrmoe.planner.placement import MemoryModel, lrmoe_placement
from lrmoe.planner.plan import LayerPlan, no_flows
from lrmoe.planner.policies import LRMoE, Capacity, StaticEP, Symi
from lrmoe.planner.replica_routing import route_forward
from lrmoe.sim.cost import (CATEGORIES, PHASES, CostModel, GemmCurve, cpu_gloo_preset, gemm_preset,
                            load_gemm_calibration)

# hidden 4, ffn 2: 24 parameters per expert, 48 FLOP per pair forward, 96 backward, 16 bytes per row (fp32)
TINY = MoEConfig(name="tiny", hidden=4, expert_ffn=2, num_experts=2, top_k=1, router="softmax_topk",
                 num_layers=1, num_heads=1, num_kv_heads=1, dtype="float32")
# two ranks on two nodes: 100 B/s and 0.5 s latency between them; 96 FLOP/s
TOY = ClusterConfig(name="toy", num_ranks=2, ranks_per_node=1, mem_budget_bytes=1e6, intra_bw=1000.0,
                    inter_bw=100.0, intra_latency=0.25, inter_latency=0.5, peak_flops=96.0, hbm_bw=0.0)
# eff_max 0.5 at 96 FLOP/s: 1 s per forward row, 2 s per backward row, plus m_half = 2 rows per busy slot
CURVE = GemmCurve(eff_max=0.5, m_half=2.0, launch_s=0.1)


def dropless(placement_NS, fwd_NG, num_experts):
    n = placement_NS.shape[0]
    return LayerPlan(placement_NS=placement_NS, fwd_NG=fwd_NG, dropped_NE=torch.zeros(n, num_experts, dtype=torch.long),
                     keep_NG=fwd_NG.clone(), bwd_flows_V4=no_flows(), floor_excess_N=torch.zeros(n, dtype=torch.long))


def free_comm(cluster: ClusterConfig) -> ClusterConfig:
    """The same cluster with communication and the optimizer made free: only expert compute costs time."""
    return cluster.replace(intra_bw=1e30, inter_bw=1e30, intra_latency=0.0, inter_latency=0.0, hbm_bw=0.0)


# -- hand-computed ----------------------------------------------------------------------------------------------
# rank 0 routes 3 pairs to e0 (home) and 1 to e1; rank 1 routes 2 to e0 and 5 to e1 (home); one slot per rank.
HAND_FWD_NG = torch.tensor([[3, 1], [2, 5]])
HAND_PLAN = dropless(torch.tensor([[0], [1]]), HAND_FWD_NG, 2)


def test_hand_computed_times_bytes_and_memory():
    t = CostModel(TINY, TOY, gemm=CURVE).cost(HAND_PLAN)
    want = {
        # rank 0 sends 1 row (16 B, 0.16 s) and receives 2 (0.32 s); rank 1 the mirror: max + 0.5 s latency
        "dispatch_a2a": [0.82, 0.82], "combine_a2a": [0.82, 0.82],
        "combine_a2a_bwd": [0.82, 0.82], "dispatch_a2a_bwd": [0.82, 0.82],
        # 5 and 6 rows: (rows + 2) s forward, 2 (rows + 2) s backward, + 0.1 s launch
        "expert_fwd": [7.1, 8.1], "expert_bwd": [14.1, 16.1],
        "shared_fwd": [0.0, 0.0], "shared_bwd": [0.0, 0.0],
        "replica_sync": [0.0, 0.0],  # one host per expert
        # each rank fetches the other's expert shard (12 params x 4 B = 48 B): 0.48 s + 0.5 s; the same for
        # sending its updated shard of its own expert to the other host
        "grad_collect": [0.98, 0.98], "redistribute": [0.98, 0.98],
        "adam": [0.0, 0.0],  # hbm_bw = 0: not modelled
        # the counts all-gather: each rank sends its 2 int64 counts (16 B) to the other, 0.16 s + 0.5 s; a
        # cost model without a system's planner pays none
        "plan": [0.66, 0.66], "recalibrate": [0.0, 0.0],
    }
    for phase, values in want.items():
        torch.testing.assert_close(t.time_NH[:, PHASES.index(phase)], torch.tensor(values, dtype=torch.float64),
                                   msg=phase)
    assert t.total_s == pytest.approx(4 * 0.82 + 8.1 + 16.1 + 2 * 0.98 + 0.66)
    assert t.straggler_rank_H[PHASES.index("expert_fwd")] == 1
    sent = {"dispatch_a2a": [16, 32], "combine_a2a": [32, 16], "combine_a2a_bwd": [16, 32],
            "dispatch_a2a_bwd": [32, 16], "grad_collect": [48, 48], "redistribute": [48, 48]}
    for phase, values in sent.items():
        assert t.bytes_NH[:, PHASES.index(phase)].tolist() == values, phase
    cats = t.category_s()
    assert cats["forward"] == pytest.approx(8.1) and cats["backward"] == pytest.approx(16.1)
    assert cats["communication"] == pytest.approx(4 * 0.82) and cats["sync"] == pytest.approx(1.96)
    assert cats["overhead"] == pytest.approx(0.66)
    # memory (lrmoe.bytemodel.memory): slot 24 x (4 + 4) B; rows of 16 B; expert side 5 and 6 pairs, home side 4 and 7.
    # saved: expert pairs x (row 16 + gate, up, h 3·2·4) + home pairs x row 16: 5·40 + 4·16, 6·40 + 7·16.
    # forward in flight: (home + expert) x 16; backward: every pair's grad row out and in, on both sides, 2·(4 + 5)
    # and 2·(7 + 6) rows, + 2F·4 = 16 B per backward GEMM row: 288 + 80, 416 + 96.
    assert t.slot_bytes_N.tolist() == [192.0, 192.0]
    assert t.saved_bytes_N.tolist() == [264.0, 352.0]
    assert t.fwd_buffer_bytes_N.tolist() == [144.0, 208.0]
    assert t.bwd_buffer_bytes_N.tolist() == [368.0, 512.0]
    assert t.buffer_bytes_N.tolist() == [368.0, 512.0]
    assert t.peak_bytes_N.tolist() == [824.0, 1056.0]  # one MoE layer: resident + in flight


def test_early_selection_pays_its_keep_bit_all_to_all():
    """Early selection sends each pair's keep bit (one byte) to its expert in an all-to-all of its own along the
    dispatch's splits: the hand plan's rank 0 sends 1 byte and receives 2 (rank 1 the mirror), max(0.01, 0.02) s +
    the 0.5 s latency each; a byte per row of the dispatch (the layer's count); nothing else changes, and a cost
    model without early selection pays nothing there."""
    late = CostModel(TINY, TOY, gemm=CURVE).cost(HAND_PLAN)
    early = CostModel(TINY, TOY, gemm=CURVE, early_selection=True).cost(HAND_PLAN)
    col = PHASES.index("early_keep_a2a")
    torch.testing.assert_close(early.time_NH[:, col], torch.tensor([0.52, 0.52], dtype=torch.float64))
    assert early.bytes_NH[:, col].tolist() == [1.0, 2.0]
    row_bytes = TINY.hidden * TINY.dtype_bytes
    assert (early.bytes_NH[:, col] * row_bytes).tolist() == early.bytes_NH[:, PHASES.index("dispatch_a2a")].tolist()
    assert late.time_NH[:, col].tolist() == [0.0, 0.0] and late.bytes_NH[:, col].tolist() == [0.0, 0.0]
    others = [i for i in range(len(PHASES)) if i != col]
    torch.testing.assert_close(early.time_NH[:, others], late.time_NH[:, others])
    assert early.total_s == pytest.approx(late.total_s + 0.52)
    assert early.category_s()["communication"] == pytest.approx(late.category_s()["communication"] + 0.52)


def test_intra_and_inter_node_links_run_concurrently():
    # 4 ranks, 2 per node; rank 0 sends 10 rows to rank 1 (same node) and 3 rows to rank 2 (other node)
    cluster = TOY.replace(num_ranks=4, ranks_per_node=2)
    cm = CostModel(TINY, cluster, gemm=CURVE)
    b_NM = torch.zeros(4, 4, dtype=torch.float64)
    b_NM[0, 1], b_NM[0, 2], b_NM[3, 3] = 160.0, 48.0, 1e9  # the diagonal is a local copy: free
    t = cm.a2a_seconds(b_NM)
    # rank 0: max(160 / 1000, 48 / 100) + max(0.25, 0.5); rank 1 receives 0.16 s intra; rank 2 0.48 s inter
    torch.testing.assert_close(t, torch.tensor([0.48 + 0.5, 0.16 + 0.25, 0.48 + 0.5, 0.0], dtype=torch.float64))


# -- the layer's own accounting ---------------------------------------------------------------------------------
def _random_counts(n, e, seed, scale=20):
    g = torch.Generator().manual_seed(seed)
    pop = torch.rand(e, generator=g) ** 3 + 0.05
    return (torch.rand(n, e, generator=g) * pop * scale).long()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("n", [2, 4])
def test_bytes_equal_the_layers_accounting_formulas(n, seed):
    """Dropless plans on SYMI, LRMoE (scattered replicas: wide ranges) and static placements: every all-to-all
    and every optimizer-step phase sends exactly the bytes :mod:`lrmoe.runtime.distributed.accounting` derives for the
    layer."""
    e = 8
    model = TINY.replace(num_experts=e, hidden=8, expert_ffn=5)
    cm = CostModel(model, TOY.replace(num_ranks=n, ranks_per_node=2 if n > 2 else 1), gemm=CURVE)
    counts = _random_counts(n, e, seed)
    pop = counts.sum(0)
    placements = [Symi(4).plan(counts, pop).placement_NS, lrmoe_placement(pop, n, e // n, 2),
                  StaticEP().plan(counts).placement_NS]
    for placement_NS in placements:
        plan = dropless(placement_NS, route_forward(counts, placement_NS, "even"), e)
        t = cm.cost(plan)
        want = expected_layer(plan, model.hidden, model.expert_ffn, 4)
        want.update(expected_step(placement_NS, placement_NS, e, model.hidden, model.expert_ffn, 4))
        for key, value in want.items():
            phase, _, what = key.partition(".")
            if what != "sent_bytes":
                continue
            assert t.bytes_NH[:, PHASES.index(phase)].tolist() == value.double().tolist(), (key, placement_NS)


@pytest.mark.parametrize("compaction", [True, False], ids=["compact", "padded"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("n", [2, 4])
def test_trimmed_moved_and_padded_plans_cost_the_bytes_the_layer_counts(n, seed, compaction):
    """LRMoE plans that trim (budget mode) and move (cap mode with backward routing), compact and padded, and a
    capacity plan that drops: every all-to-all (the index exchange included) sends exactly the bytes the layer's
    accountant must count for them, metric m2's extra combine column included."""
    e = 8
    model = TINY.replace(num_experts=e, hidden=8, expert_ffn=5)
    cm = CostModel(model, TOY.replace(num_ranks=n, ranks_per_node=2 if n > 2 else 1), gemm=CURVE,
                   compaction=compaction, combine_cols=1)
    counts = _random_counts(n, e, seed, scale=40)
    pop = counts.sum(0)
    cap = LRMoE(quota_mode="cap", eps=0.0, extra_slots=1, forward="even")
    moving = [cap.plan(c, c.sum(0)) for c in (_random_counts(n, e, seed + 10 * i, scale=40) for i in range(6))]
    plans = [LRMoE(rho=0.6, extra_slots=1).plan(counts, pop), Capacity(1.0).plan(counts, pop), *moving]
    assert not torch.equal(plans[0].keep_NG, plans[0].fwd_NG)  # something to compact
    assert plans[1].dropped_NE.sum() > 0 and any(len(p.bwd_flows_V4) for p in moving)
    for plan in plans:
        t = cm.cost(plan)
        want = expected_layer(plan, model.hidden, model.expert_ffn, 4, "m2", compaction)
        for key, value in want.items():
            phase, _, what = key.partition(".")
            if what == "sent_bytes":
                assert t.bytes_NH[:, PHASES.index(phase)].tolist() == value.double().tolist(), (key, plan.policy)
        assert t.bwd_rows_N.tolist() == want["pairs_bwd"].tolist()  # the backward GEMM multiplies what arrives


def test_sync_groups_hosts_only_never_costs_more_than_ranges():
    model = model_preset("qwen3-30b-a3b")
    cluster = cluster_preset("a100-40gb-x8", 2)
    counts = _random_counts(16, 128, 0, scale=200)
    plan = LRMoE(extra_slots=2, quotas=False, backward_routing=False).plan(counts, counts.sum(0))
    rng = CostModel(model, cluster, sync_groups="range").cost(plan)
    hosts = CostModel(model, cluster, sync_groups="hosts").cost(plan)
    i = PHASES.index("replica_sync")
    assert (hosts.bytes_NH[:, i] <= rng.bytes_NH[:, i]).all() and hosts.bytes_H[i] < rng.bytes_H[i]
    assert hosts.phase_s("replica_sync") < rng.phase_s("replica_sync")


@pytest.mark.parametrize("mode", ["range", "shard"])
@pytest.mark.parametrize("n", [2, 4])
def test_step_bytes_equal_the_layers_accounting_in_both_modes(n, mode):
    """The optimizer step's bytes in the cost model are the layer's closed form (one byte model), for SYMI's
    contiguous, LRMoE's scattered and static placements, in both replica-gradient modes."""
    e = 8
    model = TINY.replace(num_experts=e, hidden=8, expert_ffn=5)
    cm = CostModel(model, TOY.replace(num_ranks=n, ranks_per_node=2 if n > 2 else 1), gemm=CURVE, replica_grad=mode)
    for seed in range(3):
        counts = _random_counts(n, e, seed)
        pop = counts.sum(0)
        for placement_NS in [Symi(4).plan(counts, pop).placement_NS, lrmoe_placement(pop, n, e // n, 2),
                             StaticEP().plan(counts).placement_NS]:
            t = cm.cost(dropless(placement_NS, route_forward(counts, placement_NS, "even"), e))
            want = expected_step(placement_NS, placement_NS, e, model.hidden, model.expert_ffn, 4, replica_grad=mode)
            for phase in ("replica_sync", "grad_collect", "redistribute"):
                got = t.bytes_NH[:, PHASES.index(phase)].tolist()
                assert got == want[f"{phase}.sent_bytes"].double().tolist(), (mode, phase, placement_NS)


def test_sync_modes_hand_computed():
    """TINY (24 fp32 parameters per expert: 96 B, shards of 48 B) on TOY (100 B/s, 0.5 s latency between the
    two ranks). Both experts on both ranks: range all-reduces each expert (96 B per rank: 0.96 s + 2 x 1 hop x
    0.5 s, twice); shard sends the other rank its shard of both experts at once (96 B: 0.96 s + 0.5 s)."""
    both = dropless(torch.tensor([[0, 1], [0, 1]]), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1]]), 2)
    i, j = PHASES.index("replica_sync"), PHASES.index("grad_collect")
    rng = CostModel(TINY, TOY, gemm=CURVE).cost(both)
    shd = CostModel(TINY, TOY, gemm=CURVE, replica_grad="shard").cost(both)
    assert rng.time_NH[:, i].tolist() == pytest.approx([3.92, 3.92]) and rng.time_NH[:, j].tolist() == [0, 0]
    assert shd.time_NH[:, i].tolist() == pytest.approx([1.46, 1.46]) and shd.time_NH[:, j].tolist() == [0, 0]
    assert rng.bytes_NH[:, i].tolist() == [192, 192] and shd.bytes_NH[:, i].tolist() == [96, 96]
    # one host per expert: range has nothing to all-reduce and each owner fetches the other's shard (48 B);
    # shard sends the same 48 B unasked, in the sync phase instead of the collection
    r1, s1 = (CostModel(TINY, TOY, gemm=CURVE, replica_grad=mode).cost(HAND_PLAN) for mode in ("range", "shard"))
    assert r1.time_NH[:, i].tolist() == [0, 0] and r1.time_NH[:, j].tolist() == pytest.approx([0.98, 0.98])
    assert s1.time_NH[:, i].tolist() == pytest.approx([0.98, 0.98]) and s1.time_NH[:, j].tolist() == [0, 0]
    assert r1.phase_s("redistribute") == s1.phase_s("redistribute")


def test_measured_step_fixed_times_replace_the_latency_terms():
    """The same two plans on TOY with a measured fixed time per step phase (shard mode 0.25 s, range 0.75 s, Adam
    0.125 s): every rank pays it once per phase, and the phase's latency terms go (they are part of it)."""
    both = dropless(torch.tensor([[0, 1], [0, 1]]), torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1]]), 2)
    fixed = {"shard": 0.25, "range": 0.75}
    toy = TOY.replace(step_fixed_s=tuple((f"{mode}/{phase}", 0.125 if phase == "adam" else fixed[mode])
                                         for mode in fixed for phase in STEP_PHASES))
    for mode, f in fixed.items():
        for plan in (both, HAND_PLAN):
            plain = CostModel(TINY, TOY, gemm=CURVE, replica_grad=mode).cost(plan)
            timed = CostModel(TINY, toy, gemm=CURVE, replica_grad=mode).cost(plan)
            for phase in STEP_PHASES:
                k = PHASES.index(phase)
                latency = 0.5 * (plain.bytes_NH[:, k] > 0)  # one message between the two ranks...
                if mode == "range" and phase == "replica_sync":
                    latency = 2 * 2 * 0.5 * (plain.bytes_NH[:, k] > 0)  # ...or a ring hop per expert, twice
                want = plain.time_NH[:, k] - latency + (0.125 if phase == "adam" else f)
                assert timed.time_NH[:, k].tolist() == pytest.approx(want.tolist()), (mode, phase)
                assert timed.bytes_NH[:, k].tolist() == plain.bytes_NH[:, k].tolist()
    with pytest.raises(ValueError, match="step_fixed_s"):
        TOY.replace(step_fixed_s=(("shard/adam", -1.0),))


def test_shard_mode_is_cheaper_for_scattered_replicas():
    """LRMoE's scattered replicas on two 8-rank nodes: ranges cross nodes and span non-hosts; sending shards
    straight to the owners moves fewer bytes and takes less time for the sync phases together."""
    model = model_preset("qwen3-30b-a3b")
    cluster = cluster_preset("a100-40gb-x8", 2)
    counts = _random_counts(16, 128, 0, scale=200)
    plan = LRMoE(extra_slots=2, quotas=False, backward_routing=False).plan(counts, counts.sum(0))
    rng = CostModel(model, cluster).cost(plan)
    shd = CostModel(model, cluster, replica_grad="shard").cost(plan)
    sync = [PHASES.index(p) for p in ("replica_sync", "grad_collect")]
    assert shd.bytes_H[sync].sum() < rng.bytes_H[sync].sum()
    assert shd.phase_s("replica_sync") + shd.phase_s("grad_collect") < \
        rng.phase_s("replica_sync") + rng.phase_s("grad_collect")
    # static EP keeps optimizer state with the one host: no shard owners, so both modes price the same
    static = StaticEP().plan(counts)
    a, b = (CostModel(model, cluster, sharded_optimizer=False, replica_grad=mode).cost(static)
            for mode in ("range", "shard"))
    assert torch.equal(a.time_NH, b.time_NH)


# -- monotonicity -----------------------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 1e6), min_size=16, max_size=16), st.lists(st.floats(0, 1e6), min_size=16, max_size=16),
       st.sampled_from([1, 2, 4]))
def test_a2a_more_bytes_never_less_time(base, extra, ranks_per_node):
    cm = CostModel(TINY, TOY.replace(num_ranks=4, ranks_per_node=ranks_per_node), gemm=CURVE)
    b = torch.tensor(base, dtype=torch.float64).view(4, 4)
    more = b + torch.tensor(extra, dtype=torch.float64).view(4, 4)
    assert (cm.a2a_seconds(more) >= cm.a2a_seconds(b)).all()


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(0, 3), st.integers(0, 7), st.integers(1, 50), st.booleans())
def test_more_pairs_never_less_time(seed, n, g, extra, compaction):
    """One more batch of pairs on one (source, slot), everything else equal: no phase gets faster."""
    e, ranks = 8, 4
    model = TINY.replace(num_experts=e)
    cm = CostModel(model, TOY.replace(num_ranks=ranks, ranks_per_node=2), gemm=CURVE, compaction=compaction)
    counts = _random_counts(ranks, e, seed)
    plan = Symi(2).plan(counts, counts.sum(0) + 1)
    more_NG = plan.fwd_NG.clone()
    more_NG[n, g] += extra
    bigger = dataclasses.replace(plan, fwd_NG=more_NG, keep_NG=more_NG.clone())  # same policy, same planner
    base, more = cm.cost(plan), cm.cost(bigger)
    assert (more.straggler_H >= base.straggler_H - 1e-12).all()
    assert (more.time_NH >= base.time_NH - 1e-12).all()
    assert more.bytes_H.sum() >= base.bytes_H.sum()
    assert (more.peak_bytes_N >= base.peak_bytes_N).all()


def test_gemm_time_grows_with_rows_and_is_zero_for_an_empty_group():
    rows = torch.arange(0, 2000)
    t = CURVE.seconds(rows, 1e6, 1e12)
    assert t[0] == 0 and (t[1:].diff() > 0).all()
    # efficiency m / (m + m_half): per-row time falls towards 1 / eff_max of the ideal
    per_row = t[1:] / rows[1:]
    assert (per_row.diff() < 0).all() and per_row[-1] == pytest.approx(1e6 / (0.5 * 1e12) * 2001 / 1999, rel=1e-6)


# -- compaction -------------------------------------------------------------------------------------------------
def _lrmoe_plan(backward_routing=True, seed=0):
    model = model_preset("qwen3-30b-a3b")
    counts = _random_counts(8, 128, seed, scale=400)
    # an even forward split leaves replicas with spare room, so the backward routing has pairs to move
    policy = LRMoE(eps=0.05, gamma=0.05, extra_slots=1, backward_routing=backward_routing, forward="even")
    return model, policy.plan(counts, counts.sum(0))


def test_compaction_off_pads_the_backward_to_forward_sizes():
    model, plan = _lrmoe_plan()
    assert int(plan.bwd_NG.sum()) < int(plan.fwd_NG.sum())  # the quotas did trim
    cluster = cluster_preset("a100-40gb-x8")
    on, off = CostModel(model, cluster).cost(plan), CostModel(model, cluster, compaction=False).cost(plan)
    for phase in ("combine_a2a_bwd", "expert_bwd", "dispatch_a2a_bwd"):
        i = PHASES.index(phase)
        assert off.bytes_H[i] >= on.bytes_H[i] and off.straggler_H[i] >= on.straggler_H[i]
    assert off.phase_s("expert_bwd") > on.phase_s("expert_bwd")
    # padded rows: max(fwd, bwd) per (source, slot), so at least every forward row
    assert (off.bwd_rows_N >= off.fwd_rows_N).all()
    assert (on.bwd_rows_N == plan.bwd_load_N).all()
    # the forward is the same either way
    for phase in ("dispatch_a2a", "expert_fwd", "combine_a2a"):
        assert off.phase_s(phase) == on.phase_s(phase)


def test_compaction_changes_nothing_without_trimming():
    counts = _random_counts(8, 128, 3, scale=400)
    plan = Symi(17).plan(counts, counts.sum(0))
    model, cluster = model_preset("qwen3-30b-a3b"), cluster_preset("a100-40gb-x8")
    on, off = CostModel(model, cluster).cost(plan), CostModel(model, cluster, compaction=False).cost(plan)
    assert torch.equal(on.time_NH, off.time_NH) and torch.equal(on.bytes_NH, off.bytes_NH)


def test_moved_pairs_carry_their_input_rows_and_recompute():
    model, plan = _lrmoe_plan(backward_routing=True)
    assert len(plan.bwd_flows_V4) > 0 and int(plan.carry_NG.sum()) > 0
    cm = CostModel(model, cluster_preset("a100-40gb-x8"))
    t = cm.cost(plan)
    i = PHASES.index("combine_a2a_bwd")
    off_diag = (plan.bwd_NG + plan.carry_NG).view(8, 8, -1).sum(2) * (1 - torch.eye(8, dtype=torch.long))
    assert t.bytes_NH[:, i].tolist() == (off_diag.sum(1) * model.pair_bytes).double().tolist()
    # with free communication, the routed plan's backward costs its rows plus the recompute of moved pairs
    free = CostModel(model, free_comm(cluster_preset("a100-40gb-x8")), gemm=GemmCurve(1.0, 0.0))
    per_row = model.pair_fwd_flops / cluster_preset("a100-40gb-x8").peak_flops
    moved_N = plan.moved_NG.sum(0).view(8, -1).sum(1).double()
    want_N = (2 * plan.bwd_load_N.double() + 2 / 3 * moved_N) * per_row
    torch.testing.assert_close(free.cost(plan).time_NH[:, PHASES.index("expert_bwd")], want_N)


# -- memory -----------------------------------------------------------------------------------------------------
def test_out_of_memory_is_flagged_against_the_budget():
    t_fit = CostModel(TINY, TOY, gemm=CURVE, mem_budget_bytes=1056).cost(HAND_PLAN)  # rank 1's peak
    t_oom = CostModel(TINY, TOY, gemm=CURVE, mem_budget_bytes=1055).cost(HAND_PLAN)
    assert not t_fit.oom and t_oom.oom
    # more replica slots, same tokens: more memory
    model, cluster = model_preset("qwen3-30b-a3b"), cluster_preset("a100-40gb-x8")
    counts = _random_counts(8, 128, 1, scale=400)
    few, many = Symi(16).plan(counts, counts.sum(0)), Symi(24).plan(counts, counts.sum(0))
    cm = CostModel(model, cluster)
    assert (cm.cost(many).slot_bytes_N > cm.cost(few).slot_bytes_N).all()
    budget = (float(cm.cost(few).peak_bytes_N.max()) + 1) / model.num_moe_layers  # one layer's share
    tight = CostModel(model, cluster, mem_budget_bytes=budget)
    assert not tight.cost(few).oom and tight.cost(many).oom


def test_default_budget_is_the_clusters_share_per_moe_layer():
    model, cluster = model_preset("glm-4.5-air"), cluster_preset("h200x8")
    assert CostModel(model, cluster).mem_budget_bytes == pytest.approx(cluster.mem_budget_bytes / 45)


def test_optimizer_state_counts_only_when_asked():
    a = CostModel(TINY, TOY, gemm=CURVE).cost(HAND_PLAN)
    b = CostModel(TINY, TOY, gemm=CURVE, optimizer_in_budget=True).cost(HAND_PLAN)
    # two experts of 24 params, sharded over 2 ranks: 24 params x 12 B each
    assert b.state_bytes_N.tolist() == [288.0, 288.0]
    assert torch.equal(b.peak_bytes_N - a.peak_bytes_N, b.state_bytes_N)


def test_memory_model_sizes_match_the_cost_model():
    cm = CostModel(model_preset("qwen3-30b-a3b"), cluster_preset("a100-40gb-x8"))
    assert cm.slot_bytes == 4 * 2048 * 768 * 3  # bf16 weights and bf16 gradients
    assert cm.pair_bytes == (2048 + 3 * 768) * 2  # the received (= saved) input row, gate, up and h
    mm = cm.memory_model()  # the planner's view of the same accounting: the whole budget over all 48 layers
    assert (mm.slot_bytes, mm.pair_bytes, mm.num_layers) == (cm.slot_bytes, cm.pair_bytes, 48)
    assert mm.budget_bytes == pytest.approx(cm.mem_budget_bytes * 48)
    assert isinstance(mm, MemoryModel)


# -- the sanity relation of DESIGN.md §5 ------------------------------------------------------------------------
@pytest.mark.parametrize("extra_slots, forward", [(0, "balanced"), (1, "even")])
def test_sanity_relation_lrmoe_over_symi_dropless(extra_slots, forward):
    """Compute only (free communication, linear GEMM): LRMoE ÷ SYMI-dropless = (I_L + β ρ) / ((1 + β) I_S),
    exactly without moved pairs, and within the recompute of moved pairs with them."""
    model = model_preset("qwen3-30b-a3b")
    cluster = free_comm(cluster_preset("a100-40gb-x8"))
    cm = CostModel(model, cluster, gemm=GemmCurve(eff_max=1.0, m_half=0.0), overheads=())
    g = torch.Generator().manual_seed(4)
    pop = torch.rand(128, generator=g) ** 4 + 0.02  # a few hot experts
    counts = (pop / pop.sum() * 4096 * 8).round().long().expand(8, -1)  # 8 ranks, 4096 tokens, top-8
    lrmoe = LRMoE(eps=0.1, gamma=0.0, extra_slots=extra_slots, forward=forward).plan(counts, counts.sum(0))
    moves = len(lrmoe.bwd_flows_V4) > 0
    assert moves == (extra_slots > 0)  # with replicas and an even forward, the backward routing moves pairs
    symi = Symi(17).plan(counts, counts.sum(0))
    t_l, t_s = cm.cost(lrmoe), cm.cost(symi)
    mean = float(t_s.fwd_rows_N.double().mean())
    assert mean == pytest.approx(float(t_l.fwd_rows_N.double().mean()))
    i_l, i_s = float(t_l.fwd_rows_N.max()) / mean, float(t_s.fwd_rows_N.max()) / mean
    rho = float(t_l.bwd_rows_N.max()) / mean
    beta = model.pair_bwd_flops / model.pair_fwd_flops
    assert i_l > 1.2 and rho < i_l - 0.1  # a skewed case where the quotas trim
    predicted = (i_l + beta * rho) / ((1 + beta) * i_s)
    ratio = t_l.total_s / t_s.total_s
    assert ratio == pytest.approx(predicted, rel=0.10 if moves else 1e-9)
    assert set(CATEGORIES["forward"]) | set(CATEGORIES["backward"]) <= set(PHASES)


# -- presets and errors -----------------------------------------------------------------------------------------
def test_gemm_presets_and_calibration_file(tmp_path):
    assert "published" in gemm_preset("h200x8").source and "MAMF" in gemm_preset("h200x8").source
    assert gemm_preset("a100-40gb-x8@2n").m_half == gemm_preset("a100-80gb-x16").m_half
    # with the cluster known, m_half is the roofline's: eff_max · peak / HBM bandwidth for bf16 weights
    a100 = cluster_preset("a100-40gb-x8")
    assert gemm_preset(a100.name, cluster=a100).m_half == pytest.approx(0.86 * 312e12 / 1.555e12)
    assert CostModel(model_preset("qwen3-30b-a3b"), a100).gemm.m_half == pytest.approx(172.55, abs=0.01)
    path = tmp_path / "h200_gemm.json"
    path.write_text(json.dumps({"provenance": {"date": "2026-01-01", "device": "NVIDIA H200", "torch": "2.11",
                                               "triton": "3.6"},
                                "pooled": {"eff_max": 0.6, "m_half": 300.0, "launch_s": 4e-6},
                                "fits": {"glm-4.5-air": {"eff_max": 0.65, "m_half": 200.0, "launch_s": 4e-6}}}))
    pooled = gemm_preset("h200x8", "qwen3-30b-a3b", calibration=path)
    assert (pooled.eff_max, pooled.m_half) == (0.6, 300.0) and "NVIDIA H200" in pooled.source
    assert load_gemm_calibration(path, "glm-4.5-air").m_half == 200.0
    with pytest.raises(ValueError, match="does not exist"):
        gemm_preset("h200x8", calibration=tmp_path / "missing.json")
    with pytest.raises(ValueError, match="no GEMM curve"):
        gemm_preset("tpu-v5")


def test_cpu_gloo_preset_seam(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"peak_flops": 5e10, "a2a_bw": 2e9, "a2a_latency": 5e-5, "mem_bw": 1e10,
                                "gemm": {"eff_max": 0.8, "m_half": 16, "launch_s": 2e-5}}))
    cluster, curve = cpu_gloo_preset(path, num_ranks=4)
    assert cluster.num_ranks == 4 and cluster.num_nodes == 1 and curve.m_half == 16
    t = CostModel(model_preset("qwen3-30b-a3b-debug"), cluster, gemm=curve).cost(
        StaticEP().plan(_random_counts(4, 16, 0)))
    assert t.total_s > 0
    path.write_text(json.dumps({"peak_flops": 1.0}))
    with pytest.raises(ValueError, match="lacks"):
        cpu_gloo_preset(path, 2)


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="eff_max"):
        GemmCurve(eff_max=1.5, m_half=1.0)
    with pytest.raises(ValueError, match="m_half"):
        GemmCurve(eff_max=0.5, m_half=-1.0)
    with pytest.raises(ValueError, match="sync_groups"):
        CostModel(TINY, TOY, gemm=CURVE, sync_groups="tree")
    with pytest.raises(ValueError, match="replica_grad"):
        CostModel(TINY, TOY, gemm=CURVE, replica_grad="ring")
    with pytest.raises(ValueError, match="recompute_fraction"):
        CostModel(TINY, TOY, gemm=CURVE, recompute_fraction=-1.0)
    with pytest.raises(ValueError, match="num_ranks=4"):
        CostModel(TINY, TOY.replace(num_ranks=4), gemm=CURVE).cost(HAND_PLAN)
    with pytest.raises(ValueError, match="num_experts=8"):
        CostModel(TINY.replace(num_experts=8), TOY, gemm=CURVE).cost(HAND_PLAN)
    assert Capacity(1.0).plan(torch.ones(2, 2, dtype=torch.long)).num_experts == 2


# -- the GPU calibration script (its fit and its data file; the measurement itself needs a GPU) -------------------
def _calibrate_module():
    from _scripts import load_experiment

    return load_experiment("calibrate_gpu")


def test_calibration_fit_recovers_known_constants():
    cal = _calibrate_module()
    peak, eff, m_half, launch = 1e15, 0.7, 200.0, 6e-6
    samples = []
    for flops in (9.4e6, 34.6e6):
        for groups in (1, 8):
            for rows in (1, 16, 128, 512, 2048, 8192):
                t = launch + groups * flops * (rows + m_half) / (eff * peak)
                samples.append({"rows": rows, "groups": groups, "flops_per_row": flops, "fwd_s": t,
                                "fwd_bwd_s": 3 * t})
    fit = cal.fit_curve(samples, peak)
    assert fit["eff_max"] == pytest.approx(eff, rel=1e-6) and fit["m_half"] == pytest.approx(m_half, rel=1e-6)
    assert fit["launch_s"] == pytest.approx(launch, rel=1e-6) and fit["median_rel_error"] < 1e-9
    assert fit["bwd_over_fwd"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="at least 3"):
        cal.fit_curve(samples[:2], peak)


def test_calibration_script_without_gpu_and_on_cpu(tmp_path, capsys):
    cal = _calibrate_module()
    if not torch.cuda.is_available():
        assert cal.main(["--no-wandb", "--out", str(tmp_path / "r.jsonl")]) is None
        assert "no CUDA GPU" in capsys.readouterr().out
        assert not (tmp_path / "r.jsonl").exists()
    # the CPU path exercises measurement, fit and data file end to end (its numbers mean nothing)
    out = tmp_path / "cpu_gemm.json"
    # rows far apart, so that timing noise on a busy machine does not make the time fall with rows
    data = cal.main(["--cpu", "--models", "qwen3-30b-a3b-debug", "--rows", "1", "256", "2048", "--groups", "1", "2",
                     "--repeats", "2", "--peak-tflops", "1", "--preset-out", str(out), "--out",
                     str(tmp_path / "cal.jsonl"), "--no-wandb"])
    assert set(data["provenance"]) >= {"date", "device", "torch", "triton"} and len(data["measurements"]) == 6
    curve = load_gemm_calibration(out, "qwen3-30b-a3b-debug")
    assert 0 < curve.eff_max <= 1 and curve.m_half >= 0 and "calibrated" in curve.source
    with pytest.raises(FileExistsError):
        cal.main(["--cpu", "--peak-tflops", "1", "--preset-out", str(out), "--no-wandb"])


# -- overheads (lrmoe.sim.overheads) and sensitivity --------------------------------------------------------------
def _qwen_plans():
    model, cluster = model_preset("qwen3-30b-a3b"), cluster_preset("a100-40gb-x8")
    g = torch.Generator().manual_seed(3)
    pop = torch.arange(1, 129, dtype=torch.float64) ** -0.8
    counts = torch.stack([torch.bincount(torch.multinomial(pop, 4096 * 8, replacement=True, generator=g),
                                         minlength=128) for _ in range(8)])
    prev = counts.sum(0)
    plans = {"lrmoe": LRMoE(rho=0.75, extra_slots=2).plan(counts, prev), "symi-dl": Symi(18).plan(counts, prev),
             "symi-cf1": Symi(18, 1.0).plan(counts, prev)}
    return model, cluster, plans


def test_every_overhead_is_charged_and_can_be_switched_off():
    model, cluster, plans = _qwen_plans()
    on, off = CostModel(model, cluster, planner="lrmoe"), CostModel(model, cluster, planner="lrmoe", overheads=())
    lr_on, lr_off = on.cost(plans["lrmoe"]), off.cost(plans["lrmoe"])
    assert lr_off.category_s()["overhead"] == 0.0
    # LRMoE's measured planner, 0.54 ms at 8 ranks, of which its critical path (0.90 of it) is charged, plus the
    # counts; its placements run off the critical path (lrmoe.sim.overheads)
    assert lr_on.phase_s("plan") > 0.543e-3 * 0.89
    assert lr_on.phase_s("recalibrate") > 0  # scoring, selection and the compaction passes
    for name in ("planning", "counts", "selection", "compaction"):
        without = dataclasses.replace(on, overheads=tuple(o for o in on.overheads if o != name))
        assert without.cost(plans["lrmoe"]).total_s < lr_on.total_s, name
    # SYMI-dropless selects nothing: its overhead is its own (smaller) planner and the counts all-gather
    dl = CostModel(model, cluster, planner="symi-dropless").cost(plans["symi-dl"])
    assert dl.phase_s("recalibrate") == 0.0 and 0 < dl.phase_s("plan") < lr_on.phase_s("plan")
    # the planner is the system's (its registry entry's), never read from the plan's label: a plan priced without
    # one pays none, and a planner with no benchmark is an error, not a free pass
    assert CostModel(model, cluster).cost(plans["lrmoe"]).phase_s("plan") < 1e-4
    with pytest.raises(ValueError, match="no planner benchmark"):
        CostModel(model, cluster, planner="mystery").cost(plans["symi-dl"])
    with pytest.raises(ValueError, match="no scoring benchmark"):
        CostModel(model, cluster, metric="m2", mode="sideways")


def test_each_selection_pays_what_it_runs():
    """Scoring and selection priced per metric and mode (lrmoe.sim.overheads.SCORING_MS): random selection is
    cheaper than m2 (no pass over the pairs' rows, no ‖h‖ at the expert, no extra combine column), unbiased m2
    dearer than top-k m2; a plan that keeps every pair pays none of it."""
    model, cluster, plans = _qwen_plans()
    plan = plans["lrmoe"]
    priced = {(metric, mode): CostModel(model, cluster, planner="lrmoe", metric=metric, mode=mode).cost(plan)
              for metric, mode in [("m2", "topk"), ("m2", "unbiased"), ("random", "topk"), ("m1", "topk")]}
    m2, m2u, rnd, m1 = (priced[k] for k in [("m2", "topk"), ("m2", "unbiased"), ("random", "topk"), ("m1", "topk")])
    assert rnd.phase_s("recalibrate") < m1.phase_s("recalibrate") < m2.phase_s("recalibrate") < \
        m2u.phase_s("recalibrate")
    assert rnd.total_s < m1.total_s < m2.total_s < m2u.total_s
    # m2's ‖h‖: computed at the expert in the forward, one combine column more home
    assert m2.phase_s("expert_fwd") > m1.phase_s("expert_fwd") == rnd.phase_s("expert_fwd")
    assert m2.bytes_H[PHASES.index("combine_a2a")] > m1.bytes_H[PHASES.index("combine_a2a")]
    keep_all = CostModel(model, cluster, metric="m2").cost(plans["symi-dl"])
    assert keep_all.phase_s("recalibrate") == 0.0
    assert keep_all.phase_s("expert_fwd") == CostModel(model, cluster, metric="random").cost(
        plans["symi-dl"]).phase_s("expert_fwd")


def test_the_scoring_figures_are_the_committed_benchmarks():
    """Every (metric, mode) price is the committed bench_scoring run's, read back from the file it cites."""
    from pathlib import Path

    from lrmoe.results import read_results
    from lrmoe.sim import overheads

    path = Path(__file__).resolve().parent.parent / "paper_figures" / "results" / "bench_scoring.jsonl"
    run = next(r for r in read_results(path, "run") if r["run_id"] == overheads.SCORING_RUN)
    assert run["config"]["tokens"] * run["config"]["top_k"] == overheads.SCORING_PAIRS
    records = [r for r in read_results(path) if r["run_id"] == overheads.SCORING_RUN]
    assert {(r["metric"], r["mode"]) for r in records} == set(overheads.SCORING_MS)
    for r in records:
        assert overheads.SCORING_MS[(r["metric"], r["mode"])] == (r["score_ms"], r["select_ms"])
        assert r["pairs"] == overheads.SCORING_PAIRS
        assert overheads.selection_ms_per_pair(r["metric"], r["mode"]) == max(r["score_ms"], r["select_ms"]) / \
            r["pairs"]


def test_capacity_buffers_pad_memory_and_compute():
    """SYMI-cf1's fixed-size buffers: every slot holds and multiplies ceil(cf · pairs / slots) rows."""
    model, cluster, plans = _qwen_plans()
    plan = plans["symi-cf1"]
    padded = CostModel(model, cluster, capacity_cf=1.0).cost(plan)
    bare = CostModel(model, cluster, capacity_cf=1.0, overheads=("planning", "counts")).cost(plan)
    assert padded.phase_s("expert_fwd") > bare.phase_s("expert_fwd")
    assert (padded.saved_bytes_N > bare.saved_bytes_N).any() and (padded.saved_bytes_N >= bare.saved_bytes_N).all()
    cap = -(-int(plan.routed_NE.sum()) // plan.num_slots)
    assert padded.fwd_rows_N.tolist() == bare.fwd_rows_N.tolist()  # the counted pairs stay the real ones
    assert CostModel(model, cluster, capacity_cf=1.0).slot_capacity_rows(plan) == cap
    assert CostModel(model, cluster).slot_capacity_rows(plan) is None  # dropless systems have no capacity


def test_variants_move_only_time_and_in_the_expected_direction():
    model, cluster, plans = _qwen_plans()
    cm = CostModel(model, cluster)
    work = cm.work(plans["symi-dl"])
    base = cm.price(work)
    slow_gemm = cm.variant(eff_max=0.5).price(work)
    fast_gemm = cm.variant(eff_max=0.9).price(work)
    assert slow_gemm.phase_s("expert_fwd") > base.phase_s("expert_fwd") > fast_gemm.phase_s("expert_fwd")
    assert cm.variant(m_half=512).price(work).phase_s("expert_fwd") > cm.variant(m_half=32).price(work).phase_s(
        "expert_fwd")
    slow_link = cm.variant(bw_scale=0.7).price(work)
    assert slow_link.phase_s("dispatch_a2a") > base.phase_s("dispatch_a2a")
    assert slow_link.phase_s("expert_fwd") == base.phase_s("expert_fwd")
    assert torch.equal(slow_link.peak_bytes_N, base.peak_bytes_N)
    assert torch.equal(cm.cost(plans["symi-dl"]).time_NH, base.time_NH)  # cost = price(work)
