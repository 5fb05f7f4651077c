"""The convergence summary and the frontier's pure functions, on synthetic records (no training, no simulator)."""

import math

import numpy as np
import pandas as pd
import pytest

from _scripts import load_experiment

from lrmoe.analysis import runs
from lrmoe.analysis.frontier import (FrontierError, frontier_table, headline, headline_text, modelled_times,
                                     regime_times)

convergence = load_experiment("convergence")
frontier = load_experiment("frontier")


def curve(policy: str, seed: int, final: float, ms_per_step: float = 1.0, steps: int = 10, every: int = 2,
          cut: float = 0.0, drop: float = 0.0) -> list[dict]:
    """A run whose validation loss falls linearly from final + 1 at step 0 to ``final`` at ``steps``."""
    recs = []
    for step in range(1, steps + 1):
        rec = {"policy": policy, "seed": seed, "step": step, "modelled_s": ms_per_step / 1e3,
               "hot_rank_bwd_cut": cut, "dropped_frac": drop, "bwd_pairs_max": 10.0, "fwd_pairs_mean": 10.0}
        if step % every == 0:
            rec["val_loss"] = final + 1.0 - step / steps
        recs.append(rec)
    return recs


def curves(spec: dict[str, list[float]], **kw) -> pd.DataFrame:
    frame = pd.DataFrame([r for policy, finals in spec.items() for seed, f in enumerate(finals)
                          for r in curve(policy, seed, f, **kw.get(policy, {}))])
    frame["time_s"] = frame.groupby(["policy", "seed"]).modelled_s.cumsum()
    return frame


def test_spread_is_mean_std_min_max_over_the_finite_values():
    s = runs.spread([1.0, 2.0, 3.0, float("nan")])
    assert s == {"mean": 2.0, "std": 1.0, "min": 1.0, "max": 3.0, "n": 3}
    assert runs.spread([4.0])["std"] == 0.0
    assert runs.spread([])["n"] == 0 and math.isnan(runs.spread([])["mean"])


def test_time_to_loss_interpolates_the_first_crossing():
    steps, times, loss = [2, 4, 6, 8], [0.2, 0.4, 0.6, 0.8], [3.0, 2.0, 1.5, 1.0]
    # target 2.5 lies halfway between the evaluations at steps 2 (3.0) and 4 (2.0)
    assert runs.time_to_loss(steps, times, loss, 2.5) == pytest.approx((3.0, 0.3))
    assert runs.time_to_loss(steps, times, loss, 3.5) == (2.0, 0.2)  # reached at the first evaluation
    assert runs.time_to_loss(steps, times, loss, 1.5) == pytest.approx((6.0, 0.6))  # exactly on a point
    assert all(math.isnan(v) for v in runs.time_to_loss(steps, times, loss, 0.5))  # never reached
    # the first crossing wins, even when the curve comes back up
    assert runs.time_to_loss([1, 2, 3], [1, 2, 3], [2.0, 1.0, 3.0], 1.0)[0] == 2.0
    assert runs.loss_at_step([2, 4], [3.0, 2.0], 3) == 2.5 and math.isnan(runs.loss_at_step([2, 4],
                                                                                                       [3.0, 2.0], 5))


def test_summary_gap_is_taken_seed_by_seed_then_averaged():
    # static EP differs between seeds; the system is 1 % and 3 % above it on its two seeds
    c = curves({"static-ep": [2.0, 4.0], "sys": [2.02, 4.12]}, sys={"cut": 0.25, "drop": 0.01})
    table = runs.summarise(c).set_index("policy")
    assert table.loc["static-ep", "gap_pct"] == 0.0
    assert table.loc["sys", "gap_pct"] == pytest.approx(2.0)
    assert table.loc["sys", "gap_pct_min"] == pytest.approx(1.0)
    assert table.loc["sys", "gap_pct_max"] == pytest.approx(3.0)
    assert table.loc["sys", "val_loss"] == pytest.approx(3.07)
    assert table.loc["sys", "val_loss_std"] == pytest.approx(np.std([2.02, 4.12], ddof=1))
    assert table.loc["sys", "hot_rank_bwd_cut_pct"] == pytest.approx(25.0)
    assert table.loc["sys", "dropped_pct"] == pytest.approx(1.0) and table.loc["sys", "seeds"] == 2


