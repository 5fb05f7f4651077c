"""The EP x DP device mesh and torchrun as the way in (lrmoe.runtime.distributed.mesh, .torchrun).

On gloo: training with EP 2 x DP 2 equals the single-process dense reference for static EP, SYMI-dropless, LRMoE at
rho 0.75 (on the pairs it kept) and online replication, forked on one machine and as two torchrun "nodes" on the
loopback rendezvous; every registry system runs on the mesh with identical DP copies; a rank killed mid-step ends
every rank of both nodes within 30 s; the replica-gradient sync creates no process group.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from math import comb
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import _mesh_training as mt
from lrmoe.planner.policies import Symi
from lrmoe.runtime.distributed.launch import launch
from lrmoe.runtime.distributed.mesh import (build_mesh, ep_problem, ep_ranks_per_node, process_group_count,
                                            resolve_ep_size)
from lrmoe.runtime.distributed.torchrun import TORCHRUN_VARS, launched_world_size, torchrun_env
from lrmoe.bytemodel.sync_model import sync_plan
from lrmoe.systems import SYSTEMS

ROOT = Path(__file__).resolve().parents[1]
RANKS_SCRIPT = Path(__file__).with_name("_mesh_ranks.py")
TOL = 1e-5  # losses (relative), outputs and weights (absolute): the expert masters are fp32


# -- pure ------------------------------------------------------------------------------------------------------
def test_torchrun_is_found_from_its_whole_environment_or_not_at_all():
    env = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x"}
    found = torchrun_env(env)
    assert (found.rank, found.local_rank, found.world_size, found.local_world_size, found.num_nodes) == (3, 1, 4, 2, 2)
    assert torchrun_env({"PATH": "/bin"}) is None
    assert launched_world_size(6, {}) == 6 and launched_world_size(6, env) == 4
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        torchrun_env({k: v for k, v in env.items() if k != "LOCAL_WORLD_SIZE"})
    with pytest.raises(ValueError, match="inconsistent"):
        torchrun_env({**env, "LOCAL_RANK": "2"})
    assert set(TORCHRUN_VARS) == set(env)


def test_the_default_ep_group_is_a_node_and_bad_sizes_are_named():
    assert resolve_ep_size(None, 16, 8) == 8 and resolve_ep_size(None, 4, 8) == 4 and resolve_ep_size(16, 16, 8) == 16
    assert ep_problem(8, 16, 8) is None and ep_problem(16, 16, 8) is None and ep_problem(2, 16, 8) is None
    assert "divide the world" in ep_problem(3, 16, 8)
    assert "unevenly" in ep_problem(12, 24, 8)
    assert ep_ranks_per_node(16, 8) == 8 and ep_ranks_per_node(4, 8) == 4


def test_process_groups_grow_with_n_not_n_squared():
    """Before: a group per consecutive rank range, N(N-1)/2. Now the mesh's EP and DP groups (EP = a node of 8),
    and no range groups: the replica sync runs point to point. The ranges that SYMI's placements of a skewed load
    span (what lazily created range groups would have needed) are counted beside."""
    rows = {}
    for n in (16, 64, 256):
        g = torch.Generator().manual_seed(n)
        used = set()
        for _ in range(20):  # a skewed load drawn 20 times, SYMI's placement of each
            counts_E = (torch.rand(2 * n, generator=g) ** 4 * 1000).long() + 1
            placement = Symi(slots_per_rank=3).placement(counts_E, n, int(counts_E.sum()))  # 2 home + 1
            span = sync_plan(placement, 2 * n).span_E2
            used |= {tuple(s) for s in span.tolist() if s[1] > s[0]}
        rows[n] = (comb(n, 2), process_group_count(n, 8), len(used))
    assert rows[16][:2] == (120, 10) and rows[64][:2] == (2016, 16) and rows[256][:2] == (32640, 40)
    assert all(lazy < before for before, _, lazy in rows.values())
    print(rows)


# -- forked ranks (one machine, LOCAL_WORLD_SIZE given as 2) --------------------------------------------------------
def _matched(rank, names):
    before = len(dist.distributed_c10d._world.pg_map)
    mesh = build_mesh(ranks_per_node=2)
    made = len(dist.distributed_c10d._world.pg_map) - before
    results = {name: mt.train(name, mesh) for name in names}
    return results, made, len(dist.distributed_c10d._world.pg_map) - before


def check_matched(results: dict) -> None:
    for name, r in results.items():
        assert (r["ep_size"], r["dp_size"]) == (2, 2), name
        assert r["loss"] <= TOL and r["y"] <= TOL and r["dense"] <= TOL and r["experts"] <= TOL, (name, r)
        assert r["copies_equal"], name
    assert len({str(p) for p in results["symi-dropless"]["placements"]}) > 1  # SYMI's replicas moved
    assert results["lrmoe-rho0.75"]["trimmed"] > 0  # the budget trimmed pairs


def test_ep2_dp2_training_equals_the_dense_reference_forked():
    out = launch(_matched, 4, list(mt.MATCHED), timeout_s=300, preload=("torch._dynamo",))
    for results, made, after in out:
        check_matched(results)
        assert after == made  # training (range mode) created no process group beyond the mesh's


def _online_across_nodes(rank):
    mesh = build_mesh(ep_size=4, ranks_per_node=2)  # one EP group over two "nodes" of 2 ranks
    layer = mt.make_layer("online", mesh, mt.skewed_reference())
    x, _ = mt.batch(4, 1)
    _, info = layer(x[rank * mt.T:(rank + 1) * mt.T].clone())
    return info.dispatch.plan.push_src_G, layer.slots_per_rank


def test_online_replication_pushes_inside_a_node_of_the_ep_group():
    """EP = the world of 4 ranks on nodes of 2: the copies come from a rank of the receiving rank's node."""
    push_src_G, S = launch(_online_across_nodes, 4, timeout_s=120)[0]
    pushed = (push_src_G >= 0).nonzero().flatten()
    assert len(pushed) > 0
    assert all(int(push_src_G[g]) // S // 2 == int(g) // S // 2 for g in pushed)


def _every_system(rank):
    mesh = build_mesh(ranks_per_node=2)
    return {name: mt.train(name, mesh, steps=1, reference=False) for name in SYSTEMS}


def test_every_registry_system_runs_on_the_mesh_with_identical_dp_copies():
    for results in launch(_every_system, 4, timeout_s=600, preload=("torch._dynamo",)):
        for name, r in results.items():
            assert r["copies_equal"] and all(torch.isfinite(torch.tensor(r["losses"]))), name


# -- torchrun: two "nodes" of two ranks on the loopback rendezvous -------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    return env


def torchrun_nodes(*args, timeout_s: float = 240):
    """Two torchrun launches (--nnodes 2, node ranks 0 and 1, 2 ranks each) of tests/_mesh_ranks.py ``args``;
    returns [(exit code, output, exit time)] per node."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
                               "2", "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port",
                               str(port), "--max-restarts", "0", str(RANKS_SCRIPT), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=rank_env(),
                              start_new_session=True)
             for node in range(2)]
    done, deadline = {}, time.monotonic() + timeout_s
    try:
        while len(done) < 2 and time.monotonic() < deadline:
            for i, p in enumerate(procs):
                if i not in done and p.poll() is not None:
                    done[i] = time.time()
            time.sleep(0.1)
    finally:
        for i, p in enumerate(procs):
            if i not in done:
                os.killpg(p.pid, signal.SIGKILL)
    outputs = [p.communicate()[0] for p in procs]
    assert len(done) == 2, f"torchrun did not finish in {timeout_s} s:\n" + "\n".join(outputs)
    return [(p.returncode, out, done[i]) for i, (p, out) in enumerate(zip(procs, outputs))]


def read_ranks(folder: Path) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_torchrun_nodes_train_ep2_dp2_equal_to_the_dense_reference(tmp_path):
    """One system (SYMI-dropless: its replicas move). Slow: 35-65 s on two shared cores, six processes importing
    torch; the forked test above checks the four systems on the same mesh in the default suite."""
    nodes = torchrun_nodes("train", str(tmp_path), "symi-dropless")
    assert all(code == 0 for code, _, _ in nodes), nodes
    for results in read_ranks(tmp_path):
        r = results["symi-dropless"]
        assert (r["ep_size"], r["dp_size"]) == (2, 2) and r["copies_equal"]
        assert max(r["loss"], r["y"], r["dense"], r["experts"]) <= TOL, r


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_torchrun_nodes_train_all_four_systems_equal_to_the_dense_reference(tmp_path):
    nodes = torchrun_nodes("train", str(tmp_path), timeout_s=600)
    assert all(code == 0 for code, _, _ in nodes), nodes
    for results in read_ranks(tmp_path):
        check_matched(results)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_a_rank_that_dies_mid_step_ends_every_rank_of_both_nodes_within_30_s(tmp_path, mode):
    """Rank 3 (node 1) is SIGKILLed, or raises, between its forward and its backward: both torchrun launches exit
    non-zero within 30 s, no rank survives, and a raised error's traceback is in torchrun's report (record)."""
    nodes = torchrun_nodes(mode, str(tmp_path))
    failed_at = float((tmp_path / "failed_at").read_text())
    for code, out, ended in nodes:
        assert code != 0, out
        assert ended - failed_at < 30, (ended - failed_at, out)
    assert not any(alive(int((tmp_path / f"pid{r}").read_text())) for r in range(4))
    if mode == "raise":
        assert "FailOnPurpose: rank 3 fails in the middle of its second step" in nodes[1][1], nodes[1][1]
