"""A run's whole iteration priced from its own recorded routing (lrmoe.sim.replay, docs/protocols/time_to_quality.md
§11.3): the dense part is the same for every system and is what its FLOPs say; the MoE layers' time is the simulator's
on the same rescaled trace, every paper layer simulated."""

import numpy as np
import pytest

from lrmoe.config import cluster_preset, model_preset
from lrmoe.sim.cells import Cell, CellRules, build_systems, cost_kwargs
from lrmoe.sim.replay import dense_flops_per_token, dense_seconds, price_run
from lrmoe.sim.simulator import micro_batch_counts, simulate
from lrmoe.traces.rescale import to_paper_scale
from lrmoe.traces.trace import Trace

MODEL, CLUSTER = model_preset("qwen3-30b-a3b"), cluster_preset("a100-40gb-x8", 2)


def recorded_trace(steps=4, layers=2, tokens=64, seed=0) -> Trace:
    """A small trace of the protocol's routing shape (128 experts, top-8, 16 source ranks), skewed per layer."""
    rng = np.random.default_rng(seed)
    k, n, e = 8, 16, 128
    counts = np.zeros((steps, layers, n, e), dtype=np.int64)
    for layer in range(layers):
        p_E = rng.dirichlet(np.full(e, 0.3 + layer))
        for i in range(steps):
            for r in range(n):
                counts[i, layer, r] = rng.multinomial(tokens * k, p_E)
    # the metadata experiments/train.py writes (no top_k: each row's pairs over its tokens say it)
    return Trace(counts, {"source": "recorded", "micro_batches": 1, "tokens_per_rank": tokens})


def test_dense_flops_by_hand():
    """Qwen3-30B-A3B per token: 48 x (q, k, v, o projections 2048x4096 + 2 x 2048x512 + 4096x2048, attention over
    half of 2048 tokens of 32 heads of 128, router 2048x128) + the LM head 2048x151936, 2 FLOPs per multiply-add."""
    proj = 2048 * 4096 + 2 * 2048 * 512 + 4096 * 2048
    per_layer = 2 * (proj + 2 * 1024 * 4096) + 2 * 2048 * 128  # QKᵀ and AV
    assert dense_flops_per_token(MODEL, 2048) == 48 * per_layer + 2 * 2048 * 151936
    # 3 x forward FLOPs x 8 x 2048 tokens at half of 312 TFLOP/s
    assert dense_seconds(MODEL, CLUSTER, 2048, 8) == pytest.approx(
        3 * (48 * per_layer + 2 * 2048 * 151936) * 8 * 2048 / (0.5 * 312e12))
    with pytest.raises(ValueError, match="efficiency"):
        dense_seconds(MODEL, CLUSTER, 2048, 8, efficiency=0.0)


def test_dense_part_the_same_and_moe_time_the_simulators():
    """Per system: the dense seconds are one number for all; the MoE seconds equal the simulator's on the trace
    rescaled to all 48 paper layers (recorded layer ⌊l · 2 / 48⌋ each), built as the sweep cell builds it."""
    trace = recorded_trace(steps=3)
    tokens, mb = 2048, 1
    times = {}
    for system in ("static-ep", "lrmoe-rho0.75-unbiased"):
        t = price_run(trace, system, MODEL, CLUSTER, tokens, mb, spare_slots=2, eps=0.1, gamma=0.1,
                      warmup_steps=2, band=False)
        times[system] = t
        assert t.layer_weights == [24, 24]
        assert t.steps_priced == 1
        paper = to_paper_scale(trace, num_layers=48, tokens_per_rank=tokens, micro_batches=mb, top_k=8,
                               num_experts=128, num_ranks=16)
        one_mb_ILNE, _ = micro_batch_counts(paper)
        cell = Cell(MODEL, CLUSTER, ("recorded", 0.0), CLUSTER.mem_budget_bytes / 1e9, tokens)
        rules = CellRules(eps=0.1, gamma=0.1, max_extra=2)
        systems, _, _, _ = build_systems(cell, [system], rules, (one_mb_ILNE[0], one_mb_ILNE[1]))
        res = simulate(Trace(paper.counts_ILNE[1:], paper.meta), systems[system], MODEL, CLUSTER,
                       cost_kwargs=cost_kwargs(system, cell, rules), warmup=1,
                       variants={"shard": {"replica_grad": "shard"}})
        full = min(res.time_s(), res.time_s("shard"))
        assert t.moe_s == pytest.approx(full, rel=1e-12)
        assert t.time_s == pytest.approx(t.moe_s + t.dense_s, rel=1e-15)
    assert times["static-ep"].dense_s == times["lrmoe-rho0.75-unbiased"].dense_s
    assert times["static-ep"].dense_s == dense_seconds(MODEL, CLUSTER, tokens, mb)
    assert times["static-ep"].moe_s != times["lrmoe-rho0.75-unbiased"].moe_s


def test_band_corners_and_bad_input():
    trace = recorded_trace(steps=3, layers=1)
    t = price_run(trace, "symi-dropless", MODEL, CLUSTER, 2048, 8, spare_slots=2, eps=0.1, gamma=0.1,
                  warmup_steps=2)
    # (base + 8 cost corners) x 6 micro-batch counts (1, 2, 4, 8, 16, 32: Record 3) x 3 dense efficiencies
    assert len(t.corners) == 9 * 6 * 3
    assert t.corners["base|mb=8|dense=0.5"] == pytest.approx(t.time_s, rel=1e-12)
    assert min(t.corners.values()) < t.time_s < max(t.corners.values())
    with pytest.raises(ValueError, match="warmup_steps"):
        price_run(trace, "symi-dropless", MODEL, CLUSTER, 2048, 8, 2, 0.1, 0.1, warmup_steps=1)
    small = Trace(trace.counts_array()[:, :, :, :64], {"top_k": 8})
    with pytest.raises(ValueError, match="experts"):
        price_run(small, "static-ep", MODEL, CLUSTER, 2048, 8, 2, 0.1, 0.1, warmup_steps=2)
    top4 = Trace(trace.counts_array(), {"tokens_per_rank": 128, "micro_batches": 1})  # 512 pairs of 128 tokens
    with pytest.raises(ValueError, match="4 experts per token"):
        price_run(top4, "static-ep", MODEL, CLUSTER, 2048, 8, 2, 0.1, 0.1, warmup_steps=2)
    with pytest.raises(ValueError, match="pairs per token are unknown"):
        price_run(Trace(trace.counts_array()), "static-ep", MODEL, CLUSTER, 2048, 8, 2, 0.1, 0.1, warmup_steps=2)


def test_a_slot_left_empty_at_a_step_is_not_a_missing_slot():
    """Under heavy skew LRMoE's plans leave a replica slot empty at some steps (mean slots per rank below 10): the
    regime still gives it 10 slots, so it is priced (it was refused as "different systems")."""
    from lrmoe.traces.synthetic import generate_trace

    trace = generate_trace(6, 8, 16, 128, 8, 2048, skew="zipf", skew_param=1.207, seed=0)
    trace.meta |= {"top_k": 8, "tokens_per_rank": 2048, "micro_batches": 1}
    t = price_run(trace, "lrmoe-rho0.75-early-unbiased", MODEL, CLUSTER, 2048, 8, spare_slots=2, eps=0.1, gamma=0.1,
                  warmup_steps=2, band=False)
    assert t.summary["slots_per_rank"] < 10 and t.moe_s > 0
