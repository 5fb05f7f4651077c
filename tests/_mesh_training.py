"""Training on an EP x DP mesh against the single-process dense reference, shared by the fork-launched tests
(tests/test_mesh.py) and the torchrun ranks (tests/_mesh_ranks.py).

Every rank holds the same global batch of ``world`` x T tokens and computes rows [rank·T, (rank+1)·T) on the layer;
the reference (:class:`lrmoe.runtime.reference.ReferenceMoE`, float64) runs the whole batch in one process, with
the backward through the pairs the layer kept (all of them for the dropless systems; the retained ones, with their
scales, for a retention budget), and both take Adam steps on the gradient of the summed loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from lrmoe.runtime.distributed.comm import all_gather_rows
from lrmoe.runtime.distributed.replica import AdamConfig, flatten_experts
from lrmoe.runtime.layer import EPMoELayer, initial_placement
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.systems import SystemContext, get_system

D, F, E, K, T = 8, 5, 8, 2, 16
MATCHED = ("static-ep", "symi-dropless", "lrmoe-rho0.75", "online")  # the systems compared step by step
LR = 1e-2


def skewed_reference() -> ReferenceMoE:
    """A reference layer whose router prefers high expert ids through feature 0 (:func:`batch` shifts it), so the
    placements replicate and the budget trims."""
    ref = ReferenceMoE(D, F, E, K, "softmax_topk", seed=3, dtype=torch.float64)
    with torch.no_grad():
        ref.w_router_ED[:, 0] = torch.linspace(-1.0, 2.0, E)
    return ref


def batch(world: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world * T, D, generator=g, dtype=torch.float64)
    x[:, 0] += 1.5
    return x, torch.randn(world * T, D, generator=g, dtype=torch.float64)


def make_layer(name: str, mesh, ref: ReferenceMoE) -> EPMoELayer:
    system = get_system(name)
    ctx = SystemContext(num_experts=E, num_ranks=mesh.ep_size, spare_slots=1, pairs_per_rank=T * K,
                        push_cost_rows=0.0,
                        ranks_per_node=None if mesh.ep_ranks_per_node == mesh.ep_size else mesh.ep_ranks_per_node)
    policy = system.make_policy(ctx)
    return EPMoELayer(ref.export_weights(), K, "softmax_topk", policy,
                      initial_placement(policy, mesh.ep_size, E, T * K), mesh.groups, adam=AdamConfig(lr=LR),
                      backward=system.layer_backward(7))


def train(name: str, mesh, steps: int = 3, reference: bool = True) -> dict:
    """``steps`` training steps of system ``name`` on ``mesh``; with ``reference``, the largest differences from the
    dense reference (per-step global loss, outputs, dense weights, every expert's master weights). Also what every
    system must satisfy on a mesh: the DP copies' expert masters and every rank's dense weights stay identical."""
    world, rank = dist.get_world_size(), dist.get_rank()
    ref = skewed_reference()
    layer = make_layer(name, mesh, ref)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR, foreach=False)
    dense_opt = torch.optim.Adam(layer.dense_parameters(), lr=LR, foreach=False)
    mine = slice(rank * T, (rank + 1) * T)
    out = {"loss": 0.0, "y": 0.0, "dense": 0.0, "experts": 0.0, "losses": [],
           "placements": [layer.placement_NS.tolist()]}
    for step in range(steps):
        x, w = batch(world, 40 + step)
        y, info = layer(x[mine].clone())
        loss = (y * w[mine]).sum()
        loss.backward()
        total = loss.detach().reshape(1).clone()
        dist.all_reduce(total)
        out["losses"].append(float(total))
        if reference:
            keep_TK = scale_TK = None
            if info.record is not None:  # the budget: the reference's backward through the kept pairs alone
                keep_TK = all_gather_rows(info.record.keep_TK.double()).view(-1, K) > 0
                scale_TK = all_gather_rows(info.record.scale_TK.double()).view(-1, K)
                out["trimmed"] = out.get("trimmed", 0) + int((~keep_TK).sum())
            y_ref, _ = ref(x, keep_TK, scale_TK)
            ref_loss = (y_ref * w).sum()
            ref_loss.backward()
            ref_total = float(ref_loss.detach())
            out["loss"] = max(out["loss"], abs(float(total) - ref_total) / max(1.0, abs(ref_total)))
            out["y"] = max(out["y"], float((y - y_ref[mine]).abs().max()))
            ref_opt.step()
            ref_opt.zero_grad()
        layer.sync_dense_grads(1.0)  # the summed loss's gradient, over the whole world
        dense_opt.step()
        dense_opt.zero_grad()
        out["placements"].append(layer.expert_step(grad_scale=1.0).tolist())
    master = layer.store.full_master()  # this EP group's copy of every expert, [E, P]
    if reference:
        want = flatten_experts(ref.w_gate_EDF.detach(), ref.w_up_EDF.detach(), ref.w_down_EFD.detach())
        out["experts"] = float((master.double() - want).abs().max())
        out["dense"] = float((layer.w_router_ED.detach() - ref.w_router_ED.detach()).abs().max())
    # the DP copies: the same masters in every EP group, the same dense weights on every rank
    copies = [torch.empty_like(master) for _ in range(world)]
    dist.all_gather(copies, master)
    routers = [torch.empty_like(layer.w_router_ED) for _ in range(world)]
    dist.all_gather(routers, layer.w_router_ED.detach().contiguous())
    out["copies_equal"] = all(torch.equal(c, copies[0]) for c in copies) and all(
        torch.equal(r, routers[0]) for r in routers)
    out["ep_size"], out["dp_size"] = mesh.ep_size, mesh.dp_size
    return out
