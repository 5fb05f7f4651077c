"""What a training run is sized by: the facts its system's policy is built from (experts, ranks, slots), the memory
the expert slots of one rank need (bounded by what the machine has), and the modelled time of a step's plans
(--cost-model: the plans priced as full-size pairs on a cluster preset)."""

from __future__ import annotations

from lrmoe.checks import available_memory_bytes
from lrmoe.config import MoEConfig, cluster_preset, full_scale_preset
from lrmoe.runtime.distributed.torchrun import torchrun_env
from lrmoe.systems import SystemContext, get_system


def system_context(args, cfg, ranks: int, ranks_per_node: int | None = None) -> SystemContext:
    """The facts the system's policy is built from, for an EP group of ``ranks`` ranks, ``ranks_per_node`` of them
    on one node (None: all): SYMI and LRMoE get the same memory, E/N home slots plus ``--extra-slots`` per rank."""
    return SystemContext(num_experts=cfg.num_experts, num_ranks=ranks, spare_slots=args.extra_slots, eps=args.eps,
                         gamma=args.gamma, pairs_per_rank=args.batch * args.seq_len * cfg.top_k,
                         push_cost_rows=args.push_cost_rows,
                         ranks_per_node=None if ranks_per_node in (None, ranks) else ranks_per_node)


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
