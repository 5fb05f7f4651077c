"""The registry of systems: one set of names for every script, notebook, figure and results file.

A system is a placement policy (built by a factory from a :class:`SystemContext`, the facts a script knows:
experts, ranks, spare slots, memory, LRMoE's knobs) + the backward the real layer runs
(:class:`~lrmoe.runtime.exchange.BackwardConfig`: metric, selection mode, compaction, seed) + how it executes (the
recalibrated backward or the plain one, sharded optimizer state, replica-sync groups) + how figures show it
(label, colour). Adding a placement policy or a system is one entry in :data:`SYSTEMS`.

    ctx = SystemContext(num_experts=128, num_ranks=8, spare_slots=1)
    spec = get_system("symi-dropless")
    policy = spec.make_policy(ctx)              # a Policy (lrmoe.planner.plan): plan(counts_NE, prev_counts_E)
    backward = spec.layer_backward(seed=0)      # None: the plain backward (keep every pair) suffices
    system = simulator_system(spec, ctx)        # lrmoe.sim.simulated_systems: the simulator's System, as priced

Names are canonical. :data:`ALIASES` maps the names that older scripts and results files used (``ep-dropless``,
``lrmoe-m2``, ...) onto them: scripts accept and record the canonical name, figures rename old records on reading.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from lrmoe.recal.backward_config import BackwardConfig
from lrmoe.planner.online import Online
from lrmoe.planner.placement import MemoryModel
from lrmoe.planner.plan import PlacingPolicy, Policy
from lrmoe.planner.policies import LRMoE, Capacity, StaticEP, Symi, Trimmed


@dataclass(frozen=True)
class SystemContext:
    """What a script knows when it builds a system's policy; every script builds policies from one of these.

    num_experts, num_ranks  E and N; every system keeps the static E/N home slots per rank, so N must divide E.
    spare_slots     replica slots per rank beyond the E/N home slots: SYMI's extra slots, and LRMoE's most.
    eps, gamma      LRMoE's balance slack and per-expert floor (:class:`~lrmoe.planner.policies.LRMoE`).
    memory          the per-rank budget of one MoE layer: LRMoE sizes its replica slots and its memory cap from it
                    (None: ``spare_slots`` as given, no memory cap).
    pairs_per_rank  the mean routed pairs per rank (tokens · k): the load memory-sized slot counts and the tight
                    LRMoE variant are derived from.
    symi_headroom   None: SYMI uses every spare slot (its memory is not modelled). A number: SYMI keeps the spare
                    slots that fit ``memory`` beside token buffers for that many times the mean load (SYMI-cf1:
                    1.0, its capacity bound), as the simulator's fair-memory comparison does.
    lrmoe_headroom  None: LRMoE's spare slots are ``spare_slots`` (its own memory rule may use fewer). A number:
                    at most the spare slots that fit ``memory`` beside buffers for that many times the mean load.
                    With ``symi_headroom``, the one headroom rule of DESIGN.md §5.4: each system's own planned
                    peak load (:meth:`~lrmoe.planner.placement.MemoryModel.spare_slots_for`), never a constant per
                    system.
    symi_planned_spare  the headroom rule's own answer for SYMI-dropless: the most spare slots with which its plans
                    of the reference iteration fit (:meth:`~lrmoe.planner.placement.MemoryModel.spare_slots_for`).
                    SYMI sized from ``symi_headroom`` takes at most these: the scalar headroom, re-applied to every
                    layer alike, can grant a slot that the plans themselves did not fit (None: no such bound).
    ranks_per_node  consecutive ranks that share a node (None: one node): online replication pushes weights only
                    inside a node.
    push_cost_rows  one weight push's cost in pairs of the busiest rank's work (the cost model's
                    :meth:`~lrmoe.sim.cost.CostModel.push_cost_rows`): cost-aware online replication pushes a copy
                    only when it saves more (None: not priced; only the greedy ``online-greedy`` entries build).
    """

    num_experts: int
    num_ranks: int
    spare_slots: int = 1
    eps: float = 0.1
    gamma: float = 0.1
    memory: MemoryModel | None = None
    pairs_per_rank: float | None = None
    symi_headroom: float | None = None
    ranks_per_node: int | None = None
    lrmoe_headroom: float | None = None
    push_cost_rows: float | None = None
    symi_planned_spare: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_experts", "num_ranks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SystemContext.{name} must be a positive int, got {value!r}")
        if self.num_experts % self.num_ranks:
            raise ValueError(f"{self.num_experts} experts are not divisible by {self.num_ranks} ranks: every system "
                             f"keeps E/N home slots per rank, so the number of ranks must divide the experts")
        if isinstance(self.spare_slots, bool) or not isinstance(self.spare_slots, int) or self.spare_slots < 0:
            raise ValueError(f"SystemContext.spare_slots must be a non-negative int, got {self.spare_slots!r}")
        if self.pairs_per_rank is not None and not self.pairs_per_rank >= 0:
            raise ValueError(f"SystemContext.pairs_per_rank must be non-negative, got {self.pairs_per_rank!r}")
        if self.ranks_per_node is not None and (isinstance(self.ranks_per_node, bool)
                                                or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1
                                                or self.num_ranks % self.ranks_per_node):
            raise ValueError(f"SystemContext.ranks_per_node must be a positive int dividing num_ranks="
                             f"{self.num_ranks}, got {self.ranks_per_node!r}")
        if self.symi_planned_spare is not None and (isinstance(self.symi_planned_spare, bool) or not isinstance(
                self.symi_planned_spare, int) or self.symi_planned_spare < 0):
            raise ValueError(f"SystemContext.symi_planned_spare must be a non-negative int, got "
                             f"{self.symi_planned_spare!r}")
        if self.push_cost_rows is not None and not self.push_cost_rows >= 0:
            raise ValueError(f"SystemContext.push_cost_rows must be non-negative, got {self.push_cost_rows!r}")
        if self.lrmoe_headroom is not None and not (self.lrmoe_headroom > 0 and self.memory is not None
                                                    and self.pairs_per_rank is not None):
            raise ValueError(f"SystemContext.lrmoe_headroom={self.lrmoe_headroom!r} must be positive, with memory "
                             f"and pairs_per_rank")
        if self.symi_headroom is not None:
            if not self.symi_headroom > 0:
                raise ValueError(f"SystemContext.symi_headroom must be positive, got {self.symi_headroom!r}")
            if self.memory is None or self.pairs_per_rank is None:
                raise ValueError("SystemContext.symi_headroom sizes SYMI's slots from memory: it needs memory and "
                                 "pairs_per_rank")

    @property
    def base_slots(self) -> int:
        """The E/N home slots per rank."""
        return self.num_experts // self.num_ranks


# -- policy factories: small frozen objects, so that two entries with equal factories make equal plans ------------
@dataclass(frozen=True)
class StaticEPFactory:
    family = "static-ep"
    planner = "static-ep"

    def __call__(self, ctx: SystemContext) -> StaticEP:
        return StaticEP()


@dataclass(frozen=True)
class CapacityFactory:
    cf: float = 1.0
    drop_by: str = "position"
    family = "capacity"
    planner = "capacity"

    def __call__(self, ctx: SystemContext) -> Capacity:
        return Capacity(cf=self.cf, drop_by=self.drop_by)


def lrmoe_headroom(ctx: SystemContext) -> float:
    """The buffer headroom LRMoE plans for: the context's (its planned peak load), else (1 + eps) x the mean."""
    return ctx.lrmoe_headroom if ctx.lrmoe_headroom is not None else 1.0 + ctx.eps


