"""Collected lines of the time-to-quality protocol whose answer is known, for the report's and the figure's tests."""

import numpy as np

from lrmoe.analysis import time_to_quality as tq
from lrmoe.analysis import tq_protocol as P

A, B = 1.2, -0.3  # log d(r) = A + B r


def rows_for(seeds=10, ratio=0.85, r_arm=1.0, noise=0.002, time_noise=0.01, regime="weak"):
    """Collected lines of ``seeds`` whole seeds: static EP's endpoints on the curve, every full-budget arm's loss
    at the curve's value at ``r_arm``, its time ``ratio`` x the dropless systems' (2.0 s), with a little noise."""
    rng = np.random.default_rng(1)
    rows = []
    for seed in range(2000, 2000 + seeds):
        for arm, budget in P.SEED_RUNS:
            r = budget if arm in ("static-ep", "symi-dropless") else r_arm
            loss = float(np.exp(A + B * r) * (1 + noise * rng.standard_normal()))
            row = {"stage": "pilot", "regime": regime, "seed": seed, "arm": arm, "budget": budget,
                   "endpoint": loss, "val_loss": [loss + 0.01, loss, loss],
                   "shape": {"rank_max_over_mean": 1.3, "gini": 0.3, "expert_max_over_mean": 2.5}}
            if budget == 1.0:
                dropless = arm in ("static-ep", "symi-dropless")
                t = 2.0 if dropless else 2.0 * ratio * (1 + time_noise * rng.standard_normal())
                row |= {"time_s": t, "time_corners": {"base|mb=8|dense=0.5": t, "low": t * 0.97,
                                                      "high": t * (1.1 if arm not in tq.REFERENCES else 1.0)}}
            rows.append(row)
    return rows
