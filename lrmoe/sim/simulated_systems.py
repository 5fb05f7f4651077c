"""The registry's systems (:mod:`lrmoe.systems`) as the simulator runs and prices them.

Everything the cost model needs to know about a system comes from its registry entry, never from its name: the
planner benchmark its factory declares (``spec.planner``, plus LRMoE's quota stage for a trimmed plan), the metric
and selection mode of its backward (what scoring and selection cost, and the metric's extra combine columns), its
compaction, optimizer sharding, replica-sync groups and capacity buffers. A new registry entry is simulated and
priced with no edit here.

    spec = get_system("lrmoe-rho0.75-unbiased")
    system = simulator_system(spec, ctx)     # lrmoe.sim.simulator.System, with spec's cost options
    twins = plan_twins(names)                # entries that run the same work: simulated once
"""

from __future__ import annotations

from collections.abc import Iterable

from lrmoe.sim.simulator import System
from lrmoe.systems import SystemContext, SystemSpec, get_system


def cost_options(spec: SystemSpec) -> dict:
    """Keyword arguments of :class:`~lrmoe.sim.cost.CostModel` that the system's entry sets: its planner benchmark
    (and whether its plans add LRMoE's quota stage), the metric and mode its backward selects with (scoring and
    selection prices, the metric's combine columns), its replica-sync groups and its fixed-size capacity buffers."""
    cf = getattr(spec.make, "cf", None)  # fixed-size capacity buffers (SYMI-cf1, capacity systems)
    return {"planner": spec.planner, "quota_stage": spec.quota_stage, "metric": spec.backward.metric,
            "mode": spec.backward.mode, "sync_groups": spec.sync_groups,
            **({"capacity_cf": cf} if cf is not None else {}),
            **({"early_selection": True} if spec.backward.early else {})}


def simulator_system(spec: SystemSpec, ctx: SystemContext) -> System:
    """``spec`` for :func:`lrmoe.sim.simulator.simulate` in context ``ctx``, priced as its entry says."""
    return System(spec.name, lambda: spec.make(ctx), compaction=spec.backward.compact,
                  sharded_optimizer=spec.sharded_optimizer, description=spec.label, costs=cost_options(spec))


def work_key(spec: SystemSpec) -> tuple:
    """Equal for two systems that make the same plans and run the same work on them (so the same simulated time):
    the same factory, compaction, optimizer sharding and sync groups, and, for a system whose plans select, the
    same metric and selection mode (they are priced apart: :mod:`lrmoe.sim.overheads`)."""
    selection = (spec.backward.metric, spec.backward.mode, spec.backward.early) if spec.recalibrated else None
    return spec.make, spec.backward.compact, spec.sharded_optimizer, spec.sync_groups, selection


def plan_twins(names: Iterable[str]) -> dict[str, str]:
    """{name: an earlier name of ``names`` that runs the same work (:func:`work_key`)}: the simulator runs the
    first of each group only. No two systems share a simulated time unless they run the same work."""
    first: dict[tuple, str] = {}
    twins = {}
    for name in names:
        key = work_key(get_system(name))
        if key in first:
            twins[name] = first[key]
        else:
            first[key] = name
    return twins
