"""The simulator's validation against the measured layer: the CPU calibration's fits recover known constants, the
micro-benchmarks run on forked ranks and write a file the cost model reads, the replayed plans are the plans the
layer benchmark ran (every pair and byte it counted), the error statistics on a hand case, and the script's table
(one row per covered phase)."""

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from lrmoe.harness.calibrate_cpu import (CalibrationSpec, across_ranks, calibrate, calibration_data,
                                         fit_gemm, fit_line, spec_for_bench, write_calibration)
from lrmoe.bytemodel.layout import STEP_PHASES
from lrmoe.sim.cost import cpu_gloo_preset
from lrmoe.integrations.tracking import read_results

ROOT = Path(__file__).resolve().parent.parent


def _script(name: str):
    from _scripts import load_experiment

    return load_experiment(name)


# -- the fits ----------------------------------------------------------------------------------------------------
PEAK, M_HALF, LAUNCH = 4e10, 24.0, 1.5e-4
CALLS = [(g, m) for g in (1, 4) for m in (1, 8, 32, 128, 512)]
FLOPS = (6.0 * 64 * 32, 12.0 * 64 * 32)  # forward, backward FLOPs per row at D=64, F=32


def _gemm_seconds(groups, rows, flops):
    return LAUNCH + groups * flops * (rows + M_HALF) / PEAK


