"""Kernels of the MoE layer, each a Triton kernel beside a torch reference (imported as ``lrmoe.kernels``).

* :mod:`.compact` -- pack kept token-expert pairs by (destination rank, expert) and unpack them back to token
  order with a weighted sum, deterministic (prefix sums, no atomics), as autograd functions;
* :mod:`.grouped_gemm` -- variable-size grouped GEMM (forward, dX, dW) and the SwiGLU expert MLP;
* :mod:`.dispatch` -- which implementation runs (compiled Triton, the Triton interpreter, torch) and why.

Triton itself is imported only when a Triton backend first runs, so the torch paths work without it.
"""

from .compact import CompactPlan, compact_plan, pack, unpack
from .dispatch import BACKENDS, BackendChoice, active_backend, choose_backend, use_backend
from .grouped_gemm import grouped_mm, grouped_mm_dw, swiglu_experts

__all__ = ["BACKENDS", "BackendChoice", "CompactPlan", "active_backend", "choose_backend", "compact_plan",
           "grouped_mm", "grouped_mm_dw", "pack", "swiglu_experts", "unpack", "use_backend"]
