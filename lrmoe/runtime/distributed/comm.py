"""Communication primitives of the expert-parallel layer, on ``torch.distributed``.

* :func:`all_to_all_rows`: a differentiable ``all_to_all_single`` over the rows of a tensor with uneven (and zero)
  split sizes. The backward is the same exchange with the splits swapped. It is the only collective the MoE
  dispatch and combine use, because the list form ``all_to_all`` with uneven sizes fails on gloo.
* :func:`exchange_flat`: one flat buffer per peer, every peer's in one ``all_to_all_single`` (one collective
  however many peers): the replica substrate's exchanges (replica sync, gradient collection, redistribution, push).
* :func:`exchange_rows`: the same exchange as point-to-point sends and receives, one message per pair of ranks (kept
  for the CPU calibration, which times both).
* :func:`init_process_group_from_env`: process-group setup under ``torchrun`` (NCCL on GPU, gloo on CPU).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from lrmoe.kernels.amp import amp_backward, amp_forward


def _check_splits(name: str, splits: list[int], world_size: int) -> list[int]:
    splits = [int(s) for s in splits]
    if len(splits) != world_size:
        raise ValueError(f"{name} must have one entry per rank ({world_size}), got {len(splits)}")
    if any(s < 0 for s in splits):
        raise ValueError(f"{name} must be non-negative, got {splits}")
    return splits


def _a2a(x_MD: torch.Tensor, in_splits: list[int], out_splits: list[int], group) -> torch.Tensor:
    out = x_MD.new_empty((sum(out_splits),) + tuple(x_MD.shape[1:]))  # on the input's device and dtype
    if dist.get_world_size(group) == 1:
        out.copy_(x_MD)
        return out
    dist.all_to_all_single(out, x_MD.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=group)
    return out


class _AllToAllRows(torch.autograd.Function):
    """Rows ``in_splits[r]`` of the input go to rank r; rows ``out_splits[r]`` arrive from rank r, in rank order."""

    @staticmethod
    @amp_forward
    def forward(ctx, x_MD, in_splits, out_splits, group, on_backward):
        ctx.in_splits, ctx.out_splits, ctx.group, ctx.on_backward = in_splits, out_splits, group, on_backward
        return _a2a(x_MD, in_splits, out_splits, group)

    @staticmethod
    @amp_backward
    def backward(ctx, grad_RD):
        if ctx.on_backward is not None:
            ctx.on_backward("start")
        grad_MD = _a2a(grad_RD.contiguous(), ctx.out_splits, ctx.in_splits, ctx.group)
        if ctx.on_backward is not None:
            ctx.on_backward("end")
        return grad_MD, None, None, None, None


def all_to_all_rows(x_MD: torch.Tensor, in_splits: list[int], out_splits: list[int], group=None,
                    on_backward=None) -> torch.Tensor:
    """Differentiable variable-size all-to-all over the rows (dim 0) of ``x_MD``.

    ``in_splits[r]`` rows (consecutive, in rank order) are sent to rank r and ``out_splits[r]`` rows are received
    from rank r; both must be known on each side (the MoE layer derives them from the plan, which every rank holds).
    The output is allocated on the input's device. ``on_backward("start" | "end")``, if given, is called around the
    backward exchange (the layer's accounting uses it to time the backward all-to-all).
    """
    world_size = dist.get_world_size(group)
    in_splits = _check_splits("in_splits", in_splits, world_size)
    out_splits = _check_splits("out_splits", out_splits, world_size)
    if sum(in_splits) != x_MD.shape[0]:
        raise ValueError(f"in_splits sum to {sum(in_splits)} but x_MD has {x_MD.shape[0]} rows")
    return _AllToAllRows.apply(x_MD, in_splits, out_splits, group, on_backward)


def exchange_rows(send: dict[int, torch.Tensor], recv_numel: dict[int, int], dtype: torch.dtype,
                  device: torch.device, group=None) -> dict[int, torch.Tensor]:
    """Point-to-point exchange of one flat buffer per peer (not differentiable).

    ``send[peer]`` is sent to ``peer``; a buffer of ``recv_numel[peer]`` elements is received from each peer in
    ``recv_numel``; empty buffers are skipped on both sides. Peers are ranks of ``group`` (default: the world); a
    rank never sends to itself (copy locally instead). Every pair of ranks exchanges at most one message each way,
    so no tags are needed and the matching works the same on gloo and NCCL.
    """
    rank = dist.get_rank(group)
    if rank in send or rank in recv_numel:
        raise ValueError(f"exchange_rows: rank {rank} must not send to or receive from itself")
    received = {peer: torch.empty(int(n), dtype=dtype, device=device) for peer, n in sorted(recv_numel.items())}
    send = {peer: buf for peer, buf in send.items() if buf.numel()}  # empty messages are not sent (nor awaited)
    ops = []
    # Post sends and receives in increasing peer order on every rank: NCCL then pairs them without deadlock.
    for peer in sorted(set(send) | set(received)):
        if peer in send:
            buf = send[peer]
            if buf.dtype != dtype or buf.dim() != 1:
                raise ValueError(f"exchange_rows: buffer for rank {peer} must be flat {dtype}, got "
                                 f"{buf.dtype} of shape {tuple(buf.shape)}")
            ops.append(dist.P2POp(dist.isend, buf.contiguous(), group=group, group_peer=peer))
        if peer in received and received[peer].numel():
            ops.append(dist.P2POp(dist.irecv, received[peer], group=group, group_peer=peer))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return received


def exchange_flat(send: dict[int, torch.Tensor], recv_numel: dict[int, int], dtype: torch.dtype,
                  device: torch.device, group=None) -> dict[int, torch.Tensor]:
    """:func:`exchange_rows`'s contract (``send[peer]`` to ``peer``, ``recv_numel[peer]`` elements from ``peer``, no
    message to itself) in one variable ``all_to_all_single`` of the concatenated buffers: a constant number of
    collectives per exchange instead of one send and one receive per peer. Every rank of ``group`` must call it.
    The bytes on the wire are the same; a peer absent from ``send`` gets an empty split."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if rank in send or rank in recv_numel:
        raise ValueError(f"exchange_flat: rank {rank} must not send to or receive from itself")
    for peer, buf in send.items():
        if buf.dtype != dtype or buf.dim() != 1:
            raise ValueError(f"exchange_flat: buffer for rank {peer} must be flat {dtype}, got {buf.dtype} of "
                             f"shape {tuple(buf.shape)}")
    in_splits = [send[q].numel() if q in send else 0 for q in range(world)]
    out_splits = [int(recv_numel.get(q, 0)) for q in range(world)]
    parts = [send[q] for q in range(world) if in_splits[q]]
    flat = torch.cat(parts).to(device) if parts else torch.empty(0, dtype=dtype, device=device)
    out = _a2a(flat, in_splits, out_splits, group)
    pieces = out.split(out_splits)
    return {q: pieces[q] for q in sorted(recv_numel)}


