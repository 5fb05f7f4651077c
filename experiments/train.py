"""Train a scaled-down Qwen3-MoE or GLM-4.5-Air model on real text with expert parallelism.

Experts are expert-parallel (the replica substrate of the EP layer: slots, sharded Adam, redistribution into the
next placement); everything else is data-parallel (gradients all-reduced, AdamW). The policy decides placement,
forward routing and what the backward keeps. Each rank draws its own batches from a generator seeded by
(seed, rank), so every policy sees the same data in the same order.

Two architectures run the same loop (data, systems, checkpoints, --resume, records, trace):

* lrmoe's own transformer (lrmoe.integrations.model) of --preset, the default;
* --hf-config qwen3 | glm | PRESET: Hugging Face transformers' Qwen3-MoE or GLM-4.5 (glm4_moe) model of a preset's
  shape (qwen3: qwen3-30b-a3b-debug, glm: glm-4.5-air-debug; lrmoe.integrations.hf.hf_config), its sparse MoE blocks
  swapped
  onto the expert-parallel layer (lrmoe.integrations.hf.swap_moe_blocks; HF's routers, attention and shared experts
  stay HF's).
  Qwen3 adds --aux-coef times HF's load-balancing loss (of each rank's own tokens); GLM balances with its
  selection bias (--bias-rate). Needs the [hf] extra (transformers).

    torchrun --standalone --nproc-per-node 4 experiments/train.py --policy lrmoe --steps 200
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 experiments/train.py ...
    python experiments/train.py --preset qwen3-30b-a3b-debug --policy lrmoe --ranks 4 --steps 200
    python experiments/train.py --hf-config glm --policy symi-dropless --ranks 4 --steps 200

Under torchrun (found from its environment; docs/cluster.md) the script runs as one of torchrun's ranks; otherwise
it forks --ranks gloo ranks on this machine. The ranks form an expert-parallel x data-parallel mesh
(lrmoe.runtime.distributed.mesh): --ep-size ranks per EP group, by default the ranks of a node (LOCAL_WORLD_SIZE),
the whole world when it fits one node.

Logged per step: loss, validation loss (every --eval-every), dropped pairs, retained backward pairs per rank,
throughput, modelled time (--cost-model), load statistics (lrmoe.integrations.load_stats:
"load/<key>_mean|_p50|_p90|_p99"
across layers and the dropped / trimmed totals every step; each layer's "load/layer<i>/<key>" every --eval-every
steps), and the per-layer routing counts, saved as a recorded trace. Sharded checkpoints every --ckpt-every steps,
the newest --ckpt-keep kept (lrmoe.integrations.checkpoint; docs/checkpoints.md); --resume continues from the latest
intact one exactly where it stopped, on the same or another number of ranks (re-sharded).

--micro-batches K splits each rank's --batch sequences of a step into K micro-batches, each with its own forward,
plan and backward, one optimizer step after the last (lrmoe.runtime.layer: the placement holds for the step; the
gradient is that of the mean loss over ranks and micro-batches, so K changes the arithmetic, not the data).
--activation-checkpointing recomputes each transformer block's activations in the backward (torch's non-reentrant
checkpoint; HF's activation_checkpointing_enable()); the MoE layers replay their recorded plans. Per-step records
hold both; their load columns are the last micro-batch's.

--timeout S bounds how long a rank waits for the others in a collective (default 5 minutes), not the run: past it
the run ends naming the rank(s) that did not arrive and where they are (lrmoe.runtime.distributed.launch); a healthy
run of any length is never stopped (--engine emulated: its in-process launcher bounds the whole run instead).
Every argument is checked before any rank starts (argparse errors, status 2), the expert slots' memory against what
the machine has available too; Ctrl-C ends the run with one line and status 130.

--clip-grad X clips every step's gradient to a global L2 norm of X over the dense parameters and the experts (each
expert once, after its replicas' gradients are summed; lrmoe.runtime.clip), as torch.nn.utils.clip_grad_norm_ would
on the dense model, before the dense and the expert steps; records hold the norm before clipping ("grad_norm").
The budget systems (retention < 1) clip their recalibrated gradient. Off (0) by default: earlier runs' results stay
reproducible.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path


import torch
import torch.distributed as dist
import torch.nn.functional as F

from lrmoe.config import MoEConfig, cluster_preset, full_scale_preset, layer_seed, model_preset
from lrmoe.harness.rss import peak_bytes, reset_peak
from lrmoe.integrations.data import get_batch, load_corpus
from lrmoe.runtime.distributed.mesh import Mesh, build_mesh, ep_problem, ep_ranks_per_node, resolve_ep_size
from lrmoe.runtime.distributed.replica import AdamConfig, RangeGroups
from lrmoe.runtime.distributed.torchrun import record, torchrun_env
from lrmoe.runtime.layer import EPMoELayer, initial_placement
from lrmoe.integrations.load_stats import flat_log, load_stats
from lrmoe.integrations.model import MoETransformer
from lrmoe.planner.plan import LayerPlan
from lrmoe.runtime.reference import ReferenceMoE
from lrmoe.runtime.distributed.launch import LaunchError, launch
from lrmoe.runtime.optim import ExpertParallelOptimizer
from lrmoe.bytemodel.sync_model import REPLICA_GRAD_MODES
from lrmoe.systems import SystemContext, check_systems, get_system, system_arg
from lrmoe.checks import available_memory_bytes
from lrmoe.cli import fraction_arg, non_negative_float_arg, non_negative_int_arg, positive_float_arg, positive_int_arg
from lrmoe.integrations.checkpoint import CheckpointDir
from lrmoe.cli import SYSTEMS_HELP, script_parser
from lrmoe.integrations.tracking_args import check_tracking_args, output_problem
from lrmoe.traces.trace import Trace

DEFAULT_PRESET = "qwen3-30b-a3b-debug"
DEFAULT_TIMEOUT_S = 300.0  # --timeout: minutes, so a hung rank is named soon, far above any healthy wait
EMULATED_TIMEOUT_S = 3600.0  # --engine emulated: its in-process launcher bounds the whole run, not each wait
HF_CONFIGS = {"qwen3": "qwen3-30b-a3b-debug", "glm": "glm-4.5-air-debug"}  # --hf-config shorthands
ENGINES = ("distributed", "emulated")  # --engine: how the ranks run (the same worker either way)


def system_context(args, cfg, ranks: int, ranks_per_node: int | None = None) -> SystemContext:
    """The facts the system's policy is built from, for an EP group of ``ranks`` ranks, ``ranks_per_node`` of them
    on one node (None: all): SYMI and LRMoE get the same memory, E/N home slots plus ``--extra-slots`` per rank."""
    return SystemContext(num_experts=cfg.num_experts, num_ranks=ranks, spare_slots=args.extra_slots, eps=args.eps,
                         gamma=args.gamma, pairs_per_rank=args.batch * args.seq_len * cfg.top_k,
                         push_cost_rows=args.push_cost_rows,
                         ranks_per_node=None if ranks_per_node in (None, ranks) else ranks_per_node)


def trace_path_arg(text: str) -> str:
    """--trace-out: a trace file's name ends in .npz (lrmoe.integrations.traces), checked before the run trains."""
    if text and Path(text).suffix != ".npz":
        raise argparse.ArgumentTypeError(f"trace files end in .npz, got {text!r}")
    return text