def spare_at(ctx: SystemContext, headroom: float) -> int | None:
    """The spare slots that fit ``ctx.memory`` beside buffers for ``headroom`` x the mean load (at most the
    context's spare slots); None when not even the home slots fit."""
    try:
        return ctx.memory.extra_slots(headroom * ctx.pairs_per_rank, ctx.base_slots, ctx.spare_slots,
                                      ctx.pairs_per_rank)
    except ValueError:
        return None


@dataclass(frozen=True)
class SymiFactory:
    """SYMI with E/N + spare slots per rank, or, when the context sizes SYMI from memory (``symi_headroom``), the
    spare slots that fit beside buffers for ``headroom`` x the mean load (None: the context's headroom; a
    function of the context: e.g. :func:`lrmoe_headroom`). ``cf`` None: dropless."""

    cf: float | None = None
    headroom: float | Callable[[SystemContext], float] | None = None
    family = "symi"

    @property
    def planner(self) -> str:
        return "symi-dropless" if self.cf is None else "symi-cf"

    def _fit(self, ctx: SystemContext) -> tuple[int, str]:
        if ctx.symi_headroom is None:
            return ctx.base_slots + ctx.spare_slots, ""
        h = ctx.symi_headroom if self.headroom is None else self.headroom
        h = h(ctx) if callable(h) else h
        spare = spare_at(ctx, h)
        if spare is None:  # not even the home slots beside those buffers: no spare slot, and say so
            return ctx.base_slots, f"buffers for {h:g}x the mean load do not fit beside the home slots: no spare slot"
        if self.headroom is None and ctx.symi_planned_spare is not None:  # never more than its own plans fit
            spare = min(spare, ctx.symi_planned_spare)
        return ctx.base_slots + spare, ""

    def slots(self, ctx: SystemContext) -> int:
        """SYMI's slots per rank in this context."""
        return self._fit(ctx)[0]

    def note(self, ctx: SystemContext) -> str:
        return self._fit(ctx)[1]

    def __call__(self, ctx: SystemContext) -> Symi:
        return Symi(slots_per_rank=self.slots(ctx), cf=self.cf)


