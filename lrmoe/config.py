"""Model-shape and cluster configs, with named presets.

Every preset number cites its source. Configs are frozen dataclasses validated on construction: a bad value
raises ``ValueError`` naming the field and the value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from lrmoe.checks import non_negative_fields, positive_fields

ROUTER_FAMILIES = ("softmax_topk", "sigmoid_bias")  # Qwen3 family, GLM-4.5 family
DTYPES = ("float32", "bfloat16", "float16", "float64")
# how replica gradients reach the optimizer shards (lrmoe.bytemodel.sync_model); here, so parsers need no torch
REPLICA_GRAD_MODES = ("range", "shard")

GB = 1e9  # decimal gigabytes, as GPU datasheets quote memory and bandwidth
GiB = 2**30


@dataclass(frozen=True)
class MoEConfig:
    """Shape of a decoder-only MoE model: the MoE layer plus what a small trainable model around it needs."""

    name: str
    hidden: int  # model width D
    expert_ffn: int  # routed-expert SwiGLU width F
    num_experts: int  # routed experts E
    top_k: int  # experts per token k
    router: str  # one of ROUTER_FAMILIES
    num_layers: int  # transformer blocks in all
    first_dense_layers: int = 0  # leading blocks with a dense FFN instead of MoE (GLM: 1)
    num_shared_experts: int = 0  # always-on experts beside the routed ones (GLM: 1)
    shared_ffn: int = 0  # SwiGLU width of each shared expert
    dense_ffn: int = 0  # width of the dense FFN in the first_dense_layers
    routed_scaling: float = 1.0  # multiplier on routed gate weights (GLM routed_scaling_factor)
    num_heads: int = 8  # attention heads (used by the trainable model only)
    num_kv_heads: int = 8
    head_dim: int = 0  # 0: hidden // num_heads
    vocab_size: int = 256  # byte-level tokenizer for the debug models
    seq_len: int = 256
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        positive_fields(self, "hidden", "expert_ffn", "num_experts", "top_k", "num_layers", "num_heads",
                  "num_kv_heads", "vocab_size", "seq_len", "routed_scaling")
        non_negative_fields(self, "first_dense_layers", "num_shared_experts", "shared_ffn", "dense_ffn", "head_dim")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.router not in ROUTER_FAMILIES:
            raise ValueError(f"MoEConfig.router={self.router!r} is not one of {ROUTER_FAMILIES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"MoEConfig.dtype={self.dtype!r} is not one of {DTYPES}")
        if self.first_dense_layers >= self.num_layers:
            raise ValueError(f"MoEConfig.first_dense_layers={self.first_dense_layers} leaves no MoE layer "
                             f"out of num_layers={self.num_layers}")
        if self.num_shared_experts and not self.shared_ffn:
            raise ValueError(f"MoEConfig.shared_ffn must be positive with num_shared_experts="
                             f"{self.num_shared_experts}, got {self.shared_ffn}")
        if self.first_dense_layers and not self.dense_ffn:
            raise ValueError(f"MoEConfig.dense_ffn must be positive with first_dense_layers="
                             f"{self.first_dense_layers}, got {self.dense_ffn}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"MoEConfig.num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if not self.head_dim and self.hidden % self.num_heads:
            raise ValueError(f"MoEConfig.hidden={self.hidden} is not divisible by num_heads={self.num_heads}")

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers

    @property
    def expert_params(self) -> int:
        """Parameters of one routed SwiGLU expert: gate, up and down projections."""
        return 3 * self.hidden * self.expert_ffn

    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}[self.dtype]

    @property
    def pair_fwd_flops(self) -> int:
        """FLOPs of one token-expert pair through one routed expert in the forward (3 GEMVs, 2 FLOP/MAC)."""
        return 2 * self.expert_params

    @property
    def pair_bwd_flops(self) -> int:
        """Backward FLOPs of one pair: input and weight gradients, about twice the forward."""
        return 2 * self.pair_fwd_flops

    @property
    def pair_bytes(self) -> int:
        """Bytes of one token row in one all-to-all direction."""
        return self.hidden * self.dtype_bytes

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, config, name: str | None = None, seq_len: int | None = None) -> "MoEConfig":
        """The shape of a Hugging Face Qwen3-MoE (``qwen3_moe``) or GLM-4.5 (``glm4_moe``) config (read by
        attribute; transformers is not imported). ``seq_len`` defaults to ``max_position_embeddings``; ``name`` to
        the config's ``_name_or_path`` or model type. Routing details beyond the family (``norm_topk_prob``,
        ``n_group``/``topk_group``) stay with HF's router in :mod:`lrmoe.integrations.hf`."""
        model_type = getattr(config, "model_type", None)
        get = lambda key, default=None: getattr(config, key, default)  # noqa: E731
        layers = get("num_hidden_layers")
        if model_type == "qwen3_moe":
            step, only = get("decoder_sparse_step", 1) or 1, set(get("mlp_only_layers") or [])
            dense = [i for i in range(layers) if i in only or get("num_experts", 0) <= 0 or (i + 1) % step]
            if dense != list(range(len(dense))):
                raise ValueError(f"MoEConfig.from_hf: layers {dense} of this Qwen3-MoE config are dense; MoEConfig "
                                 f"describes leading dense layers only")
            shape = dict(router="softmax_topk", num_experts=get("num_experts"), first_dense_layers=len(dense),
                         dense_ffn=get("intermediate_size") if dense else 0)
        elif model_type == "glm4_moe":
            shape = dict(router="sigmoid_bias", num_experts=get("n_routed_experts"),
                         first_dense_layers=get("first_k_dense_replace", 0),
                         dense_ffn=get("intermediate_size") if get("first_k_dense_replace", 0) else 0,
                         num_shared_experts=get("n_shared_experts", 0) or 0,
                         shared_ffn=get("moe_intermediate_size") if get("n_shared_experts", 0) else 0,
                         routed_scaling=float(get("routed_scaling_factor", 1.0)))
        else:
            raise ValueError(f"MoEConfig.from_hf reads qwen3_moe and glm4_moe configs, got model_type={model_type!r}")
        dtype = get("dtype") or get("torch_dtype") or "bfloat16"
        dtype = str(dtype).removeprefix("torch.")
        heads, hidden, head_dim = get("num_attention_heads"), get("hidden_size"), get("head_dim") or 0
        if hidden % heads == 0 and head_dim == hidden // heads:
            head_dim = 0  # MoEConfig's way of saying "hidden // num_heads"
        return cls(name=name or get("_name_or_path") or model_type, hidden=hidden,
                   expert_ffn=get("moe_intermediate_size"), top_k=get("num_experts_per_tok"), num_layers=layers,
                   num_heads=heads, num_kv_heads=get("num_key_value_heads") or heads, head_dim=head_dim,
                   vocab_size=get("vocab_size"), seq_len=seq_len or get("max_position_embeddings"),
                   dtype=dtype if dtype in DTYPES else "bfloat16", **shape)

    def check_divisible(self, num_ranks: int) -> None:
        """Static expert parallelism places E / N experts per rank: E must be divisible by N."""
        if num_ranks <= 0:
            raise ValueError(f"num_ranks must be positive, got {num_ranks}")
        if self.num_experts % num_ranks:
            raise ValueError(f"MoEConfig.num_experts={self.num_experts} is not divisible by num_ranks={num_ranks}")