def _gemm_samples(noise=0.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows_XG, flops_X, secs_X = [], [], []
    for g, m in CALLS:
        for f in FLOPS:
            jitter = math.exp(noise * float(torch.randn((), generator=gen)))
            rows_XG.append([m] * g)
            flops_X.append(f)
            secs_X.append(_gemm_seconds(g, m, f) * jitter)
    return rows_XG, flops_X, secs_X


def test_gemm_fit_recovers_known_constants():
    fit = fit_gemm(*_gemm_samples())
    assert fit.peak_flops == pytest.approx(PEAK, rel=1e-9)
    assert fit.m_half == pytest.approx(M_HALF, rel=1e-9)
    assert fit.launch_s == pytest.approx(LAUNCH, rel=1e-9)
    assert fit.median_rel_error < 1e-9 and fit.samples == 2 * len(CALLS)
    # 3 % multiplicative noise: the constants still come back within 10 %
    noisy = fit_gemm(*_gemm_samples(noise=0.03, seed=1))
    assert noisy.peak_flops == pytest.approx(PEAK, rel=0.1)
    assert noisy.m_half == pytest.approx(M_HALF, rel=0.1)
    assert noisy.launch_s == pytest.approx(LAUNCH, rel=0.1)
    assert noisy.predict([100, 0, 3], FLOPS[0]) == pytest.approx(
        noisy.launch_s + FLOPS[0] * (103 + 2 * noisy.m_half) / noisy.peak_flops)
    assert noisy.as_preset() == {"eff_max": 1.0, "m_half": noisy.m_half, "launch_s": noisy.launch_s}


def test_gemm_fit_keeps_constants_non_negative_and_rejects_bad_samples():
    # timings with no fixed cost at all, plus noise that would pull an unconstrained launch_s below zero
    rows_XG = [[m] for m in (1, 2, 4, 8, 64, 256)]
    secs = [0.97 * 100 * (m + 4) / 1e9 if m < 8 else 100 * (m + 4) / 1e9 for m in (1, 2, 4, 8, 64, 256)]
    fit = fit_gemm(rows_XG, [100.0] * 6, secs)
    assert fit.launch_s >= 0 and fit.m_half >= 0 and fit.peak_flops > 0
    with pytest.raises(ValueError, match="at least 3"):
        fit_gemm([[1], [2]], [1.0, 1.0], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive"):
        fit_gemm([[1], [2], [3]], [1.0] * 3, [1.0, -2.0, 3.0])
    with pytest.raises(ValueError, match="differ in length"):
        fit_gemm([[1], [2], [3]], [1.0] * 2, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="non-empty group"):
        fit_gemm([[0], [2], [3]], [1.0] * 3, [1.0, 2.0, 3.0])


def test_line_fit_recovers_latency_and_bandwidth():
    sizes = [0, 1024, 65536, 262144, 1 << 20]
    fit = fit_line(sizes, [2e-4 + b / 3e9 for b in sizes])
    assert fit.latency_s == pytest.approx(2e-4, rel=1e-9) and fit.bandwidth == pytest.approx(3e9, rel=1e-9)
    assert fit.predict(3e9) == pytest.approx(1.0 + 2e-4)
    # no latency, noisy: the latency is clamped at zero, the bandwidth still within 5 %
    gen = torch.Generator().manual_seed(0)
    secs = [(1 + b) / 3e9 * math.exp(0.02 * float(torch.randn((), generator=gen))) for b in sizes]
    fit = fit_line(sizes, secs)
    assert fit.latency_s >= 0 and fit.bandwidth == pytest.approx(3e9, rel=0.05)
    with pytest.raises(ValueError, match="two sizes"):
        fit_line([8, 8], [1.0, 1.0])


# -- the calibration file ------------------------------------------------------------------------------------------
def _fake_ranks(spec: CalibrationSpec):
    """Per-rank timings made from known constants: CPU clock exact (rank 1 slower by 10 %), wall clock with one
    fast rank in every collective (the last to arrive) and a few-ms spike in one repetition of rank 0."""
    lat, bw, mem_bw = 1e-4, 2e9, 1e10
    ranks = []
    for r in range(spec.num_ranks):
        slow = 1.1 if r == 1 else 1.0

        def reps(t, wall_factor, spike=False):
            cpu = [t * slow] * spec.repeats
            wall = [t * slow * wall_factor] * spec.repeats
            if spike:
                wall[0] += 5e-3
            return {"cpu": cpu, "wall": wall}

        gemm = [{"groups": g, "rows": m, "fwd": reps(_gemm_seconds(g, m, 6.0 * spec.hidden * spec.ffn), 2.0),
                 "bwd": reps(_gemm_seconds(g, m, 12.0 * spec.hidden * spec.ffn), 2.0)} for g, m in spec.gemm_calls()]
        a2a = [{"bytes_per_peer": b, "bytes_sent": b * (spec.num_ranks - 1),
                "s": reps(lat + b * (spec.num_ranks - 1) / bw, 1.0 if r == 2 else 3.0, spike=r == 0),
                "p2p_s": reps(2 * lat + b / bw, 1.0)} for b in spec.a2a_bytes]
        params = spec.num_experts * spec.shard_numel
        passes = {"bytes": 4 * spec.packed_bytes, "s": reps(4 * spec.packed_bytes / mem_bw, 2.0)}
        step_host = {mode: {phase: reps(FIXED[f"{mode}/{phase}"], 1.0 if r == 3 else 2.0) for phase in STEP_PHASES}
                     for mode in ("range", "shard")}
        ranks.append({"gemm": gemm, "a2a": a2a, "mem_passes": passes, "step_host": step_host,
                      "adam": {"params": params, "s": reps(64.0 * params / mem_bw, 2.0)}})
    return ranks


FIXED = {f"{mode}/{phase}": (2e-3 if mode == "range" else 1e-3) * (k + 1)
         for mode in ("range", "shard") for k, phase in enumerate(STEP_PHASES)}


def test_calibration_file_holds_both_clocks_and_the_cost_model_reads_it(tmp_path):
    spec = CalibrationSpec(num_ranks=4, hidden=64, ffn=32, num_experts=16, gemm_rows=(1, 8, 32, 128, 512),
                           gemm_groups=(1, 4), a2a_bytes=(0, 1024, 65536, 1 << 20), repeats=3)
    data = calibration_data(spec, _fake_ranks(spec))
    # CPU clock: the slowest rank (rank 1, 10 % slower) everywhere
    assert data["clock"] == "cpu"
    assert data["peak_flops"] == pytest.approx(PEAK / 1.1, rel=1e-6)
    assert data["gemm"]["m_half"] == pytest.approx(M_HALF, rel=1e-6)
    assert data["a2a_latency"] == pytest.approx(1.1e-4, rel=1e-6) and data["a2a_bw"] == pytest.approx(2e9 / 1.1)
    assert data["mem_bw"] == pytest.approx(1e10 / 1.1)  # from the copy, not from Adam (a diagnostic: half of it)
    assert data["clocks"]["cpu"]["fits"]["adam"]["effective_bw"] == pytest.approx(1e10 / 2.2)
    # wall clock: the all-to-all is its fastest rank's (rank 2, undelayed); rank 0's spike is a median away
    wall = data["clocks"]["wall"]
    assert wall["a2a_latency"] == pytest.approx(1e-4, rel=1e-6) and wall["a2a_bw"] == pytest.approx(2e9, rel=1e-6)
    assert wall["peak_flops"] == pytest.approx(PEAK / 2.2, rel=1e-6)
    path = write_calibration(data, tmp_path / "cpu.json")
    with pytest.raises(FileExistsError, match="overwrite"):
        write_calibration(data, path)
    cluster, curve = cpu_gloo_preset(path, 4)
    assert cluster.peak_flops == data["peak_flops"] and curve.eff_max == 1.0 and curve.m_half == data["gemm"]["m_half"]
    # the step phases' fixed times: the slowest rank by the CPU clock; by the wall clock the exchanges' fastest rank
    # (rank 3) and Adam's slowest; the cost model reads them per mode and phase
    assert data["step_fixed_s"] == pytest.approx({k: 1.1 * v for k, v in FIXED.items()})
    assert wall["step_fixed_s"]["shard/replica_sync"] == pytest.approx(FIXED["shard/replica_sync"])
    assert wall["step_fixed_s"]["range/adam"] == pytest.approx(1.1 * 2 * FIXED["range/adam"])
    assert cluster.step_fixed("range", "redistribute") == data["step_fixed_s"]["range/redistribute"]
    cluster, curve = cpu_gloo_preset(path, 4, clock="wall")
    assert cluster.intra_latency == wall["a2a_latency"]
    with pytest.raises(ValueError, match="clock='gpu'"):
        cpu_gloo_preset(path, 4, clock="gpu")


def testacross_ranks_takes_medians_first():
    per_rank = [[1.0, 9.0, 1.0], [2.0, 2.0, 9.0], [1.5, 1.5, 1.5]]
    assert across_ranks(per_rank, "max") == 2.0  # not 9: every rank's spike is a median away
    assert across_ranks(per_rank, "min") == 1.0
    with pytest.raises(ValueError, match="how"):
        across_ranks(per_rank, "mean")


def test_spec_validation_and_the_bench_grid():
    with pytest.raises(ValueError, match="num_ranks"):
        CalibrationSpec(num_ranks=1, hidden=8, ffn=4, num_experts=4)
    with pytest.raises(ValueError, match="a2a_bytes"):
        CalibrationSpec(num_ranks=2, hidden=8, ffn=4, num_experts=4, a2a_bytes=(0, 0))
    spec = spec_for_bench(4, 256, 128, 16, 4, 128, 5, quick=True)
    assert spec.gemm_groups == (1, 5) and max(g * m for g, m in spec.gemm_calls()) <= 2 * 128 * 4
    assert 0 in spec.a2a_bytes and max(spec.a2a_bytes) >= 128 * 4 * 256 * 4 // 4


def test_micro_benchmarks_run_on_forked_ranks(tmp_path):
    spec = CalibrationSpec(num_ranks=2, hidden=16, ffn=8, num_experts=4, gemm_rows=(1, 8, 32), gemm_groups=(1, 2),
                           max_gemm_rows=64, a2a_bytes=(0, 1024, 8192), repeats=2, warmup=1)
    data = calibrate(spec, timeout_s=120)
    for clock in ("cpu", "wall"):
        c = data["clocks"][clock]
        assert all(math.isfinite(c[k]) and c[k] > 0 for k in ("peak_flops", "a2a_bw", "mem_bw"))
        assert len(c["measurements"]["gemm"]) == 2 * len(spec.gemm_calls())
    assert data["provenance"]["ranks"] == 2 and data["provenance"]["torch"] == torch.__version__
    path = write_calibration(data, tmp_path / "cal.json")
    assert cpu_gloo_preset(path, 2)[0].num_ranks == 2


# -- the error statistics ------------------------------------------------------------------------------------------
def test_errors_on_a_hand_case():
    vs = _script("validate_sim")
    base = {"trace": "t", "policy": "p"}

    def frame(col, values):  # values[phase][rank] = per-step ms
        return pd.DataFrame([{**base, "clock": clock, "phase": phase, "rank": r, "step": s, col: v}
                             for (clock, phase), per_rank in values.items() for r, steps in enumerate(per_rank)
                             for s, v in enumerate(steps)])

    predicted = frame("predicted_ms", {("cpu", "expert_fwd"): [[1, 1, 1], [2, 2, 2]],
                                       ("wall", "dispatch_a2a"): [[0.5] * 3, [0.8] * 3]})
    measured = frame("measured_ms", {("cpu", "expert_fwd"): [[9, 1, 1], [2.5, 9, 2.5]],
                                     ("wall", "dispatch_a2a"): [[1, 1, 1], [3, 3, 3]]})
    cells = vs.compare(predicted, measured).set_index(["clock", "phase"])
    fwd = cells.loc[("cpu", "expert_fwd")]
    # each rank's median over steps (1 and 2.5; the 9 ms spikes are a median away), then the slowest rank
    assert fwd["predicted_ms"] == 2 and fwd["measured_ms"] == 2.5 and fwd["error"] == pytest.approx(-0.2)
    # the literal statistic: each step's slowest rank (9, 9, 2.5), then the median over steps
    assert fwd["measured_step_slowest_ms"] == 9 and fwd["error_step_slowest"] == pytest.approx(2 / 9 - 1)
    # a collective by the wall clock: the fastest rank (the last to arrive); the model's slowest rank
    a2a = cells.loc[("wall", "dispatch_a2a")]
    assert a2a["measured_ms"] == 1 and a2a["predicted_ms"] == 0.8 and a2a["error"] == pytest.approx(-0.2)
    assert vs.phase_statistic("dispatch_a2a", "cpu") == "slowest"
    table = vs.phase_table(cells.reset_index(), "cpu")
    assert list(table["phase"]) == ["expert_fwd"] and table["median_abs_error"].iloc[0] == pytest.approx(0.2)
    assert vs.relative_error(3.0, 2.0) == 0.5
    with pytest.raises(ValueError, match="positive"):
        vs.relative_error(pd.Series([1.0]), pd.Series([0.0]))


# -- the replay and the script, on a tiny measured run ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    """A 2-rank layer_bench on a synthetic and a recorded trace: capacity (drops), SYMI, and LRMoE without a spare
    slot under a tight memory budget (its quotas trim the backward), compact (metric m2) and padded."""
    from lrmoe.integrations.traces import generate_trace

    folder = tmp_path_factory.mktemp("bench")
    generate_trace(3, 2, 2, 16, 4, 32, seed=5).save(folder / "recorded.npz")
    out = folder / "bench.jsonl"
    _script("layer_bench").main([
        "--ranks", "2", "--tokens-per-rank", "32", "--steps", "2", "--warmup", "1", "--skew-param", "0.8",
        "--trace", str(folder / "recorded.npz"), "--trace-layer", "1",
        "--hidden", "32", "--ffn", "16", "--spare-slots", "0", "--buffer-load", "0.9", "--no-grad-error",
        "--no-wandb", "--policies", "capacity-cf1", "symi-dropless", "lrmoe-m2", "lrmoe-padded", "--out", str(out)])
    return out


def test_replayed_plans_are_the_plans_the_bench_ran(tiny_bench):
    vs = _script("validate_sim")
    config, raw = vs.read_bench(tiny_bench)
    replay = vs.replay_plans(config)
    assert set(replay) == {(t, p) for t in ("synthetic zipf 0.8", "recorded recorded") for p in config["policies"]}
    assert any(not torch.equal(plan.keep_NG, plan.fwd_NG) for plan in replay[("synthetic zipf 0.8", "lrmoe")]
               ["plans"]), "the tiny run should trim the backward, so the check covers the compact layout"
    mismatches = vs.check_replay(raw, replay, config)
    assert mismatches.empty, mismatches.head().to_string()
    # the check fails when the replay is not the run: another seed gives other traces, so other plans
    other = vs.replay_plans({**config, "seed": config["seed"] + 1})
    assert not vs.check_replay(raw, other, config).empty
    # a recorded trace that is gone is left out; the synthetic one still replays
    gone = vs.replay_plans({**config, "trace": str(Path(config["trace"]).with_name("missing.npz"))})
    assert {t for t, _ in gone} == {"synthetic zipf 0.8"} and vs.check_replay(raw, gone, config).empty


@pytest.mark.script
@pytest.mark.timeout(600)
def test_validate_sim_reports_one_row_per_covered_phase(tiny_bench, tmp_path):
    vs = _script("validate_sim")
    spec = CalibrationSpec(num_ranks=2, hidden=32, ffn=16, num_experts=16, gemm_rows=(1, 8, 32, 128),
                           gemm_groups=(1, 8), a2a_bytes=(0, 1024, 65536), repeats=3)
    cal = write_calibration(calibration_data(spec, _fake_ranks(spec)), tmp_path / "cal.json")
    out = tmp_path / "validate.jsonl"
    table = vs.main(["--bench", str(tiny_bench), "--calibration", str(cal), "--out", str(out), "--no-wandb"])
    _, raw = vs.read_bench(tiny_bench)
    timed = [p for p in vs.COVERED if f"{p}.cpu_ms" in raw and raw[f"{p}.cpu_ms"].notna().any()]
    assert list(table["phase"]) == timed and len(timed) == 10
    assert table["cells"].eq(8).all()  # 2 traces x 4 policies
    predicted = table.set_index("phase")["predicted_ms"]
    # no spare slot, so no replica to sync: nothing to send, and a single slot's gradient is its sum (no pass); what
    # is left is the phase's measured fixed time (range mode, the bench's)
    fixed_ms = 1e3 * json.loads(cal.read_text())["step_fixed_s"]["range/replica_sync"]
    assert predicted["replica_sync"] == pytest.approx(fixed_ms)
    assert predicted.drop("replica_sync").gt(0).all()
    records = read_results(out)
    assert {r["phase"] for r in records if r["table"] == "phase"} == set(timed)
    assert len([r for r in records if r["table"] == "cell"]) == 2 * 8 * len(timed)  # clocks x cells x phases
    summary = read_results(out, "summary")[0]
    assert summary["replay_mismatches"] == 0 and 0 <= summary["median_abs_error"]
    assert (tmp_path / "validate_predicted_vs_measured.png").exists()
    assert json.loads(cal.read_text())["clock"] == "cpu"
    with pytest.raises(SystemExit):  # an existing results file: refused before any work
        vs.main(["--bench", str(tiny_bench), "--calibration", str(cal), "--out", str(out), "--no-wandb"])