@dataclass(frozen=True)
class TrimmedFactory:
    """Another system's policy with its backward trimmed to LRMoE's ``budget`` at ``rho``
    (:class:`~lrmoe.planner.policies.Trimmed`): the "less work, not the right work" control."""

    base: Callable[[SystemContext], PlacingPolicy]
    rho: float
    gamma: float | None = 0.0  # the per-expert floor; None: the context's (LRMoE's own floor)

    quota_stage = True  # the trim is LRMoE's quota stage on top of the base's plan

    @property
    def family(self) -> str:
        return self.base.family

    @property
    def planner(self) -> str:
        return self.base.planner

    def note(self, ctx: SystemContext) -> str:
        note = getattr(self.base, "note", None)
        return note(ctx) if note is not None else ""

    def __call__(self, ctx: SystemContext) -> Trimmed:
        return Trimmed(self.base(ctx), self.rho, ctx.gamma if self.gamma is None else self.gamma)


@dataclass(frozen=True)
class OnlineFactory:
    """Online replication (:class:`~lrmoe.planner.online.Online`) with the spare slots SYMI-dropless gets in this
    context (``fit``: the same memory rule, so both replicate into the same memory), pushing inside the context's
    nodes, a copy only where it saves more than its push costs (the context's ``push_cost_rows``); ``greedy``: any
    copy that relieves the busiest rank at all (the ablation)."""

    fit: SymiFactory = SymiFactory()
    greedy: bool = False
    family = "online"
    planner = "lrmoe"  # ours, a proxy: its greedy placement + LRMoE's balanced forward, timed as LRMoE's planner

    def push_cost_rows(self, ctx: SystemContext) -> float:
        if self.greedy:
            return 0.0
        if ctx.push_cost_rows is None:
            raise ValueError("cost-aware online replication needs SystemContext.push_cost_rows (the cost model's "
                             "CostModel.push_cost_rows(), or a script's --push-cost-rows); the greedy rule is "
                             "'online-greedy'")
        return ctx.push_cost_rows

    def spare_slots(self, ctx: SystemContext) -> int:
        return self.fit.slots(ctx) - ctx.base_slots

    def note(self, ctx: SystemContext) -> str:
        return self.fit.note(ctx)

    def __call__(self, ctx: SystemContext) -> Online:
        return Online(spare_slots=self.spare_slots(ctx), ranks_per_node=ctx.ranks_per_node,
                      push_cost_rows=self.push_cost_rows(ctx))