@dataclass(frozen=True)
class ClusterConfig:
    """A GPU (or CPU) cluster as the cost model sees it. Bandwidths are per rank and per direction."""

    name: str
    num_ranks: int
    ranks_per_node: int
    mem_budget_bytes: float  # device memory per rank usable by the MoE layers (weights, grads, buffers)
    intra_bw: float  # bytes/s per rank per direction inside a node
    inter_bw: float  # bytes/s per rank per direction between nodes
    intra_latency: float  # seconds per message inside a node
    inter_latency: float  # seconds per message between nodes
    peak_flops: float  # dense matmul FLOP/s per rank at the model dtype
    hbm_bw: float = 0.0  # device memory bandwidth, bytes/s (0: unknown)
    source: str = ""  # where the numbers come from
    # Measured fixed seconds of an optimizer-step phase, (("<mode>/<phase>", s), ...): the phase run with negligible
    # bytes (its loops, launches and collective wake-ups), which then stands in for its latency terms. Empty on the
    # GPU presets (not measured there: their step phases pay the latency model); the CPU calibration measures it.
    step_fixed_s: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        positive_fields(self, "num_ranks", "ranks_per_node", "mem_budget_bytes", "intra_bw", "inter_bw", "peak_flops")
        non_negative_fields(self, "intra_latency", "inter_latency", "hbm_bw")
        if self.num_ranks % self.ranks_per_node:
            raise ValueError(f"ClusterConfig.num_ranks={self.num_ranks} is not a multiple of "
                             f"ranks_per_node={self.ranks_per_node}")
        bad = [(k, v) for k, v in self.step_fixed_s if not (v >= 0 and "/" in k)]
        if bad:
            raise ValueError(f"ClusterConfig.step_fixed_s needs ('<mode>/<phase>', seconds >= 0) entries, got {bad}")

    def step_fixed(self, mode: str, phase: str) -> float | None:
        """The measured fixed seconds of optimizer-step ``phase`` in replica-gradient ``mode``; None if unmeasured."""
        return dict(self.step_fixed_s).get(f"{mode}/{phase}")

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    def replace(self, **changes) -> "ClusterConfig":
        return dataclasses.replace(self, **changes)

    def with_nodes(self, num_nodes: int) -> "ClusterConfig":
        """The same hardware scaled to ``num_nodes`` nodes."""
        if num_nodes <= 0:
            raise ValueError(f"num_nodes must be positive, got {num_nodes}")
        return self.replace(name=f"{self.name.split('@')[0]}@{num_nodes}n", num_ranks=self.ranks_per_node * num_nodes)


