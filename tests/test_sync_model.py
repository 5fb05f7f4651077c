"""The optimizer step's byte model (lrmoe.bytemodel.sync_model): range groups and sources, the bytes of both
replica-gradient
modes from hand-derived cases and from their definitions, and its purity (no torch.distributed)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lrmoe.bytemodel.sync_model import (REPLICA_GRAD_MODES, allreduce_bytes, check_replica_grad, hosted_experts,
                                        hosts_mask, ring_allreduce_bytes, shard_sizes, step_bytes, sync_plan)

E, P = 6, 18  # P = 18: shards 5, 5, 4, 4 over four ranks
CONTIGUOUS_4 = [[0, 0, 1], [1, 1, 2], [3, 4, 5], [5, 5, 5]]
SCATTERED_4 = [[0, 1, 2], [3, 4, -1], [5, 0, 1], [2, 3, 4]]


def _sync_plan_by_definition(placement_NS, num_experts, groups):
    """The range plan, one expert at a time: the group is the span (or the hosts); the i-th rank outside it asks
    member i mod h."""
    n = placement_NS.shape[0]
    source = torch.full((n, num_experts), -1, dtype=torch.long)
    member = torch.zeros(n, num_experts, dtype=torch.bool)
    for e in range(num_experts):
        hosts = (placement_NS == e).any(dim=1).nonzero().flatten().tolist()
        if not hosts:
            continue
        group = list(range(hosts[0], hosts[-1] + 1)) if groups == "range" else hosts
        others = [r for r in range(n) if r not in group]
        for r in group:
            source[r, e], member[r, e] = r, True
        for i, r in enumerate(others):
            source[r, e] = group[i % len(group)]
    return source, member


def _random_placement(gen, n, s, e):
    placement = torch.randint(-1, e, (n, s), generator=gen)
    return placement


@pytest.mark.parametrize("groups", ["range", "hosts"])
def test_vectorised_sync_plan_equals_its_definition(groups):
    gen = torch.Generator().manual_seed(0)
    for n, s, e in [(1, 2, 3), (2, 3, 6), (4, 3, 6), (8, 4, 16), (5, 2, 4)]:
        for _ in range(20):
            placement = _random_placement(gen, n, s, e)
            plan = sync_plan(placement, e, groups)
            source, member = _sync_plan_by_definition(placement, e, groups)
            assert torch.equal(plan.source_NE, source), (placement, plan.source_NE, source)
            assert torch.equal(plan.group_NE, member)


def test_sync_plan_spans_and_round_robin_sources():
    plan = sync_plan(torch.tensor(CONTIGUOUS_4), E)
    assert plan.span_E2.tolist() == [[0, 0], [0, 1], [1, 1], [2, 2], [2, 2], [2, 3]]
    assert plan.source_NE.tolist() == [[0, 0, 1, 2, 2, 2],
                                       [0, 1, 1, 2, 2, 3],
                                       [0, 0, 1, 2, 2, 2],
                                       [0, 1, 1, 2, 2, 3]]
    hosts = sync_plan(torch.tensor(SCATTERED_4), E, groups="hosts")
    # expert 0 on ranks 0 and 2: with host groups rank 1 is outside and asks rank 0, rank 3 asks rank 2
    assert hosts.source_NE[:, 0].tolist() == [0, 0, 2, 2]
    assert hosts_mask(torch.tensor(SCATTERED_4), E)[:, 0].tolist() == [True, False, True, False]
    with pytest.raises(ValueError, match="groups"):
        sync_plan(torch.tensor(CONTIGUOUS_4), E, groups="tree")


def test_allreduce_bytes_are_the_ring_figure_when_the_group_divides_the_vector():
    for h in (2, 3, 6, 9):
        assert all(allreduce_bytes(P, h, i, 2) == ring_allreduce_bytes(P * 2, h) for i in range(h))
    # 18 over 4 members: chunks 5, 5, 4, 4; member i sends the 3 others their chunks and gathers its own back
    assert [allreduce_bytes(P, 4, i, 1) for i in range(4)] == [28, 28, 26, 26]
    assert allreduce_bytes(P, 1, 0, 4) == 0
    assert ring_allreduce_bytes(1200, 4) == 1800


def test_range_bytes_by_hand():
    """CONTIGUOUS_4, 1 byte per element: expert 1 spans ranks 0-1 (18 each), 5 spans 2-3 (18 each); the other
    experts have one host. Rank q fetches its shard of every expert it is outside of."""
    got = step_bytes(torch.tensor(CONTIGUOUS_4), torch.tensor(CONTIGUOUS_4), E, P, 1)
    per = got.per_rank()
    assert per["replica_sync.sent_bytes"].tolist() == [18, 18, 18, 18]
    assert got.group_NE[:, 1].tolist() == [True, True, False, False]
    # rank 0 (shard 5) fetches experts 2, 3, 4, 5: from 1, 2, 2, 2
    assert got.collect_NM[:, 0].tolist() == [0, 5, 15, 0]
    # outside 4, 4, 3 and 5 experts' groups, shards 5, 5, 4, 4
    assert per["grad_collect.recv_bytes"].tolist() == [20, 20, 12, 20]
    assert int(got.sync_NM.abs().sum()) == 0


def test_shard_bytes_by_hand():
    """SCATTERED_4, 2 bytes per element: host n sends each owner q its shard of all |H_n| hosted experts."""
    got = step_bytes(torch.tensor(SCATTERED_4), torch.tensor(SCATTERED_4), E, P, 2, replica_grad="shard")
    shard = torch.tensor(shard_sizes(P, 4))
    assert got.sync_NM.tolist() == [[0, 30, 24, 24],  # rank 0 hosts 3 experts
                                    [20, 0, 16, 16],  # rank 1 hosts 2 (one empty slot)
                                    [30, 30, 0, 24],
                                    [30, 30, 24, 0]]
    per = got.per_rank()
    hosted = torch.tensor([3, 2, 3, 3])
    assert torch.equal(per["replica_sync.sent_bytes"], hosted * (P - shard) * 2)  # (N-1)/N of G per class
    assert torch.equal(per["replica_sync.recv_bytes"], (hosted.sum() - hosted) * shard * 2)
    assert int(got.collect_NM.abs().sum()) == 0 and int(got.allreduce_NE.abs().sum()) == 0


def test_shard_bytes_do_not_depend_on_where_the_other_replicas_sit():
    """A host's bytes are (N-1)/N of G per hosted class whatever the rest of the placement; range mode's grow
    with the span."""
    near = torch.tensor([[0, 1], [0, 2], [3, 4], [5, 3]])  # expert 0 on ranks 0, 1
    far = torch.tensor([[0, 1], [3, 2], [5, 4], [0, 3]])  # expert 0 on ranks 0, 3: the range spans all four
    sent = {name: step_bytes(pl, pl, E, P, 1, replica_grad="shard").per_rank()["replica_sync.sent_bytes"]
            for name, pl in (("near", near), ("far", far))}
    assert torch.equal(sent["near"], sent["far"])
    ring = {name: step_bytes(pl, pl, E, P, 1).per_rank()["replica_sync.sent_bytes"].sum()
            for name, pl in (("near", near), ("far", far))}
    assert ring["far"] > ring["near"]


def test_without_replicas_the_modes_move_the_same_bytes():
    """Static EP (one host per expert): range mode has no all-reduce and every owner fetches its shard from the
    host; shard mode's host sends it unasked. The same pairs, the same bytes."""
    n, s = 4, 2
    static = torch.arange(n * s).view(n, s)
    rng = step_bytes(static, static, n * s, P, 4)
    shd = step_bytes(static, static, n * s, P, 4, replica_grad="shard")
    assert int(rng.allreduce_NE.sum()) == 0
    assert torch.equal(rng.collect_NM, shd.sync_NM)
    assert int(rng.collect_NM.sum()) == s * n * P * 4 * (n - 1) // n
    assert torch.equal(rng.redistribute_NM, shd.redistribute_NM)


