"""Timing for the benchmark scripts: milliseconds per call, by CUDA events on a GPU and the wall clock on CPU."""

from __future__ import annotations

import time
from typing import Callable

import torch


def time_once_ms(fn: Callable[[], object], cuda: bool = False) -> float:
    """Milliseconds of one ``fn()``: CUDA events (waited for) when ``cuda``, else ``time.perf_counter``."""
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def time_ms(fn: Callable[[], object], repeats: int, warmup: int = 0, cuda: bool = False) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn()``, after ``warmup`` untimed calls (take the median:
    times on a shared machine are noisy)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return [time_once_ms(fn, cuda) for _ in range(repeats)]
