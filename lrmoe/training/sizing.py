"""What a training run is sized by: the facts its system's policy is built from (experts, ranks, slots), the memory
the experts of one rank need at a step's peak (bounded by what the machine has), and the modelled time of a step's
plans (--cost-model: the plans priced as full-size pairs on a cluster preset)."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class ExpertMemory:
    """The bytes one rank's experts hold at the peak of a training step (:func:`expert_memory`), by part. S slots of
    P = 3·D·F numbers of e bytes (the slots' dtype) in each of L MoE layers; H = min(E, S) distinct experts hosted.

    weights    L·S·P·e   the slots (the replica store's ``slots_SW``)
    grads      L·S·P·e   their gradients (``slots_SW.grad``), every layer's, until its expert step
    working    S·P·w     one layer's working copy, the largest of: the backward's weight gradient before it is
                         stored (its three parts and their concatenation, while that layer's gradient is not yet
                         held: w = e; with k > 1 micro-batches the later ones add a whole new copy into the held
                         gradient: w = 2e), and the expert step's stack of one expert's replica gradients (w = e,
                         plus its fp32 copy when the slots are narrower: w = e + 4)
    plans      L·k·8·(2·N·G + 2·N·S + G), G = N·S: the k micro-batches' plans' slot tables (int64 forward and
                         retained pairs [N, G], placements [N, S], weight-push sources [G])
    exchange   3·H·P·e   one layer's redistribution (the send and receive buffers, and the assembled ``full``
                         [H, P]); the replica-gradient sync's buffers are no larger
    optimizer  (4·L + 1)·E·⌈P/N⌉·4   fp32 master shard, two Adam moments and the collected gradient shard of
                         every layer, and one Adam update's temporary: E/N experts' worth, independent of S

    The parts are added (the working copy and the exchange do not coincide: an upper bound by at most the exchange);
    the first four grow with the slots (:attr:`slot_bytes`). Process memory (torch, the dense model, activations,
    the corpus) is not counted."""

    slots: int
    moe_layers: int
    slot_numel: int  # P
    elem: int  # e
    weights: int
    grads: int
    working: int
    plans: int
    exchange: int
    optimizer: int

    @property
    def slot_bytes(self) -> int:
        """The part that grows with the slots per rank."""
        return self.weights + self.grads + self.working + self.plans

    @property
    def total(self) -> int:
        return self.slot_bytes + self.exchange + self.optimizer

    def describe(self) -> str:
        """The parts, as the refusal of :func:`check_slot_memory` names them."""
        return (f"{self.slots} slots x {self.moe_layers} MoE layers x {self.slot_numel * self.elem / 2**10:.0f} KiB: "
                f"weights {_size(self.weights)} + gradients {_size(self.grads)} + a layer's working copy "
                f"{_size(self.working)} + plans {_size(self.plans)}; redistribution buffers {_size(self.exchange)}; "
                f"fp32 master shards and Adam state {_size(self.optimizer)}")


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def expert_memory(args, cfg: MoEConfig, ep: int) -> ExpertMemory:
    """The bytes one rank's experts hold at a step's peak (:class:`ExpertMemory`, its parts and formulas) in an EP
    group of ``ep`` ranks: E/ep home slots plus --extra-slots in each MoE layer (the most any system holds), in the
    slots' dtype (fp32 in lrmoe's model; the preset's in HF's), with --micro-batches micro-batches per step. A pure
    function of the arguments."""
    elem = cfg.dtype_bytes if args.hf_config else 4
    E, N, L, k = cfg.num_experts, ep, cfg.num_moe_layers, args.micro_batches
    S, P = E // N + args.extra_slots, 3 * cfg.hidden * cfg.expert_ffn
    G = N * S
    working = max(2 * elem if k > 1 else elem, elem + 4 if elem < 4 else elem)
    return ExpertMemory(slots=S, moe_layers=L, slot_numel=P, elem=elem, weights=L * S * P * elem,
                        grads=L * S * P * elem, working=S * P * working, plans=L * k * 8 * (2 * N * G + 2 * N * S + G),
                        exchange=3 * min(E, S) * P * elem, optimizer=(4 * L + 1) * E * -(-P // N) * 4)


def check_slot_memory(args, cfg: MoEConfig, world: int, ep: int | None = None) -> None:
    """ValueError when the experts of the ranks this machine runs (every rank, under the fork launcher) would not
    fit in the memory it has available (:func:`expert_memory`: slots, their gradients and working copies, plans,
    redistribution buffers, optimizer shards): --extra-slots is bounded by what the machine can hold. ``ep``: the
    EP group's size, whose E/EP home slots each rank holds (default: the world)."""
    need = expert_memory(args, cfg, world if ep is None else ep)
    env = torchrun_env()
    local = world if env is None else env.local_world_size
    available = available_memory_bytes()
    if available is not None and need.total * local > available:
        raise ValueError(f"--extra-slots {args.extra_slots}: the experts need {need.total / 2**30:.2f} GiB per rank "
                         f"at a step's peak ({need.describe()}), {need.total * local / 2**30:.2f} GiB for the "
                         f"{local} ranks on this machine, more than the {available / 2**30:.2f} GiB of memory it "
                         f"has available")


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
