"""The differentiable variable-size all-to-all, the point-to-point exchange and the torchrun setup."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

from lrmoe.runtime.distributed.comm import all_gather_rows, all_to_all_rows, exchange_rows
from lrmoe.runtime.distributed.launch import launch


def _splits_NN(world_size: int) -> torch.Tensor:
    """rows sent from rank src to rank dst: uneven, with zeros (a rank sending nothing to a peer and to itself)."""
    g = torch.Generator().manual_seed(7)
    s = torch.randint(0, 4, (world_size, world_size), generator=g)
    s[0, :] = 0  # rank 0 sends nothing at all
    return s


def _rows(src, dst, count, width=3):
    """Row i sent from src to dst holds (src, dst, i) in its first three columns: the layout is checkable."""
    base = torch.tensor([[src, dst, i] for i in range(count)], dtype=torch.float64).reshape(count, 3)
    return torch.cat([base, torch.zeros(count, width - 3, dtype=torch.float64)], dim=1)


def _a2a_forward_backward(rank):
    n = dist.get_world_size()
    s_NN = _splits_NN(n)
    x = torch.cat([_rows(rank, dst, int(s_NN[rank, dst]), width=5) for dst in range(n)]).requires_grad_(True)
    out = all_to_all_rows(x, s_NN[rank].tolist(), s_NN[:, rank].tolist())
    expected = torch.cat([_rows(src, rank, int(s_NN[src, rank]), width=5) for src in range(n)])
    assert torch.equal(out, expected), "rows arrive grouped by source rank, in the order they were sent"
    # backward: the gradient of row j of the output returns to the row of the input it came from
    coef = torch.arange(out.numel(), dtype=torch.float64).reshape(out.shape) + 100 * rank
    (out * coef).sum().backward()
    back = all_to_all_rows(coef, s_NN[:, rank].tolist(), s_NN[rank].tolist())  # the reverse exchange
    assert torch.equal(x.grad, back)
    # permute -> all-to-all -> all-to-all back -> un-permute is the identity, forward and backward
    y = torch.randn(int(s_NN[rank].sum()), 4, dtype=torch.float64, requires_grad=True)
    perm = torch.randperm(y.shape[0])
    there = all_to_all_rows(y[perm], s_NN[rank].tolist(), s_NN[:, rank].tolist())
    home = all_to_all_rows(there * 1.0, s_NN[:, rank].tolist(), s_NN[rank].tolist())
    y_back = torch.empty_like(home).index_copy(0, perm, home)
    assert torch.equal(y_back, y)
    w = torch.randn_like(y)
    (y_back * w).sum().backward()
    assert torch.equal(y.grad, w)
    return out.shape[0]


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_to_all_rows_uneven_and_zero_splits(world_size):
    received = launch(_a2a_forward_backward, world_size)
    s_NN = _splits_NN(world_size)
    assert received == s_NN.sum(0).tolist()


def _bad_splits(rank):
    x = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="in_splits sum to 2"):
        all_to_all_rows(x, [1, 1], [1, 1])
    with pytest.raises(ValueError, match="one entry per rank"):
        all_to_all_rows(x, [3], [3])
    with pytest.raises(ValueError, match="non-negative"):
        all_to_all_rows(x, [4, -1], [1, 1])
    return True


def test_all_to_all_rows_rejects_bad_splits():
    assert launch(_bad_splits, 2) == [True, True]


def _exchange(rank):
    n = dist.get_world_size()
    send = {peer: torch.full((peer + rank + 1,), float(10 * rank + peer)) for peer in range(n) if peer != rank
            and (peer + rank) % 3 != 0}
    recv = {peer: peer + rank + 1 for peer in range(n) if peer != rank and (peer + rank) % 3 != 0}
    got = exchange_rows(send, recv, torch.float32, torch.device("cpu"))
    for peer, buf in got.items():
        assert torch.equal(buf, torch.full((peer + rank + 1,), float(10 * peer + rank)))
    counts = all_gather_rows(torch.tensor([rank, 2 * rank]))
    assert torch.equal(counts, torch.tensor([[r, 2 * r] for r in range(n)]))
    return sorted(got)


@pytest.mark.parametrize("world_size", [2, 4])
def test_exchange_rows_and_all_gather(world_size):
    out = launch(_exchange, world_size)
    for rank, peers in enumerate(out):
        assert peers == [p for p in range(world_size) if p != rank and (p + rank) % 3 != 0]


def test_init_process_group_from_env_under_torchrun(tmp_path):
    script = tmp_path / "tr.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.distributed as dist
        from lrmoe.runtime.distributed.comm import init_process_group_from_env, all_to_all_rows
        info = init_process_group_from_env(timeout_s=30)
        assert info.backend == "gloo" and info.device.type == "cpu"
        x = torch.full((info.rank + 1, 2), float(info.rank), requires_grad=True)
        out = all_to_all_rows(x, [0, info.rank + 1] if info.rank == 0 else [info.rank + 1, 0],
                              [0, 2] if info.rank == 0 else [1, 0])
        out.sum().backward()
        print(f"rank {info.rank} of {info.world_size}: {out.shape[0]} rows; grad {x.grad.sum().item()}")
        dist.destroy_process_group()
    """))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 of 2: 2 rows; grad 2.0" in proc.stdout and "rank 1 of 2: 1 rows; grad 4.0" in proc.stdout


def test_init_process_group_from_env_without_torchrun_names_the_missing_variables(monkeypatch):
    from lrmoe.runtime.distributed.comm import init_process_group_from_env

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="RANK"):
        init_process_group_from_env()
