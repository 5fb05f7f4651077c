"""Which implementation a kernel op runs, and why: compiled Triton, the Triton interpreter, or the torch reference.

Every public op of ``lrmoe.kernels`` takes ``backend=None`` and asks :func:`choose_backend`. The first of these
that is set wins:

1. the op's ``backend=`` argument;
2. the innermost :func:`use_backend` context;
3. the environment variable ``LRMOE_KERNEL_BACKEND`` (``auto`` or empty means: not set);
4. automatic: CUDA tensors -> ``triton``; ``TRITON_INTERPRET=1`` -> ``interpret``; otherwise ``torch``.

A forced backend that cannot run here (``triton`` on CPU tensors, ``interpret`` without ``TRITON_INTERPRET=1``)
raises ``ValueError`` instead of quietly falling back. :func:`active_backend` reports the choice and its reason.

Triton decides at import time whether ``@triton.jit`` builds compiled or interpreted kernels, so
``TRITON_INTERPRET`` must be set before the ``*_triton`` modules are imported; they are imported lazily, on the
first launch, and :func:`check_kernel_mode` refuses a launch whose kernel mode disagrees with the backend.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

import torch

BACKENDS = ("triton", "interpret", "torch")
BACKEND_ENV = "LRMOE_KERNEL_BACKEND"
_TRUE = ("1", "true", "on", "yes")

# The innermost use_backend() name; a ContextVar so threads and async tasks do not see each other's choice.
_FORCED: ContextVar[str | None] = ContextVar("lrmoe_kernel_backend", default=None)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The arithmetic dtype every backend of the row movement computes in: float32 (bf16/fp16 upcast), float64 for
    float64 data."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class BackendChoice:
    """The backend an op runs on (one of :data:`BACKENDS`) and a sentence saying why."""

    name: str
    reason: str


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` asks Triton to interpret kernels (parsed as Triton parses it)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _check_name(name: str, where: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"{where}: unknown kernel backend {name!r}; choose one of {BACKENDS}")
    return name


class _Probe:
    """Stands in for a tensor when only a device is known (:func:`active_backend`)."""

    def __init__(self, device: str | torch.device):
        self.device = torch.device(device)


def _device_of(tensors) -> torch.device:
    for t in tensors:
        if isinstance(t, (torch.Tensor, _Probe)):
            return t.device
    return torch.device("cpu")


def _unavailable(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run on ``device`` here, or None when it can."""
    if name == "torch":
        return None
    if not triton_installed():
        return "triton is not installed"
    if name == "triton":
        if device.type != "cuda":
            return f"compiled Triton needs CUDA tensors, got tensors on {device}"
        if interpreter_enabled():
            return "TRITON_INTERPRET=1 is set, so Triton kernels are interpreted, not compiled"
        return None
    if not interpreter_enabled():  # name == "interpret"
        return "TRITON_INTERPRET=1 is not set (it must be set before the kernels are imported)"
    return None


def choose_backend(*tensors: torch.Tensor | None, backend: str | None = None) -> BackendChoice:
    """The backend for an op on ``tensors`` (their first tensor's device decides), with the reason."""
    device = _device_of(tensors)
    if backend is not None:
        name, source = _check_name(backend, "backend argument"), f"backend={backend!r} was passed"
    elif _FORCED.get() is not None:
        name, source = _FORCED.get(), f"inside use_backend({_FORCED.get()!r})"
    elif os.environ.get(BACKEND_ENV, "").strip().lower() not in ("", "auto"):
        value = os.environ[BACKEND_ENV].strip().lower()
        name, source = _check_name(value, f"environment variable {BACKEND_ENV}"), f"{BACKEND_ENV}={value}"
    else:
        if device.type == "cuda" and triton_installed() and not interpreter_enabled():
            return BackendChoice("triton", "automatic: CUDA tensors, compiled Triton kernels")
        if interpreter_enabled() and triton_installed():
            return BackendChoice("interpret", "automatic: TRITON_INTERPRET=1, Triton kernels run in the interpreter")
        return BackendChoice("torch", f"automatic: tensors on {device} and TRITON_INTERPRET is not set")
    why_not = _unavailable(name, device)
    if why_not is not None:
        raise ValueError(f"kernel backend {name!r} ({source}) cannot run here: {why_not}")
    return BackendChoice(name, source)


def active_backend(device: str | torch.device = "cpu", backend: str | None = None) -> BackendChoice:
    """The backend an op on tensors of ``device`` would run on now, and why (for logs and notebooks)."""
    return choose_backend(_Probe(device), backend=backend)


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Force every op inside the block onto backend ``name`` (``None`` or ``"auto"``: automatic choice)."""
    if name == "auto":
        name = None
    if name is not None:
        _check_name(name, "use_backend")
    token = _FORCED.set(name)
    try:
        yield
    finally:
        _FORCED.reset(token)


def kernel_is_interpreted(kernel) -> bool:
    """Whether a ``@triton.jit`` (or autotuned) kernel object was built for the interpreter."""
    while hasattr(kernel, "fn") and type(kernel).__name__ != "InterpretedFunction":
        kernel = kernel.fn  # unwrap Autotuner / Heuristics
    return type(kernel).__name__ == "InterpretedFunction"


def check_kernel_mode(backend: str, interpreted: bool) -> None:
    """Refuse to launch kernels whose build mode (compiled / interpreted) disagrees with ``backend``."""
    if backend == "interpret" and not interpreted:
        raise ValueError("backend 'interpret': the Triton kernels were imported compiled; set TRITON_INTERPRET=1 "
                         "before lrmoe.kernels launches its first kernel")
    if backend == "triton" and interpreted:
        raise ValueError("backend 'triton': the Triton kernels were imported under TRITON_INTERPRET=1 and are "
                         "interpreted; unset it before the first launch to compile them")
