"""Configs: presets carry the public numbers of DESIGN.md §5, and bad values raise ValueError naming the field."""

import pytest

from lrmoe.config import ClusterConfig, MoEConfig, cluster_preset, cluster_presets, model_preset, model_presets


def test_qwen3_preset_matches_public_config():
    m = model_preset("qwen3-30b-a3b")
    assert (m.hidden, m.expert_ffn, m.num_experts, m.top_k, m.num_moe_layers) == (2048, 768, 128, 8, 48)
    assert m.router == "softmax_topk" and m.num_shared_experts == 0
    assert m.expert_params == 4_718_592  # 4.72 M params
    assert m.expert_params * m.dtype_bytes == pytest.approx(9.44e6, rel=1e-3)  # 9.44 MB bf16
    assert m.pair_fwd_flops == pytest.approx(9.4e6, rel=0.01)  # 9.4 MFLOP forward per pair
    assert m.pair_bwd_flops == pytest.approx(18.9e6, rel=0.01)
    assert m.pair_bytes == 4096  # 4 KB per all-to-all direction


def test_glm_preset_matches_public_config():
    m = model_preset("glm-4.5-air")
    assert (m.hidden, m.expert_ffn, m.num_experts, m.top_k) == (4096, 1408, 128, 8)
    assert (m.num_shared_experts, m.shared_ffn, m.num_moe_layers, m.first_dense_layers) == (1, 1408, 45, 1)
    assert m.router == "sigmoid_bias" and m.routed_scaling == 1.0
    assert m.expert_params * m.dtype_bytes == pytest.approx(34.6e6, rel=1e-3)
    assert m.pair_fwd_flops == pytest.approx(34.6e6, rel=0.01)
    assert m.pair_bytes == 8192


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "glm-4.5-air"])
def test_debug_variant_keeps_router_family_and_structure(name):
    full, debug = model_preset(name), model_preset(name + "-debug")
    assert debug.router == full.router
    assert bool(debug.num_shared_experts) == bool(full.num_shared_experts)
    assert bool(debug.first_dense_layers) == bool(full.first_dense_layers)
    assert debug.expert_params < 10_000 and debug.num_experts <= 32


def test_every_preset_builds_and_clusters_cite_a_source():
    assert {"qwen3-30b-a3b", "glm-4.5-air", "qwen3-30b-a3b-debug", "glm-4.5-air-debug"} <= set(model_presets())
    assert {"h200x8", "a100-80gb-x16", "a100-40gb-x8"} <= set(cluster_presets())
    for name in cluster_presets():
        assert cluster_preset(name).source
    symi = cluster_preset("a100-80gb-x16")
    assert (symi.num_ranks, symi.ranks_per_node, symi.inter_bw) == (16, 1, 12.5e9)  # 100 Gb/s
    two = cluster_preset("h200x8", num_nodes=2)
    assert (two.num_ranks, two.num_nodes) == (16, 2)


@pytest.mark.parametrize("change, field", [
    (dict(top_k=200), "top_k"), (dict(hidden=0), "hidden"), (dict(expert_ffn=-1), "expert_ffn"),
    (dict(router="nope"), "router"), (dict(num_experts=0), "num_experts"), (dict(dtype="int8"), "dtype"),
    (dict(first_dense_layers=48), "first_dense_layers"), (dict(num_shared_experts=1), "shared_ffn"),
])
def test_bad_model_values_raise_naming_the_field(change, field):
    with pytest.raises(ValueError, match=field):
        model_preset("qwen3-30b-a3b").replace(**change)


def test_bad_cluster_values_and_unknown_presets_raise():
    with pytest.raises(ValueError, match="ranks_per_node"):
        cluster_preset("h200x8").replace(num_ranks=12)
    with pytest.raises(ValueError, match="inter_bw"):
        cluster_preset("h200x8").replace(inter_bw=0)
    with pytest.raises(ValueError, match="unknown model preset 'gpt-5'"):
        model_preset("gpt-5")
    with pytest.raises(ValueError, match="unknown cluster preset"):
        cluster_preset("tpu")
    with pytest.raises(ValueError, match="num_experts=128 is not divisible by num_ranks=12"):
        model_preset("qwen3-30b-a3b").check_divisible(12)
    assert isinstance(model_preset("glm-4.5-air"), MoEConfig) and isinstance(cluster_preset("h200x8"), ClusterConfig)