def slot_memory(args, cfg: MoEConfig, world: int) -> tuple[float, str]:
    """(bytes, how they add up) the expert slots of one rank hold: E/N home slots plus --extra-slots in each MoE
    layer, each an expert's weights and their gradient (lrmoe.bytemodel.memory: a slot's footprint), in the slots'
    dtype (fp32 in lrmoe's model; the preset's in HF's). A lower bound on the rank's memory."""
    from lrmoe.bytemodel.memory import footprint

    elem = cfg.dtype_bytes if args.hf_config else 4
    slots = cfg.num_experts // world + args.extra_slots
    per_slot = footprint(cfg.hidden, cfg.expert_ffn, elem).slot
    return (slots * cfg.num_moe_layers * per_slot,
            f"{slots} slots x {cfg.num_moe_layers} MoE layers x {per_slot / 2**10:.0f} KiB (weights and gradient)")


def check_slot_memory(args, cfg: MoEConfig, world: int, ep: int | None = None) -> None:
    """ValueError when the slots of the ranks this machine runs (every rank, under the fork launcher) would not fit
    in the memory it has available: --extra-slots is bounded by what the machine can hold. ``ep``: the EP group's
    size, whose E/EP home slots each rank holds (default: the world)."""
    per_rank, how = slot_memory(args, cfg, world if ep is None else ep)
    env = torchrun_env()
    local = world if env is None else env.local_world_size
    available = available_memory_bytes()
    if available is not None and per_rank * local > available:
        raise ValueError(f"--extra-slots {args.extra_slots}: the expert slots alone need {per_rank / 2**30:.2f} GiB "
                         f"per rank ({how}), {per_rank * local / 2**30:.2f} GiB for the {local} ranks on this "
                         f"machine, more than the {available / 2**30:.2f} GiB of memory it has available")