def test_time_to_reach_uses_the_same_seeds_baseline_at_step_t_and_counts_who_reaches_it():
    # "fast" ends 0.5 below static EP on each seed at half the time per step; "slow" never gets there
    c = curves({"static-ep": [2.0, 2.2], "fast": [1.5, 1.7], "slow": [2.5, 2.7]}, fast={"ms_per_step": 0.5})
    reach = runs.time_to_reach(c).set_index("policy")
    # static EP's loss at step 10 is reached by "fast" at step 5 (its loss falls 0.1 per step)
    assert reach.loc["fast", "step_to_reach"] == pytest.approx(5.0)
    assert reach.loc["fast", "modelled_ms_to_reach"] == pytest.approx(2.5)
    assert reach.loc["static-ep", "step_to_reach"] == 10.0 and reach.loc["static-ep", "seeds_reached"] == 2
    assert reach.loc["slow", "seeds_reached"] == 0 and math.isnan(reach.loc["slow", "step_to_reach"])
    # T = 6: static EP's loss there is final + 0.4; "fast" is below it at its first evaluation (step 2), "slow"
    # would need step 11
    reach6 = runs.time_to_reach(c, target_step=6).set_index("policy")
    assert reach6.loc["static-ep", "step_to_reach"] == pytest.approx(6.0)
    assert reach6.loc["static-ep", "target_step"] == 6
    assert reach6.loc["fast", "step_to_reach"] == 2.0 and reach6.loc["slow", "seeds_reached"] == 0


SYSTEMS = {  # policy: (finals over 3 seeds, modelled ms per iteration at paper scale)
    "static-ep": ([2.0, 2.0, 2.0], 200.0),
    "symi-dropless": ([2.0, 2.0, 2.0], 100.0),
    "symi-cf1": ([2.03, 2.03, 2.03], 95.0),
    "lrmoe-rho0.9": ([2.01, 2.01, 2.01], 90.0),  # 0.5 % gap
    "lrmoe-rho0.75": ([2.016, 2.02, 2.02], 80.0),  # 0.93 % mean gap: within the bar
    "lrmoe-rho0.75-random": ([2.03, 2.01, 2.04], 80.0),  # the control: 1.33 % mean, lower than LRMoE on one seed
    "symi-dropless-rho0.75": ([2.05, 2.05, 2.05], 70.0),
    "lrmoe-rho0.5": ([2.1, 2.1, 2.1], 60.0),  # 5 % gap: past the bar, although fastest
    "lrmoe-rho0.5-unbiased": ([2.05, 2.05, 2.05], 60.0),  # 2.5 %: past the 1 % bar and past SYMI-cf1's 1.5 %
}


def frontier_of(systems=SYSTEMS):
    c = curves({p: finals for p, (finals, _) in systems.items()})
    times = {p: ms for p, (_, ms) in systems.items()}
    per_run = runs.per_run(c)
    table = frontier_table(runs.summarise(c), runs.time_to_reach(c), times)
    return table, per_run


def test_frontier_table_divides_by_symi_dropless_and_symi_cf1():
    table, _ = frontier_of()
    t = table.set_index("policy")
    assert t.loc["symi-dropless", "time_vs_dropless"] == 1.0 and t.loc["static-ep", "time_vs_dropless"] == 2.0
    assert t.loc["lrmoe-rho0.75", "time_vs_cf1"] == pytest.approx(80 / 95)
    assert t.loc["lrmoe-rho0.75", "rho"] == 0.75 and t.loc["lrmoe-rho0.75", "selection"] == "m2 top-k"
    assert t.loc["lrmoe-rho0.5-unbiased", "selection"] == "m2 unbiased"
    assert not t.loc["lrmoe-rho0.75-random", "uses_metric"] and t.loc["symi-dropless-rho0.75", "selection"] == "random"
    # equal quality: static EP reaches its own step-10 loss at step 10, at twice SYMI-dropless's time per step
    assert t.loc["static-ep", "time_to_reach_vs_dropless"] == pytest.approx(2.0)
    assert math.isnan(t.loc["lrmoe-rho0.5", "time_to_reach_vs_dropless"])  # never reaches it


