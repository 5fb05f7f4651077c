"""Placement: static EP, SYMI's Algorithm 1 (against a literal transcription), LRMoE's memory-aware layout."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lrmoe.bytemodel.memory import Footprint
from lrmoe.planner.placement import (MemoryModel, lrmoe_placement, replica_table, slots_that_fit, static_placement,
                             symi_placement, symi_replica_counts)


def algorithm1_oracle(pop, N, s):
    """DESIGN.md §3 Algorithm 1, transcribed line by line in plain Python floats (the test oracle)."""
    goal = [p / sum(pop) * N * s for p in pop]                      # goal = pop / sum(pop) * N * s
    cnt = [float(int(max(g, 1.0))) for g in goal]                    # cnt  = floor(max(goal, 1))
    diff = [c - g for c, g in zip(cnt, goal)]                        # diff = cnt - goal
    while sum(cnt) > N * s:                                          # while sum(cnt) > N*s:
        i = max(range(len(diff)), key=lambda j: (diff[j], -j))       #     i = argmax(diff) (first on ties)
        if cnt[i] > 1:                                               #     if cnt[i] > 1:
            cnt[i] -= 1                                              #         cnt[i] -= 1
        diff[i] -= 1                                                 #     diff[i] -= 1
    while sum(cnt) < N * s:                                          # while sum(cnt) < N*s:
        i = min(range(len(diff)), key=lambda j: (diff[j], j))        #     i = argmin(diff) (first on ties)
        cnt[i] += 1                                                  #     cnt[i] += 1
        diff[i] += 1                                                 #     diff[i] += 1
    placement = [e for e in range(len(pop)) for _ in range(int(cnt[e]))]  # concat([e] * cnt[e])
    return [placement[g * s:(g + 1) * s] for g in range(N)]          # slot j of rank g = placement[g*s + j]


@st.composite
def symi_inputs(draw):
    E = draw(st.integers(1, 24))
    N = draw(st.integers(1, 8))
    s = draw(st.integers(-(-E // N), -(-E // N) + 4))  # N*s >= E
    pop = draw(st.lists(st.one_of(st.just(0), st.integers(0, 20), st.integers(0, 10**6)), min_size=E, max_size=E))
    if sum(pop) == 0:
        pop[draw(st.integers(0, E - 1))] = 1
    return pop, N, s


# --- static ---------------------------------------------------------------------------------------------------

def test_static_placement_hand_case():
    # E=8 over N=4: two experts per rank, in order
    assert static_placement(8, 4).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert static_placement(3, 1).tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("E, N", [(6, 4), (0, 2), (4, 0)])
def test_static_placement_rejects(E, N):
    with pytest.raises(ValueError, match="num_"):
        static_placement(E, N)


# --- SYMI -----------------------------------------------------------------------------------------------------

def test_symi_hand_case_first_loop():
    # pop [6, 1, 1], N=2, s=2: goal [3, .5, .5] -> cnt [3, 1, 1] (sum 5 > 4), diff [0, .5, .5].
    # argmax picks expert 1 (cnt stays 1, diff -.5), then expert 2 (same), then expert 0: cnt 3 -> 2.
    # counts [2, 1, 1] -> placement [[0, 0], [1, 2]]
    assert symi_replica_counts(torch.tensor([6, 1, 1]), 4).tolist() == [2, 1, 1]
    assert symi_placement(torch.tensor([6, 1, 1]), 2, 2).tolist() == [[0, 0], [1, 2]]


def test_symi_hand_case_second_loop_and_ties():
    # pop [1, 1, 1], N=2, s=2: goal 4/3 each -> cnt [1, 1, 1] (sum 3 < 4), diff -1/3 each;
    # argmin ties go to expert 0 -> counts [2, 1, 1] -> [[0, 0], [1, 2]]
    assert symi_placement(torch.tensor([1, 1, 1]), 2, 2).tolist() == [[0, 0], [1, 2]]
    # all-zero popularity is uniform popularity
    assert torch.equal(symi_placement(torch.zeros(3), 2, 2), symi_placement(torch.ones(3), 2, 2))


@settings(max_examples=300, deadline=None)
@given(symi_inputs())
def test_symi_matches_literal_algorithm1(inputs):
    pop, N, s = inputs
    assert symi_placement(torch.tensor(pop), N, s).tolist() == algorithm1_oracle(pop, N, s)


@settings(max_examples=100, deadline=None)
@given(symi_inputs())
def test_symi_replica_counts_match_oracle(inputs):
    pop, N, s = inputs  # total_slots = N*s as one factor: goal = pop / sum(pop) * total_slots
    oracle = algorithm1_oracle(pop, N * s, 1)
    expected = [sum(row.count(e) for row in oracle) for e in range(len(pop))]
    assert symi_replica_counts(torch.tensor(pop), N * s).tolist() == expected


@settings(max_examples=150, deadline=None)
@given(symi_inputs())
def test_symi_placement_properties(inputs):
    pop, N, s = inputs
    E = len(pop)
    placement = symi_placement(torch.tensor(pop), N, s)
    assert placement.shape == (N, s)
    r_E = torch.bincount(placement.flatten(), minlength=E)
    assert int(r_E.sum()) == N * s and int(r_E.min()) >= 1
    # contiguous: each class's hosts form a consecutive rank range
    for e in range(E):
        hosts = torch.nonzero((placement == e).any(1)).flatten().tolist()
        assert hosts == list(range(hosts[0], hosts[-1] + 1))
    assert torch.equal(placement, symi_placement(torch.tensor(pop), N, s))  # same input, same plan


@pytest.mark.parametrize("pop, N, s, match", [
    ([1, 2, 3], 1, 2, "fewer than num_experts"),
    ([1, -2, 3], 2, 2, "non-negative"),
    ([1, float("nan")], 2, 2, "non-finite"),
    ([[1, 2]], 2, 2, "1-D"),
    ([1, 2], 0, 2, "num_ranks"),
    ([1, 2], 2, 0, "slots_per_rank"),
])
def test_symi_rejects(pop, N, s, match):
    with pytest.raises(ValueError, match=match):
        symi_placement(torch.tensor(pop, dtype=torch.float64), N, s)


def test_symi_replica_counts_rejects_too_few_slots():
    with pytest.raises(ValueError, match="total_slots"):
        symi_replica_counts(torch.ones(5), 4)


# --- LRMoE ----------------------------------------------------------------------------------------------------

def test_lrmoe_placement_hand_case():
    # pop [100, 1, 1, 1, 50, 1, 1, 1], N=4, E/N=2 home slots, 1 extra: Algorithm 1 over 12 slots gives
    # r = [5, 1, 1, 1, 1, 1, 1, 1]; capped at N=4 replicas, the freed slot goes to expert 4 (D'Hondt: 50/2).
    # Extra replicas hottest first (25 per replica each; tie to the lower expert): [0, 0, 0, 4].
    # Ranks by expected home load: rank1 (2), rank3 (2), rank0 (26), rank2 (26) -> pairs (0,r1) (0,r3)
    # (0,r0: clash, hosts 0) (4,r2: clash, hosts 4); swapping the last two clears both.
    placement = lrmoe_placement(torch.tensor([100., 1, 1, 1, 50, 1, 1, 1]), 4, 2, 1)
    assert placement.tolist() == [[0, 1, 4],
                                  [2, 3, 0],
                                  [4, 5, 0],
                                  [6, 7, 0]]


def test_lrmoe_placement_no_extra_is_static():
    assert torch.equal(lrmoe_placement(torch.rand(8), 4, 2, 0), static_placement(8, 4))


def test_lrmoe_placement_leaves_useless_slots_empty():
    # one hot expert, 2 ranks, 2 extra slots each: expert 0 can use only rank 1 (rank 0 is its home), the
    # rest of the extra slots go to the other experts by D'Hondt; none duplicates its expert on a rank
    placement = lrmoe_placement(torch.tensor([1000., 1, 1, 1]), 2, 2, 2)
    for row in placement.tolist():
        hosted = [e for e in row if e >= 0]
        assert len(hosted) == len(set(hosted))


@st.composite
def lrmoe_inputs(draw):
    N = draw(st.integers(1, 6))
    base = draw(st.integers(1, 4))
    extra = draw(st.integers(0, 3))
    pop = draw(st.lists(st.integers(0, 1000), min_size=N * base, max_size=N * base))
    return pop, N, base, extra


@settings(max_examples=150, deadline=None)
@given(lrmoe_inputs())
def test_lrmoe_placement_properties(inputs):
    pop, N, base, extra = inputs
    E = N * base
    placement = lrmoe_placement(torch.tensor(pop, dtype=torch.float64), N, base, extra)
    assert placement.shape == (N, base + extra)
    assert torch.equal(placement[:, :base], static_placement(E, N))  # every expert keeps its home slot
    for row in placement.tolist():  # no rank holds two copies of one expert
        hosted = [e for e in row if e >= 0]
        assert len(hosted) == len(set(hosted))
    assert int(placement.min()) >= -1 and int(placement.max()) < E
    assert torch.equal(placement, lrmoe_placement(torch.tensor(pop, dtype=torch.float64), N, base, extra))
    top = max(pop)
    if sum(pop) and extra and pop.count(top) == 1:  # a strictly hottest expert gets a replica whenever a slot could
        hottest = pop.index(top)                    # take it (among tied experts the split is Algorithm 1's)
        if N > 1:
            assert int((placement == hottest).sum()) >= 2


def test_lrmoe_placement_rejects():
    with pytest.raises(ValueError, match="base_slots"):
        lrmoe_placement(torch.ones(8), 4, 3, 1)
    with pytest.raises(ValueError, match="extra_slots"):
        lrmoe_placement(torch.ones(8), 4, 2, -1)


# --- memory ---------------------------------------------------------------------------------------------------

def test_slots_that_fit_hand_case():
    # budget 100 B, slots of 10 B, 1 B per pair, 30 planned pairs, 2 base slots: 100 - 20 - 30 = 50 B -> 5 slots
    assert slots_that_fit(100, 10, 1, 30, 2, 10) == 5
    assert slots_that_fit(100, 10, 1, 30, 2, 3) == 3  # capped
    # per-rank budgets and loads: the tightest rank decides (rank 1: 80 - 20 - 40 = 20 B -> 2 slots)
    assert slots_that_fit(torch.tensor([100., 80.]), 10, 1, torch.tensor([30, 40]), 2, 10) == 2
    with pytest.raises(ValueError, match="cannot hold"):
        slots_that_fit(100, 10, 1, 90, 2, 10)
    with pytest.raises(ValueError, match="slot_bytes"):
        slots_that_fit(100, 0, 1, 10, 2, 10)


def test_memory_model():
    m = MemoryModel(budget_bytes=100, slot_bytes=10, pair_bytes=2)
    assert m.extra_slots(30, 2, 10) == 2  # 100 - 20 - 60 = 20 B
    assert m.pair_cap(3) == 35  # (100 - 30) / 2
    with pytest.raises(ValueError, match="slot_bytes"):
        MemoryModel(budget_bytes=100, slot_bytes=0, pair_bytes=2)


def test_memory_model_of_a_footprint_over_layers():
    """The full model (lrmoe.bytemodel.memory): slots and saved activations in every layer, in-flight buffers once."""
    fp = Footprint(slot=10.0, row=2.0, expert_act=1.0, bwd_act=1.0, index=0.5)
    m = MemoryModel.for_model(fp, budget_bytes=1000, num_layers=4, fixed_bytes=20)
    assert (m.slot_bytes, m.pair_bytes) == (10.0, 3.0)  # pair: the received (= saved) row and its activations
    # 3 slots, 20 expert pairs, 10 home pairs: 4 x (30 + 60 + 20) resident; in flight max(forward 2·(10 + 20),
    # backward 2·(2·10 + 2·20) + 20) = 140; plus 20 fixed
    assert float(m.peak_bytes(3, 20, 10)) == 4 * 110 + 140 + 20
    assert m.fits(3, 20, 10) and not m.fits(3, 60, 10)
    # free after the base slots: 1000 - 600 = 400 bytes = 10 more slots across 4 layers
    assert m.extra_slots(20, 3, 20, 10) == 10
    # Q^mem per rank: beside 3 slots, the loads' saved activations and the home side's backward buffers
    # (4.5 per home pair), retained pairs take 2·2 + 1 + 0.5 = 5.5 bytes each
    cap = m.pair_cap(3, torch.tensor([20, 40]), torch.tensor([10, 10]))
    assert cap.tolist() == [int((1000 - 20 - 4 * (30 + 60 + 20) - 45) // 5.5),
                            int((1000 - 20 - 4 * (30 + 120 + 20) - 45) // 5.5)]


# --- lookups --------------------------------------------------------------------------------------------------

def test_replica_table_hand_case():
    # slots g:      0  1   2 | 3  4  5
    # rank 0: [1, 0, -1], rank 1: [0, 0, 2] -> expert 0 on slots 1, 3, 4 (units: rank 0 {1}, rank 1 {3, 4}),
    # expert 1 on slot 0, expert 2 on slot 5, expert 3 nowhere
    t = replica_table(torch.tensor([[1, 0, -1], [0, 0, 2]]), 4)
    assert t.replicas_E.tolist() == [3, 1, 1, 0]
    assert t.replica_G.tolist() == [0, 0, -1, 1, 2, 0]
    assert t.hosted_R.tolist() == [1, 3, 4, 0, 5] and t.start_E.tolist() == [0, 3, 4, 5]
    assert t.unit_G.tolist() == [2, 0, -1, 1, 1, 3]
    assert t.expert_U.tolist() == [0, 0, 1, 2] and t.rank_U.tolist() == [0, 1, 0, 1]
    assert t.slots_U.tolist() == [1, 2, 1, 1] and t.first_slot_U.tolist() == [1, 3, 0, 5]


def test_replica_table_rejects_bad_ids():
    with pytest.raises(ValueError, match="expert ids"):
        replica_table(torch.tensor([[0, 5]]), 4)
    with pytest.raises(ValueError, match="long"):
        replica_table(torch.tensor([[0.0, 1.0]]), 4)
