"""The simulator's validation against the measured layer: the CPU calibration's fits recover known constants, the
micro-benchmarks run on forked ranks and write a file the cost model reads, the replayed plans are the plans the
layer benchmark ran (every pair and byte it counted), the error statistics on a hand case, and the script's table
(one row per covered phase). The frontier's measured points: a regime's settings reach the layer (slots, matched
skew, the arms and their rho), the modelled and measured ratios are of the same plans, and the statistic on a hand
case."""

import json
import math
from argparse import Namespace
from pathlib import Path

import pandas as pd
import pytest
import torch

from lrmoe.harness.calibrate_cpu import (CalibrationSpec, across_ranks, calibrate, calibration_data,
                                         fit_gemm, fit_line, spec_for_bench, write_calibration)
from lrmoe.bytemodel.layout import STEP_PHASES
from lrmoe.harness import sim_validation as sv
from lrmoe.harness.sim_validation_run import regime_point
from lrmoe.sim.cost import cpu_gloo_preset
from lrmoe.results import read_results

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
    base = {"trace": "t", "policy": "p"}

    def frame(col, values):  # values[phase][rank] = per-step ms
        return pd.DataFrame([{**base, "clock": clock, "phase": phase, "rank": r, "step": s, col: v}
                             for (clock, phase), per_rank in values.items() for r, steps in enumerate(per_rank)
                             for s, v in enumerate(steps)])

    predicted = frame("predicted_ms", {("cpu", "expert_fwd"): [[1, 1, 1], [2, 2, 2]],
                                       ("wall", "dispatch_a2a"): [[0.5] * 3, [0.8] * 3]})
    measured = frame("measured_ms", {("cpu", "expert_fwd"): [[9, 1, 1], [2.5, 9, 2.5]],
                                     ("wall", "dispatch_a2a"): [[1, 1, 1], [3, 3, 3]]})
    cells = sv.compare(predicted, measured).set_index(["clock", "phase"])
    fwd = cells.loc[("cpu", "expert_fwd")]
    # each rank's median over steps (1 and 2.5; the 9 ms spikes are a median away), then the slowest rank
    assert fwd["predicted_ms"] == 2 and fwd["measured_ms"] == 2.5 and fwd["error"] == pytest.approx(-0.2)
    # the literal statistic: each step's slowest rank (9, 9, 2.5), then the median over steps
    assert fwd["measured_step_slowest_ms"] == 9 and fwd["error_step_slowest"] == pytest.approx(2 / 9 - 1)
    # a collective by the wall clock: the fastest rank (the last to arrive); the model's slowest rank
    a2a = cells.loc[("wall", "dispatch_a2a")]
    assert a2a["measured_ms"] == 1 and a2a["predicted_ms"] == 0.8 and a2a["error"] == pytest.approx(-0.2)
    assert sv.phase_statistic("dispatch_a2a", "cpu") == "slowest"
    table = sv.phase_table(cells.reset_index(), "cpu")
    assert list(table["phase"]) == ["expert_fwd"] and table["median_abs_error"].iloc[0] == pytest.approx(0.2)
    assert sv.relative_error(3.0, 2.0) == 0.5
    with pytest.raises(ValueError, match="positive"):
        sv.relative_error(pd.Series([1.0]), pd.Series([0.0]))


