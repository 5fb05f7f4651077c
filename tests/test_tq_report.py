"""The time-to-quality report over collected lines (lrmoe.analysis.tq_report, docs/protocols/time_to_quality.md §11.4):
on runs whose answer is known (a dropless curve, arms whose loss sits at a chosen r*, times at a chosen ratio) the
claims, the six robustness checks, power and the controls come out as constructed."""

import numpy as np
import pytest

from lrmoe.analysis import time_to_quality as tq
from lrmoe.analysis import tq_protocol as P
from lrmoe.analysis import tq_report as R
from lrmoe.paper_figures import tq_figures

from _tq_rows import A, B, rows_for  # noqa: F401  (A, B: the constructed curve)


def test_claims_hold_where_constructed_and_band_corner_turns_them():
    rows = rows_for()
    per_seed = tq.per_seed_table(*R.regime_frames(rows, "weak"))
    assert len(per_seed) == 10
    assert per_seed["r_star/lrmoe"].mean() == pytest.approx(1.0, abs=0.02)
    table = tq.tq_table(per_seed)
    assert (table["word"] == "holds").all()
    assert table["estimate"].mean() == pytest.approx(-15, abs=1.5)  # 0.85 / 1.0 - 1
    checks = R.robustness(rows, "weak")
    # (10 seeds: with 6 the smallest sign-flip or Wilcoxon p, 1/64, is 0.125 after Holm's x 8: they cannot hold)
    assert list(checks.columns) == ["claim", *R.CHECKS, "robust"]
    assert (checks[list(R.CHECKS[:6])] == "holds").all().all()
    # the least favourable corner puts every arm at 1.1 x 0.85 = 0.935 of the references: still a saving
    assert (checks[R.CHECKS[6]] == "holds").all() and checks["robust"].all()
    power = R.power_after(table)
    assert (power["power"] > 0.99).all() and (power["seeds_for_0.8"] <= 4).all()


def test_no_saving_fails_and_controls_reported():
    rows = rows_for(ratio=1.0, r_arm=1.0, noise=0.0005, time_noise=0.002)
    table = tq.tq_table(tq.per_seed_table(*R.regime_frames(rows, "weak")))
    assert (table["word"] == "fails").all()  # the interval's lower end is above −2 %
    ctrl = R.controls(rows, "weak")
    assert list(ctrl["arm"]) == list(P.CONTROLS)
    assert ctrl["gap_pct"].abs().max() < 1 and ctrl["r_star"].sub(1).abs().max() < 0.05
    own = R.own_ratios(rows, "weak").set_index("arm")
    assert own.loc["lrmoe", "/static-ep"] == pytest.approx(1.0, abs=0.02)
    assert R.runs_shape(rows, "weak")["rank_max_over_mean"] == pytest.approx(1.3)


def test_report_text_and_figure(tmp_path):
    rows = rows_for(seeds=3)
    text = R.regime_report(rows, "weak", planned_seeds=4, stage="pilot")
    assert "interim, 3 of 4 seeds" in text and "Robustness" in text and "Controls" in text
    table = tq.tq_table(tq.per_seed_table(*R.regime_frames(rows, "weak")))
    tq_figures.draw_claims({"weak": table})[0].savefig(tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0
    assert "No whole seed yet" in R.regime_report(rows[:5], "weak", 4, "pilot")
    # the pilot's seeds complete are still no decision (§11.5); the sweep's are
    assert "pilot, not confirmatory" in R.regime_report(rows, "weak", 3, "pilot")
    assert "Claims (final;" in R.regime_report([r | {"stage": "sweep"} for r in rows], "weak", 3, "sweep")


def test_the_claims_figure_is_drawn_from_the_results_file_alone(tmp_path):
    import json

    from lrmoe.paper_figures.reading import CannotDraw

    path = tmp_path / "tq_protocol_pilot.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows_for(seeds=3)))
    fig, axes = tq_figures.claims(path)
    assert [ax.get_title() for ax in axes[0]] == ["regime weak (3 seeds)"]
    assert len(axes[0][0].get_yticklabels()) == 8  # the family's eight claims
    table = tq.tq_table(tq.per_seed_table(*R.regime_frames(rows_for(seeds=3), "weak")))
    drawn = [x for line in axes[0][0].get_lines() for x in np.atleast_1d(line.get_xdata())]
    assert set(np.round(table["estimate"], 9)) <= set(np.round(np.asarray(drawn, dtype=float), 9))
    few = tmp_path / "few.jsonl"
    few.write_text("".join(json.dumps(r) + "\n" for r in rows_for(seeds=3)[:5]))
    with pytest.raises(CannotDraw, match="no whole seed"):
        tq_figures.claims(few)
