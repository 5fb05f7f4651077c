"""How the backward chooses and moves pairs: the recalibration settings a system fixes (DESIGN.md §4 steps 4–7).

Plain data, read by the runtime's backward (:mod:`lrmoe.runtime.exchange`), by the registry of systems and by the
simulator, which prices the metric and the mode it names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lrmoe.recal.scoring import METRICS
from lrmoe.recal.selection import DEFAULT_UNIFORM_MIX, MODES

FORWARD_METRICS = ("gate", "random")  # known before the backward's delta: early selection can use them


@dataclass(frozen=True)
class BackwardConfig:
    """How the layer's backward chooses and moves pairs (the plan says how many; this says which and how).

    metric      recalibration metric of :mod:`lrmoe.recal.scoring` ("m1", "m2", "m3", "gate" or "random").
    mode        "topk" (keep the best, biased) or "unbiased" (sample p ∝ score, scale by 1/p).
    compact     pack retained rows densely (True) or send padded forward-layout buffers (False: same gradients,
                more bytes and GEMM rows).
    seed        seeds the generator of the random metric and of unbiased draws (offset by the rank).
    uniform_mix the unbiased mode's zero-score guard (:func:`lrmoe.recal.selection.select`).
    early       early selection (DESIGN.md §4): the forward selects, with a metric it already knows (the gate, or
                random), and the expert side saves activations for the kept pairs alone.
    """

    metric: str = "m1"
    mode: str = "topk"
    compact: bool = True
    seed: int = 0
    uniform_mix: float = DEFAULT_UNIFORM_MIX
    early: bool = False

    def __post_init__(self) -> None:
        if self.early and not self.compact:
            raise ValueError("BackwardConfig.early needs compact=True: the padded layout sends every forward row")
        if self.early and self.metric not in FORWARD_METRICS:
            raise ValueError(f"BackwardConfig.early selects in the forward, which knows only the metrics "
                             f"{FORWARD_METRICS}, not {self.metric!r}")
        if self.metric not in METRICS:
            raise ValueError(f"BackwardConfig.metric={self.metric!r} is not one of {METRICS}")
        if self.mode not in MODES:
            raise ValueError(f"BackwardConfig.mode={self.mode!r} is not one of {MODES}")
        if not isinstance(self.compact, bool):
            raise ValueError(f"BackwardConfig.compact must be a bool, got {self.compact!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"BackwardConfig.seed must be a non-negative int, got {self.seed!r}")
        if not self.uniform_mix >= 0:
            raise ValueError(f"BackwardConfig.uniform_mix must be non-negative, got {self.uniform_mix!r}")

    def generator(self, rank: int) -> torch.Generator:
        """The rank's own generator: every rank draws differently, every run the same."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + rank)