# -- the replay and the script, on a tiny measured run ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    """A 2-rank layer_bench on a synthetic and a recorded trace: capacity (drops), SYMI, and LRMoE without a spare
    slot under a tight memory budget (its quotas trim the backward), compact (metric m2) and padded."""
    from lrmoe.traces.synthetic import generate_trace

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
    config, raw = sv.read_bench(tiny_bench)
    replay = sv.replay_plans(config)
    assert set(replay) == {(t, p) for t in ("synthetic zipf 0.8", "recorded recorded") for p in config["policies"]}
    assert any(not torch.equal(plan.keep_NG, plan.fwd_NG) for plan in replay[("synthetic zipf 0.8", "lrmoe")]
               ["plans"]), "the tiny run should trim the backward, so the check covers the compact layout"
    mismatches = sv.check_replay(raw, replay, config)
    assert mismatches.empty, mismatches.head().to_string()
    # the check fails when the replay is not the run: another seed gives other traces, so other plans
    other = sv.replay_plans({**config, "seed": config["seed"] + 1})
    assert not sv.check_replay(raw, other, config).empty
    # a recorded trace that is gone is left out; the synthetic one still replays
    gone = sv.replay_plans({**config, "trace": str(Path(config["trace"]).with_name("missing.npz"))})
    assert {t for t, _ in gone} == {"synthetic zipf 0.8"} and sv.check_replay(raw, gone, config).empty


@pytest.mark.script
@pytest.mark.timeout(600)
def test_validate_sim_reports_one_row_per_covered_phase(tiny_bench, tmp_path):
    vs = _script("validate_sim")
    spec = CalibrationSpec(num_ranks=2, hidden=32, ffn=16, num_experts=16, gemm_rows=(1, 8, 32, 128),
                           gemm_groups=(1, 8), a2a_bytes=(0, 1024, 65536), repeats=3)
    cal = write_calibration(calibration_data(spec, _fake_ranks(spec)), tmp_path / "cal.json")
    out = tmp_path / "validate.jsonl"
    table = vs.main(["--bench", str(tiny_bench), "--calibration", str(cal), "--out", str(out), "--no-wandb"])
    _, raw = sv.read_bench(tiny_bench)
    timed = [p for p in sv.COVERED if f"{p}.cpu_ms" in raw and raw[f"{p}.cpu_ms"].notna().any()]
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


# -- measured points of the frontier protocol: layer_bench --regime, priced on the same plans ------------------------
def _runs_file(path: Path, production: float = 1.12, weak: float = 1.2) -> Path:
    """Collected protocol runs: two static-EP runs per regime (their slowest rank ÷ mean is what a regime's skew is
    matched to) and another arm's run, whose routing must not count."""
    rows = [{"regime": regime, "seed": seed, "arm": "static-ep", "load/rank_max_over_mean_mean": value,
             "load/gini_mean": 0.1, "load/expert_max_over_mean_mean": 1.5}
            for regime, value in (("production", production), ("weak", weak)) for seed in (0, 1)]
    rows.append({**rows[-1], "arm": "symi-dropless", "load/rank_max_over_mean_mean": 3.0})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


REGIME_BENCH = ["--ranks", "2", "--tokens-per-rank", "64", "--steps", "2", "--warmup", "1", "--no-wandb"]


def test_a_regime_sets_the_protocols_settings_at_the_benchs_scale(tmp_path):
    from lrmoe.analysis.protocol import REGIMES, SWEEP_ARMS
    from lrmoe.analysis.skew import trace_imbalance
    from lrmoe.harness.layer_bench_setup import make_traces

    lb = _script("layer_bench")
    runs = str(_runs_file(tmp_path / "runs.jsonl"))
    argv = [*REGIME_BENCH, "--runs", runs, "--out", str(tmp_path / "bench.jsonl")]
    picked = {}
    for name in ("production", "weak"):
        args = lb.parse_args(["--regime", name, *argv])
        lb.check_args(args)
        regime = REGIMES[name]
        # the regime's slots at this scale (16 experts on 2 ranks: 8 home slots, a quarter of them spare), eps, gamma
        assert (args.spare_slots, args.eps, args.gamma) == (regime.spare_slots(16, 2), regime.eps, regime.gamma)
        assert args.spare_slots == 2
        # its arms: the budget systems at every rho of its grid beside SYMI-dropless, its random trim, static EP
        assert args.policies == list(SWEEP_ARMS)
        assert {f"lrmoe-rho{r:g}-unbiased" for r in regime.rhos} | {"static-ep", "symi-dropless",
                                                                      "symi-dropless-rho0.75"} <= set(args.policies)
        # one Zipf trace, whose static-EP slowest rank ÷ mean is the runs' (the other arm's run is not counted)
        assert args.skew == "zipf" and len(args.skew_param) == 1
        target = {"production": 1.12, "weak": 1.2}[name]
        assert args.regime_match["runs"]["rank_max_over_mean"] == pytest.approx(target)
        (_, counts_INE, _), = make_traces(args, 2, 16, 4, "qwen3-30b-a3b-debug")
        assert trace_imbalance(counts_INE[:, None])["rank_max_over_mean"] == pytest.approx(target, rel=0.05)
        picked[name] = args.skew_param[0]
    assert picked["weak"] > picked["production"] + 0.05
    # a flag the regime sets, given otherwise, or another skew: refused before any work
    for extra in (["--spare-slots", "3"], ["--eps", "0.2"], ["--skew-param", "0.3"], ["--skew", "dirichlet"]):
        with pytest.raises(SystemExit):
            lb.parse_args(["--regime", "weak", *argv, *extra])
    # a skew no Zipf exponent reaches is an error, not a silently different trace
    with pytest.raises(SystemExit):
        lb.parse_args(["--regime", "weak", *REGIME_BENCH, "--out", str(tmp_path / "b.jsonl"),
                       "--runs", str(_runs_file(tmp_path / "far.jsonl", weak=1.99))])