@pytest.mark.parametrize("mode", REPLICA_GRAD_MODES)
def test_random_placements_conserve_bytes(mode):
    """Every byte sent is received; no rank sends to itself; redistribution is the same in both modes."""
    gen = torch.Generator().manual_seed(1)
    for n, s, e in [(2, 3, 6), (4, 3, 6), (8, 2, 12)]:
        for _ in range(10):
            place, nxt = _random_placement(gen, n, s, e), _random_placement(gen, n, s, e)
            got = step_bytes(place, nxt, e, 19, 2, weight_bytes=4, replica_grad=mode)
            per = got.per_rank()
            for phase in ("replica_sync", "grad_collect", "redistribute"):
                assert int(per[f"{phase}.sent_bytes"].sum()) == int(per[f"{phase}.recv_bytes"].sum())
            for m in (got.sync_NM, got.collect_NM, got.redistribute_NM):
                assert int(torch.diag(m).abs().sum()) == 0
            distinct = torch.tensor([len(hosted_experts(nxt, r)) for r in range(n)])
            assert torch.equal(per["redistribute.recv_bytes"],
                               distinct * (19 - torch.tensor(shard_sizes(19, n))) * 4)


def test_modes_are_checked():
    with pytest.raises(ValueError, match="replica_grad"):
        check_replica_grad("ring")
    with pytest.raises(ValueError, match="replica_grad"):
        step_bytes(torch.tensor(CONTIGUOUS_4), torch.tensor(CONTIGUOUS_4), E, P, 1, replica_grad="tree")