# --- model presets -------------------------------------------------------------------------------------------
# Qwen3-30B-A3B: Hugging Face config.json of Qwen/Qwen3-30B-A3B (hidden_size 2048, moe_intermediate_size 768,
# num_experts 128, num_experts_per_tok 8, norm_topk_prob true, num_hidden_layers 48, 32 query / 4 KV heads of 128,
# vocab 151936); DESIGN.md §5.
# GLM-4.5-Air: config.json of zai-org/GLM-4.5-Air (hidden_size 4096, moe_intermediate_size 1408,
# n_routed_experts 128, n_shared_experts 1, num_experts_per_tok 8, routed_scaling_factor 1.0,
# first_k_dense_replace 1, intermediate_size 10944, num_hidden_layers 46, 96 query / 8 KV heads of 128,
# vocab 151552); DESIGN.md §5.
_MODELS = {
    "qwen3-30b-a3b": MoEConfig(
        name="qwen3-30b-a3b", hidden=2048, expert_ffn=768, num_experts=128, top_k=8, router="softmax_topk",
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, vocab_size=151936, seq_len=4096, dtype="bfloat16"),
    "glm-4.5-air": MoEConfig(
        name="glm-4.5-air", hidden=4096, expert_ffn=1408, num_experts=128, top_k=8, router="sigmoid_bias",
        num_layers=46, first_dense_layers=1, dense_ffn=10944, num_shared_experts=1, shared_ffn=1408,
        routed_scaling=1.0, num_heads=96, num_kv_heads=8, head_dim=128, vocab_size=151552, seq_len=4096,
        dtype="bfloat16"),
    # CPU-trainable variants: same router family and block structure, tiny sizes (ours).
    "qwen3-30b-a3b-debug": MoEConfig(
        name="qwen3-30b-a3b-debug", hidden=64, expert_ffn=32, num_experts=16, top_k=4, router="softmax_topk",
        num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=256, seq_len=128, dtype="float32"),
    "glm-4.5-air-debug": MoEConfig(
        name="glm-4.5-air-debug", hidden=64, expert_ffn=32, num_experts=16, top_k=4, router="sigmoid_bias",
        num_layers=3, first_dense_layers=1, dense_ffn=128, num_shared_experts=1, shared_ffn=32,
        num_heads=4, num_kv_heads=2, vocab_size=256, seq_len=128, dtype="float32"),
    # Qwen3-30B-A3B's routing shape (its 128 experts, top-8; the time axis's 16 ranks) on the debug model's small
    # dimensions, for the emulated engine (docs/emulated.md: the pilot that chose them).
    "qwen3-30b-a3b-routing-debug": MoEConfig(
        name="qwen3-30b-a3b-routing-debug", hidden=64, expert_ffn=32, num_experts=128, top_k=8,
        router="softmax_topk", num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=256, seq_len=128,
        dtype="float32"),
}
# The model pilot's ladder of docs/protocols/time_to_quality.md §11.1 (ours): the routing-shape preset at hidden 64 /
# 128, expert width 32 / 64, layers 2 / 4 (the smallest rung is qwen3-30b-a3b-routing-debug itself).
_MODELS.update({
    f"qwen3-30b-a3b-routing-h{h}-f{f}-l{n}": _MODELS["qwen3-30b-a3b-routing-debug"].replace(
        name=f"qwen3-30b-a3b-routing-h{h}-f{f}-l{n}", hidden=h, expert_ffn=f, num_layers=n)
    for h in (64, 128) for f in (32, 64) for n in (2, 4) if (h, f, n) != (64, 32, 2)})
# The paper-scale preset each debug preset scales down (what a training run's modelled time prices it as).
_FULL_SCALE = {"qwen3-30b-a3b-debug": "qwen3-30b-a3b", "glm-4.5-air-debug": "glm-4.5-air",
               **{name: "qwen3-30b-a3b" for name in _MODELS if name.startswith("qwen3-30b-a3b-routing")}}

