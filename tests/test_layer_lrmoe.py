"""LRMoE end to end in the expert-parallel layer (gloo, 2 and 4 forked ranks) against the reference layer.

The recalibrated backward (lrmoe.runtime.exchange) must give, for every plan: with unbounded quotas, exactly the
reference's gradients; with quotas, exactly the reference's gradients on the retained pair set the layer
reports (keep, scale); the router gradient and the shared expert untouched by the trimming; per-rank retained
pairs within the cap apart from the reported floor excess; and backward all-to-all bytes of exactly the
retained rows plus the carried input rows of moved pairs. Tiny float64 shapes; the routing is skewed (a router
feature every token shares) so that the quotas trim and the backward routing moves pairs.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from lrmoe.recal.backward_config import BackwardConfig
from lrmoe.bytemodel.layout import plan_selects
from lrmoe.runtime.distributed.accounting import Accountant, check_accounting, expected_layer
from lrmoe.runtime.distributed.comm import all_gather_rows
from lrmoe.runtime.distributed.launch import launch
from lrmoe.runtime.distributed.replica import AdamConfig, RangeGroups, flatten_experts, unflatten_experts
from lrmoe.runtime.layer import EPMoELayer, RecalibratedPlanError, initial_placement
from lrmoe.planner.policies import LRMoE, StaticEP, Symi, Trimmed
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.harness.layer_bench_setup import make_traces

D, F, E, K, T = 8, 5, 8, 2, 16
TIGHT = dict(rtol=1e-10, atol=1e-12)
SHARD = dict(rtol=1e-5, atol=1e-6)  # expert gradients pass through the fp32 optimizer shards


# -- distributed cases -----------------------------------------------------------------------------------------
def skewed_reference(family: str, shared: bool) -> ReferenceMoE:
    """A reference layer whose router prefers low expert ids through feature 0 (see :func:`batch`)."""
    ref = ReferenceMoE(D, F, E, K, family, shared_ffn=4 if shared else 0, seed=3, dtype=torch.float64)
    with torch.no_grad():
        ref.w_router_ED[:, 0] = torch.linspace(2.0, -1.0, E)
        if family == "sigmoid_bias":
            ref.bias_E.copy_(torch.linspace(0.3, -0.3, E))
    return ref


def batch(world: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * T, D, generator=g, dtype=torch.float64)
    x[:, 0] += 1.5  # the shared feature: skewed routing
    return x, torch.randn(world * T, D, generator=g, dtype=torch.float64)


def exchange_node(y):
    """The autograd node of the recalibrated expert exchange behind ``y`` (it holds the forward's saved tensors)."""
    todo, seen = [y.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "state"):
            return node
        todo += [nxt for nxt, _ in node.next_functions]
    raise AssertionError("no expert exchange in the graph")


def gathered_selection(record):
    keep = all_gather_rows(record.keep_TK.double()).view(-1, K) > 0
    return keep, all_gather_rows(record.scale_TK.double()).view(-1, K)


def expert_grads(layer):
    layer.store.sync_replica_grads()
    return unflatten_experts(layer.store.gather_full(layer.store.collect_grad_shards()), D, F)


def run_case(rank, groups, policy, cfg, *, family="softmax_topk", shared=False, seed=5, input_grad=True):
    """One iteration of the layer with the recalibrated backward against the reference on the retained pair
    set the layer reports; checks every gradient, the selection rule and the accounting. Returns a summary."""
    world = dist.get_world_size()
    ref = skewed_reference(family, shared)
    acc = Accountant()
    layer = EPMoELayer(ref.export_weights(), K, family, policy, initial_placement(policy, world, E), groups,
                       accountant=acc, backward=cfg)
    x, w = batch(world, seed)
    mine = slice(rank * T, (rank + 1) * T)
    x_local = x[mine].clone().requires_grad_(input_grad)
    y, info = layer(x_local)
    saved_rows = exchange_node(y).saved_tensors[2].shape[0]  # the expert side's saved input rows (x_MD)
    (y * w[mine]).sum().backward()
    rec, plan = info.record, info.dispatch.plan
    keep_TK, scale_TK = gathered_selection(rec)
    x_ref = x.clone().requires_grad_(True)
    y_ref, _ = ref(x_ref, keep_TK, scale_TK)
    (y_ref * w).sum().backward()
    torch.testing.assert_close(y, y_ref[mine], **TIGHT)
    if input_grad:
        torch.testing.assert_close(x_local.grad, x_ref.grad[mine], **TIGHT)
    layer.sync_dense_grads(1.0)
    names = ["w_router_ED"] + (["w_shared_gate_DF", "w_shared_up_DF", "w_shared_down_FD"] if shared else [])
    for p, name in zip(layer.dense_parameters(), names):  # the router and the shared expert: exact
        torch.testing.assert_close(p.grad, getattr(ref, name).grad, **TIGHT)
    for got, want in zip(expert_grads(layer), (ref.w_gate_EDF.grad, ref.w_up_EDF.grad, ref.w_down_EFD.grad)):
        torch.testing.assert_close(got.double(), want, **SHARD)

    # the selection follows the plan's pair-level rule
    G = plan.num_slots
    slot_P = info.dispatch.slot_P
    kept = torch.bincount(slot_P[rec.keep_P], minlength=G)
    assert torch.equal(kept, plan.keep_NG[rank])  # every group keeps exactly its quota
    moved = rec.keep_P & (rec.bwd_slot_P != slot_P)
    for frm, to, count in plan.bwd_flows_V4[plan.bwd_flows_V4[:, 0] == rank][:, 1:].tolist():
        out = moved & (slot_P == frm) & (rec.bwd_slot_P == to)
        assert int(out.sum()) == count
        stay = rec.keep_P & ~moved & (slot_P == frm)
        if stay.any():  # the flows take the group's lowest-scoring kept pairs
            assert float(rec.scores_P[out].max()) <= float(rec.scores_P[stay].min())
    assert int(moved.sum()) == int(plan.moved_out_NG[rank].sum())

    # counted = the formulas, and the byte rules of DESIGN.md §5.1 / lrmoe.bytemodel.layout
    elem = torch.tensor([], dtype=torch.float64).element_size()
    record = acc.record()
    check_accounting(record, expected_layer(plan, D, F, elem, cfg.metric, cfg.compact, input_grad), rank)
    S = plan.slots_per_rank
    away_G = torch.arange(G) // S != rank
    if cfg.compact and plan_selects(plan):
        retained_away = int(plan.bwd_NG[rank][away_G].sum())
        assert record["combine_a2a_bwd.sent_bytes"] == (retained_away + int(plan.carry_NG[rank].sum())) * D * elem
    assert record["pairs_retained"] == int(plan.bwd_load_N[rank])
    if plan.bwd_cap_N is not None:
        assert record["pairs_retained"] <= int(plan.bwd_cap_N[rank]) + int(plan.floor_excess_N[rank])
    mine_G = slice(rank * S, (rank + 1) * S)
    if cfg.early and plan_selects(plan):  # the forward saved the kept rows alone, and sent one byte per pair
        assert saved_rows == int(plan.keep_NG[:, mine_G].sum())
        assert record["early_keep_a2a.sent_bytes"] * D * elem == record["dispatch_a2a.sent_bytes"]
    else:
        assert saved_rows == int(plan.fwd_NG[:, mine_G].sum())
    trimmed = int((plan.fwd_NG - plan.keep_NG).sum())
    return {"trimmed": trimmed, "flows": plan.bwd_flows_V4.shape[0], "grads": expert_grads(layer),
            "bytes": record["combine_a2a_bwd.sent_bytes"], "keep_all": bool(rec.keep_P.all())}


QUOTA_CONFIGS = [
    BackwardConfig(metric="m1"),
    BackwardConfig(metric="m2", mode="unbiased", seed=3),
    BackwardConfig(metric="m3", compact=False),
    BackwardConfig(metric="random", seed=1),
    BackwardConfig(metric="gate", mode="unbiased", compact=False),
]


def _lrmoe_cases(rank):
    groups = RangeGroups()
    summary = {}
    # unbounded quotas: every pair, exactly the reference (and the record says so)
    for policy in (LRMoE(quotas=False, backward_routing=False), LRMoE(eps=100.0)):
        out = run_case(rank, groups, policy, BackwardConfig())
        assert out["keep_all"] and out["trimmed"] == 0
    # quotas, backward routing, every metric, both modes, compact and padded
    for i, cfg in enumerate(QUOTA_CONFIGS):
        out = run_case(rank, groups, LRMoE(eps=0.0, forward="even", extra_slots=2), cfg)
        summary[i] = (out["trimmed"], out["flows"])
    # the GLM family: sigmoid router with a selection bias, and a shared expert that is never dropped
    run_case(rank, groups, LRMoE(eps=0.0, forward="even"), BackwardConfig(metric="m2"), family="sigmoid_bias",
             shared=True)
    # an input that needs no gradient: the input-gradient all-to-all is skipped
    run_case(rank, groups, LRMoE(eps=0.0, forward="even"), BackwardConfig(), input_grad=False)
    # compaction off: the same gradients from the same selection, more bytes
    policy = LRMoE(eps=0.0, forward="even", extra_slots=2)
    dense = run_case(rank, groups, policy, BackwardConfig(compact=False))
    packed = run_case(rank, groups, policy, BackwardConfig(compact=True))
    for a, b in zip(dense["grads"], packed["grads"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    summary["bytes"] = (dense["bytes"], packed["bytes"])
    # the other ablation switches: backward routing off (no flows), placement off (home slots only)
    assert run_case(rank, groups, LRMoE(eps=0.0, forward="even", backward_routing=False),
                    BackwardConfig())["flows"] == 0
    run_case(rank, groups, LRMoE(eps=0.0, extra_slots=0), BackwardConfig())
    # the retention budget (every rank trimmed to ceil(rho * mean)), LRMoE's and the random-trim control on SYMI
    for policy, cfg in ((LRMoE(rho=0.6, extra_slots=1), BackwardConfig(metric="m2")),
                        (LRMoE(rho=0.6, extra_slots=1), BackwardConfig(metric="m2", mode="unbiased")),
                        (Trimmed(Symi(slots_per_rank=E // dist.get_world_size() + 1), 0.6),
                         BackwardConfig(metric="random", compact=False))):
        assert run_case(rank, groups, policy, cfg)["trimmed"] > 0
    return summary


def _early_cases(rank):
    groups = RangeGroups()
    trimmed = []
    for cfg in (BackwardConfig(metric="gate", early=True), BackwardConfig(metric="gate", mode="unbiased", seed=2,
                                                                          early=True),
                BackwardConfig(metric="random", seed=1, early=True)):
        trimmed.append(run_case(rank, groups, LRMoE(rho=0.6, extra_slots=1), cfg)["trimmed"])
    # a plan that keeps everything: nothing to select early, every row saved
    run_case(rank, groups, LRMoE(quotas=False, backward_routing=False), BackwardConfig(metric="gate", early=True))
    return trimmed


@pytest.mark.parametrize("world_size", [2, 4])
def test_early_selection_saves_the_kept_rows_alone_and_equals_the_reference_on_them(world_size):
    """Early selection (the gate chooses in the forward, top-k and unbiased; random): the expert side saves the
    activations of the kept rows alone, and the layer equals the reference on the retained pairs."""
    assert all(t > 0 for t in launch(_early_cases, world_size, timeout_s=120)[0])
    with pytest.raises(ValueError, match="early"):
        BackwardConfig(metric="m1", early=True)  # the forward does not know delta


@pytest.mark.parametrize("world_size", [2, 4])
def test_lrmoe_layer_equals_the_reference_on_the_retained_pairs(world_size):
    summary = launch(_lrmoe_cases, world_size, timeout_s=120)[0]
    # the cases did exercise what they claim: pairs moved between replicas, and (4 ranks) pairs trimmed
    assert all(flows > 0 for i, (_, flows) in summary.items() if isinstance(i, int))
    if world_size == 4:
        assert all(trimmed > 0 for i, (trimmed, _) in summary.items() if isinstance(i, int))
    dense_bytes, packed_bytes = summary["bytes"]
    assert dense_bytes >= packed_bytes


def _training(rank, steps):
    """LRMoE over several steps: the placement follows the previous counts, the weights move by redistribution,
    and the layer stays equal to the reference trained by Adam on the gradients of the pairs the layer kept."""
    world = dist.get_world_size()
    policy = LRMoE(eps=0.0, forward="even", extra_slots=1)
    ref = skewed_reference("softmax_topk", False)
    with torch.no_grad():  # the hottest experts are the last ones: not where a uniform history puts replicas
        ref.w_router_ED[:, 0] = ref.w_router_ED[:, 0].flip(0)
    cfg = AdamConfig(lr=1e-2)
    layer = EPMoELayer(ref.export_weights(), K, "softmax_topk", policy, initial_placement(policy, world, E),
                       RangeGroups(), adam=cfg, backward=BackwardConfig(metric="m1"))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=cfg.lr, foreach=False)
    dense_opt = torch.optim.Adam(layer.dense_parameters(), lr=cfg.lr, foreach=False)
    mine = slice(rank * T, (rank + 1) * T)
    placements = [layer.placement_NS.clone()]
    for step in range(steps):
        x, w = batch(world, 40 + step)
        y, info = layer(x[mine].clone().requires_grad_(True))
        (y * w[mine]).sum().backward()
        keep_TK, scale_TK = gathered_selection(info.record)
        y_ref, _ = ref(x, keep_TK, scale_TK)
        (y_ref * w).sum().backward()
        torch.testing.assert_close(y, y_ref[mine].detach(), rtol=1e-5, atol=1e-6)  # masters are fp32
        layer.sync_dense_grads(1.0)
        for opt in (dense_opt, ref_opt):
            opt.step()
            opt.zero_grad()
        placements.append(layer.expert_step(grad_scale=1.0).clone())
    master = layer.store.full_master()
    want = flatten_experts(ref.w_gate_EDF.detach(), ref.w_up_EDF.detach(), ref.w_down_EFD.detach())
    torch.testing.assert_close(master.double(), want, rtol=1e-5, atol=1e-6)
    return placements


def test_lrmoe_training_steps_follow_the_reference_through_redistribution():
    placements = launch(_training, 2, 3, timeout_s=120)[0]
    assert len({tuple(p.flatten().tolist()) for p in placements}) > 1  # the replicas did move (uniform → skewed)


class HalfRetention:
    """Static EP whose plan keeps half of each group's pairs for the backward."""

    def plan(self, counts_NE, prev_counts_E=None):
        plan = StaticEP().plan(counts_NE, prev_counts_E)
        return dataclasses.replace(plan, keep_NG=plan.fwd_NG // 2, policy="half-retention")


def _plain_backward_refuses(rank):
    ref = skewed_reference("softmax_topk", False)
    placement = initial_placement(StaticEP(), dist.get_world_size(), E)
    layer = EPMoELayer(ref.export_weights(), K, "softmax_topk", StaticEP(), placement, RangeGroups())
    with pytest.raises(ValueError, match="backward=BackwardConfig"):
        layer(torch.randn(T, D, dtype=torch.float64), policy=HalfRetention())
    with pytest.raises(RecalibratedPlanError):
        layer(torch.randn(T, D, dtype=torch.float64), policy=HalfRetention())
    with pytest.raises(ValueError, match="backward must be a BackwardConfig"):
        EPMoELayer(ref.export_weights(), K, "softmax_topk", StaticEP(), placement, RangeGroups(), backward="m1")
    return True


def test_a_layer_without_the_recalibrated_backward_refuses_trimming_plans():
    assert launch(_plain_backward_refuses, 2) == [True, True]


# -- the benchmark ---------------------------------------------------------------------------------------------
def _bench():
    from _scripts import load_experiment

    return load_experiment("layer_bench")


def test_layer_bench_replays_a_recorded_trace_beside_the_synthetic_ones(tmp_path):
    from lrmoe.traces.synthetic import generate_trace

    bench = _bench()
    generate_trace(4, 2, 4, 16, 4, 32, seed=7).save(tmp_path / "run.npz")
    args = bench.parse_args(["--trace", str(tmp_path / "run.npz"), "--trace-layer", "1", "--steps", "3",
                             "--warmup", "1", "--skew-param", "0.4", "0.8"])
    traces = make_traces(args, 4, 16, 4, "qwen3-30b-a3b-debug")
    assert [label for label, _, _ in traces] == ["synthetic zipf 0.4", "synthetic zipf 0.8", "recorded run"]
    label, counts, tokens = traces[-1]
    assert counts.shape == (4, 4, 16) and tokens == 32
    args = bench.parse_args(["--trace", str(tmp_path / "run.npz"), "--steps", "9"])
    with pytest.raises(ValueError, match="--trace"):
        make_traces(args, 4, 16, 4, "qwen3-30b-a3b-debug")
    # a trace whose steps sum 2 micro-batches: the layer replays one of them, the simulator's split
    from lrmoe.sim.simulator import split_micro_batches

    two = generate_trace(4, 2, 4, 16, 4, 32, seed=7)
    two.meta["micro_batches"] = 2
    two.save(tmp_path / "two.npz")
    args = bench.parse_args(["--trace", str(tmp_path / "two.npz"), "--trace-layer", "1", "--steps", "3",
                             "--warmup", "1", "--skew-param", "0.4"])
    label, half, tokens = make_traces(args, 4, 16, 4, "qwen3-30b-a3b-debug")[-1]
    assert label == "recorded two (one of 2 micro-batches)" and tokens == 16
    assert torch.equal(half, split_micro_batches(two.counts_ILNE, 2)[:, 1])
    assert (half.sum(-1) == 16 * 4).all() and not torch.equal(half * 2, two.counts_ILNE[:, 1])


@pytest.mark.script
@pytest.mark.timeout(600)
def test_layer_bench_quick_runs_every_policy_and_reports_the_targets(tmp_path):
    bench = _bench()
    out = tmp_path / "bench.jsonl"
    bench.main(["--ranks", "2", "--tokens-per-rank", "32", "--steps", "2", "--warmup", "0", "--skew-param", "0.8",
                "--hidden", "32", "--ffn", "16", "--no-wandb", "--out", str(out)])
    from lrmoe.results import read_results

    records = read_results(out)
    policies = {r["policy"] for r in records if r["table"] == "policy"}
    assert policies == set(bench.DEFAULT_POLICIES)
    targets = [r for r in records if r["table"] == "target"]
    assert len(targets) == 3 * 2 and all("measured" in r and "met" in r for r in targets)  # LRMoE M1 and M2
    per_policy = {r["policy"]: r for r in records if r["table"] == "policy"}
    assert per_policy["symi-dropless"]["grad_rel_err"] < 1e-5  # dropless, nothing trimmed: the full gradient
    assert per_policy["capacity-cf1"]["dropped_pct"] > 0
    assert (tmp_path / "bench_policies.png").exists()


def test_layer_bench_targets_compare_with_symi_dropless_in_the_same_replica_gradient_mode():
    import pandas as pd

    from lrmoe.harness.layer_bench_summary import targets

    rows = [("lrmoe (range)", 50.0, 8.0), ("lrmoe (shard)", 40.0, 8.0),
            ("symi-dropless (range)", 100.0, 10.0), ("symi-dropless (shard)", 80.0, 10.0)]
    totals = pd.DataFrame([{"trace": "t", "policy": p, "slowest_cpu_ms": ms, "bwd_a2a_KiB": kib,
                            "bwd_pairs_max": 2.0, "bwd_pairs_mean": 2.0} for p, ms, kib in rows])
    got = targets(totals, "t").set_index(["policy", "measured_as"])["measured"]
    assert got[("lrmoe (range)", "slowest_cpu_ms / symi-dropless's")] == 0.5
    assert got[("lrmoe (shard)", "slowest_cpu_ms / symi-dropless's")] == 0.5
    assert got[("lrmoe (shard)", "bwd_a2a_KiB / symi-dropless's")] == 0.8