@dataclass(frozen=True)
class SpareSlotsOf:
    """A context-derived option: the spare slots another system's factory gets (LRMoE given SYMI's slots)."""

    factory: SymiFactory

    def __call__(self, ctx: SystemContext) -> int:
        return self.factory.slots(ctx) - ctx.base_slots

    def note(self, ctx: SystemContext) -> str:
        return self.factory.note(ctx)


def tight_cap(ctx: SystemContext) -> int:
    """A memory cap of 90 % of the mean load: the backward routing and the quotas do work on every rank."""
    if ctx.pairs_per_rank is None:
        raise ValueError("the tight LRMoE variant needs SystemContext.pairs_per_rank")
    return int(0.9 * ctx.pairs_per_rank)


@dataclass(frozen=True)
class LRMoEFactory:
    """:class:`~lrmoe.planner.policies.LRMoE` with the context's eps, gamma, spare slots and memory, overridden by
    ``options`` (keyword arguments of LRMoE; a callable value is a function of the context)."""

    options: tuple[tuple[str, object], ...] = ()
    family = "lrmoe"
    planner = "lrmoe"

    def kwargs(self, ctx: SystemContext) -> dict:
        kw = {"eps": ctx.eps, "gamma": ctx.gamma, "extra_slots": ctx.spare_slots, "memory": ctx.memory}
        for key, value in self.options:
            kw[key] = value(ctx) if callable(value) else value
        options = dict(self.options)
        if ctx.lrmoe_headroom is not None and "extra_slots" not in options:
            # the headroom rule: at most the slots its planned peak leaves, in its own memory model
            own = ctx if kw["memory"] is None else replace(ctx, memory=kw["memory"])
            kw["extra_slots"] = spare_at(own, ctx.lrmoe_headroom) or 0
        return kw

    def note(self, ctx: SystemContext) -> str:
        return "; ".join(n for _, v in self.options if hasattr(v, "note") and (n := v.note(ctx)))

    def __call__(self, ctx: SystemContext) -> LRMoE:
        return LRMoE(**self.kwargs(ctx))


@dataclass(frozen=True)
class EarlyMemory:
    """A context-derived option: the context's memory model with early selection at ``rho`` (the forward saves
    activations only for the pairs the backward keeps), so LRMoE's placement may hold more replicas."""

    rho: float

    def __call__(self, ctx: SystemContext) -> MemoryModel | None:
        return None if ctx.memory is None else replace(ctx.memory, early_rho=self.rho)


def lrmoe(**options) -> LRMoEFactory:
    """LRMoE's factory with these keyword arguments over the context's (e.g. ``quotas=False``)."""
    return LRMoEFactory(tuple(sorted(options.items())))