def test_the_byte_model_and_the_cost_model_stay_off_torch_distributed():
    """Planner-side modules never import the distributed runtime: the byte model's source imports no
    torch.distributed, and importing it with the cost model loads no lrmoe.runtime.distributed module."""
    import lrmoe.bytemodel.sync_model as sync_model

    tree = ast.parse(Path(sync_model.__file__).read_text())
    imported = [a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [m for m in imported if "distributed" in m], imported
    code = ("import sys, lrmoe.bytemodel.sync_model, lrmoe.sim.cost, lrmoe.sim.simulator; "
            "print([m for m in sys.modules if m.startswith('lrmoe.runtime.distributed')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_local_traffic_follows_the_passes_of_each_mode():
    """The optimizer step's local memory passes (priced at memory bandwidth by the cost model), as the store runs
    them: a class's slots summed where it has several; shard mode writes each sum into the send buffer, range mode
    folds and all-gathers every multi-member group; redistribution writes every next slot whole."""
    placement_NS = torch.tensor([[0, 1, 3], [2, 3, 1]])  # 3 slots per rank, classes 1 and 3 on both ranks
    e, p, b = 4, 12, 4
    shard = step_bytes(placement_NS, placement_NS, e, p, b, replica_grad="shard")
    rng = step_bytes(placement_NS, placement_NS, e, p, b, replica_grad="range")
    # one slot per class: its gradient is its sum (no pass); shard mode writes each into the send buffer
    assert shard.local_N3[:, 0].tolist() == [2 * 3 * p * b] * 2
    assert rng.local_N3[:, 0].tolist() == [4 * 2 * p * b] * 2  # two two-member groups per rank: fold, gather
    doubled = torch.tensor([[0, 0, 3], [2, 3, 1]])  # two slots of class 0 on rank 0: gathered and summed
    two = step_bytes(doubled, doubled, e, p, b, replica_grad="shard").local_N3[:, 0].tolist()
    assert two == [(2 * 2 * b + 2 * 4 + 4) * p + 2 * 2 * p * b, 2 * 3 * p * b]
    parts = 6  # three hosted classes per rank, both ranks fold shard q of each
    assert shard.local_N3[:, 1].tolist() == [parts * 6 * 16 + 12 * e * 6] * 2
    half = step_bytes(doubled, doubled, e, p, 2, replica_grad="shard")  # bf16: widened, summed, narrowed
    assert half.local_N3[0, 0] == 2 * p * (2 * 2 + 4 + 6) + p * (4 + 6) + 2 * 2 * p * 2
    assert (shard.local_N3[:, 2] == rng.local_N3[:, 2]).all()  # the same redistribution in both modes
    sent = shard.redistribute_NM.sum(1)
    assert shard.local_N3[:, 2].tolist() == (4 * sent + 2 * 3 * 6 * b + 2 * 3 * p * b).tolist()
