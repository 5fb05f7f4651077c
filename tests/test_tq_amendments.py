"""What docs/protocols/time_to_quality.md §11.6 Record 3 adds to the time-to-quality report
(lrmoe.analysis.tq_amendments): on rows whose answer is constructed, the break-even micro-batch count, the r* flags, the
selection's price and the replica-gradient mode come out as built, and the registered check (6) is left as it was."""

import numpy as np
import pytest

from lrmoe.analysis import time_to_quality as tq
from lrmoe.analysis import tq_amendments as M
from lrmoe.analysis import tq_protocol as P
from lrmoe.analysis import tq_report as R

from _tq_rows import A, B, rows_for


def affine_rows(a_x=0.8, b_x=1.5, a_y=1.0, b_y=1.0, counts=(1, 8, 32)):
    """rows_for's runs (r* = 1) with band corners at ``counts`` micro-batches: the dropless systems' time
    a_y · mb + b_y, the other arms' a_x · mb + b_x (each x a little noise), the other constants central."""
    rows = rows_for(time_noise=0.0)
    rng = np.random.default_rng(2)
    for r in rows:
        if r["budget"] == 1.0:
            a, b = (a_y, b_y) if r["arm"] in tq.REFERENCES else (a_x, b_x)
            f = 1.0 + (0.0 if r["arm"] in tq.REFERENCES else 0.005 * rng.standard_normal())
            r["time_corners"] = {M.mb_key(mb): f * (a * mb + b) for mb in counts}
            r["time_s"] = r["time_corners"][M.mb_key(8)]
    return rows


def test_break_even_where_constructed():
    """t_X = 0.8 mb + 1.5 against t_Y = mb + 1 at r* = 1: q is +15 % at mb 1, +3 % at 2, −6 % at 4, −12 % at 8:
    every claim breaks even at 4, holds at 8 and 32 and not at 1; the counts 2, 4, 16 are derived exactly."""
    rows, derived = M.with_micro_batches(affine_rows())
    assert derived["derived"] == sum(r["budget"] == 1.0 for r in rows) and derived["max_rel_err"] < 1e-12
    r = next(r for r in rows if r["arm"] == "static-ep" and r["budget"] == 1.0)
    assert r["time_corners"][M.mb_key(4)] == pytest.approx(5.0, rel=1e-12)
    words, breakeven = M.micro_batch_check(rows, "weak")
    assert list(words.columns) == ["claim", *(f"mb={mb}" for mb in M.MICRO_BATCH_COUNTS)]
    assert (breakeven["break-even mb"] == 4).all()
    assert words["mb=8"].str.endswith("(holds)").all() and words["mb=32"].str.endswith("(holds)").all()
    assert not words["mb=1"].str.endswith("(holds)").any()
    # rows that carry every count are used as they are; a row that is not affine is refused
    again, d = M.with_micro_batches(affine_rows(counts=M.MICRO_BATCH_COUNTS))
    assert d["derived"] == 0
    bad = affine_rows()
    bad[3]["time_corners"][M.mb_key(32)] *= 1.01
    with pytest.raises(ValueError, match="not affine"):
        M.with_micro_batches(bad)


def test_no_break_even_and_registered_corner_unchanged():
    """An arm slower at every count has no break-even; a mb = 4 corner, however bad, does not enter check (6)."""
    rows, _ = M.with_micro_batches(affine_rows(a_x=1.1, b_x=1.1))
    _, breakeven = M.micro_batch_check(rows, "weak")
    assert breakeven["break-even mb"].isna().all()
    good = affine_rows(a_x=0.8, b_x=0.8)
    before = R.robustness(good, "weak")
    for r in good:
        if r["budget"] == 1.0 and r["arm"] not in tq.REFERENCES:
            r["time_corners"][M.mb_key(4)] = 100.0
    assert R.robustness(good, "weak").equals(before)
    assert (before[R.CHECKS[6]] == "holds").all()


def test_r_star_flags_count_as_constructed():
    """Losses put at r = 0.8 and 1.1 (extrapolated) and 0.6 and 1.2 (clipped to 0.70 and 1.15) are marked and
    counted per arm; every other r* is 1 and unmarked, as the per-seed table has it."""
    rows = rows_for(noise=0.0)
    put = {(2000, "lrmoe"): 0.8, (2001, "lrmoe"): 0.6, (2002, "lrmoe-rho0.9-unbiased"): 1.1,
           (2003, "symi-dropless-rho0.75-unbiased"): 1.2}
    for r in rows:
        if (r["seed"], r["arm"]) in put:
            r["endpoint"] = float(np.exp(A + B * put[(r["seed"], r["arm"])]))
    marks, counts = M.r_star_flags(rows, "weak")
    marks = marks.set_index("seed")
    assert marks.loc[2000, "lrmoe"] == "0.800 e" and marks.loc[2001, "lrmoe"] == "0.700 c"
    assert marks.loc[2002, "lrmoe-rho0.9-unbiased"] == "1.100 e"
    assert marks.loc[2003, "symi-dropless-rho0.75-unbiased"] == "1.150 c"
    assert marks.loc[2004, "lrmoe"] == "1.000"
    got = counts.set_index("arm")[["extrapolated", "clipped"]].T.to_dict("list")
    want = {arm: [0, 0] for arm in M.FLAG_ARMS} | {"lrmoe": [2, 1], "lrmoe-rho0.9-unbiased": [1, 0],
                                                   "symi-dropless-rho0.75-unbiased": [1, 1]}
    assert got == want and (counts["seeds"] == 10).all()
    per_seed = tq.per_seed_table(*R.regime_frames(rows, "weak")).set_index("seed")
    for arm in tq.ARMS:
        assert [float(m.split()[0]) for m in marks[arm]] == pytest.approx(per_seed[f"r_star/{arm}"], abs=5e-4)