# -- the spec ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SystemSpec:
    """One named system.

    make             the policy factory: ``make(ctx)`` returns a fresh policy.
    backward         the backward the real layer runs (its seed is replaced per layer by :meth:`layer_backward`).
    recalibrated     its plans may keep fewer pairs for the backward or move them between replicas, so the layer
                     needs the hand-written backward (False: the plain backward runs its plans).
    sharded_optimizer  the simulator's optimizer model: SYMI's statically sharded state (True) or each expert's
                     state with its one host (static EP, capacity). The real layer shards every system's state.
    sync_groups      the simulator's replica-sync groups ("range": the layer's consecutive-range groups).
    label            its name in words (figures, tables, the simulator's description); its colour in figures is
                     lrmoe.paper_figures.style's.
    """

    name: str
    make: Callable[[SystemContext], Policy]
    label: str
    backward: BackwardConfig = field(default_factory=BackwardConfig)
    recalibrated: bool = False
    sharded_optimizer: bool = True
    sync_groups: str = "range"
    description: str = ""

    @property
    def family(self) -> str:
        """"static-ep", "capacity", "symi", "lrmoe" or "online": the policy family of the factory."""
        return self.make.family

    def make_policy(self, ctx: SystemContext) -> Policy:
        return self.make(ctx)

    def layer_backward(self, seed: int | None = None, always: bool = False) -> BackwardConfig | None:
        """The layer's ``backward=`` argument: the backward config (with ``seed``), or None where the plain backward
        suffices, unless ``always`` (benchmarks run every system through the hand-written backward)."""
        if not (self.recalibrated or always):
            return None
        return self.backward if seed is None else replace(self.backward, seed=seed)

    def note(self, ctx: SystemContext) -> str:
        """What the context changed about this system (e.g. SYMI left without a spare slot); "" if nothing."""
        note = getattr(self.make, "note", None)
        return note(ctx) if note is not None else ""

    @property
    def planner(self) -> str:
        """The planner benchmark whose time this system's plans cost (a policy of experiments/bench_planner.py,
        :data:`lrmoe.sim.overheads.PLANNER_MS`): declared by the factory (``planner``)."""
        return self.make.planner

    @property
    def quota_stage(self) -> bool:
        """Its plans add LRMoE's quota stage on top of its planner (a trimmed plan)."""
        return bool(getattr(self.make, "quota_stage", False))


def _system(name: str, make, label: str, **kw) -> tuple[str, SystemSpec]:
    return name, SystemSpec(name, make, label, **kw)


def _lrmoe(name: str, label: str, make: LRMoEFactory | None = None, metric: str = "m2",
           mode: str = "topk", compact: bool = True, early: bool = False, **kw) -> tuple[str, SystemSpec]:
    """An LRMoE entry: the hand-written backward with this metric, selection mode, compaction and early
    selection."""
    return _system(name, make or lrmoe(), label,
                   backward=BackwardConfig(metric=metric, mode=mode, compact=compact, early=early), recalibrated=True,
                   **kw)


RHOS = (0.9, 0.75, 0.6, 0.5)  # the retention budgets of the registry, fixed in advance (never tuned per cell)
_UNSHARDED = {"sharded_optimizer": False}  # static placements: each expert's optimizer state on its one host

