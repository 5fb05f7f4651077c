"""The simulator's sweep cells: one point of a sweep (model, cluster, skew, budget, tokens), the rules every system
of a cell is built by (DESIGN.md §5.4: one memory model, the headroom rule, the overheads charged), and the cell's
systems built from the registry (:mod:`lrmoe.systems`) as the simulator runs them (:mod:`lrmoe.sim.simulated_systems`).

Shared by every script that simulates registry systems at paper scale (experiments/ablate.py, experiments/frontier.py):
a script builds a :class:`Cell` and a :class:`CellRules` (or passes its argparse namespace, which has the same
attribute names) and asks :func:`build_systems` for the cell's systems and :func:`cost_kwargs` for each one's cost
options.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe.config import ClusterConfig, MoEConfig
from lrmoe.sim.cost import CostModel
from lrmoe.sim.overheads import OVERHEADS
from lrmoe.sim.simulator import System
from lrmoe.sim.simulated_systems import cost_options, plan_twins, simulator_system
from lrmoe.systems import SystemContext, get_system

# Tokens per rank per micro-batch (ours). Qwen3: one 4096-token sequence per GPU. GLM-4.5-Air: its expert
# weights and gradients alone need 50 GB per GPU on one 8-GPU node, and 25 GB on two, which leaves 40 GB A100s
# room for about 1024 tokens per GPU.
TOKENS = {"qwen3-30b-a3b": 4096, "glm-4.5-air": 1024}


@dataclass(frozen=True)
class Cell:
    """One point of the sweep: everything but the system."""

    model: MoEConfig
    cluster: ClusterConfig
    skew: tuple[str, float]  # (family, parameter)
    mem_gb: float
    tokens: int

    @property
    def layer_budget(self) -> float:
        """One MoE layer's share of a rank's budget (the cost model's; the planner's MemoryModel is the whole)."""
        return self.mem_gb * 1e9 / self.model.num_moe_layers


@dataclass(frozen=True)
class CellRules:
    """How every system of a cell is built and priced (the ablation's flags of the same names, and their defaults).

    eps, gamma        LRMoE's balance slack and per-expert floor.
    max_extra         the most spare slots per rank (None: E/N).
    headroom_rule     "planned": each dropless system's buffers for its own planned peak (:func:`planned_headrooms`);
                      "fixed": SYMI-dropless for ``symi_headroom`` x the mean, LRMoE for 1 + eps.
    headroom_margin   the planned rule's margin over the planned peak, every system alike.
    symi_headroom     the fixed rule's SYMI-dropless buffers.
    no_overheads      overheads not charged (:data:`lrmoe.sim.overheads.OVERHEADS`, or "all").
    replica_grad      "range", "shard", or "best" (range priced, shard a variant).
    """

    eps: float = 0.1
    gamma: float = 0.1
    max_extra: int | None = None
    headroom_rule: str = "planned"
    headroom_margin: float = 0.05
    symi_headroom: float = 1.5
    no_overheads: tuple[str, ...] = ()
    replica_grad: str = "best"


def planned_headrooms(cell: Cell, cm: CostModel, reference: tuple[torch.Tensor, torch.Tensor],
                      rules: CellRules) -> dict[str, float]:
    """The headroom rule (DESIGN.md §5.4): each dropless system's planned peak load over the mean, from its own
    plans (every layer) of a reference iteration, placed from the iteration before it as at run time
    (``reference`` = (previous counts [L, N, E], counts [L, N, E])), with the most spare slots whose plans fit the
    memory model, times 1 + ``headroom_margin``. Keys "symi" (SYMI-dropless) and "lrmoe"; and "symi_spare", those
    most spare slots of SYMI-dropless's (the bound of :attr:`lrmoe.systems.SystemContext.symi_planned_spare`)."""
    prev_LNE, ref_LNE = reference
    m, c = cell.model, cell.cluster
    base = m.num_experts // c.num_ranks
    max_spare = base if rules.max_extra is None else rules.max_extra
    mm = cm.memory_model()
    out = {}
    for key, name in (("symi", "symi-dropless"), ("lrmoe", "lrmoe")):
        spec = get_system(name)

        def plans(spare: int, spec=spec) -> list:
            policy = spec.make_policy(SystemContext(m.num_experts, c.num_ranks, spare_slots=spare, eps=rules.eps,
                                                    gamma=rules.gamma))
            return [policy.plan(counts, prev.sum(0)) for prev, counts in zip(prev_LNE, ref_LNE)]

        spare, h = mm.spare_slots_for(plans, base, max_spare, load_margin=rules.headroom_margin)
        out[key] = h * (1.0 + rules.headroom_margin)
        if key == "symi":
            out["symi_spare"] = spare
    # LRMoE's own memory rule plans its balanced forward at ceil((1 + eps) x the mean) every iteration
    # (lrmoe.planner.policies.LRMoE), so that is its planned peak wherever its plans of the reference come out lower
    out["lrmoe"] = max(out["lrmoe"], 1.0 + rules.eps)
    return out


def system_context(cell: Cell, cm: CostModel, rules: CellRules,
                   headrooms: dict[str, float] | None = None) -> SystemContext:
    """What every system of a cell is built from: the memory model of the cost model's accounting (the whole
    budget over every MoE layer), at most ``max_extra`` spare slots (default E/N), LRMoE's eps and gamma, and the
    headroom each system's buffers are sized for: with the planned rule (the default) each dropless system's own
    planned peak (``headrooms``, :func:`planned_headrooms`); with ``fixed``, ``symi_headroom`` x the mean load for
    SYMI-dropless and LRMoE's own (1 + eps). SYMI-cf1 sizes for its capacity (1x; lrmoe.systems). With the planned
    rule SYMI-dropless also keeps no more spare slots than its own plans of the reference fit."""
    m, c = cell.model, cell.cluster
    base = m.num_experts // c.num_ranks
    planned = rules.headroom_rule == "planned" and headrooms is not None
    return SystemContext(num_experts=m.num_experts, num_ranks=c.num_ranks,
                         spare_slots=base if rules.max_extra is None else rules.max_extra, eps=rules.eps,
                         gamma=rules.gamma, memory=cm.memory_model(), pairs_per_rank=cell.tokens * m.top_k,
                         symi_headroom=headrooms["symi"] if planned else rules.symi_headroom,
                         lrmoe_headroom=headrooms["lrmoe"] if planned else None, ranks_per_node=c.ranks_per_node,
                         push_cost_rows=cm.push_cost_rows(),
                         symi_planned_spare=int(headrooms["symi_spare"]) if planned and "symi_spare" in headrooms
                         else None)


def build_systems(cell: Cell, names: list[str], rules: CellRules,
                  reference: tuple[torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[dict[str, System], dict[str, str], dict[str, str], dict[str, float]]:
    """The systems of one cell (each name's first plan twin only,
    :func:`lrmoe.sim.simulated_systems.plan_twins`), why those that cannot run there cannot, notes on those that run
    (e.g. SYMI left without a spare slot), and the planned headrooms."""
    m, c = cell.model, cell.cluster
    cm = CostModel(m, c, mem_budget_bytes=cell.layer_budget)
    base = m.num_experts // c.num_ranks
    if cell.layer_budget < base * cm.slot_bytes:
        why = (f"the {base} home slots ({base * cm.slot_bytes / 1e6:.0f} MB per layer) exceed the per-layer "
               f"budget ({cell.layer_budget / 1e6:.0f} MB)")
        return {}, {name: why for name in names}, {}, {}
    headrooms = {}
    if rules.headroom_rule == "planned" and reference is not None:
        headrooms = planned_headrooms(cell, cm, reference, rules)
    ctx = system_context(cell, cm, rules, headrooms or None)
    twins = plan_twins(names)
    specs = {name: get_system(name) for name in names if name not in twins}
    notes = {name: spec.note(ctx) for name, spec in specs.items()}
    systems = {name: simulator_system(spec, ctx) for name, spec in specs.items()}
    return systems, {}, {k: v for k, v in notes.items() if v}, headrooms


def charged_overheads(rules: CellRules) -> tuple[str, ...]:
    """The overheads charged: all of :data:`~lrmoe.sim.overheads.OVERHEADS` but ``rules.no_overheads``."""
    off = set(OVERHEADS) if "all" in rules.no_overheads else set(rules.no_overheads)
    return tuple(o for o in OVERHEADS if o not in off)


def cost_kwargs(name: str, cell: Cell, rules: CellRules) -> dict:
    """Keyword arguments of :class:`~lrmoe.sim.cost.CostModel` for system ``name`` in ``cell``: the cell's budget,
    the rules' overheads and replica-gradient mode, and what the system's registry entry sets
    (:func:`lrmoe.sim.simulated_systems.cost_options`)."""
    mode = "range" if rules.replica_grad == "best" else rules.replica_grad  # best: range priced, shard a variant
    return {"mem_budget_bytes": cell.layer_budget, "overheads": charged_overheads(rules), "replica_grad": mode,
            **cost_options(get_system(name))}
