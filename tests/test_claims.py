"""lrmoe.analysis.claims: per-seed gaps to the two-run reference, the claim family's table (Holm, decision words) and
the pilot's seed count, on synthetic runs with planted effects."""

import numpy as np
import pandas as pd
import pytest

from lrmoe.analysis.claims import (arm_gaps, arm_quality, claim_table, decide_regime, family, gap_table, quality_text,
                                   seed_plan, time_claim, time_ratios)
from lrmoe.analysis.protocol import ARMS, endpoint
from lrmoe.analysis.stats import holm

# planted gaps (%) to the reference, per arm: the metric 1.5 points better than every control; rho 0.9 harmless,
# rho 0.5 2 % worse
PLANTED = {"static-ep": 0.0, "symi-dropless": 0.0, "lrmoe-rho0.9-unbiased": 0.0, "lrmoe-rho0.75-unbiased": 0.2,
           "lrmoe-rho0.5-unbiased": 3.0, "lrmoe-rho0.75-random-unbiased": 1.7, "lrmoe-rho0.75-random": 1.7,
           "symi-dropless-rho0.75": 1.7, "symi-dropless-rho0.75-unbiased": 1.7, "lrmoe": 0.3}


def runs(seeds, sd=0.1, seed=0, drop=()):
    """Collected rows: each seed's reference loss drifts (shared by its arms), each arm adds its gap and noise."""
    rng = np.random.default_rng(seed)
    rows = []
    for s in seeds:
        base = 2.0 * (1 + rng.normal(0, 0.03))  # trajectory drift common to the seed: cancels in the gaps
        for arm in ARMS:
            if (s, arm) in drop:
                continue
            loss = base * (1 + (PLANTED[arm] + rng.normal(0, sd)) / 100)
            rows.append({"regime": "production", "seed": s, "arm": arm, "endpoint": loss})
    return rows


def test_gap_table_uses_the_mean_of_both_references_and_whole_seeds():
    rows = [{"seed": 1, "arm": "static-ep", "endpoint": 2.0}, {"seed": 1, "arm": "symi-dropless", "endpoint": 2.2},
            {"seed": 1, "arm": "lrmoe", "endpoint": 2.31},
            {"seed": 2, "arm": "static-ep", "endpoint": 2.0}, {"seed": 2, "arm": "symi-dropless", "endpoint": 2.0}]
    gaps = gap_table(rows, arms=["static-ep", "symi-dropless", "lrmoe"])
    assert list(gaps.index) == [1]  # seed 2 has no lrmoe run: not a whole seed
    assert gaps.loc[1, "lrmoe"] == pytest.approx(10.0)  # 2.31 / 2.1 - 1 (static EP alone: 15.5)
    assert gaps.loc[1, "static-ep"] == pytest.approx(-100 * 0.1 / 2.1)
    with pytest.raises(ValueError, match="reference"):
        gap_table([{"seed": 1, "arm": "lrmoe", "endpoint": 2.0}])


def test_claim_table_decides_planted_effects():
    table = claim_table(gap_table(runs(range(12)))).set_index("claim")
    assert table.loc["C1", "word"] == "holds" and table.loc["C1", "estimate"] == pytest.approx(-1.5, abs=0.15)
    assert table.loc["C2", "word"] == "holds"
    assert table.loc["C3", "word"] == "fails"  # the two random controls are planted equal: inside ±0.5 points
    assert table.loc["C4 ρ0.9", "word"] == "holds" and table.loc["C4 ρ0.75", "word"] == "holds"
    assert table.loc["C4 ρ0.5", "word"] == "fails"
    # Holm: adjusted p never below the raw one, and the intervals contain the planted values
    assert (table.p_holm >= table.p - 1e-12).all()
    assert table.p_holm.to_numpy() == pytest.approx(holm(table.p.to_numpy()))  # one family of seven
    assert table.loc["C4 ρ0.5", "ci_low"] < 3.0 < table.loc["C4 ρ0.5", "ci_high"]


def test_claims_on_too_few_or_missing_arms_are_not_tested():
    rows = [r for r in runs(range(3)) if r["arm"] != "symi-dropless-rho0.75"]
    table = claim_table(gap_table(rows)).set_index("claim")
    assert table.loc["C2", "word"] == "not run" and np.isnan(table.loc["C2"].get("p", np.nan))
    assert (claim_table(gap_table(runs([5]))).word == "too few seeds").all()
    noisy = claim_table(gap_table(runs(range(3), sd=3.0))).set_index("claim")
    assert noisy.loc["C4 ρ0.75", "word"] == "undecided"


def test_seed_plan_from_a_pilot():
    pilot = gap_table(runs(range(4), sd=1.0, seed=3), arms=["static-ep", "symi-dropless", "lrmoe-rho0.75-unbiased",
                                                            "lrmoe-rho0.75-random-unbiased"])
    plan = seed_plan(pilot).set_index("claim")
    assert plan.loc["C1", "sd_from"] == "pilot" and plan.loc["C4 ρ0.75", "sd_from"] == "pilot"
    assert plan.loc["C2", "sd_from"] == "largest pilot sd"
    assert plan.loc["C2", "sd"] == pytest.approx(plan.loc[["C1", "C4 ρ0.75"], "sd"].max())
    assert plan.loc["C1", "alpha"] == pytest.approx(0.05 / len(family()))
    assert (plan.seeds_needed >= 2).all() and plan.capped.dtype == bool


def test_endpoint_is_the_mean_of_the_last_three_evaluations_of_a_finished_run():
    assert endpoint([25, 250, 275, 300], [9.0, 2.0, 2.2, 2.4]) == pytest.approx(2.2)
    assert np.isnan(endpoint([25, 250, 275], [9.0, 2.0, 2.2]))  # unfinished: no endpoint
    assert isinstance(pd.DataFrame(runs([1])), pd.DataFrame)