SYSTEMS: dict[str, SystemSpec] = dict([
    # -- baselines ---------------------------------------------------------------------------------------------
    _system("static-ep", StaticEPFactory(), "static EP (dropless)", **_UNSHARDED),
    _system("capacity-cf1", CapacityFactory(1.0), "capacity cf 1.0", **_UNSHARDED),
    _system("capacity-cf1.25", CapacityFactory(1.25), "capacity cf 1.25", **_UNSHARDED),
    _system("capacity-cf1-gate", CapacityFactory(1.0, "gate"), "capacity cf 1.0, lowest gates dropped", **_UNSHARDED),
    # -- SYMI (DESIGN.md §3) -----------------------------------------------------------------------------------
    _system("symi-cf1", SymiFactory(cf=1.0, headroom=1.0), "SYMI-cf1"),
    _system("symi-cf1.25", SymiFactory(cf=1.25, headroom=1.25), "SYMI-cf1.25"),
    _system("symi-dropless", SymiFactory(), "SYMI-dropless"),
    _system("symi-dropless-lrmoe-slots", SymiFactory(headroom=lrmoe_headroom), "SYMI-dropless, LRMoE's slots",
            description="SYMI given the slots LRMoE's memory rule finds at the mean load"),
    # SYMI-dropless with its backward trimmed at random to the same budget as LRMoE's at each rho (the control)
    *[_system(f"symi-dropless-rho{rho:g}", TrimmedFactory(SymiFactory(), rho), f"SYMI-dropless, random trim ρ={rho:g}",
              backward=BackwardConfig(metric="random"), recalibrated=True) for rho in RHOS],
    # the same trim drawn with equal inclusion probabilities and kept pairs scaled by 1/p (Horvitz-Thompson): the
    # reweighted control, which separates "the metric" from "the 1/p reweighting" (docs/protocols/frontier.md §10)
    *[_system(f"symi-dropless-rho{rho:g}-unbiased", TrimmedFactory(SymiFactory(), rho),
              f"SYMI-dropless, random trim ρ={rho:g}, 1/p",
              backward=BackwardConfig(metric="random", mode="unbiased"), recalibrated=True) for rho in RHOS],
    # -- online replication (lrmoe.planner.online; the MoonEP / Megatron-Core virtual-expert way): this forward's
    # hottest experts copied into SYMI-dropless's spare slots inside a node, each copy only where it saves more
    # time than its push costs; optimizer state stays with the home experts. "-greedy": every copy that relieves
    # the busiest rank at all (the first rule, an ablation). "-rho0.75": LRMoE's retention budget (m2, top-k,
    # LRMoE's floor) on top.
    _system("online", OnlineFactory(), "online replication", **_UNSHARDED),
    _system("online-rho0.75", TrimmedFactory(OnlineFactory(), 0.75, gamma=None), "online + LRMoE budget ρ=0.75",
            backward=BackwardConfig(metric="m2"), recalibrated=True, **_UNSHARDED),
    _system("online-greedy", OnlineFactory(greedy=True), "online replication, greedy", **_UNSHARDED),
    _system("online-greedy-rho0.75", TrimmedFactory(OnlineFactory(greedy=True), 0.75, gamma=None),
            "online greedy + LRMoE budget ρ=0.75", backward=BackwardConfig(metric="m2"),
            recalibrated=True, **_UNSHARDED),
    # -- LRMoE (DESIGN.md §4): "lrmoe" is the cap-mode configuration (eps), m2 metric, top-k, compacted -------
    _lrmoe("lrmoe", "LRMoE"),
    _lrmoe("lrmoe-m1", "LRMoE, m1 metric", metric="m1"),
    _lrmoe("lrmoe-m3", "LRMoE, m3 metric", metric="m3"),
    _lrmoe("lrmoe-gate", "LRMoE, gate-only metric", metric="gate"),
    _lrmoe("lrmoe-random", "LRMoE, random selection", metric="random"),
    _lrmoe("lrmoe-m2-unbiased", "LRMoE, m2 unbiased", mode="unbiased"),
    _lrmoe("lrmoe-m1-unbiased", "LRMoE, m1 unbiased", metric="m1", mode="unbiased"),
    # LRMoE minus one component each
    _lrmoe("lrmoe-padded", "LRMoE, padded packets", compact=False),
    _lrmoe("lrmoe-no-quotas", "LRMoE, no quotas", lrmoe(quotas=False)),
    _lrmoe("lrmoe-no-bwd-routing", "LRMoE, no backward routing", lrmoe(backward_routing=False)),
    # the balanced forward already spreads pairs over replicas; with an even split the backward routing has work
    _lrmoe("lrmoe-even-fwd", "LRMoE, even forward split", lrmoe(forward="even")),
    _lrmoe("lrmoe-even-fwd-no-bwd-routing", "LRMoE, even forward, no backward routing",
           lrmoe(forward="even", backward_routing=False)),
    _lrmoe("lrmoe-no-memplace", "LRMoE, SYMI-dropless's slots",
           lrmoe(memory=None, extra_slots=SpareSlotsOf(SymiFactory())),
           description="no memory-aware placement: SYMI-dropless's slot count, no memory cap"),
    _lrmoe("lrmoe-no-placement", "LRMoE, no replica slots", lrmoe(memory=None, extra_slots=0)),
    _lrmoe("lrmoe-host-groups", "LRMoE, host-only sync groups", sync_groups="hosts",
           description="replica sync in groups of the hosting ranks only (simulated; the layer uses ranges)"),
    _lrmoe("lrmoe-tight", "LRMoE, tight memory", lrmoe(eps=0.0, mem_cap_pairs_N=tight_cap),
           description="no balance slack and a memory cap of 90 % of the mean load (planner benchmark)"),
    # The demand-side retention budget (DESIGN.md §4 step 3): every rank keeps min(L_n, ceil(rho·mean)) backward
    # pairs; rho is fixed in advance, one entry each, with m2 top-k, m2 unbiased and random selection.
    *[entry for rho in RHOS for entry in (
        _lrmoe(f"lrmoe-rho{rho:g}", f"LRMoE ρ={rho:g}", lrmoe(quota_mode="budget", rho=rho)),
        _lrmoe(f"lrmoe-rho{rho:g}-unbiased", f"LRMoE ρ={rho:g}, m2 unbiased",
               lrmoe(quota_mode="budget", rho=rho), mode="unbiased"),
        _lrmoe(f"lrmoe-rho{rho:g}-random", f"LRMoE ρ={rho:g}, random",
               lrmoe(quota_mode="budget", rho=rho), metric="random"),
        # uniform inclusion at the quota, kept pairs scaled by 1/p: the control of m2 unbiased
        # (docs/protocols/frontier.md §10)
        _lrmoe(f"lrmoe-rho{rho:g}-random-unbiased", f"LRMoE ρ={rho:g}, random, 1/p",
               lrmoe(quota_mode="budget", rho=rho), metric="random", mode="unbiased"))],
    # Early selection (DESIGN.md §4): the gate chooses in the forward, which saves activations for the kept pairs
    # alone; the memory model counts the saving, so memory-aware placement may hold more replicas (top-k and
    # unbiased).
    *[entry for rho in (0.75, 0.5) for entry in (
        _lrmoe(f"lrmoe-rho{rho:g}-early", f"LRMoE ρ={rho:g}, early selection (gate)",
               lrmoe(quota_mode="budget", rho=rho, memory=EarlyMemory(rho)), metric="gate", early=True),
        _lrmoe(f"lrmoe-rho{rho:g}-early-unbiased", f"LRMoE ρ={rho:g}, early selection (gate), unbiased",
               lrmoe(quota_mode="budget", rho=rho, memory=EarlyMemory(rho)), metric="gate", mode="unbiased",
               early=True))],
])