LR_SCHEDULES = ("constant", "cosine")


def lr_at(step: int, args) -> float:
    """The learning rate of (0-based) ``step``: ``--lr`` throughout ("constant"), or a linear warm-up over
    ``--warmup`` steps then a cosine decay to ``--min-lr-frac`` × ``--lr`` at the last step ("cosine"), so a run's
    curve has flattened by its end whatever its length. A pure function of the step: a resumed run continues it."""
    if args.lr_schedule == "constant":
        return args.lr
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    span = max(args.steps - args.warmup - 1, 1)
    frac = min((step - args.warmup) / span, 1.0)
    floor = args.min_lr_frac * args.lr
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * frac))


def lr_scheduler(optimizer: torch.optim.Optimizer, args, start: int) -> torch.optim.lr_scheduler.LambdaLR:
    """torch's LambdaLR driving every group of the step core (the dense ones and the experts') along
    :func:`lr_at`, from ``start`` (a resumed run's first step). The groups' base rate is 1, so the rates are
    lr_at's values themselves, bit for bit (a base of --lr times lr_at / --lr would round differently)."""
    for group in optimizer.param_groups:
        group["initial_lr"] = 1.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, args), last_epoch=start - 1)


# -- the two architectures behind one interface ----------------------------------------------------------------------
# Each builds its model and optimizers on every rank and offers: train_step(x, y) -> (this rank's loss, the MoE
# layers' plans of every micro-batch [micro-batch][layer], routed counts [L, N, E] summed over the micro-batches);
# eval_loss(x, y) (no planning state advanced); .core (the step core, lrmoe.runtime.optim); .model, .opt (the
# step core's dense optimizer) and the MoE layers, which the checkpoint saves and loads
# (lrmoe.integrations.checkpoint).
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


def cost_model(args, cfg: MoEConfig, ep: int, ranks_per_node: int | None = None):
    """The modelled time of --cost-model: this run's plans priced as if every pair were a full-size pair of the
    model family (the paper-scale preset the debug one scales down, with this run's experts and top-k) on the EP
    group's ``ep`` ranks, ``ranks_per_node`` (default: all) to a node of the cluster preset, with the system's
    registry entry built as the simulator builds it (compaction, optimizer sharding and
    lrmoe.sim.simulated_systems.cost_options), and this run's --replica-grad."""
    from lrmoe.sim.cost import CostModel
    from lrmoe.sim.simulated_systems import simulator_system

    full = full_scale_preset(args.preset).replace(num_experts=cfg.num_experts, top_k=cfg.top_k)
    ranks_per_node = ep if ranks_per_node is None else ranks_per_node
    cluster = cluster_preset(args.cost_model).replace(num_ranks=ep, ranks_per_node=ranks_per_node)
    system = simulator_system(get_system(args.policy), system_context(args, cfg, ep, ranks_per_node))
    return CostModel(full, cluster, compaction=system.compaction, sharded_optimizer=system.sharded_optimizer,
                     replica_grad=args.replica_grad, **system.costs)


def evaluate(run, data, args, world: int) -> float:
    """Mean validation loss over fixed batches (the same for every policy); leaves the layers' state as it was."""
    gen = torch.Generator().manual_seed(10_000 + dist.get_rank())
    total = torch.zeros(1, dtype=torch.float64, device=run.device)
    for _ in range(args.eval_batches):
        x, y = get_batch(data, args.batch, args.seq_len, gen)
        total += run.eval_loss(x.to(run.device), y.to(run.device)).double()
    if world > 1:
        dist.all_reduce(total)
    return float(total) / (args.eval_batches * world)


