"""Gradient clipping over the dense parameters and the experts (lrmoe.runtime.clip) on the expert-parallel layer
(gloo, 2 and 3 forked ranks, fp32) against ``torch.nn.utils.clip_grad_norm_`` over every parameter of the dense
reference layer, run over the same micro-batches.

Properties: for dropless systems (static EP, SYMI-dropless, online replication, whose replicas' gradients join the
replica sum), the global norm equals torch's norm of the reference's mean-loss gradient (each expert counted once,
the data-parallel router once, not once per rank), the gradients the steps apply equal torch's clipped gradients,
and after a few clipped steps the weights equal the reference's (torch.optim.Adam on the reference); a norm of the
dense parameters alone (what clip_grad_norm_(model.parameters()) sees on a swapped model) is far from it. Shapes
as tests/test_microbatch.py: D=8, F=5, E=6 (2 and 3 ranks divide it), top-2, 8 tokens per rank and micro-batch,
skewed routing so that the placements replicate.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as nnF
from _scripts import load_experiment
from test_microbatch import D, E, F, K, T, micro_batch, skewed_reference

from lrmoe.config import MoEConfig
from lrmoe.integrations.model import MoETransformer
from lrmoe.planner.policies import initial_placement
from lrmoe.runtime.clip import clip_grad_norm_
from lrmoe.runtime.distributed.launch import launch
from lrmoe.runtime.distributed.replica import AdamConfig, RangeGroups, unflatten_experts
from lrmoe.runtime.layer import EPMoELayer
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.systems import SystemContext, get_system
from lrmoe.training.models import NativeModel

MB, STEPS, LR = 2, 3, 1e-2
MAX_NORM = 0.05  # well below the mean-loss gradient's norm (about 0.3-1): every step clips
CLOSE = dict(rtol=1e-4, atol=1e-6)  # the expert shards' summation order differs from the reference's
DROPLESS = ["static-ep", "symi-dropless", "online"]


def _clipped_steps(rank: int, name: str) -> dict:
    world = dist.get_world_size()
    spec = get_system(name)
    ctx = SystemContext(num_experts=E, num_ranks=world, spare_slots=1, pairs_per_rank=T * K, push_cost_rows=0.0)
    policy = spec.make_policy(ctx)
    ref = skewed_reference()
    prev_E = torch.tensor([40, 30, 10, 6, 4, 2]) * world  # the last iteration's counts: skewed
    placement = (policy.placement(prev_E, world, world * T * K) if hasattr(policy, "placement")
                 else initial_placement(policy, world, E, T * K))
    layer = EPMoELayer(ref.export_weights(), K, "softmax_topk", policy, placement, RangeGroups(),
                       adam=AdamConfig(lr=LR), backward=spec.layer_backward(7))
    layer.prev_counts_E = prev_E
    dense = layer.dense_parameters()
    ref_params = list(ref.parameters())
    ref_opt = torch.optim.Adam(ref_params, lr=LR, foreach=False)
    dense_opt = torch.optim.Adam(dense, lr=LR, foreach=False)
    mine = slice(rank * T, (rank + 1) * T)
    out = {"norms": [], "ref_norms": [], "dense_only": []}
    for step in range(STEPS):
        for m in range(MB):
            x, w = micro_batch(world, step, m)
            y, _ = layer(x[mine].clone())
            (y * w[mine]).sum().backward()
            y_ref, _ = ref(x)
            (y_ref * w).sum().div(world * MB).backward()  # the mean over ranks and micro-batches
        layer.sync_dense_grads()
        out["dense_only"].append(float(torch.nn.utils.get_total_norm([p.grad for p in dense])))
        norm = clip_grad_norm_(dense, [layer], MAX_NORM)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, MAX_NORM)
        out["norms"].append(float(norm))
        out["ref_norms"].append(float(ref_norm))
        # the gradients the steps apply: torch's clipped gradients
        torch.testing.assert_close(layer.w_router_ED.grad, ref.w_router_ED.grad, **CLOSE)
        store = layer.store
        got = unflatten_experts(store.gather_full(store.grad_shards_EW), D, F)
        for g, want in zip(got, (ref.w_gate_EDF.grad, ref.w_up_EDF.grad, ref.w_down_EFD.grad)):
            torch.testing.assert_close(g, want, **CLOSE)
        dense_opt.step()
        dense_opt.zero_grad()
        layer.expert_step(collected=True)
        ref_opt.step()
        ref_opt.zero_grad()
    experts = unflatten_experts(layer.store.full_master(), D, F)
    for g, want in zip(experts, (ref.w_gate_EDF, ref.w_up_EDF, ref.w_down_EFD)):
        torch.testing.assert_close(g, want.detach(), **CLOSE)
    torch.testing.assert_close(layer.w_router_ED.detach(), ref.w_router_ED.detach(), **CLOSE)
    return out


def _systems(rank: int, names: list[str]) -> dict:
    return {name: _clipped_steps(rank, name) for name in names}


@pytest.mark.parametrize("ranks", [2, 3])
def test_the_global_norm_counts_every_expert_once_and_clips_as_torch(ranks):
    for out in launch(_systems, ranks, DROPLESS, timeout_s=120):
        for name, rec in out.items():
            assert min(rec["ref_norms"]) > 2 * MAX_NORM, (name, rec)  # clipping happened at every step
            torch.testing.assert_close(rec["norms"], rec["ref_norms"], rtol=1e-5, atol=0)
            # the norm without the experts is far from it: a test that left them out would fail
            assert all(d < 0.9 * r for d, r in zip(rec["dense_only"], rec["ref_norms"])), (name, rec)


# -- train.py's own loop (lrmoe's transformer, --clip-grad) against the dense single-process model ---------------------
TINY = MoEConfig(name="tiny", hidden=16, expert_ffn=8, num_experts=6, top_k=2, router="softmax_topk", num_layers=2,
                 num_heads=2, num_kv_heads=1, vocab_size=32, seq_len=8, dense_ffn=32, dtype="float32")
BATCH, SEQ, CLIP = 2, 8, 0.1  # sequences per rank and step (MB micro-batches of one), tokens; every step clips


def _native(rank: int, policy: str) -> list[tuple[float, float]]:
    world = dist.get_world_size()
    train = load_experiment("train")
    args = train.parse_args(["--policy", policy, "--batch", str(BATCH), "--seq-len", str(SEQ), "--lr", str(LR),
                             "--micro-batches", str(MB), "--aux-coef", "0", "--clip-grad", str(CLIP), "--no-wandb"])
    run = NativeModel(args, TINY, world, torch.device("cpu"))
    # the reference: the same weights (the same seeds, the same draws) with the dense layers, one process
    ref = MoETransformer(TINY, lambda i: ReferenceMoE.from_config(TINY, seed=args.seed * 1000 + i), seed=args.seed)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    norms = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, TINY.vocab_size, (world, BATCH, SEQ + 1), generator=gen)
        run.train_step(ids[rank, :, :-1], ids[rank, :, 1:])
        logits = ref(ids[..., :-1].reshape(-1, SEQ))[0]
        nnF.cross_entropy(logits.reshape(-1, TINY.vocab_size), ids[..., 1:].reshape(-1)).backward()  # the mean
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
        ref_opt.step()
        ref_opt.zero_grad()
        norms.append((float(run.grad_norm), float(ref_norm)))
    got = {n: p for n, p in run.model.named_parameters()}
    for name, p in ref.named_parameters():
        if name in got:  # dense
            torch.testing.assert_close(got[name].detach(), p.detach(), rtol=1e-4, atol=LR / 100, msg=name)
    for i, layer in enumerate(run.layers):
        experts = unflatten_experts(layer.store.full_master(), TINY.hidden, TINY.expert_ffn)
        moe = ref.blocks[i].ffn
        for g, want in zip(experts, (moe.w_gate_EDF, moe.w_up_EDF, moe.w_down_EFD)):
            torch.testing.assert_close(g, want.detach(), rtol=1e-4, atol=LR / 100)
    return norms


@pytest.mark.parametrize("ranks", [2, 3])
def test_train_scripts_own_loop_clips_as_torch_on_the_dense_model(ranks):
    """--clip-grad on train.py's own loop (lrmoe's transformer, micro-batches): the norm and, after a few clipped
    steps, every weight (experts included) equal the single-process model with the reference MoE layers clipped by
    torch over all its parameters (AdamW; Adam's moves agree to 1 % of a step where gradients are near zero)."""
    for norms in launch(_systems_native, ranks, ["static-ep", "symi-dropless"], timeout_s=180):
        for policy, pairs in norms.items():
            got, want = zip(*pairs)
            assert min(want) > 2 * CLIP, pairs
            torch.testing.assert_close(got, want, rtol=1e-5, atol=0, msg=policy)


def _systems_native(rank: int, policies: list[str]) -> dict:
    return {policy: _native(rank, policy) for policy in policies}


def test_fp64_gradients_clip_as_torch():
    """fp64 gradients (a double-precision reference run) are clipped in fp64, as torch clips them: the same norm and
    the same clipped gradients, with no narrowing to fp32."""
    from lrmoe.runtime.clip import clip_grad_norm_

    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(7, 3, dtype=torch.float64)) for _ in range(2)]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    for a, b in zip(ours, ref):
        a.grad = torch.randn_like(a) * 10
        b.grad = a.grad.clone()
    norm = clip_grad_norm_(ours, [], 1.0)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert norm.dtype == torch.float64
    torch.testing.assert_close(norm, ref_norm, rtol=1e-12, atol=0)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=0)