# Names older scripts and results files used, and the system each one is.
ALIASES: dict[str, str] = {
    "ep-dropless": "static-ep",
    "capacity-cf1.0": "capacity-cf1",
    "lrmoe-m2": "lrmoe",
    "lrmoe-metric-random": "lrmoe-random",
    "lrmoe-metric-gate": "lrmoe-gate",
    "lrmoe-unbiased": "lrmoe-m2-unbiased",
}


def _known() -> str:
    return f"known: {', '.join(SYSTEMS)} (older names: {', '.join(f'{a} = {b}' for a, b in ALIASES.items())})"


def canonical(name: str, strict: bool = True) -> str:
    """The registry name of ``name`` (itself, or what an older name stands for). Unknown names raise ValueError
    listing the known ones, or come back unchanged with ``strict=False`` (records of names outside the registry)."""
    if name in SYSTEMS:
        return name
    if name in ALIASES:
        return ALIASES[name]
    if strict:
        raise ValueError(f"unknown system {name!r}; {_known()}")
    return name


def get_system(name: str) -> SystemSpec:
    """The system called ``name`` (or an older name of it); ValueError listing the known names otherwise."""
    return SYSTEMS[canonical(name)]


def system_arg(value: str) -> str:
    """argparse ``type=`` of a system name: the canonical name, or an argparse error listing the known ones."""
    try:
        return canonical(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def system_names_help() -> str:
    return "systems of lrmoe.systems: " + ", ".join(SYSTEMS)


def check_systems(names: Iterable[str], ctx: SystemContext) -> None:
    """Build every named system's policy once in ``ctx``: raises ValueError naming the system that cannot be built
    (a script's argument check, before any rank starts)."""
    for name in names:
        try:
            get_system(name).make_policy(ctx)
        except ValueError as exc:
            raise ValueError(f"system {name!r}: {exc}") from None