def test_frontier_axes_carry_intervals_and_the_time_claim_takes_the_deepest_rho_that_holds():
    gaps = gap_table(runs(range(12)))
    y = arm_gaps(gaps).set_index("arm")
    assert y.loc["lrmoe-rho0.5-unbiased", "gap_ci_low"] < 3.0 < y.loc["lrmoe-rho0.5-unbiased", "gap_ci_high"]
    assert (y.gap_n == 12).all()
    # simulated times: SYMI-dropless 100 ms, LRMoE at rho 0.75 80 +- 2 ms, over 5 trace seeds
    times = pd.DataFrame({"symi-dropless": [100.0, 100.0, 100.0, 100.0, 100.0],
                          "lrmoe-rho0.9-unbiased": [90.0, 91.0, 89.0, 90.0, 90.0],
                          "lrmoe-rho0.75-unbiased": [80.0, 82.0, 78.0, 81.0, 79.0],
                          "lrmoe-rho0.5-unbiased": [60.0] * 5})
    x = time_ratios(times).set_index("arm")
    assert x.loc["lrmoe-rho0.75-unbiased", "time_mean"] == pytest.approx(0.8)
    assert x.loc["lrmoe-rho0.75-unbiased", "time_ci_low"] < 0.8 < x.loc["lrmoe-rho0.75-unbiased", "time_ci_high"]
    c5 = time_claim(claim_table(gaps), time_ratios(times))
    # rho 0.9 and 0.75 hold, 0.5 fails: the time claim is at 0.75
    assert [r["arm"] for r in c5] == ["lrmoe-rho0.75-unbiased"] and c5[0]["time_vs_dropless"] == pytest.approx(0.8)
    with pytest.raises(ValueError, match="reference"):
        time_ratios(times.drop(columns="symi-dropless"))


def test_early_family_is_its_own_and_never_costs_the_main_table_a_seed():
    """docs/protocols/frontier.md §10.6: the early arm (added after seed 0 ran) is read over its own whole seeds, in a
    Holm family of two; the main family keeps every seed whose ten arms finished."""
    from lrmoe.analysis.claims import early_family, family_gaps
    from lrmoe.analysis.protocol import EARLY_ARMS, SWEEP_ARMS

    rows = runs(range(10))
    rng = np.random.default_rng(1)
    refs = {s: np.mean([r["endpoint"] for r in rows if r["seed"] == s and r["arm"] in ("static-ep", "symi-dropless")])
            for s in range(10)}
    # planted: early selection 2 points worse than the reference, and 1.8 points worse than late selection (m2)
    rows += [{"regime": "production", "seed": s, "arm": EARLY_ARMS[0],
              "endpoint": refs[s] * (1 + (2.0 + rng.normal(0, 0.1)) / 100)} for s in range(1, 10)]  # not seed 0
    main, early = family_gaps(rows, SWEEP_ARMS)
    assert list(main.index) == list(range(10)) and list(early.index) == list(range(1, 10))
    table = claim_table(early, early_family()).set_index("claim")
    assert table.loc["E1", "word"] == "fails" and table.loc["E2", "word"] == "holds"
    assert table.loc["E2", "estimate"] == pytest.approx(1.8, abs=0.2)
    assert table.p_holm.to_numpy() == pytest.approx(holm(table.p.to_numpy()))  # a family of two


def test_arm_quality_gives_each_arm_its_gap_claim_interim_until_the_planned_seeds():
    """decide_regime reads the sweep's runs of one regime only (a pilot row or another regime's never enters), and
    arm_quality maps each arm with a gap claim to its word: planted harmless rho 0.9 holds, rho 0.5 fails; final only
    at the planned seed count; the references are the reference; no whole seeds, no entry."""
    rows = [{**r, "stage": "sweep"} for r in runs(range(12))]
    noise = [{**r, "stage": "pilot", "endpoint": 9.0} for r in runs(range(12, 14))]
    other = [{**r, "stage": "sweep", "regime": "weak", "endpoint": r["endpoint"] * 1.5} for r in runs(range(12))]
    q = arm_quality(rows + noise + other, "production", planned=12)
    assert q["static-ep"] == q["symi-dropless"] == {"word": "reference"}
    assert q["lrmoe-rho0.9-unbiased"]["claim"] == "C4 ρ0.9" and q["lrmoe-rho0.9-unbiased"]["word"] == "holds"
    assert q["lrmoe-rho0.5-unbiased"]["word"] == "fails" and q["lrmoe"]["claim"] == "C4 cap"
    assert q["lrmoe-rho0.5-unbiased"]["seeds"] == 12 and q["lrmoe-rho0.5-unbiased"]["final"]
    assert "lrmoe-rho0.75-random" not in q  # a control: no gap claim of its own
    text = quality_text(q["lrmoe-rho0.9-unbiased"])
    assert text.startswith("C4 ρ0.9 holds (") and text.endswith("12 seeds, final)")
    assert arm_quality(rows, "production", planned=16)["lrmoe"]["final"] is False
    assert "interim" in quality_text(arm_quality(rows, "production", planned=16)["lrmoe"])
    assert quality_text(None).endswith("unmeasured")
    assert arm_quality(noise, "production") == {} and arm_quality(rows, "weak") == {}
    # an arm that never ran has no entry, not a NaN estimate under "not run"
    missing = arm_quality([r for r in rows if r["arm"] != "lrmoe-rho0.9-unbiased"], "production", planned=12)
    assert "lrmoe-rho0.9-unbiased" not in missing and missing["lrmoe"]["word"] == "holds"
    with pytest.raises(ValueError, match="whole seed"):
        decide_regime(rows[: len(ARMS)], "production")
