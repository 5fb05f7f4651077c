"""The step benchmark's arithmetic (lrmoe.harness.step_bench): a run's step, its phases and hand-offs from its ranks'
probe rows, the evaluation at the protocol's rate, and the comparison with a baseline run."""

import pytest

from lrmoe.harness import step_bench

ARGV = ["--engine", "emulated", "--policy", "static-ep", "--ranks", "2", "--batch", "4", "--seq-len", "8"]


def probe_rows(step_walls, cpu_per_step, plan_s, eval_wall=0.0, evals=0):
    """Two ranks; rank 0's step starts from ``step_walls``; each rank uses ``cpu_per_step[i]`` / 2 of CPU in step i,
    ``plan_s`` of it in the plan over the measured steps."""
    starts, t = [0.0], 0.0
    for w in step_walls:
        t += w
        starts.append(t)
    rows = []
    for rank in (0, 1):
        cpu, c = [0.0], 0.0
        for x in cpu_per_step:
            c += x / 2
            cpu.append(c)
        rows.append({"rank": rank, "warmup": 1, "starts": starts, "cpu": cpu, "seconds": {"plan": plan_s / 2},
                     "walls": {"evaluation": eval_wall} if rank == 0 else {},
                     "calls": {"evaluation": evals} if rank == 0 else {}, "losses": [1.0, 0.5] if rank == 0 else None})
    return rows


def test_a_runs_step_is_the_median_with_the_hand_offs_its_cpu_leaves_and_evaluation_at_the_protocols_rate():
    # warm-up step 9 s; measured steps 1, 1, 5 (an evaluation step), 1 s of wall; 0.6 s of the two ranks' CPU each
    rows = probe_rows([9.0, 1.0, 1.0, 5.0, 1.0], [9.0, 0.6, 0.6, 4.0, 0.6], plan_s=0.8, eval_wall=3.0, evals=1)
    got = step_bench.summarise(rows, ARGV, eval_every=15)
    assert got["steps_measured"] == 4 and got["step_s"] == pytest.approx(1.0)
    assert got["cpu_s"] == pytest.approx(0.6)  # the median over steps of the ranks' summed CPU
    assert got["phase_s"]["plan"] == pytest.approx(0.2)  # 0.8 s over 4 measured steps
    assert got["phase_s"]["other"] == pytest.approx(0.4) and got["phase_s"]["hand-off"] == pytest.approx(0.4)
    assert got["phase_s"]["evaluation"] == pytest.approx(3.0 / 15)
    assert got["step_amortized_s"] == pytest.approx(1.0 + 3.0 / 15)
    assert got["tokens_per_s"] == pytest.approx(4 * 8 * 2 / 1.0)


def test_the_comparison_gives_the_speedup_and_says_whether_the_losses_are_bitwise_the_same():
    current = step_bench.summarise(probe_rows([1, 1, 1, 1], [.5, .5, .5, .5], 0.4), ARGV)
    base_rows = probe_rows([4, 4, 4, 4], [2, 2, 2, 2], 1.0)
    baseline = step_bench.summarise(base_rows, ARGV)
    floor = {"step_s": 0.2}
    row = step_bench.compare(current, baseline, floor, layers=2)
    assert row["speedup"] == pytest.approx(4.0) and row["same_losses"]
    assert row["host_per_layer_ms"] == pytest.approx(1e3 * (1.0 - 0.2) / (2 * 2))
    base_rows[0]["losses"] = [1.0, 0.5000001]
    row = step_bench.compare(current, step_bench.summarise(base_rows, ARGV), floor, layers=2)
    assert not row["same_losses"] and row["max_loss_rel_diff"] == pytest.approx(2e-7, rel=1e-3)
    summary = step_bench.summary([{**row, "engine": "emulated"}, {"engine": "floor", "step_s": 0.2}])
    assert summary["emulated_speedup_min"] == pytest.approx(4.0) and summary["emulated_same_losses"] is False
