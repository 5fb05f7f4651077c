"""Paper-scale simulator: the planner code of the real layer run over routing traces, each plan costed on a
cluster preset.

* :mod:`~lrmoe.sim.cost`: the cost model: a plan's counted work (rows, bytes, memory) priced per phase and rank;
* :mod:`~lrmoe.sim.overheads`: the overheads on the critical path (planning, counts, scoring and selection per
  metric and mode, compaction, capacity buffers), each with the benchmark it comes from;
* :mod:`~lrmoe.sim.simulator`: :func:`~lrmoe.sim.simulator.simulate`: every (iteration, layer) of a trace, fresh
  policies per layer, as the layer runs them;
* :mod:`~lrmoe.sim.simulated_systems`: the registry's systems (:mod:`lrmoe.systems`) as the simulator runs and
  prices them;
* :mod:`~lrmoe.sim.cells`: a sweep's cells and the rules every system of a cell is built by (the ablation's and
  the frontier's);
* :mod:`~lrmoe.sim.ablation`: the ablation's sweep (experiments/ablate.py): every (cell, system) simulated, one
  record each, with the sensitivity band;
* :mod:`~lrmoe.sim.memory_sweep`: the memory-pressure sweep's budgets, where memory binds, which placement wins.

Shape letters (DESIGN.md §8 has the full glossary): I iterations, L layers, N ranks, S slots per rank, G = N·S
global slots, E experts, H phases of the cost model.
"""

from lrmoe.sim.cost import CATEGORIES, PHASES, CostModel, GemmCurve, PhaseTimes, cpu_gloo_preset, gemm_preset
from lrmoe.sim.simulator import SimResult, System, iter_plans, simulate

__all__ = ["CATEGORIES", "PHASES", "CostModel", "GemmCurve", "PhaseTimes", "SimResult", "System", "cpu_gloo_preset",
           "gemm_preset", "iter_plans", "simulate"]
