"""Load statistics on hand-derived cases: tokens per expert, Gini, rank max/mean with and without a plan, dropped and
trimmed pairs, and the across-layer summary."""

import pytest
import torch

from lrmoe.integrations.load_stats import flat_log, layer_load_stats, load_stats
from lrmoe.planner.plan import LayerPlan, no_flows


def test_static_ep_layer_on_hand_counts():
    # 2 ranks x 4 experts; per expert [6, 2, 0, 0] + [2, 2, 4, 0] = [8, 4, 4, 0], mean 4
    counts_NE = torch.tensor([[6, 2, 0, 0], [2, 2, 4, 0]])
    s = layer_load_stats(counts_NE)
    assert (s["tokens_per_expert_min"], s["tokens_per_expert_max"], s["tokens_per_expert_mean"]) == (0, 8, 4)
    assert s["tokens_per_expert_std"] == pytest.approx(8 ** 0.5)  # deviations 4, 0, 0, -4
    assert s["expert_max_over_mean"] == 2.0
    assert s["gini"] == pytest.approx(0.375)  # sorted [0, 4, 4, 8]: (-3*0 - 1*4 + 1*4 + 3*8) / (4 * 16)
    # static EP: experts 0, 1 on rank 0 (12 pairs), 2, 3 on rank 1 (4 pairs); mean 8
    assert s["rank_max_over_mean"] == 1.5
    assert s["dropped_pairs"] == 0 and s["trimmed_pairs"] == 0 and s["retained_frac"] == 1.0


def test_a_plan_gives_its_own_rank_loads_drops_and_trims():
    # 2 ranks x 2 slots, experts [0, 1 | 0, 1]: each rank computes half of every expert's pairs
    plan = LayerPlan(placement_NS=torch.tensor([[0, 1], [0, 1]]), fwd_NG=torch.tensor([[3, 1, 3, 1], [2, 2, 2, 0]]),
                     dropped_NE=torch.tensor([[0, 0], [0, 1]]), keep_NG=torch.tensor([[3, 1, 2, 1], [1, 2, 2, 0]]),
                     bwd_flows_V4=no_flows(), floor_excess_N=torch.zeros(2, dtype=torch.long))
    s = layer_load_stats(plan=plan)
    assert s["tokens_per_expert_max"] == 10 and s["tokens_per_expert_min"] == 5  # routed = computed + dropped
    assert s["rank_max_over_mean"] == pytest.approx(8 / 7)  # rank loads 8 and 6
    assert s["dropped_pairs"] == 1 and s["trimmed_pairs"] == 2 and s["retained_frac"] == pytest.approx(12 / 14)
    with pytest.raises(ValueError, match="plan covers"):
        layer_load_stats(torch.zeros(3, 2, dtype=torch.long), plan)


def test_summary_across_layers_and_flat_log():
    counts = torch.stack([torch.tensor([[2, 2], [2, 2]]), torch.tensor([[4, 0], [4, 0]])])  # uniform, then one-hot
    stats = load_stats(counts, percentiles=(50, 100))
    assert [layer["gini"] for layer in stats["layers"]] == [0.0, 0.5]
    s = stats["summary"]
    assert s["gini_mean"] == 0.25 and s["gini_p50"] == 0.25 and s["gini_p100"] == 0.5 and s["layers"] == 2
    row = flat_log(stats, prefix="moe/")
    assert row["moe/gini_p100"] == 0.5 and row["moe/layer1/rank_max_over_mean"] == 2.0
    assert all(isinstance(v, float) for v in row.values())
    with pytest.raises(ValueError, match="counts or plans"):
        load_stats()
    with pytest.raises(ValueError, match="percentiles"):
        load_stats(counts, percentiles=(120,))
    with pytest.raises(ValueError, match="not divisible"):
        layer_load_stats(torch.ones(3, 4, dtype=torch.long))
