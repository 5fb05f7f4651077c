"""The memory-pressure sweep's logic (lrmoe.sim.memory_sweep): the budget grid starts where the home slots just fit
and steps one slot's worth at a time; the binding range, each system's out-of-memory line and the placement table
read hand-made records right."""

import pytest
import torch

from lrmoe.config import cluster_preset, model_preset
from lrmoe.sim.cost import CostModel
from lrmoe.sim.memory_sweep import binding_range, budget_grid, fit_gb, placement_table, slot_gb


@pytest.mark.parametrize("model, tokens", [("qwen3-30b-a3b", 4096), ("glm-4.5-air", 1024)])
def test_grid_starts_where_the_home_slots_fit_and_steps_a_slot_at_a_time(model, tokens):
    m, c = model_preset(model), cluster_preset("a100-40gb-x8").with_nodes(2)
    grid = budget_grid(m, c, tokens, max_gb=80.0)
    assert grid == sorted(grid) and grid[-1] == 80.0 and len(set(grid)) == len(grid)
    mm = CostModel(m, c, mem_budget_bytes=grid[0] * 1e9 / m.num_moe_layers).memory_model()
    pairs = tokens * m.top_k
    assert mm.fits(8, pairs, pairs)  # the home slots and the mean load's buffers fit at the first budget ...
    assert not mm.fits(9, pairs, pairs)  # ... and not one slot more
    below = CostModel(m, c, mem_budget_bytes=(grid[0] - 0.02) * 1e9 / m.num_moe_layers).memory_model()
    assert not below.fits(8, pairs, pairs)
    steps = torch.diff(torch.tensor(grid[:5]))
    assert torch.allclose(steps, torch.full_like(steps, slot_gb(m, c)), atol=0.011)  # one slot per step
    assert fit_gb(m, c, tokens, 8, 2.0) < 80.0 <= grid[-1]
    with pytest.raises(ValueError, match="max_gb"):
        budget_grid(m, c, tokens, max_gb=grid[0] - 1)


def _rec(system, gb, slots, t, fits=True, skew="zipf:0.8"):
    return {"model": "m", "ranks": 16, "skew_label": skew, "system": system, "mem_gb": gb, "slots_per_rank": slots,
            "iter_s": t, "fits": fits}


RECORDS = [
    _rec("symi-dropless", 30, 8, 9.0, fits=False), _rec("symi-dropless", 32, 10, 5.0),
    _rec("symi-dropless", 40, 16, 4.0),
    _rec("lrmoe", 30, 9, 6.0), _rec("lrmoe", 32, 12, 4.5), _rec("lrmoe", 40, 16, 4.2),
    _rec("lrmoe-rho0.75", 30, 9, 5.0), _rec("lrmoe-rho0.75", 32, 12, 4.0), _rec("lrmoe-rho0.75", 40, 16, 3.9),
    _rec("online", 30, 8, 7.0, fits=False), _rec("online", 32, 9, 4.8), _rec("online", 40, 9, 3.0),
    {"cell": 0, "cell_done": True, "mem_gb": 30},  # bookkeeping records are ignored
]


def test_binding_range_and_out_of_memory_lines():
    (row,) = binding_range(RECORDS)
    assert (row["binds_from_gb"], row["binds_to_gb"], row["budgets"]) == (30.0, 32.0, 3)
    assert row["symi-dropless:fits_from_gb"] == 32.0 and row["lrmoe:fits_from_gb"] == 30.0
    assert row["online:fits_from_gb"] == 32.0 and row["online:most_slots_from_gb"] == 32.0
    assert row["lrmoe:most_slots_from_gb"] == 40.0


def test_placement_table_side_by_side():
    rows = {r["mem_gb"]: r for r in placement_table(RECORDS)}
    assert rows[30.0]["LRMoE"] is None and rows[30.0]["LRMoE s"] == 6.0  # SYMI-dropless does not fit: seconds
    assert rows[30.0]["online s"] is None and rows[30.0]["fastest"] == "LRMoE + ρ"
    assert rows[32.0]["LRMoE + ρ"] == pytest.approx(0.8) and rows[32.0]["SYMI"] == 1.0
    assert rows[32.0]["online + ρ"] is None  # not run
    assert rows[40.0]["fastest"] == "online" and rows[40.0]["online"] == pytest.approx(0.75)


def test_a_group_is_finished_when_its_ablation_run_wrote_its_summary(tmp_path):
    """The sweep reads a (model, skew) group's ablation results again only once that run finished (its summary is
    written last); a killed one is run again."""
    from lrmoe.experiments.memory_sweep import finished
    from lrmoe.integrations.tracking import Tracker

    path = tmp_path / "group.jsonl"
    assert not finished(path)
    with Tracker("ablate", {}, results=path, wandb=False, quiet=True) as run:
        run.log({"system": "x"})
    assert not finished(path)
    with Tracker("ablate", {}, results=path, wandb=False, quiet=True, resume=True) as run:
        run.log({"system": "x"})
        run.log_summary({"headline": ""})
    assert finished(path)
