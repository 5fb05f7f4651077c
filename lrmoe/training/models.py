"""The two architectures a training run trains, behind one interface, and the function that builds one on a rank.

Each builds its model and optimizers on every rank and offers: train_step(x, y) -> (this rank's loss, the MoE
layers' plans of every micro-batch [micro-batch][layer], routed counts [L, N, E] summed over the micro-batches);
eval_loss(x, y) (no planning state advanced); .core (the step core, lrmoe.runtime.optim); .model, .opt (the
step core's dense optimizer) and the MoE layers, which the checkpoint saves and loads
(lrmoe.integrations.checkpoint).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lrmoe.config import MoEConfig, layer_seed, model_preset
from lrmoe.integrations.model import MoETransformer
from lrmoe.planner.plan import LayerPlan
from lrmoe.runtime.distributed.mesh import Mesh
from lrmoe.runtime.distributed.replica import AdamConfig, RangeGroups
from lrmoe.runtime.layer import EPMoELayer, initial_placement
from lrmoe.runtime.optim import ExpertParallelOptimizer
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.systems import get_system
from lrmoe.training.sizing import cost_model, system_context


class NativeModel:
    """lrmoe's own transformer (lrmoe.integrations.model.MoETransformer) with an EPMoELayer per MoE layer."""

    architecture = "lrmoe"

    def __init__(self, args, cfg: MoEConfig, world: int, device: torch.device, mesh: Mesh | None = None):
        self.args, self.cfg, self.world, self.device = args, cfg, world, device
        system = get_system(args.policy)
        # the EP group: the mesh's, or without one the whole world (one node)
        ep, rpn, groups = (world, world, RangeGroups()) if mesh is None else (mesh.ep_size, mesh.ep_ranks_per_node,
                                                                              mesh.groups)
        ctx = system_context(args, cfg, ep, rpn)
        self.layers: list[EPMoELayer] = []

        def moe_factory(i: int):
            weights = ReferenceMoE.from_config(cfg, seed=layer_seed(args.seed, i)).export_weights()
            policy = system.make_policy(ctx)
            placement = initial_placement(policy, ep, cfg.num_experts, args.batch * cfg.seq_len * cfg.top_k)
            layer = EPMoELayer(weights, cfg.top_k, cfg.router, policy, placement, groups,
                               routed_scaling=cfg.routed_scaling, adam=AdamConfig(lr=args.lr, weight_decay=0.0),
                               device=device, backward=system.layer_backward(layer_seed(args.seed, i)),
                               replica_grad=args.replica_grad)
            layer.name = f"MoE layer {i}"
            self.layers.append(layer)
            return layer

        self.model = MoETransformer(cfg, moe_factory, seed=args.seed).to(device)
        self.model.activation_checkpointing = args.activation_checkpointing
        expert_params = {id(layer.store.slots_SW) for layer in self.layers}
        self.dense = [p for p in self.model.parameters() if id(p) not in expert_params]
        # dense sync, clipping, AdamW, the experts' Adam + redistribution, GLM's bias (lrmoe.runtime.optim)
        biases = [layer.bias_E if cfg.router == "sigmoid_bias" else None for layer in self.layers]
        self.core = ExpertParallelOptimizer(torch.optim.AdamW(self.dense, lr=args.lr, weight_decay=0.0), self.layers,
                                            max_grad_norm=args.clip_grad, biases=biases, bias_rate=args.bias_rate)
        self.opt = self.core.dense  # what the checkpoint saves beside the layers' expert state
        self.grad_norm: torch.Tensor | None = None  # the last step's global norm before clipping (--clip-grad)

    def train_step(self, x, y) -> tuple[torch.Tensor, list[list[LayerPlan]], torch.Tensor]:
        k = self.args.micro_batches
        self.core.zero_grad(set_to_none=False)
        losses, plans, counts = [], [], 0
        for x_m, y_m in zip(x.chunk(k), y.chunk(k)):  # micro-batches: gradients accumulate, one step
            _, infos, loss, total = self.model(x_m, y_m, aux_coef=self.args.aux_coef)
            total.backward()
            losses.append(loss.detach())
            plans.append([info.dispatch.plan for info in infos])
            counts = counts + torch.stack([info.dispatch.counts_NE for info in infos])
        self.core.step()  # the gradient of the mean loss over ranks and micro-batches
        self.grad_norm = self.core.last_grad_norm
        return torch.stack(losses).mean(), plans, counts

    @torch.no_grad()
    def eval_loss(self, x, y) -> torch.Tensor:
        saved = [(layer.prev_counts_E, layer.last_dispatch) for layer in self.layers]
        try:
            return self.model(x, y)[2]
        finally:  # an evaluation forward leaves the layers' planning state as it was
            for layer, (prev, last) in zip(self.layers, saved):
                layer.prev_counts_E, layer.last_dispatch = prev, last


