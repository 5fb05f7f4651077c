"""What the simulator charges for planning (lrmoe.sim.overheads ``planning``): the critical path of a plan on the
critical path, the placement only where the layers' placements do not fit under the iteration."""

import pytest
import torch

import lrmoe.sim.overheads as overheads
from lrmoe.config import cluster_preset, model_preset
from lrmoe.sim.simulator import simulate
from lrmoe.sim.simulated_systems import simulator_system
from lrmoe.systems import SystemContext, get_system
from lrmoe.traces.synthetic import generate_trace

MODEL, CLUSTER = model_preset("qwen3-30b-a3b"), cluster_preset("h200x8")


def test_the_critical_path_is_a_share_of_the_whole_plan_and_the_placement_the_rest():
    for planner in overheads.PLANNER_MS:
        for n, e in [(8, 128), (16, 128), (64, 256), (256, 256), (64, 384), (512, 512)]:
            whole = overheads._whole_plan_ms(planner, n, e) * 1e-3
            critical = overheads.planner_seconds(planner, False, n, e)
            placement = overheads.placement_seconds(planner, n, e)
            # the two parts of a plan: its critical path and two placements (this iteration's, the next one's)
            assert 0 < critical < whole and 0 < placement < whole / 2, (planner, n, e)
    assert overheads.planner_seconds("lrmoe", True, 16, 128) > overheads.planner_seconds("lrmoe", False, 16, 128)
    assert overheads.placement_seconds(None, 16, 128) == 0.0
    with pytest.raises(ValueError, match="no planner benchmark"):
        overheads.placement_seconds("mystery", 16, 128)


def _sim(name: str):
    counts = generate_trace(3, 2, CLUSTER.num_ranks, MODEL.num_experts, MODEL.top_k, 512, seed=1).counts_ILNE
    ctx = SystemContext(MODEL.num_experts, CLUSTER.num_ranks, spare_slots=1)
    return simulate(counts, simulator_system(get_system(name), ctx), MODEL, CLUSTER)


def test_placements_that_fit_under_the_iteration_cost_nothing_and_the_excess_is_charged(monkeypatch):
    base = _sim("symi-dropless")
    assert base.placement_s > 0 and bool((base.placement_headroom_s > 0).all())  # it fits: nothing added
    monkeypatch.setattr(overheads, "PLACEMENT_SHARE", {k: {8: 0.0} for k in overheads.PLACEMENT_SHARE})
    free = _sim("symi-dropless")
    assert torch.equal(free.phase_ILH, base.phase_ILH)
    # placements as slow as 10 iterations: the excess over each iteration's time lands in its plan phase
    slow = base.iteration_s.max().item() * 10 / (2 * overheads._whole_plan_ms("symi-dropless", 8, 128) * 1e-3)
    monkeypatch.setattr(overheads, "PLACEMENT_SHARE", {k: {8: slow} for k in overheads.PLACEMENT_SHARE})
    late = _sim("symi-dropless")
    torch.testing.assert_close(late.iteration_s, torch.full_like(base.iteration_s, 2 * late.placement_s))
    assert bool((late.placement_headroom_s <= 1e-12).all())