def step_record(args, step: int, loss_sum: float, plans_M: list[list[LayerPlan]], counts_LNE: torch.Tensor,
                elapsed: float, world: int, cost, per_layer: bool) -> dict:
    """One step's results row: loss, dropped pairs, forward / retained backward pairs per rank, the hot rank's
    backward cut (of the last micro-batch), throughput, modelled time (every micro-batch's exchanges and GEMMs, the
    sync phases once), load statistics (each layer's only when ``per_layer``)."""
    plans = plans_M[-1]
    fwd_N = torch.stack([p.fwd_load_N for p in plans]).sum(0).double()
    bwd_N = torch.stack([p.bwd_load_N for p in plans]).sum(0).double()
    hot = int(fwd_N.argmax())
    record = {
        "policy": args.policy, "step": step, "loss": loss_sum / world,
        "dropped_frac": float(sum(p.dropped_NE.sum() for ps in plans_M for p in ps)) / float(counts_LNE.sum()),
        "fwd_pairs_max": float(fwd_N.max()), "fwd_pairs_mean": float(fwd_N.mean()),
        "bwd_pairs_max": float(bwd_N.max()), "bwd_pairs_mean": float(bwd_N.mean()),
        "hot_rank_bwd_cut": 1.0 - float(bwd_N[hot] / fwd_N[hot]),
        "tokens_per_s": args.batch * args.seq_len * world / elapsed,
        "micro_batches": args.micro_batches, "activation_checkpointing": args.activation_checkpointing,
        "clip_grad": args.clip_grad,
    }
    if cost is not None:
        times = [[cost.cost(p) for p in ps] for ps in plans_M]
        record["modelled_s"] = (sum(t.total_s - t.category_s()["sync"] for ts in times for t in ts)
                                + sum(t.category_s()["sync"] for t in times[-1]))
    record.update(flat_log(load_stats(plans=plans), prefix="load/", per_layer=per_layer))
    return record


# The arguments that define a run: a checkpoint written under other values belongs to another run, and --resume
# refuses it. Add an argument here when it changes what a run computes. The world size is not one: a checkpoint
# resumes re-sharded on another (lrmoe.integrations.checkpoint_state).
RUN_ARGS = ("preset", "hf_config", "policy", "seed", "batch", "seq_len", "steps", "lr", "lr_schedule",
            "warmup", "min_lr_frac", "aux_coef", "bias_rate", "extra_slots", "eps", "gamma", "push_cost_rows",
            "replica_grad", "micro_batches", "data", "max_bytes", "clip_grad", "ep_size")
# Run arguments added after checkpoints were written: a checkpoint without one ran with this value.
RUN_ARG_DEFAULTS = {"clip_grad": 0.0, "ep_size": None}


def checkpoint_dir(args) -> CheckpointDir:
    """The run's checkpoint folder (--ckpt-dir), its identity the script, the run id, the results file and the
    defining arguments."""
    identity = {"script": "train", "run_id": getattr(args, "run_id", None), "results": args.out or None,
                "args": {name: getattr(args, name) for name in RUN_ARGS}}
    return CheckpointDir(args.ckpt_dir, identity, keep=args.ckpt_keep, defaults=RUN_ARG_DEFAULTS)


def plan_resume(args, world: int) -> None:
    """Decide, before any rank starts, which run this is and where it starts (CheckpointDir.plan): sets
    ``args.run_id`` and ``args.start_step`` (0, or the step of the checkpoint --resume continues from). ValueError
    when the folder is another run's or in use, when --resume would mix runs, or when a fresh run would start over
    an earlier run's checkpoints without --overwrite."""
    from lrmoe.integrations.provenance import new_run_id
    from lrmoe.results import read_results

    args.run_id, args.start_step = new_run_id("train"), 0
    if not args.ckpt_dir:
        return
    out = Path(args.out) if args.out else None
    headers = read_results(out, "run") if args.resume and out is not None and out.is_file() else []
    env = torchrun_env()
    probe = env is None or env.rank == 0  # under torchrun rank 0 takes the folder (main)
    args.run_id, args.start_step, manifest = checkpoint_dir(args).plan(
        args.resume, args.overwrite, [h["run_id"] for h in headers], args.run_id, probe=probe)
    if manifest is not None and manifest["world"] != world:
        if args.trace_out:
            raise ValueError(f"--trace-out: the checkpoint of step {args.start_step} ran on {manifest['world']} "
                             f"ranks, this run on {world}; a recorded trace holds one world size's counts")
        print(f"resuming the {manifest['world']}-rank checkpoint of step {args.start_step} on {world} ranks "
              f"(re-sharded)", flush=True)


def hold_checkpoints(args) -> CheckpointDir | None:
    """The checkpoint folder locked for this run (released by the caller), or None when the run keeps none."""
    if not args.ckpt_dir or not (args.ckpt_every or args.start_step):
        return None
    held = checkpoint_dir(args)
    try:
        held.lock()
    except RuntimeError as exc:
        raise SystemExit(f"train.py: error: {exc}") from None
    return held


