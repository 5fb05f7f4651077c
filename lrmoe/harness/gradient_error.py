"""The gradient error of a layer's step against the full gradient: the same weights, inputs and placement with every
routed pair computed and kept (experiments/layer_bench.py measures it every iteration, untimed). The error of the
expert gradients is over all ranks' shards (all-reduced), so every rank returns the same numbers.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from lrmoe.planner.plan import LayerPlan, Policy
from lrmoe.planner.replica_routing import route_forward
from lrmoe.runtime.layer import EPMoELayer


class FullGradient:
    """The wrapped policy's placement with every routed pair computed and kept (split evenly over replicas when
    the policy drops): the full gradient at the same weights, the reference of the gradient error."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.name = f"{policy.name}-full"

    def plan(self, counts_NE: torch.Tensor, prev_counts_E: torch.Tensor | None = None) -> LayerPlan:
        plan = self.policy.plan(counts_NE, prev_counts_E)
        fwd_NG = plan.fwd_NG if not bool(plan.dropped_NE.any()) else route_forward(counts_NE, plan.placement_NS)
        return LayerPlan.dropless(plan.placement_NS, fwd_NG, counts_NE.shape[1], policy=self.name,
                                  next_placement_NS=plan.next_placement_NS, push_src_G=plan.push_src_G)


def _reduce_sum(values: list[float]) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def full_gradient(layer: EPMoELayer, policy, routing, x_TD, dy_TD, grad_scale: float):
    """Expert-gradient shards and dx of the full gradient, with no side effect on the layer (untimed). A plan that
    pushes weights (online replication) pushes them here too; the slots get their placement and weights back."""
    saved = layer.accountant, layer.store.accountant, layer.planning_state()
    slots_SW = layer.store.slots_SW.detach().clone()
    layer.accountant = layer.store.accountant = None
    try:
        x = x_TD.clone().requires_grad_(True)
        y, _ = layer(x, policy=FullGradient(policy), routing=routing)
        (y * dy_TD).sum().backward()
        layer.store.sync_replica_grads()
        shards = layer.store.collect_grad_shards(grad_scale).clone()
    finally:
        layer.accountant, layer.store.accountant = saved[:2]
        layer.restore_planning_state(saved[2])  # empties what the pass pushed: the slots hold their placement again
        with torch.no_grad():
            layer.store.slots_SW.copy_(slots_SW)
        layer.store.slots_SW.grad = None
        for p in layer.dense_parameters():
            p.grad = None
    return shards, x.grad


def gradient_errors(shards, full_shards, dx, full_dx) -> dict[str, float]:
    """Relative error and cosine of the experts' gradient (all ranks' shards) and of dx, vs the full gradient."""
    g, f = shards.double(), full_shards.double()
    a, b = dx.double(), full_dx.double()
    gg, ff, gf, dd, aa = _reduce_sum([float((g * g).sum()), float((f * f).sum()), float((g * f).sum()),
                                      float(((g - f) ** 2).sum()), float(((a - b) ** 2).sum())])
    bb = _reduce_sum([float((b * b).sum())])[0]
    return {"grad_rel_err": math.sqrt(dd / ff) if ff else 0.0,
            "grad_cos": gf / math.sqrt(gg * ff) if gg and ff else 1.0,
            "dx_rel_err": math.sqrt(aa / bb) if bb else 0.0}
