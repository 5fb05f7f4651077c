"""The learning-rate schedule of a training run: a pure function of the step (a resumed run continues it), and
torch's ``LambdaLR`` along it. torch is imported only to build the scheduler: the names load without it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LR_SCHEDULES = ("constant", "cosine")


def lr_at(step: int, args) -> float:
    """The learning rate of (0-based) ``step``: ``--lr`` throughout ("constant"), or a linear warm-up over
    ``--warmup`` steps then a cosine decay to ``--min-lr-frac`` × ``--lr`` at the last step ("cosine"), so a run's
    curve has flattened by its end whatever its length. A pure function of the step: a resumed run continues it."""
    if args.lr_schedule == "constant":
        return args.lr
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    span = max(args.steps - args.warmup - 1, 1)
    frac = min((step - args.warmup) / span, 1.0)
    floor = args.min_lr_frac * args.lr
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * frac))


def lr_scheduler(optimizer: torch.optim.Optimizer, args, start: int) -> torch.optim.lr_scheduler.LambdaLR:
    """torch's LambdaLR driving every group of the step core (the dense ones and the experts') along
    :func:`lr_at`, from ``start`` (a resumed run's first step). The groups' base rate is 1, so the rates are
    lr_at's values themselves, bit for bit (a base of --lr times lr_at / --lr would round differently)."""
    import torch

    for group in optimizer.param_groups:
        group["initial_lr"] = 1.0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, args), last_epoch=start - 1)