def test_headline_takes_the_fastest_lrmoe_with_mean_gap_within_one_percent():
    table, runs = frontier_of()
    h = headline(table, 1.0, runs)
    # rho 0.5 is faster but 5 % (top-k) and 2.5 % (unbiased) off; rho 0.75 is 0.93 % off on average: the headline
    assert h["best"]["policy"] == "lrmoe-rho0.75"
    assert h["best"]["time_vs_dropless"] == pytest.approx(0.8) and h["best"]["gap_pct"] == pytest.approx(2.8 / 3)
    ctrl = h["controls"]["lrmoe-rho0.75-random"]
    assert ctrl["metric_lower_mean"] and ctrl["seeds_compared"] == 3 and ctrl["seeds_metric_lower"] == 2
    assert h["controls"]["symi-dropless-rho0.75"]["metric_lower_mean"]
    # against SYMI-cf1 (1.5 % gap): rho 0.75 (1 %) matches it; rho 0.5 unbiased (2.5 %) does not
    assert h["vs_cf1"]["policy"] == "lrmoe-rho0.75" and h["vs_cf1"]["time_vs_cf1"] == pytest.approx(80 / 95)
    assert "0.800" in headline_text(h)
    # the random-trim controls: SYMI-dropless at rho 0.75 is 2.5 % off, LRMoE's random 1.33 %: none within 1 %
    assert h["best_control"] is None and "No random-trim control" in headline_text(h)
    good = {**SYSTEMS, "symi-dropless-rho0.75": ([2.01, 2.0, 2.01], 70.0)}
    h = headline(frontier_of(good)[0], 1.0)
    assert h["best_control"]["policy"] == "symi-dropless-rho0.75" and h["best_control"]["time_vs_dropless"] == 0.7


def test_headline_says_so_when_nothing_qualifies_or_the_control_wins():
    worse = {**SYSTEMS, "lrmoe-rho0.75": ([2.04, 2.04, 2.04], 80.0), "lrmoe-rho0.9": ([2.021, 2.021, 2.021], 90.0)}
    h = headline(frontier_of(worse)[0], 1.0)
    assert h["best"] is None and "No LRMoE system" in headline_text(h)
    # the control beats the metric at the headline's rho: reported, not hidden
    ctrl = {**SYSTEMS, "lrmoe-rho0.75-random": ([2.01, 2.01, 2.01], 80.0)}
    table, runs = frontier_of(ctrl)
    h = headline(table, 1.0, runs)
    assert not h["controls"]["lrmoe-rho0.75-random"]["metric_lower_mean"]
    assert h["controls"]["lrmoe-rho0.75-random"]["seeds_metric_lower"] == 0
    assert "NOT lower" in headline_text(h)


def test_frontier_script_writes_its_table_figure_and_headline(tmp_path):
    """End to end on a synthetic convergence file and one simulated layer: the results file holds one record per
    system, the per-run table and the headline; the figure comes as PNG and PDF, the report says both scales."""
    from lrmoe.integrations.tracking import Tracker
    from lrmoe.results import read_results

    conv = tmp_path / "convergence.jsonl"
    systems = {p: SYSTEMS[p] for p in ("static-ep", "symi-dropless", "symi-cf1", "lrmoe-rho0.75",
                                       "lrmoe-rho0.75-random")}
    c = curves({p: finals for p, (finals, _) in systems.items()})
    with Tracker("convergence", {}, results=conv, wandb=False, quiet=True) as run:
        for rec in c.to_dict("records"):
            run.log({k: v for k, v in rec.items() if v == v}, step=None)
    out = tmp_path / "frontier.jsonl"
    frontier.main(["--convergence", str(conv), "--out", str(out), "--no-wandb", "--layers", "1", "--sim-steps", "2"])
    rows = [r for r in read_results(out) if "table" not in r]
    assert sorted(r["policy"] for r in rows) == sorted(systems)
    assert all(r["time_vs_dropless"] > 0 for r in rows)
    assert len([r for r in read_results(out) if r.get("table") == "per_run"]) == 3 * len(systems)
    (summary,) = read_results(out, "summary")
    assert "headline" in summary and "simulator" in summary["scales"] and "CPU" in summary["scales"]
    assert (tmp_path / "frontier_frontier.png").exists() and (tmp_path / "frontier_frontier.pdf").exists()
    assert "Two scales" in (tmp_path / "frontier.md").read_text()
    # a second run reuses the first one's simulated times at the same scale (and simulates nothing new)
    again = tmp_path / "again.jsonl"
    frontier.main(["--convergence", str(conv), "--out", str(again), "--no-wandb", "--layers", "1", "--sim-steps", "2",
                   "--sim-from", str(out)])
    first = {r["policy"]: r["iter_ms"] for r in rows}
    assert {r["policy"]: r["iter_ms"] for r in read_results(again) if "table" not in r} == first


