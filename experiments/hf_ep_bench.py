"""transformers' own expert parallelism beside lrmoe's static EP on the same Hugging Face experts module: one MoE
layer's experts (a one-layer Qwen3-MoE or GLM-4.5 model of the given shape), its forward and backward on gloo ranks
(CPU), each rank its own tokens and random top-k routing, the same on both sides.

* ``transformers``: ``transformers.distributed.expert_parallel.apply_expert_parallelism`` with the config's
  ``base_model_ep_plan`` and the ``all_to_all`` implementation (E / N whole experts per rank as DTensors);
* ``lrmoe``: ``swap_moe_blocks(model, "static-ep")`` (the same E / N experts per rank, no replicas).

Per side: the slowest rank's time of one forward and backward (after a warm-up; the sides alternate), median over
``--repeats``, and how far apart the two sides' outputs are (bitwise equal, and the largest difference relative to
the largest output: the same products summed in another order where not bitwise). On a shared or loaded machine
read the ratio, not the milliseconds.

    python experiments/hf_ep_bench.py --ranks 2 --hidden 512 --ffn 256 --experts 16 --top-k 4 --tokens 2048
"""

from __future__ import annotations

import argparse

from lrmoe.cli import script_parser

SIDES = ("transformers", "lrmoe")


def _model(args):
    import torch
    from transformers import Glm4MoeForCausalLM, Qwen3MoeForCausalLM

    from lrmoe.config import MoEConfig
    from lrmoe.integrations.hf import hf_config

    cfg = MoEConfig(name="hf-ep-bench", hidden=args.hidden, expert_ffn=args.ffn, num_experts=args.experts,
                    top_k=args.top_k, router="softmax_topk", num_layers=1, num_heads=4, num_kv_heads=2,
                    vocab_size=64, seq_len=32, dtype="float32")
    torch.manual_seed(args.seed)  # the same weights on every rank
    if args.family == "qwen":
        return Qwen3MoeForCausalLM(hf_config(cfg))
    return Glm4MoeForCausalLM(hf_config(cfg.replace(router="sigmoid_bias", num_shared_experts=1,
                                                    shared_ffn=args.ffn)))


def _transformers_ep(model):
    """``model`` with transformers' expert parallelism over the world (its config's plan, ep = world, tp = 1)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("ep", "tp"))
    base = model.model
    plan = {pattern.replace("*", str(i)): style for pattern, style in type(model.config).base_model_ep_plan.items()
            for i, layer in enumerate(base.layers) if hasattr(layer.mlp, "experts")}
    apply_expert_parallelism(base, mesh["ep"], mesh["tp"], plan, "all_to_all")
    return model


def _rank(rank: int, args) -> dict:
    import copy
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from lrmoe.integrations.hf import swap_moe_blocks

    torch.set_num_threads(args.threads)
    model = _model(args)
    theirs = _transformers_ep(copy.deepcopy(model))
    ours = copy.deepcopy(model)
    swap_moe_blocks(ours, "static-ep")
    gen = torch.Generator().manual_seed(args.seed + 1 + rank)  # each rank its own tokens and routing
    h_TD = torch.randn(args.tokens, args.hidden, generator=gen)
    scores_TE = torch.randn(args.tokens, args.experts, generator=gen)
    weights_TK, index_TK = scores_TE.softmax(-1).topk(args.top_k, dim=-1)
    grad_TD = torch.randn(args.tokens, args.hidden, generator=gen)
    experts = {"transformers": theirs.model.layers[0].mlp.experts, "lrmoe": ours.model.layers[0].mlp.experts}
    samples, outputs = {side: [] for side in SIDES}, {}
    for rep in range(args.repeats + 1):  # the first is the warm-up; the sides alternate, so both see the same load
        for side in SIDES:
            x_TD = h_TD.clone().requires_grad_(True)
            dist.barrier()
            start = time.perf_counter()
            y_TD = experts[side](x_TD, index_TK, weights_TK)
            y_TD.backward(grad_TD)
            elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
            if rep:
                samples[side].append(float(elapsed))
            else:
                outputs[side] = y_TD.detach()
    times = {side: statistics.median(samples[side]) for side in SIDES}
    diff = float((outputs["transformers"] - outputs["lrmoe"]).abs().max() / outputs["transformers"].abs().max())
    return {"times": times, "equal": torch.equal(outputs["transformers"], outputs["lrmoe"]), "diff": diff}


def run(args) -> dict:
    from lrmoe.runtime.distributed.launch import launch

    outs = launch(_rank, args.ranks, args, timeout_s=None, pg_timeout_s=1800)
    times = outs[0]["times"]
    result = {"family": args.family, "ranks": args.ranks, "hidden": args.hidden, "ffn": args.ffn,
              "experts": args.experts, "top_k": args.top_k, "tokens": args.tokens, "repeats": args.repeats,
              **{f"{side}_s": times[side] for side in SIDES},
              "lrmoe_over_transformers": times["lrmoe"] / times["transformers"],
              "outputs_bitwise_equal": all(o["equal"] for o in outs),
              "outputs_max_rel_diff": max(o["diff"] for o in outs)}
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    return result


def build_parser() -> argparse.ArgumentParser:
    """The command line (light modules only: tests/test_cli.py)."""
    parser = script_parser(__doc__)
    parser.add_argument("--family", default="qwen", choices=("qwen", "glm"), help="the HF architecture")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (the expert-parallel group)")
    parser.add_argument("--hidden", type=int, default=512, help="model width D")
    parser.add_argument("--ffn", type=int, default=256, help="expert width F")
    parser.add_argument("--experts", type=int, default=16, help="experts E (a multiple of --ranks)")
    parser.add_argument("--top-k", type=int, default=4, help="experts per token")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--repeats", type=int, default=5, help="timed forward-backward passes per side (median)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights, tokens and routing")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("ranks", "hidden", "ffn", "experts", "top_k", "tokens", "repeats", "threads"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    if args.experts % args.ranks:
        parser.error(f"--experts {args.experts} must be a multiple of --ranks {args.ranks}")
    if args.top_k > args.experts:
        parser.error(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    return args


def main(argv=None) -> dict:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