# --- cluster presets -----------------------------------------------------------------------------------------
_CLUSTERS = {
    # NVIDIA H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s, 989 TFLOP/s dense BF16, NVLink 900 GB/s
    # bidirectional (450 GB/s per direction). Inter-node: one 400 Gb/s ConnectX-7 NIC per GPU (DGX H200).
    # Latencies are typical NCCL small-message figures (ours, to be calibrated).
    "h200x8": ClusterConfig(
        name="h200x8", num_ranks=8, ranks_per_node=8, mem_budget_bytes=141 * GB, intra_bw=450 * GB,
        inter_bw=50 * GB, intra_latency=5e-6, inter_latency=10e-6, peak_flops=989e12, hbm_bw=4.8e12,
        source="NVIDIA H200 SXM datasheet; DGX H200 (8 GPUs, 400 Gb/s NIC per GPU)"),
    # SYMI's testbed (NSDI '26, arXiv 2504.19925 §6): 16 nodes of one A100-80GB, 100 Gb/s network, PCIe 4.0.
    # A100 datasheet: 312 TFLOP/s dense BF16, 2.0 TB/s HBM2e. One GPU per node: every exchange is inter-node.
    "a100-80gb-x16": ClusterConfig(
        name="a100-80gb-x16", num_ranks=16, ranks_per_node=1, mem_budget_bytes=80 * GB, intra_bw=32 * GB,
        inter_bw=12.5 * GB, intra_latency=5e-6, inter_latency=20e-6, peak_flops=312e12, hbm_bw=2.0e12,
        source="SYMI (arXiv 2504.19925) evaluation setup; NVIDIA A100 datasheet; PCIe 4.0 x16 = 32 GB/s"),
    # Memory-constrained node: 8 x A100-40GB with NVLink 3 (600 GB/s bidirectional = 300 per direction),
    # 200 Gb/s HDR InfiniBand per GPU between nodes (DGX A100 40GB).
    "a100-40gb-x8": ClusterConfig(
        name="a100-40gb-x8", num_ranks=8, ranks_per_node=8, mem_budget_bytes=40 * GB, intra_bw=300 * GB,
        inter_bw=25 * GB, intra_latency=5e-6, inter_latency=10e-6, peak_flops=312e12, hbm_bw=1.555e12,
        source="NVIDIA A100 40GB datasheet; DGX A100 (8 GPUs, NVLink 3, 200 Gb/s HDR per GPU)"),
}


def layer_seed(seed: int, layer: int) -> int:
    """The seed of MoE layer ``layer`` in a model seeded ``seed`` (its weights and its backward's random streams):
    one rule, so that the distributed model, the single-process reference and the drop-in draw the same layers."""
    return seed * 1000 + layer


def model_preset(name: str) -> MoEConfig:
    """The model preset called ``name``; raises ``ValueError`` listing the known names otherwise."""
    try:
        return _MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(_MODELS)}") from None


def full_scale_preset(name: str) -> MoEConfig:
    """The paper-scale model preset that preset ``name`` scales down (itself when it is one)."""
    return model_preset(_FULL_SCALE.get(name, name))


def cluster_preset(name: str, num_nodes: int | None = None) -> ClusterConfig:
    """The cluster preset called ``name``, optionally scaled to ``num_nodes`` nodes."""
    try:
        cluster = _CLUSTERS[name]
    except KeyError:
        raise ValueError(f"unknown cluster preset {name!r}; known: {sorted(_CLUSTERS)}") from None
    return cluster if num_nodes is None else cluster.with_nodes(num_nodes)


def model_presets() -> list[str]:
    return sorted(_MODELS)


def cluster_presets() -> list[str]:
    return sorted(_CLUSTERS)


# -- the cost model's uncertain constants (DESIGN.md §5.3) ---------------------------------------------------------
# GEMM efficiency, half-efficiency rows and the links' share of their datasheet bandwidth, at the ends of their
# plausible range, and the micro-batches per iteration: every band the package reports (the ablation's, a run's own
# time in lrmoe.sim.replay) spans the corners of these.
SENSITIVITY = {"eff_max": (0.5, 0.9), "m_half": (32.0, 512.0), "bw_scale": (0.7, 1.0)}
MICRO_BATCH_BAND = (1, 32)


def sensitivity_corners() -> dict[str, dict]:
    """{name: :meth:`lrmoe.sim.cost.CostModel.variant` keyword arguments} of every corner of :data:`SENSITIVITY`."""
    import itertools

    keys = list(SENSITIVITY)
    return {"|".join(f"{k}={v:g}" for k, v in zip(keys, values)): dict(zip(keys, values))
            for values in itertools.product(*(SENSITIVITY[k] for k in keys))}
