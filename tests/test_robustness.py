"""lrmoe.analysis.robustness: the permutation and rank tests against hand-counted cases, the variants against the
protocol's own decision, and the margin's worth in steps on a curve whose answer is known."""

import numpy as np
import pytest
from scipy import stats

from lrmoe.analysis import protocol
from lrmoe.analysis.claims import decide_regime
from lrmoe.analysis.robustness import robustness_table, sign_flip_p, steps_per_loss_margin, wilcoxon_p


def test_sign_flip_counts_the_patterns_at_least_as_extreme():
    # 3 values: 8 sign patterns; only all-positive has a mean >= 2 (the observed)
    assert sign_flip_p([1.0, 2.0, 3.0], "superior", direction=+1) == pytest.approx(1 / 8)
    # the claim's side is below 0: the observed mean 2 is the least extreme of all 8
    assert sign_flip_p([1.0, 2.0, 3.0], "superior", direction=-1) == pytest.approx(1.0)
    # two-sided: +-(1+2+3)/3 are the two patterns with |mean| >= 2
    assert sign_flip_p([1.0, 2.0, 3.0], "two-sided") == pytest.approx(2 / 8)
    # non-inferiority tests the values less the margin: all three 1 below it -> only the observed pattern
    assert sign_flip_p([0.0, 0.0, 0.0], "noninferior", margin=1.0) == pytest.approx(1 / 8)


def test_wilcoxon_is_scipys_on_the_claims_quantity():
    d = np.array([-0.3, 0.2, -1.1, -0.7, 0.4, -0.9])
    assert wilcoxon_p(d, "superior", -1) == pytest.approx(stats.wilcoxon(d, alternative="less").pvalue)
    assert wilcoxon_p(d, "noninferior", margin=1.0) == pytest.approx(
        stats.wilcoxon(d - 1.0, alternative="less").pvalue)


def _runs(seeds=8, regime="production"):
    """Collected runs with curves: every arm's curve falls linearly, arm-specific offsets drawn per seed."""
    rng = np.random.default_rng(0)
    steps = list(range(protocol.EVAL_EVERY, protocol.STEPS + 1, protocol.EVAL_EVERY))
    rows = []
    for seed in range(seeds):
        for i, arm in enumerate(protocol.SWEEP_ARMS):
            shift = 0.0 if arm in protocol.REFERENCES else 0.004 * (i % 3) + rng.normal(0, 0.01)
            curve = [3.0 - 0.002 * s + shift for s in steps]
            end = float(np.mean(curve[-protocol.ENDPOINT_EVALS:]))
            rows.append({"regime": regime, "seed": seed, "arm": arm, "stage": "sweep", "endpoint": end,
                         "eval_steps": steps, "val_loss": curve})
    return rows


def test_the_protocol_variant_is_the_decided_table_and_every_variant_decides_every_claim():
    rows = _runs()
    table = robustness_table(rows, "production")
    decided = decide_regime(rows, "production")
    ours = table[table.variant == "protocol"].set_index("claim")
    for frame in (decided["claims"], decided["early_claims"]):
        for row in frame.itertuples():
            assert ours.loc[row.claim, "p_holm"] == pytest.approx(row.p_holm)
            assert ours.loc[row.claim, "word"] == row.word
    assert table.groupby("variant").size().nunique() == 1  # nine claims under every variant
    assert set(table.word) <= {"holds", "fails", "undecided"}


def test_the_step_300_variant_reads_the_last_evaluation_alone():
    rows = _runs()
    for r in rows:  # the early arm's last evaluation alone is 10 % worse: its endpoint-300 gap, not the protocol's
        if r["arm"] in protocol.EARLY_ARMS:
            r["val_loss"] = r["val_loss"][:-1] + [r["val_loss"][-1] * 1.1]
    table = robustness_table(rows, "production").set_index(["variant", "claim"])
    assert table.loc[("endpoint step 300", "E1"), "estimate"] > 9
    assert table.loc[("protocol", "E1"), "estimate"] < 1


def test_the_margin_is_worth_the_steps_a_linear_curve_takes_to_fall_one_percent():
    rows = _runs(seeds=2)
    worth = steps_per_loss_margin(rows, "production")
    # reference curve 3 - 0.002 s; endpoint = curve at s = 275 (mean of 250, 275, 300) = 2.45; 1.01 x 2.45 =
    # 2.4745 is reached at s = (3 - 2.4745) / 0.002 = 262.75
    assert worth.step_at_margin.to_numpy() == pytest.approx([262.75, 262.75])
    assert worth.steps_share.to_numpy() == pytest.approx([(275 - 262.75) / 275] * 2)