class HFModel:
    """Hugging Face transformers' Qwen3-MoE or GLM-4.5 model of the preset's shape, its sparse MoE blocks on the
    expert-parallel layer; :class:`lrmoe.integrations.hf.HFExpertParallel` holds the training-loop contract."""

    def __init__(self, args, cfg: MoEConfig, world: int, device: torch.device, mesh: Mesh | None = None):
        from transformers import AutoModelForCausalLM

        from lrmoe.integrations.hf import hf_config, swap_moe_blocks

        self.device = device
        torch.manual_seed(args.seed)  # the same initial weights on every rank
        self.model = AutoModelForCausalLM.from_config(hf_config(cfg)).to(device)  # on its device before the swap
        if args.activation_checkpointing:
            self.model.train()  # HF checkpoints its decoder layers in training mode only
            getattr(self.model, "activation_checkpointing_enable", self.model.gradient_checkpointing_enable)()
        self.micro_batches = args.micro_batches
        if mesh is not None and mesh.ep_size != world:
            raise ValueError(f"--hf-config runs with EP = the world ({world} ranks), not EP {mesh.ep_size}")
        context = system_context(args, cfg, world)
        self.ep = swap_moe_blocks(self.model, args.policy, context=context, seed=args.seed,
                                  adam=AdamConfig(lr=args.lr, weight_decay=0.0), replica_grad=args.replica_grad)
        # the same step core as NativeModel's (lrmoe.runtime.optim), with HF's gate biases
        self.core = self.ep.optimizer(torch.optim.AdamW, lr=args.lr, weight_decay=0.0, bias_rate=args.bias_rate,
                                      max_grad_norm=args.clip_grad)
        self.opt = self.core.dense  # what the checkpoint saves beside the layers' expert state
        self.architecture = self.model.config.model_type
        self.aux_coef = 0.0 if self.ep.family.biased else args.aux_coef  # GLM: the selection bias balances
        self.grad_norm: torch.Tensor | None = None  # the last step's global norm before clipping (--clip-grad)

    def train_step(self, x, y) -> tuple[torch.Tensor, list[list[LayerPlan]], torch.Tensor]:
        losses, plans = [], []
        for x_m, y_m in zip(x.chunk(self.micro_batches), y.chunk(self.micro_batches)):
            out = self.model(x_m, output_router_logits=True)
            loss = F.cross_entropy(out.logits.flatten(0, 1), y_m.flatten())  # y is x shifted by one already
            total = loss + self.aux_coef * out.aux_loss if self.aux_coef else loss
            total.backward()
            losses.append(loss.detach())
            plans.append(self.ep.plans())
        self.core.step()  # the gradient of the mean loss over ranks and micro-batches
        self.core.zero_grad()
        self.grad_norm = self.core.last_grad_norm
        counts = sum(torch.stack([p.routed_NE for p in micro]) for micro in plans)
        return torch.stack(losses).mean(), plans, counts

    @torch.no_grad()
    def eval_loss(self, x, y) -> torch.Tensor:
        logits = self.model(x).logits  # a forward without grad plans nothing (lrmoe.integrations.hf)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def build(args, world: int, device: torch.device, mesh: Mesh | None = None):
    """(the preset's config, the architecture's model on this rank, the cost model or None), on ``mesh`` (None:
    EP = the world of ``world`` ranks, one node)."""
    cfg = model_preset(args.preset)
    ep, rpn = (world, world) if mesh is None else (mesh.ep_size, mesh.ep_ranks_per_node)
    cfg.check_divisible(ep)
    run = (HFModel if args.hf_config else NativeModel)(args, cfg, world, device, mesh)
    return cfg, run, cost_model(args, cfg, ep, rpn) if args.cost_model else None