def test_last20_drop_says_how_much_the_curve_still_fell_in_the_last_fifth():
    # every run falls 0.1 per step: from final + 0.2 at step 8 to final at step 10
    table = runs.summarise(curves({"static-ep": [2.0, 2.0]})).set_index("policy")
    assert table.loc["static-ep", "last20_drop_pct"] == pytest.approx(100 * (1 - 2.0 / 2.2))


def test_a_scale_where_a_system_runs_out_of_memory_is_an_error():
    """GLM-4.5-Air's MoE layers at 4096 tokens per rank do not fit 40 GB per GPU on 16 GPUs: no time is reported."""
    args = frontier.parse_args(["--model", "glm-4.5-air", "--tokens-per-rank", "4096", "--layers", "1",
                                "--sim-steps", "2"])
    with pytest.raises(FrontierError, match="run out of memory"):
        modelled_times(["symi-dropless"], args)
    assert frontier.parse_args(["--model", "glm-4.5-air"]).tokens_per_rank == 1024  # the ablation's default


def test_slim_leaves_the_load_statistics_out_of_the_aggregate_only(tmp_path):
    """A finished sweep resumed with --slim trains nothing and writes an aggregate without load/* keys; the per-run
    files keep theirs."""
    from lrmoe.integrations.tracking import Tracker
    from lrmoe.results import read_results

    out = tmp_path / "sweep.jsonl"
    args = ["--policies", "static-ep", "symi-cf1", "--ranks", "2", "--steps", "10", "--seeds", "0", "1",
            "--out", str(out), "--no-wandb", "--quiet"]
    for policy, finals in {"static-ep": [2.0, 2.1], "symi-cf1": [2.2, 2.3]}.items():
        for seed, final in enumerate(finals):
            run = tmp_path / "sweep" / f"seed{seed}" / f"{policy}.jsonl"
            with Tracker("train", {}, results=run, wandb=False) as t:
                for rec in curve(policy, seed, final):
                    t.log({**rec, "load/gini_mean": 0.5}, step=rec["step"])
    convergence.main([*args, "--slim"])
    records = read_results(out)
    assert len(records) == 40 and not any(k.startswith("load/") for r in records for k in r)
    assert all("load/gini_mean" in r for r in read_results(tmp_path / "sweep" / "seed1" / "symi-cf1.jsonl"))
    table = convergence.main([*args, "--resume"])  # without it, the statistics come back
    assert all("load/gini_mean" in r for r in read_results(out))
    assert table.set_index("policy").gap_pct["symi-cf1"] == pytest.approx(100 * np.mean([2.2 / 2.0 - 1, 2.3 / 2.1 - 1]))


