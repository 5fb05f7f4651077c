"""Small helpers shared across the package: argument checks and exact integer apportionment.

The checks raise ``ValueError`` naming the argument and its value, and return the value (normalised) so a
constructor can check and assign in one line. :func:`apportion` splits integer totals in proportion to integer
weights, exactly; the planner (capacity splits, quotas, backward routing) and the selection share it. Its
arithmetic runs in NumPy (on arrays of a few hundred entries torch's per-call overhead would dominate): the
``*_array`` forms take and return int64 arrays, the plain forms torch tensors.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

APPORTION_RULES = ("cumulative", "largest_remainder")


# --- argument checks ------------------------------------------------------------------------------------------

def positive_int(name: str, value) -> int:
    """``value`` if it is an int > 0 (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def non_negative_int(name: str, value) -> int:
    """``value`` if it is an int >= 0 (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


def check_fraction(name: str, value: float, upper: float | None) -> float:
    """``value`` as a float if it is a finite number in [0, upper] (upper None: no upper bound)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0 or (upper is not None and value > upper):
        raise ValueError(f"{name} must be in [0, {upper if upper is not None else 'inf'}), got {value!r}")
    return float(value)


def check_positive_number(name: str, value: float) -> float:
    """``value`` as a float if it is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    return float(value)


def check_cf(cf: float) -> float:
    """A capacity factor: a positive finite number."""
    return check_positive_number("cf", cf)


def positive_fields(obj, *names: str) -> None:
    """Raise unless every named attribute of ``obj`` (a config dataclass) is > 0."""
    for name in names:
        value = getattr(obj, name)
        if not value > 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be positive, got {value!r}")


def non_negative_fields(obj, *names: str) -> None:
    """Raise unless every named attribute of ``obj`` (a config dataclass) is >= 0."""
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            raise ValueError(f"{type(obj).__name__}.{name} must be non-negative, got {value!r}")


# --- apportionment ----------------------------------------------------------------------------------------------

def _zero_weight_error(what: str, total: np.ndarray, weight: np.ndarray) -> None:
    bad = np.flatnonzero((weight == 0) & (total > 0))
    if len(bad):
        raise ValueError(f"apportion: {what} {bad[0]} has total {int(total[bad[0]])} but zero weight")


def apportion_array(total_S: np.ndarray, weight_K: np.ndarray, segment_K: np.ndarray,
                    rule: str = "cumulative") -> np.ndarray:
    """:func:`apportion` on int64 NumPy arrays (no rule check)."""
    S, K = len(total_S), len(weight_K)
    W_S = np.bincount(segment_K, weights=weight_K, minlength=S).astype(np.int64)
    _zero_weight_error("segment", total_S, W_S)
    if rule == "largest_remainder":
        W_K = np.maximum(W_S, 1)[segment_K]
        scaled_K = total_S[segment_K] * weight_K
        share_K = scaled_K // W_K
        remainder_K = scaled_K - share_K * W_K
        leftover_S = total_S - np.bincount(segment_K, weights=share_K, minlength=S).astype(np.int64)
        order = np.lexsort((-remainder_K, segment_K))  # by segment, largest remainder first, then index
        size_S = np.bincount(segment_K, minlength=S)
        position_K = np.empty_like(order)
        position_K[order] = np.arange(K) - (np.cumsum(size_S) - size_S)[segment_K[order]]
        return share_K + (position_K < leftover_S[segment_K])
    order = None
    if K > 1 and (segment_K[1:] < segment_K[:-1]).any():
        order = np.argsort(segment_K, kind="stable")
        segment_K, weight_K = segment_K[order], weight_K[order]
    before_S = np.cumsum(W_S) - W_S  # weight of all earlier segments
    upto_K = np.cumsum(weight_K) - before_S[segment_K]
    cum_share_K = total_S[segment_K] * upto_K // np.maximum(W_S, 1)[segment_K]
    alloc_K = cum_share_K.copy()
    if K > 1:
        alloc_K[1:] -= cum_share_K[:-1] * (segment_K[1:] == segment_K[:-1])
    if order is None:
        return alloc_K
    out = np.empty_like(alloc_K)
    out[order] = alloc_K
    return out


def apportion_rows_array(total_R: np.ndarray, weight_RK: np.ndarray) -> np.ndarray:
    """:func:`apportion_rows` on int64 NumPy arrays."""
    W_R = weight_RK.sum(1)
    _zero_weight_error("row", total_R, W_R)
    cum_share_RK = total_R[:, None] * np.cumsum(weight_RK, 1) // np.maximum(W_R, 1)[:, None]
    alloc_RK = cum_share_RK.copy()
    alloc_RK[:, 1:] -= cum_share_RK[:, :-1]
    return alloc_RK


def long_array(t: Tensor) -> np.ndarray:
    """A tensor as an int64 NumPy array on the host."""
    return t.detach().cpu().long().numpy()


def apportion(total_S: Tensor, weight_K: Tensor, segment_K: Tensor, rule: str = "cumulative") -> Tensor:
    """Split each integer total_S[s] over the items k with segment_K[k] = s, in proportion to weight_K.

    Exact integer arithmetic; sums are exact, every item gets the floor or the ceiling of its share
    T·w_k / W, zero weights get nothing, and when T <= W no item gets more than its weight. Two rules for
    where the rounding units fall:

    * "cumulative" (default, no sort when segments are contiguous and in order): in item order, item k gets
      floor(T·W_{<=k} / W) - floor(T·W_{<k} / W), W_{<=k} the segment's weights up to and including k;
    * "largest_remainder": floor(T·w_k / W) each, the leftover units one each to the largest remainders,
      ties to the lower item index (one sort of K items).

    Raises ``ValueError`` when a segment with a positive total has zero weight. LongTensor[K] on
    weight_K's device.
    """
    if rule not in APPORTION_RULES:
        raise ValueError(f"apportion: rule={rule!r} is not one of {APPORTION_RULES}")
    out = apportion_array(long_array(total_S), long_array(weight_K), long_array(segment_K), rule)
    return torch.from_numpy(out).to(weight_K.device)


def apportion_rows(total_R: Tensor, weight_RK: Tensor) -> Tensor:
    """:func:`apportion` with rule "cumulative" where segment r is row r of a dense [R, K] weight matrix."""
    return torch.from_numpy(apportion_rows_array(long_array(total_R), long_array(weight_RK))).to(weight_RK.device)
