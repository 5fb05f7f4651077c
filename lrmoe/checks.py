"""Small helpers shared across the package: argument checks (and the memory a check before launch is bounded by)
and exact integer apportionment.

The checks raise ``ValueError`` naming the argument and its value, and return the value (normalised) so a
constructor can check and assign in one line. :func:`apportion` splits integer totals in proportion to integer
weights, exactly; the planner (capacity splits, quotas, backward routing) and the selection share it. Its
arithmetic runs in NumPy (on arrays of a few hundred entries torch's per-call overhead would dominate): the
``*_array`` forms take and return int64 arrays, the plain forms torch tensors.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where a tensor is handled, so the command-line types load without it
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
        raise ValueError(f"{name} must be in [0, {upper}], got {value!r}" if upper is not None else
                         f"{name} must be non-negative, got {value!r}")
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


def available_memory_bytes() -> int | None:
    """The memory this machine can still give a new job, or None when it cannot be read: the smaller of Linux's
    MemAvailable and the room left under the process's cgroup limit (a container's bound); elsewhere the free
    physical pages. The bound of a memory check before launch."""
    found = [v for v in (_meminfo_available(), _cgroup_room()) if v is not None]
    if found:
        return min(found)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")), None)
    except OSError:
        return None


def _cgroup_room() -> int | None:
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and usage is not None and limit < 2**60:  # v1 writes a huge number for no limit
            return max(limit - usage, 0)
    return None


# --- apportionment ----------------------------------------------------------------------------------------------

def check_placement(placement_NS: Tensor, num_experts: int, num_ranks: int | None = None,
                    name: str = "placement_NS") -> None:
    """Raise ``ValueError`` unless ``placement_NS`` is a non-empty long [N, S] tensor of experts in [-1, E) (-1: an
    empty slot), with one row per rank when ``num_ranks`` is given."""
    import torch

    if not isinstance(placement_NS, torch.Tensor) or placement_NS.dim() != 2 or placement_NS.dtype != torch.long:
        raise ValueError(f"{name} must be a 2-D long tensor [ranks, slots], got "
                         f"{getattr(placement_NS, 'dtype', type(placement_NS))} of shape "
                         f"{tuple(getattr(placement_NS, 'shape', ()))}")
    if num_ranks is not None and placement_NS.shape[0] != num_ranks:
        raise ValueError(f"{name} has {placement_NS.shape[0]} rows, expected one per rank ({num_ranks})")
    if placement_NS.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(placement_NS.shape)})")
    lo, hi = int(placement_NS.min()), int(placement_NS.max())
    if lo < -1 or hi >= num_experts:
        raise ValueError(f"{name} holds expert ids in [{lo}, {hi}]; valid ids are -1 (empty) to "
                         f"num_experts-1={num_experts - 1}")


def _zero_weight_error(what: str, total: np.ndarray, weight: np.ndarray) -> None:
    bad = np.flatnonzero((weight == 0) & (total > 0))
    if len(bad):
        raise ValueError(f"apportion: {what} {bad[0]} has total {int(total[bad[0]])} but zero weight")


def apportion_array(total_Y: np.ndarray, weight_Z: np.ndarray, segment_Z: np.ndarray,
                    rule: str = "cumulative") -> np.ndarray:
    """:func:`apportion` on int64 NumPy arrays (no rule check). Y: segments, Z: items (local letters)."""
    Y, Z = len(total_Y), len(weight_Z)
    W_Y = np.bincount(segment_Z, weights=weight_Z, minlength=Y).astype(np.int64)
    _zero_weight_error("segment", total_Y, W_Y)
    if rule == "largest_remainder":
        W_Z = np.maximum(W_Y, 1)[segment_Z]
        scaled_Z = total_Y[segment_Z] * weight_Z
        share_Z = scaled_Z // W_Z
        remainder_Z = scaled_Z - share_Z * W_Z
        leftover_Y = total_Y - np.bincount(segment_Z, weights=share_Z, minlength=Y).astype(np.int64)
        order = np.lexsort((-remainder_Z, segment_Z))  # by segment, largest remainder first, then index
        size_Y = np.bincount(segment_Z, minlength=Y)
        position_Z = np.empty_like(order)
        position_Z[order] = np.arange(Z) - (np.cumsum(size_Y) - size_Y)[segment_Z[order]]
        return share_Z + (position_Z < leftover_Y[segment_Z])
    order = None
    if Z > 1 and (segment_Z[1:] < segment_Z[:-1]).any():
        order = np.argsort(segment_Z, kind="stable")
        segment_Z, weight_Z = segment_Z[order], weight_Z[order]
    before_Y = np.cumsum(W_Y) - W_Y  # weight of all earlier segments
    upto_Z = np.cumsum(weight_Z) - before_Y[segment_Z]
    cum_share_Z = total_Y[segment_Z] * upto_Z // np.maximum(W_Y, 1)[segment_Z]
    alloc_Z = cum_share_Z.copy()
    if Z > 1:
        alloc_Z[1:] -= cum_share_Z[:-1] * (segment_Z[1:] == segment_Z[:-1])
    if order is None:
        return alloc_Z
    out = np.empty_like(alloc_Z)
    out[order] = alloc_Z
    return out


def apportion_rows_array(total_R: np.ndarray, weight_RZ: np.ndarray) -> np.ndarray:
    """:func:`apportion_rows` on int64 NumPy arrays."""
    W_R = weight_RZ.sum(1)
    _zero_weight_error("row", total_R, W_R)
    cum_share_RZ = total_R[:, None] * np.cumsum(weight_RZ, 1) // np.maximum(W_R, 1)[:, None]
    alloc_RZ = cum_share_RZ.copy()
    alloc_RZ[:, 1:] -= cum_share_RZ[:, :-1]
    return alloc_RZ


def long_array(t: Tensor) -> np.ndarray:
    """A tensor as an int64 NumPy array on the host."""
    return t.detach().cpu().long().numpy()


def apportion(total_Y: Tensor, weight_Z: Tensor, segment_Z: Tensor, rule: str = "cumulative") -> Tensor:
    """Split each integer total_Y[y] over the items z with segment_Z[z] = y, in proportion to weight_Z.

    Exact integer arithmetic; sums are exact, every item gets the floor or the ceiling of its share
    T·w_k / W, zero weights get nothing, and when T <= W no item gets more than its weight. Two rules for
    where the rounding units fall:

    * "cumulative" (default, no sort when segments are contiguous and in order): in item order, item k gets
      floor(T·W_{<=k} / W) - floor(T·W_{<k} / W), W_{<=k} the segment's weights up to and including k;
    * "largest_remainder": floor(T·w_k / W) each, the leftover units one each to the largest remainders,
      ties to the lower item index (one sort of Z items).

    Raises ``ValueError`` when a segment with a positive total has zero weight. LongTensor[Z] on
    weight_Z's device.
    """
    if rule not in APPORTION_RULES:
        raise ValueError(f"apportion: rule={rule!r} is not one of {APPORTION_RULES}")
    import torch

    out = apportion_array(long_array(total_Y), long_array(weight_Z), long_array(segment_Z), rule)
    return torch.from_numpy(out).to(weight_Z.device)


def apportion_rows(total_R: Tensor, weight_RZ: Tensor) -> Tensor:
    """:func:`apportion` with rule "cumulative" where segment r is row r of a dense [R, Z] weight matrix."""
    import torch

    return torch.from_numpy(apportion_rows_array(long_array(total_R), long_array(weight_RZ))).to(weight_RZ.device)
