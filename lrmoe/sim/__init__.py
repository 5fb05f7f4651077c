"""Paper-scale simulator: the planner code of the real layer run over routing traces, each plan costed on a
cluster preset (:mod:`lrmoe.sim.cost`, :mod:`lrmoe.sim.simulator`)."""

from lrmoe.sim.cost import CATEGORIES, PHASES, CostModel, GemmCurve, PhaseTimes, cpu_gloo_preset, gemm_preset
from lrmoe.sim.simulator import SimResult, System, iter_plans, simulate

__all__ = ["CATEGORIES", "PHASES", "CostModel", "GemmCurve", "PhaseTimes", "SimResult", "System", "cpu_gloo_preset",
           "gemm_preset", "iter_plans", "simulate"]