def all_gather_rows(x_E: torch.Tensor, group=None) -> torch.Tensor:
    """Stack every rank's equal-shaped tensor into ``[N, ...]`` (used for the N·E routed-pair counts)."""
    world_size = dist.get_world_size(group)
    if world_size == 1:
        return x_E.unsqueeze(0).clone()
    parts = [torch.empty_like(x_E) for _ in range(world_size)]
    dist.all_gather(parts, x_E.contiguous(), group=group)
    return torch.stack(parts)


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: its rank, the world size, its device and the backend in use."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def init_process_group_from_env(backend: str | None = None, timeout_s: float = 120.0) -> DistInfo:
    """Initialise the default process group from the ``torchrun`` environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

    The backend defaults to NCCL when CUDA is available (each process then takes GPU ``LOCAL_RANK``) and gloo
    otherwise. If the group is already initialised, its description is returned unchanged.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if dist.is_initialized():
        return current_info()
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(f"init_process_group_from_env: environment variables {missing} are not set "
                         f"(run under torchrun, or use lrmoe.runtime.distributed.launch for local runs)")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl' or 'gloo', got {backend!r}")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", init_method="env://", timeout=timedelta(seconds=timeout_s),
                                device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=timeout_s))
    return current_info()


def current_info() -> DistInfo:
    """The :class:`DistInfo` of the initialised default process group."""
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised")
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", 0)) if backend == "nccl" else 0
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device,
                    backend=str(backend))