def worker(rank: int, args) -> list[dict]:
    torch.manual_seed(args.seed)
    world = dist.get_world_size()
    # NCCL ranks own one GPU each (torchrun on a GPU cluster); gloo ranks compute on the CPU
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    mesh = build_mesh(args.ep_size)  # collective; LOCAL_WORLD_SIZE (torchrun) says what a node is
    cfg, run, cost = build(args, world, device, mesh)
    corpus = load_corpus(args.data, max_bytes=args.max_bytes)
    gen = torch.Generator().manual_seed(args.seed * 7919 + rank)
    counts: list[torch.Tensor] = []  # per step: [layers, N, E] routed pairs (the recorded trace)
    history: list[dict] = []
    layers = run.ep.layers if isinstance(run, HFModel) else run.layers
    ckpt = checkpoint_dir(args) if args.ckpt_dir else None
    start = args.start_step  # plan_resume's choice, made before the ranks started
    if start:
        history, counts = ckpt.load(start, run.model, run.opt, layers, {"data": gen}, run.architecture)
    scheduler = lr_scheduler(run.core, args, start)  # after the checkpoint: it continues from the step
    tracker = None
    if rank == 0 and args.out:
        from lrmoe.integrations.tracking import Tracker

        tracker = Tracker("train", vars(args), results=args.out, seed=args.seed, overwrite=args.overwrite,
                          resume=args.resume, resume_step=start,  # records past the checkpoint are redone
                          wandb=not args.no_wandb, group=args.preset, quiet=args.quiet, run_id=args.run_id)
    progress = None
    if rank == 0 and not args.quiet:
        from tqdm import tqdm

        progress = tqdm(total=args.steps, initial=start, desc=f"{args.policy}", disable=None)
    try:
        for step in range(start, args.steps):
            base = reset_peak() if args.record_peak_rss else 0  # before the clock starts
            t0 = time.perf_counter()
            x, y = get_batch(corpus.train, args.batch, args.seq_len, gen)
            loss, plans, counts_LNE = run.train_step(x.to(device), y.to(device))
            scheduler.step()
            peak = torch.tensor([peak_bytes() - base if args.record_peak_rss else 0], dtype=torch.float64)
            elapsed = time.perf_counter() - t0
            loss_sum = loss.double().reshape(1)
            if world > 1:
                dist.all_reduce(loss_sum)
            counts.append(counts_LNE)
            evaluating = (step + 1) % args.eval_every == 0 or step + 1 == args.steps
            record = step_record(args, step + 1, float(loss_sum), plans, counts_LNE, elapsed, world, cost,
                                 per_layer=evaluating)
            if run.grad_norm is not None:  # --clip-grad: the global norm before clipping (the same on every rank)
                record["grad_norm"] = float(run.grad_norm)
            if args.record_peak_rss:  # the step's peak resident memory above its start, the largest rank's
                if world > 1:
                    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                record["peak_rss_mib"] = float(peak) / 2**20
            if evaluating:
                record["val_loss"] = evaluate(run, corpus.val, args, world)
            history.append(record)
            if tracker is not None:
                tracker.log(record, step=step + 1)
            if progress is not None:
                progress.update(1)
                progress.set_postfix(loss=f"{record['loss']:.3f}",
                                     **({"grad_norm": f"{record['grad_norm']:.3f}"} if "grad_norm" in record else {}))
            if args.ckpt_every and (step + 1) % args.ckpt_every == 0:
                ckpt.save(step + 1, run.model, run.opt, layers, {"data": gen}, history, counts, run.architecture)
            if args.stop_after and step + 1 >= args.stop_after:  # simulate an interruption (tests)
                break
        if rank == 0 and args.trace_out:
            trace = Trace(torch.stack(counts), {"source": "recorded", "model": cfg.name, "seed": args.seed,
                                                 "policy": args.policy, "architecture": run.architecture,
                                                 "steps": len(counts),
                                                 "tokens_per_rank": args.batch * args.seq_len,
                                                 "micro_batches": args.micro_batches})  # counts: summed over them
            trace.save(args.trace_out, overwrite=args.overwrite or args.resume)
    finally:
        if progress is not None:
            progress.close()
        if tracker is not None:
            tracker.finish()
    return history