def test_protocol_frontier_matches_the_skew_and_decides_the_claims(tmp_path):
    """--regime: the runs' static-EP imbalance is matched by the simulated trace (both in the report), every claim
    gets a word, and the frontier's points carry intervals on both axes; a regime whose slots the memory model
    cuts is an error."""
    import json

    from lrmoe.results import read_results

    arms = ("static-ep", "symi-dropless", "lrmoe-rho0.75-unbiased", "lrmoe-rho0.75-random-unbiased")
    rng = np.random.default_rng(0)
    rows = [{"regime": "production", "stage": "sweep", "seed": s, "arm": a,
             "endpoint": 2.0 * (1 + (0.02 if "random" in a else 0.0) + rng.normal(0, 1e-3)),
             "load/rank_max_over_mean_mean": 1.12, "load/gini_mean": 0.13, "load/expert_max_over_mean_mean": 1.45}
            for s in range(3) for a in arms]
    runs = tmp_path / "runs.jsonl"
    runs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "f.jsonl"
    argv = ["--regime", "production", "--runs", str(runs), "--no-wandb", "--layers", "1", "--sim-steps", "2",
            "--sim-seeds", "2", "--planned-seeds", "4"]
    claims = frontier.main([*argv, "--out", str(out)]).set_index("claim")
    assert claims.loc["C1", "word"] == "holds" and claims.loc["C2", "word"] == "not run"
    points = [r for r in read_results(out) if "table" not in r]
    assert sorted(p["arm"] for p in points) == sorted(arms)
    assert all(p["gap_ci_low"] <= p["gap_mean"] <= p["gap_ci_high"] for p in points)
    assert all(p["time_ci_low"] <= p["time_mean"] <= p["time_ci_high"] for p in points if p["arm"] != "symi-dropless")
    report = (tmp_path / "f.md").read_text()
    assert "interim: 3 of 4 planned seeds" in report and "rank_max_over_mean" in report
    (summary,) = read_results(out, "summary")
    matched = {r["statistic"]: r for r in summary["imbalance"]}["rank_max_over_mean"]
    assert matched["simulated"] == pytest.approx(1.12, rel=0.05)
    # a regime asking for more replica slots than the memory model grants at paper scale: the axes would differ
    from dataclasses import replace

    from lrmoe.analysis.protocol import REGIMES

    greedy = replace(REGIMES["production"], spare_per_home=4.0)
    with pytest.raises(FrontierError, match="different systems"):
        regime_times(["static-ep", "symi-dropless"], greedy, 0.2, frontier.parse_args(argv))


def test_convergence_prints_the_protocol_claims_over_its_runs():
    """With both references the convergence summary carries the claim table: endpoints over the last three
    evaluations, gaps to the mean of static EP and SYMI-dropless; claims whose arms did not run say so."""
    c = curves({"static-ep": [2.0, 2.2, 2.1], "symi-dropless": [2.0, 2.2, 2.1],
                "lrmoe-rho0.75-unbiased": [2.002, 2.2022, 2.1021]})
    claims = convergence.protocol_claims(c).set_index("claim")
    assert claims.loc["C4 ρ0.75", "estimate"] == pytest.approx(100 * 0.002 / 2.2, rel=0.1)
    assert claims.loc["C4 ρ0.75", "word"] == "holds" and claims.loc["C1", "word"] == "not run"
    assert convergence.protocol_claims(curves({"static-ep": [2.0, 2.2]})) is None


def test_frontier_labels_of_nearby_points_never_overlap():
    """Two arms at nearly the same point (the weak regime's early and late selection) get labels stacked apart;
    a point far from every other keeps the default offset."""
    from lrmoe.paper_figures.frontier_figures import label_offsets

    x, y = [0.943, 0.955, 1.16, 1.017, 1.027], [0.84, 0.83, 0.0, 0.30, 0.30]
    dy = label_offsets(x, y)
    assert dy[0] == dy[2] == -2.0 and dy[1] < dy[0]  # the second of the close pair moves down
    assert dy[4] != dy[3]


def test_the_script_names_a_frontier_error_in_one_line(tmp_path, capsys):
    """The library's FrontierError reaches the command line as the script's one-line error, nothing run past it: a
    convergence file with no convergence record."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(SystemExit, match=r"^frontier.py: error: .*empty.jsonl hold no convergence records$"):
        frontier.main(["--convergence", str(empty), "--out", str(tmp_path / "f.jsonl"), "--no-wandb"])
    assert not (tmp_path / "f.jsonl").exists()