def test_a_regime_point_prices_the_plans_the_layer_ran(tmp_path):
    lb, vs = _script("layer_bench"), _script("validate_sim")
    out = tmp_path / "points_layer_bench_weak.jsonl"  # where validate_sim --regimes weak --out points.jsonl has it
    policies = ["static-ep", "symi-dropless", "lrmoe-rho0.5-unbiased", "symi-dropless-rho0.75"]
    lb.main(["--regime", "weak", *REGIME_BENCH, "--hidden", "32", "--ffn", "16", "--no-grad-error",
             "--runs", str(_runs_file(tmp_path / "runs.jsonl")), "--policies", *policies, "--out", str(out)])
    config, raw = sv.read_bench(out)
    spec = CalibrationSpec(num_ranks=2, hidden=32, ffn=16, num_experts=16, gemm_rows=(1, 8, 32, 128),
                           gemm_groups=(1, 8), a2a_bytes=(0, 1024, 65536), repeats=3)
    cal = write_calibration(calibration_data(spec, _fake_ranks(spec)), tmp_path / "cal.json")
    table, groups, info = regime_point(config, raw, cal, json.loads(cal.read_text()))

    # the regime reached the layer: its slots, its skew (static EP's counted pairs are the matched trace's), its rho
    facts = table[table["span"] == "layer"].set_index("policy")
    assert facts.loc["static-ep", "slots_per_rank"] == 8
    assert (facts.drop("static-ep")["slots_per_rank"] == 8 + 2).all() and info["spare_slots"] == 2
    assert info["zipf_s"] == config["skew_param"][0] and info["trace"]["rank_max_over_mean"] == pytest.approx(1.2,
                                                                                                          rel=0.05)
    from lrmoe.harness.layer_bench_setup import make_traces

    (_, counts_INE, _), = make_traces(Namespace(**config), 2, 16, 4, config["model"])
    static = raw[raw["policy"] == "static-ep"]
    for rec in static.to_dict("records"):  # static EP: rank r computes every pair routed to its 8 home experts
        hosted_N = counts_INE[rec["step"] + config["warmup"]].sum(0).view(2, 8).sum(1)
        assert rec["pairs_fwd"] == int(hosted_N[rec["rank"]])
    assert facts.loc["lrmoe-rho0.5-unbiased", "retained_pct"] == pytest.approx(50, abs=1)
    assert facts.loc["symi-dropless-rho0.75", "retained_pct"] == pytest.approx(75, abs=2)
    assert facts.loc["symi-dropless", "retained_pct"] == 100

    # one row per policy and span, for the plans the layer ran; SYMI-dropless is the unit on both sides
    assert set(zip(table["policy"], table["span"])) == {(p, s) for p in policies for s in sv.SPANS}
    assert (table["steps"] == 2).all()
    symi = table[table["policy"] == "symi-dropless"]
    assert np_all_close(symi[["measured_ratio", "modelled_ratio", "stragglers_ratio"]], 1.0)
    ref = facts.loc["symi-dropless"]
    assert np_all_close(facts["modelled_ratio"], facts["modelled_ms"] / ref["modelled_ms"])
    assert np_all_close(facts["difference"], facts["modelled_ratio"] - facts["measured_ratio"])
    # the measured statistic is the bench's own headline (slowest rank's forward + backward CPU time, median)
    bench = {r["policy"]: r["slowest_cpu_ms"] for r in read_results(out) if r.get("table") == "policy"}
    assert np_all_close(facts["measured_ms"], pd.Series(bench)[facts.index])
    assert set(groups["group"]) == set(sv.PHASE_GROUPS) and (groups["modelled_ms"] >= 0).all()
    assert info["covered_median_abs_error"] >= 0

    # the script prices that benchmark again: the same table, a report and a figure beside its results file
    points = tmp_path / "points.jsonl"
    again = vs.main(["--regimes", "weak", "--reuse-benches", "--calibration", str(cal), "--out", str(points),
                     "--no-wandb"])
    assert np_all_close(again["modelled_ratio"], table["modelled_ratio"])
    assert "## Regime weak" in points.with_suffix(".md").read_text()
    assert (tmp_path / "points_ratios.png").exists()
    with pytest.raises(SystemExit):  # an existing results file: refused before any work
        vs.main(["--regimes", "weak", "--reuse-benches", "--calibration", str(cal), "--out", str(points),
                 "--no-wandb"])
    # re-priced into a new results file from the benchmarks beside an earlier one: the same plans, the same prices
    repriced = tmp_path / "later" / "repriced.jsonl"
    third = vs.main(["--regimes", "weak", "--reuse-benches", str(points), "--calibration", str(cal),
                     "--out", str(repriced), "--no-wandb"])
    assert np_all_close(third["modelled_ratio"], table["modelled_ratio"])
    assert not (tmp_path / "later" / "repriced_layer_bench_weak.jsonl").exists()
    assert "benchmarks of `points.jsonl`" in repriced.with_suffix(".md").read_text()
    with pytest.raises(SystemExit):  # no benchmark beside the results file named: refused
        vs.main(["--regimes", "weak", "--reuse-benches", str(tmp_path / "none.jsonl"), "--calibration", str(cal),
                 "--out", str(tmp_path / "x.jsonl"), "--no-wandb"])