def build_parser() -> argparse.ArgumentParser:
    """The command line; its flags come from light modules alone (lrmoe.cli; tests/test_cli.py)."""
    parser = script_parser(__doc__, "outputs/train.jsonl")  # --resume also continues from the latest checkpoint
    parser.add_argument("--preset", default=None, help=f"model preset (default {DEFAULT_PRESET})")
    parser.add_argument("--hf-config", default=None, metavar="FAMILY",
                        help="train Hugging Face transformers' architecture instead of lrmoe's: 'qwen3' (Qwen3-MoE "
                             f"of {HF_CONFIGS['qwen3']}), 'glm' (GLM-4.5, glm4_moe, of {HF_CONFIGS['glm']}) or any "
                             "model preset of either family; its MoE blocks run on the expert-parallel layer "
                             "(lrmoe.integrations.hf; needs the [hf] extra)")
    parser.add_argument("--policy", default="lrmoe", type=system_arg, help=f"the system trained; {SYSTEMS_HELP}")
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the fork launcher (not under torchrun)")
    parser.add_argument("--torchrun", action="store_true",
                        help="accepted for older command lines: torchrun is found from its environment")
    parser.add_argument("--ep-size", type=int, default=None, metavar="EP",
                        help="ranks per expert-parallel group; the EP groups are data-parallel copies (default: the "
                             "ranks of a node, LOCAL_WORLD_SIZE under torchrun; the world when it fits a node)")
    parser.add_argument("--engine", choices=ENGINES, default="distributed",
                        help="'distributed': one process per rank (the fork launcher, gloo), the reference for "
                             "exactness and time; 'emulated': the --ranks ranks as threads of this process taking "
                             "turns, every exchange a local gather (lrmoe.runtime.inprocess), the same code")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--micro-batches", type=int, default=1,
                        help="split each rank's --batch into this many micro-batches per optimizer step (gradient "
                             "accumulation; the placement holds for the step); must divide --batch")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's activations in the backward (the MoE layers replay their plans)")
    parser.add_argument("--record-peak-rss", action="store_true",
                        help="record each step's peak resident memory above its start (the largest rank's; Linux "
                             "only, CPU ranks; the heap is freed before every step, outside the timed part)")
    parser.add_argument("--lr", type=positive_float_arg, default=3e-3, help="peak learning rate (AdamW)")
    parser.add_argument("--clip-grad", type=non_negative_float_arg, default=0.0, metavar="MAX_NORM",
                        help="clip each step's gradient to this global L2 norm over the dense parameters and the "
                             "experts (0: off; Megatron-Core's default is 1.0)")
    parser.add_argument("--lr-schedule", choices=LR_SCHEDULES, default="constant",
                        help="'cosine': linear warm-up, then cosine decay to --min-lr-frac x --lr at the last step")
    parser.add_argument("--warmup", type=non_negative_int_arg, default=0, help="warm-up steps of the cosine schedule")
    parser.add_argument("--min-lr-frac", type=positive_float_arg, default=0.1,
                        help="the cosine schedule's final lr / --lr")
    parser.add_argument("--aux-coef", type=non_negative_float_arg, default=0.1,
                        help="global-batch load-balancing loss weight (0.1: recorded Gini 0.3-0.4 on the debug "
                             "models; 1e-3, Qwen3's value at scale, lets the tiny models collapse to Gini 0.65)")
    parser.add_argument("--bias-rate", type=non_negative_float_arg, default=1e-3,
                        help="aux-free selection-bias update rate (GLM; 0: no balancing)")
    parser.add_argument("--extra-slots", type=non_negative_int_arg, default=1,
                        help="replica slots per rank beside E/N home slots (bounded by the memory the ranks' slots "
                             "need: every slot holds an expert's weights and gradient in every MoE layer)")
    parser.add_argument("--eps", type=non_negative_float_arg, default=0.1,
                        help="LRMoE balance slack (fraction of the mean load a rank may exceed)")
    parser.add_argument("--replica-grad", choices=REPLICA_GRAD_MODES, default="range",
                        help="replica gradients: 'range' (SYMI's range all-reduce, then collection) or 'shard' "
                             "(each host's sum straight to the optimizer-shard owners), for every system")
    parser.add_argument("--gamma", type=fraction_arg, default=0.1,
                        help="LRMoE per-expert floor (fraction of each expert's pairs always kept)")
    # the CPU ranks' figure, as layer_bench.py's (lrmoe.sim.cost.CostModel.push_cost_rows on the CPU calibration)
    parser.add_argument("--push-cost-rows", type=non_negative_float_arg, default=32.0,
                        help="cost-aware online replication pushes a copy only when it relieves the busiest rank by "
                             "more than this many pairs (online-greedy: any relief)")
    parser.add_argument("--cost-model", default="h200x8",
                        help="cluster preset pricing each step's plans as full-size pairs ('' to skip)")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between validation losses")
    parser.add_argument("--eval-batches", type=int, default=4, help="validation batches per rank per evaluation")
    parser.add_argument("--data", default=None, help="folder or glob of text files (default: Python's stdlib)")
    parser.add_argument("--max-bytes", type=positive_int_arg, default=4_000_000,
                        help="read at most this many bytes of text")
    parser.add_argument("--seed", type=non_negative_int_arg, default=0, help="seed of the model and the data order")
    parser.add_argument("--ckpt-dir", default=None,
                        help="checkpoints of this run (default: beside the results file, --out's name + .ckpt)")
    parser.add_argument("--ckpt-every", type=non_negative_int_arg, default=50,
                        help="steps between checkpoints (0: no checkpoints)")
    parser.add_argument("--ckpt-keep", type=non_negative_int_arg, default=2,
                        help="keep the newest this many checkpoints (0: all; 2 or more lets --resume fall back "
                             "past a corrupted one); each step's record is kept once, whatever this is")
    parser.add_argument("--stop-after", type=non_negative_int_arg, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--trace-out", default=None, type=trace_path_arg,
                        help="save the routing counts as a recorded trace (.npz)")
    parser.add_argument("--timeout", type=positive_float_arg, default=None, metavar="SECONDS",
                        help="the longest a rank waits for its peers in a collective: past it the run ends, naming "
                             f"the ranks that did not arrive and where they are (default {DEFAULT_TIMEOUT_S:g}; a "
                             "bound on inactivity, not on the run's length; --engine emulated: a bound on the whole "
                             f"run, default {EMULATED_TIMEOUT_S:g})")
    parser.add_argument("--quiet", action="store_true", help="no progress bar and no tracking notices")
    return parser


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.hf_config:
        preset = HF_CONFIGS.get(args.hf_config, args.hf_config)
        if args.preset not in (None, preset):
            parser.error(f"--hf-config {args.hf_config} trains {preset}; drop --preset {args.preset}")
        args.preset = preset
    elif args.preset is None:
        args.preset = DEFAULT_PRESET
    for name in ("steps", "batch", "seq_len", "ranks", "eval_every", "eval_batches", "micro_batches"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.batch % args.micro_batches:
        parser.error(f"--micro-batches {args.micro_batches} must divide --batch {args.batch} (sequences per rank)")
    if not 0 <= args.warmup < args.steps:
        parser.error(f"--warmup must be in [0, --steps), got {args.warmup}")
    if not 0 < args.min_lr_frac <= 1:
        parser.error(f"--min-lr-frac must be in (0, 1], got {args.min_lr_frac}")
    if args.ckpt_dir is None:
        if args.ckpt_every and not args.out:
            parser.error("--out '' writes no results file: name a --ckpt-dir, or --ckpt-every 0")
        args.ckpt_dir = str(Path(args.out).with_suffix(".ckpt")) if args.out else None
    if args.resume and not args.out:
        parser.error("--resume continues the run of a results file: name it with --out")
    if args.engine == "emulated" and (args.torchrun or args.hf_config):
        parser.error(f"--engine emulated runs lrmoe's own transformer on the fork launcher's --ranks: drop "
                     f"{'--torchrun' if args.torchrun else '--hf-config'}")
    if args.timeout is None:
        args.timeout = EMULATED_TIMEOUT_S if args.engine == "emulated" else DEFAULT_TIMEOUT_S
    return args


def check_args(args) -> None:
    """Everything a rank would otherwise find out on its own, checked once before any rank starts or any record is
    written: the output paths (lrmoe.integrations.tracking_args), the presets, the world size against
    the experts, the system in that world, the expert slots' memory on this machine (:func:`check_slot_memory`), the
    text files and their validation split, and which run --resume
    continues (:func:`plan_resume`: sets ``args.run_id`` and ``args.start_step``). SystemExit with one message."""
    parser = build_parser()
    try:
        env = torchrun_env()
    except ValueError as exc:
        parser.error(str(exc))
    if args.torchrun and env is None:
        parser.error("--torchrun: this process was not started by torchrun (no RANK, LOCAL_WORLD_SIZE, ... in its "
                     "environment); drop --torchrun to fork --ranks ranks here")
    if args.engine == "emulated" and env is not None:
        parser.error("--engine emulated runs its ranks as threads of one process: run it with python, not torchrun")
    world = args.ranks if env is None else env.world_size
    rpn = world if env is None else env.local_world_size
    ep = resolve_ep_size(args.ep_size, world, rpn)
    if problem := ep_problem(ep, world, rpn):
        parser.error(problem)
    for flag, used in (("--hf-config", args.hf_config), ("--engine emulated", args.engine == "emulated")):
        if used and ep != world:  # one EP group: HF's swap and the in-process group know no mesh
            parser.error(f"{flag} runs with EP = the world ({world} ranks); --ep-size {ep} is not supported there "
                         f"(pass --ep-size {world})")
    check_tracking_args(parser, args, "train", {"--trace-out": args.trace_out})
    if args.ckpt_dir and (problem := output_problem("--ckpt-dir", Path(args.ckpt_dir) / "step", replace=True)):
        parser.error(problem)
    try:
        cfg = model_preset(args.preset)
        if args.cost_model:
            cluster_preset(args.cost_model)
            full_scale_preset(args.preset)
        check_systems([args.policy], system_context(args, cfg, ep, ep_ranks_per_node(ep, rpn)))
        check_slot_memory(args, cfg, world, ep)
        if args.hf_config:
            from lrmoe.integrations.hf import hf_config  # imports transformers here, once, before the ranks fork

            hf_config(cfg)  # raises when the preset has no HF counterpart
        corpus = load_corpus(args.data, max_bytes=args.max_bytes)  # raises when it holds no file or is too small
        for split in ("train", "val"):
            if getattr(corpus, split).numel() <= args.seq_len + 1:
                raise ValueError(f"the {split} split of the corpus holds {getattr(corpus, split).numel()} tokens, "
                                 f"too few for one window of --seq-len {args.seq_len}")
        plan_resume(args, world)
    except ImportError as exc:
        raise SystemExit(f"train.py: error: --hf-config needs transformers (pip install 'lrmoe[hf]'): {exc}") from None
    except (ValueError, OSError) as exc:
        parser.error(str(exc))


@record  # under torchrun: a failing rank's traceback reaches torchrun's report
def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    check_args(args)
    if torchrun_env() is not None:  # one of torchrun's ranks
        from lrmoe.runtime.distributed.comm import init_process_group_from_env

        info = init_process_group_from_env(timeout_s=args.timeout)  # --timeout bounds each collective's wait
        chosen = [args.run_id, args.start_step]
        dist.broadcast_object_list(chosen, src=0)  # a new run's id and the resumed step: rank 0's
        args.run_id, args.start_step = chosen
        held = hold_checkpoints(args) if info.rank == 0 else None  # rank 0 holds the folder for the run
        try:
            if held is not None and args.overwrite:
                held.remove_own()
            dist.barrier()
            history = worker(info.rank, args)
        finally:
            if held is not None:
                held.release()
        dist.destroy_process_group()
        return history
    held = hold_checkpoints(args)
    try:
        if held is not None and args.overwrite:
            held.remove_own()
        if args.engine == "emulated":  # the same worker on in-process ranks (lrmoe.runtime.inprocess)
            from lrmoe.runtime.inprocess import launch_inprocess

            return launch_inprocess(worker, args.ranks, args, timeout_s=args.timeout)[0]

        # Read the corpus and import what the ranks' optimizers import, once, here: the forked ranks inherit both (a
        # process reads a corpus once) instead of spending seconds on each.
        load_corpus(args.data, max_bytes=args.max_bytes)
        # no bound on the run's length; --timeout bounds each collective's wait, and past it names the ranks that hang
        return launch(worker, args.ranks, args, timeout_s=None, pg_timeout_s=args.timeout,
                      preload=("torch._dynamo",))[0]
    finally:
        if held is not None:
            held.release()


def cli(argv=None) -> int:
    """The command line: :func:`main`, its exit status. An interrupt (Ctrl-C) ends with one line and status 130, a
    failed rank with the launcher's report (it names the rank and holds its traceback) and status 1, neither with a
    traceback of the launcher's own."""
    try:
        main(argv)
    except KeyboardInterrupt:
        print("train.py: interrupted; the checkpoints written so far are kept (--resume continues from the last)",
              file=sys.stderr)
        return 130
    except LaunchError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(cli())