def test_selection_sensitivity_at_x1_is_the_protocol():
    """Selection charged at f x its value moves the selecting arms' times by 5 % per unit of f: at x1 the family is
    the protocol's, and q rises with f; rows without the scaled times give no table."""
    rows = rows_for()
    assert M.selection_sensitivity(rows, "weak")[0].empty
    for r in rows:
        if r["budget"] == 1.0:
            slope = 0.0 if r["arm"] in tq.REFERENCES else 0.05
            r["time_select"] = {f"select={f:g}": r["time_s"] * (1 + slope * (f - 1)) for f in M.SELECTION_SCALES}
    sens, seeds = M.selection_sensitivity(rows, "weak")
    assert seeds == 10 and list(sens.columns) == ["claim", "x0.5", "x1", "x2", "x4"]
    protocol = tq.tq_table(tq.per_seed_table(*R.regime_frames(rows, "weak"))).set_index("claim")
    assert list(sens["x1"]) == [M.cell(protocol, c.name) for c in tq.tq_family()]
    q = sens[["x0.5", "x1", "x2", "x4"]].map(lambda s: float(s.split()[0]))
    assert (q.diff(axis=1).iloc[:, 1:] > 0).all().all()
    # one seed's arm without the scaled times: that seed leaves the sensitivity, nothing else
    rows = [r for r in rows if not (r["seed"] == 2000 and r["arm"] == "lrmoe" and r["budget"] == 1.0)] + [
        {k: v for k, v in r.items() if k != "time_select"} for r in rows
        if r["seed"] == 2000 and r["arm"] == "lrmoe" and r["budget"] == 1.0]
    assert M.selection_sensitivity(rows, "weak")[1] == 9


def test_replica_grad_modes_and_the_report_section():
    """The modes are counted per arm (a row without the training mode trained in range); the regime's report ends
    with Record 3's sections and keeps what it had."""
    rows = rows_for(seeds=3)
    for r in rows:
        if r["budget"] == 1.0:
            r["replica_grad"] = "range" if r["arm"] in tq.REFERENCES else "shard"
            if r["seed"] == 2000:
                r["train_replica_grad"] = "shard"
    modes = M.replica_grad_modes(rows, "weak").set_index("arm")
    assert modes.loc["lrmoe", "trained in"] == "range 2, shard 1" and modes.loc["lrmoe", "priced in"] == "shard 3"
    assert list(modes.index) == list(R.FULL_ARMS)
    text = R.regime_report(rows, "weak", planned_seeds=3, stage="pilot")
    assert text.index("Controls (reported") < text.index("Record 3's additions")
    for part in ("r* per seed and arm", "The selection's price: no seed", "Replica-gradient mode"):
        assert part in text
    assert P.CONTROLS[0] in text


def test_price_run_prices_every_count_affinely_and_the_selection_scaled():
    """collect's pricing (lrmoe.sim.replay.price_run): the band's corners at every micro-batch count, each exactly
    affine in the count at fixed other constants (the registered 1, 8, 32 among them); the selection's scaled
    times at the central constants, x1 the run's time, moving only a system that selects."""
    from test_tq_replay import CLUSTER, MODEL, recorded_trace

    from lrmoe.config import sensitivity_corners
    from lrmoe.sim.replay import MICRO_BATCH_COUNTS, price_run

    trace = recorded_trace(steps=4)
    for system in ("static-ep", "lrmoe-rho0.75-unbiased"):
        t = price_run(trace, system, MODEL, CLUSTER, 2048, 8, spare_slots=2, eps=0.1, gamma=0.1, warmup_steps=2)
        assert t.corners[M.mb_key(8)] == pytest.approx(t.time_s, rel=1e-15)
        for corner in ("base", *sensitivity_corners()):
            for eff in ("0.35", "0.5", "0.65"):
                y = {mb: t.corners[f"{corner}|mb={mb}|dense={eff}"] for mb in MICRO_BATCH_COUNTS}
                a = (y[8] - y[1]) / 7
                assert [a * mb + y[1] - a for mb in MICRO_BATCH_COUNTS] == pytest.approx(list(y.values()), rel=1e-12)
        assert len(t.corners) == 9 * 6 * 3
        sel = t.select_times
        assert list(sel) == ["select=0.5", "select=1", "select=2", "select=4"] and sel["select=1"] == t.time_s
        if system == "static-ep":
            assert len(set(sel.values())) == 1
        else:
            assert sel["select=0.5"] < sel["select=1"] < sel["select=2"] < sel["select=4"]