def np_all_close(a, b) -> bool:
    import numpy as np

    return bool(np.allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float)))


def test_the_ratio_table_on_a_hand_case():

    def frame(col, per):  # per[policy][step] = [[rank 0's ms per phase], [rank 1's]] over PHASES below
        return pd.DataFrame([{"trace": "t", "policy": p, "step": s, "rank": r, "phase": ph, col: v}
                             for p, steps in per.items() for s, ranks in enumerate(steps)
                             for r, values in enumerate(ranks) for ph, v in zip(PHASES, values)])

    PHASES = ("expert_fwd", "dispatch_a2a", "adam")  # two of the layer's covered phases and one of the step
    measured = frame("measured_ms", {"symi-dropless": [[[2, 1, 5], [1, 3, 0]], [[4, 4, 0], [1, 1, 0]]],
                                     "p": [[[1, 1, 0], [1, 2, 0]], [[2, 2, 0], [2, 1, 0]]]})
    predicted = frame("predicted_ms", {"symi-dropless": [[[2, 2, 0], [2, 2, 0]]] * 2,
                                       "p": [[[1, 0, 0], [0, 1, 0]]] * 2})
    table = sv.ratio_table(predicted, measured).set_index(["policy", "span"])
    layer = table.loc[("p", "layer")]
    # measured: the slowest rank's layer sum per step, SYMI (4, 8) and p (3, 4), medians 6 and 3.5
    assert layer["measured_ms"] == 3.5 and layer["measured_ratio"] == pytest.approx(3.5 / 6)
    # the quartiles of the per-step ratios (3/4 and 4/8), interpolated
    assert (layer["measured_ratio_q25"], layer["measured_ratio_q75"]) == pytest.approx((0.5625, 0.6875))
    # modelled: p's slowest rank 1 ms against SYMI's 4; the simulator's statistic sums per-phase stragglers: 2 vs 4
    assert layer["modelled_ratio"] == pytest.approx(0.25) and layer["stragglers_ratio"] == pytest.approx(0.5)
    assert layer["difference"] == pytest.approx(0.25 - 3.5 / 6)
    # the iteration adds the step's phases: SYMI's rank 0 carries 5 more ms in step 0 (slowest 8 and 8, median 8)
    assert table.loc[("symi-dropless", "iteration"), "measured_ms"] == 8
    assert table.loc[("p", "iteration"), "measured_ratio"] == pytest.approx(3.5 / 8)
    # modelled and measured must be the same plans
    with pytest.raises(ValueError, match="different plans"):
        sv.ratio_table(predicted[predicted["step"] == 0], measured)
    with pytest.raises(ValueError, match="symi-dropless did not run"):
        sv.ratio_table(predicted[predicted["policy"] == "p"], measured[measured["policy"] == "p"])


def test_the_bench_runs_in_this_process_and_its_failure_names_it(tmp_path, capsys):
    """validate_sim.py runs layer_bench.py through its entry point, in this process (no script by its path): the
    bench's own error reaches this process's stderr, and validate_sim stops with an error naming layer_bench.py and
    its arguments, before anything is written."""
    vs = _script("validate_sim")
    args = Namespace(reuse_benches=False, out=str(tmp_path / "points.jsonl"), quick=True, steps=2,
                     runs=str(tmp_path / "none.jsonl"), seed=0, overwrite=False, resume=False, no_wandb=True)
    with pytest.raises(SystemExit) as exc:
        vs.run_bench(args, tmp_path, "weak")
    assert str(exc.value.code).startswith("validate_sim.py: error: layer_bench.py --regime weak ")
    assert f"--runs {args.runs}" in exc.value.code and exc.value.code.endswith("failed: exited with 2")
    assert "layer_bench.py: error:" in capsys.readouterr().err
    assert not list(tmp_path.glob("points*"))
