"""lrmoe.analysis.time_to_quality and lrmoe.traces.rescale (docs/protocols/time_to_quality.md §11.3): the step fraction
read off a dropless curve whose answer is known, the time-to-quality quantity's sign, the claims' decision, and a
recorded trace at paper scale keeping every row's expert shares."""

import numpy as np
import pandas as pd
import pytest

from lrmoe.analysis.time_to_quality import (ARMS, BUDGETS, REFERENCES, fit_curve, per_seed_table, r_star,
                                            r_star_interpolated, time_to_quality, tq_table)
from lrmoe.traces.rescale import layer_map, to_paper_scale
from lrmoe.traces.trace import Trace


def test_the_fit_recovers_an_exponential_curve_and_r_star_inverts_it():
    fit = fit_curve(BUDGETS, [np.exp(1.0 - 0.5 * r) for r in BUDGETS])
    assert (fit.a, fit.b) == pytest.approx((1.0, -0.5))
    assert r_star(np.exp(1.0 - 0.5 * 0.93), fit) == pytest.approx(0.93)
    assert r_star(np.exp(1.0 - 0.5 * 5), fit) == 1.15  # far beyond the curve: clipped to the range


def test_a_curve_that_does_not_fall_has_no_step_fraction():
    with pytest.raises(ValueError, match="does not fall"):
        fit_curve(BUDGETS, [2.0, 2.0, 2.1, 2.2])


def test_interpolation_is_linear_between_budgets_and_monotone():
    budgets, ends = [0.85, 0.9, 0.95, 1.0], [2.30, 2.20, 2.25, 2.10]  # 0.95 is noisy: the running minimum is 2.20
    assert r_star_interpolated(2.15, budgets, ends) == pytest.approx(0.95 + 0.05 * (2.20 - 2.15) / (2.20 - 2.10))
    assert r_star_interpolated(2.25, budgets, ends) == pytest.approx(0.875)
    assert r_star_interpolated(2.35, budgets, ends) == pytest.approx(0.825)  # extended from the first two


def test_time_to_quality_is_negative_exactly_when_x_is_faster_than_the_step_fraction():
    assert time_to_quality(0.9, 1.0, 0.95) < 0 < time_to_quality(0.97, 1.0, 0.95)
    assert time_to_quality(0.95, 1.0, 0.95) == pytest.approx(0.0)


def _frames(seeds=6, arm_r=0.97, arm_t=0.90, noise=0.0):
    rng = np.random.default_rng(1)
    ends, times = [], []
    for seed in range(seeds):
        curve = lambda r: float(np.exp(0.7 - 0.3 * r))  # noqa: E731
        for b in BUDGETS[:-1]:
            ends.append({"seed": seed, "arm": "static-ep", "budget": b, "endpoint": curve(b)})
        for ref in REFERENCES:
            ends.append({"seed": seed, "arm": ref, "budget": 1.0, "endpoint": curve(1.0)})
            times.append({"seed": seed, "arm": ref, "time": 1.0})
        for arm in ARMS:
            ends.append({"seed": seed, "arm": arm, "budget": 1.0, "endpoint": curve(arm_r)})
            times.append({"seed": seed, "arm": arm, "time": arm_t + rng.normal(0, noise)})
    return pd.DataFrame(ends), pd.DataFrame(times)


def test_per_seed_quantities_from_a_known_curve():
    ends, times = _frames()
    table = per_seed_table(ends, times)
    assert len(table) == 6
    assert table[f"r_star/{ARMS[0]}"].to_numpy() == pytest.approx([0.97] * 6)
    assert table[f"q/{ARMS[0]}/{REFERENCES[0]}"].to_numpy() == pytest.approx([100 * (0.90 / 0.97 - 1)] * 6)


def test_the_claims_hold_when_every_seed_saves_and_fail_when_none_is_left():
    ends, times = _frames(noise=0.005)
    words = tq_table(per_seed_table(ends, times)).word
    assert len(words) == 8 and set(words) == {"holds"}
    ends, times = _frames(arm_t=0.985, noise=0.002)  # q = +1.5 % +- a little: no 2 % saving left
    assert set(tq_table(per_seed_table(ends, times)).word) == {"fails"}


def test_rescaling_keeps_each_rows_shares_and_maps_layers():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 30, size=(3, 2, 4, 16)).astype(np.int64)
    counts[..., 0] += 1  # no empty row
    paper = to_paper_scale(Trace(counts, {"source": "recorded"}), num_layers=6, tokens_per_rank=2048,
                           micro_batches=2, top_k=4)
    out = paper.counts_array()
    assert out.shape == (3, 6, 4, 16) and (out.sum(-1) == 2048 * 4 * 2).all()
    assert layer_map(2, 6).tolist() == [0, 0, 0, 1, 1, 1]
    share = counts[:, [0, 0, 0, 1, 1, 1]] / counts[:, [0, 0, 0, 1, 1, 1]].sum(-1, keepdims=True)
    assert np.abs(out - share * 2048 * 8).max() < 1  # floor or ceiling of the exact share
    assert paper.meta["micro_batches"] == 2 and paper.meta["source"] == "recorded, rescaled"
    with pytest.raises(ValueError, match="experts"):
        to_paper_scale(Trace(counts), 6, 2048, top_k=4, num_experts=128)
