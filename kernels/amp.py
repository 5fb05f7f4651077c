"""Autocast for the package's autograd Functions: torch's ``torch.amp.custom_fwd`` / ``custom_bwd`` for the device
the inputs are on (``cpu`` or ``cuda``, read from the first tensor argument at each call), so one Function serves
both. The forward runs under the caller's autocast state and the backward under the same state, whatever state
``loss.backward()`` is called in (torch's AMP contract for custom Functions)."""

from __future__ import annotations

import functools

import torch


def _device_type(args) -> str:
    return next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cpu")


def amp_forward(fwd):
    """``torch.amp.custom_fwd(fwd, device_type=...)`` with the device type of the first tensor argument; the
    backward (:func:`amp_backward`) reads it from the context."""

    @functools.wraps(fwd)
    def forward(ctx, *args, **kwargs):
        ctx.amp_device_type = _device_type(args)
        return torch.amp.custom_fwd(fwd, device_type=ctx.amp_device_type)(ctx, *args, **kwargs)

    return forward


def amp_backward(bwd):
    """``torch.amp.custom_bwd(bwd, device_type=...)`` for the device type its forward (:func:`amp_forward`) saw."""

    @functools.wraps(bwd)
    def backward(ctx, *grads):
        return torch.amp.custom_bwd(bwd, device_type=ctx.amp_device_type)(ctx, *grads)

    return backward


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast computes in on ``x``'s device, None when autocast is off there."""
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
