"""Compaction: the packed layout, pack/unpack as inverse maps (forward and backward), the Triton kernels
(interpreted) against the torch reference, edge cases, and bad input."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lrmoe.kernels.compact import compact_plan, pack, unpack
from lrmoe.kernels.dispatch import interpreter_enabled

needs_interp = pytest.mark.skipif(not interpreter_enabled(), reason="needs TRITON_INTERPRET=1 (set by conftest)")


def random_routing(T, k, N, E, seed, keep_frac=0.7, carry_frac=0.3):
    g = torch.Generator().manual_seed(seed)
    P = T * k
    dest_P = torch.randint(0, N, (P,), generator=g)
    expert_P = torch.randint(0, E, (P,), generator=g)
    keep_P = torch.rand(P, generator=g) < keep_frac
    carry_P = keep_P & (torch.rand(P, generator=g) < carry_frac)
    return dest_P, expert_P, keep_P, carry_P, g


def test_layout_hand_derived():
    # T=3 tokens, top_k=2 -> pairs p = 0..5 (token p // 2); N=2 destinations, E=2 experts.
    #   p      0  1  2  3  4  5
    #   dest   1  0  0  1  0  1
    #   expert 0  1  0  0  1  0
    #   keep   y  y  y  n  y  y
    #   carry  n  n  n  n  y  y
    # dest 0 rows block: expert 0: [2]; expert 1: [4 (carried, first), 1]; carry block: [4]
    # dest 1 rows block: expert 0: [5 (carried), 0];                       carry block: [5]
    dest = torch.tensor([1, 0, 0, 1, 0, 1])
    expert = torch.tensor([0, 1, 0, 0, 1, 0])
    keep = torch.tensor([1, 1, 1, 0, 1, 1], dtype=torch.bool)
    carry = torch.tensor([0, 0, 0, 0, 1, 1], dtype=torch.bool)
    plan = compact_plan(dest, expert, 2, 2, keep, carry, top_k=2)
    assert plan.pair_M.tolist() == [2, 4, 1, 4, 5, 0, 5]
    assert plan.carry_M.tolist() == [False, False, False, True, False, False, True]
    assert plan.pos_P.tolist() == [5, 2, 0, -1, 1, 4]
    assert plan.carry_pos_P.tolist() == [-1, -1, -1, -1, 3, 6]
    assert plan.counts_NE.tolist() == [[1, 2], [2, 0]]
    assert plan.carry_counts_NE.tolist() == [[0, 1], [1, 0]]
    assert plan.send_splits() == [4, 3]
    assert plan.start_N.tolist() == [0, 4]
    assert plan.offs_NE.tolist() == [[1, 3], [2, 2]] and plan.offs_NE.dtype == torch.int32
    assert plan.carry_offs_NE.tolist() == [[0, 1], [1, 1]]
    with pytest.raises(ValueError, match="offs_G"):
        plan.offs_G

    # Rows per token (T=3) vs per pair (P=6): each packed row is its pair's row / its token's row.
    x_TD = torch.arange(3.0)[:, None].expand(3, 2) * 10  # token t's row is 10 t
    g_PD = torch.arange(6.0)[:, None].expand(6, 2) + 0.5  # pair p's row is p + 0.5
    packed = pack(g_PD, plan, carry_YD=x_TD, backend="torch")
    assert packed[:, 0].tolist() == [2.5, 4.5, 1.5, 20.0, 5.5, 0.5, 20.0]


def plan_invariants(plan, dest, expert, keep, carry):
    """The packed buffer is exactly the kept rows + carried rows, in (dest, block, expert, carried first, p) order."""
    P = dest.numel()
    E = plan.num_experts
    assert plan.num_packed == int(keep.sum()) + int(carry.sum()) == plan.pair_M.numel()
    assert int(plan.splits_N.sum()) == plan.num_packed
    assert torch.equal(plan.pos_P >= 0, keep) and torch.equal(plan.carry_pos_P >= 0, carry)
    assert torch.equal(plan.pair_M[plan.pos_P[keep]], torch.arange(P)[keep])
    assert torch.equal(plan.pair_M[plan.carry_pos_P[carry]], torch.arange(P)[carry])
    p, c = plan.pair_M, plan.carry_M.long()
    key = ((dest[p] * 2 + c) * E + expert[p]) * 2 + (1 - carry[p].long()) * (1 - c)
    order = key * (P + 1) + p
    assert bool((order[1:] > order[:-1]).all()), "packed rows are not in layout order"
    # counts and offsets agree with the buffer
    for n in range(plan.num_dests):
        s, kept = int(plan.start_N[n]), int(plan.counts_NE[n].sum())
        block = p[s:s + kept]
        assert torch.equal(torch.bincount(expert[block], minlength=E), plan.counts_NE[n])
        assert not plan.carry_M[s:s + kept].any() and plan.carry_M[s + kept:s + int(plan.splits_N[n])].all()


@given(T=st.integers(1, 12), k=st.integers(1, 3), N=st.integers(1, 3), E=st.integers(1, 4),
       keep_frac=st.sampled_from([0.0, 0.5, 1.0]), carry_frac=st.sampled_from([0.0, 0.5, 1.0]),
       seed=st.integers(0, 10_000))
@settings(max_examples=40, deadline=None)
def test_plan_invariants_random(T, k, N, E, keep_frac, carry_frac, seed):
    dest, expert, keep, carry, _ = random_routing(T, k, N, E, seed, keep_frac, carry_frac)
    plan = compact_plan(dest, expert, N, E, keep, carry, top_k=k)
    plan_invariants(plan, dest, expert, keep, carry)


def test_carried_rows_line_up_with_their_gradient_rows():
    """The first carry_counts[n, e] rows of group (n, e) in the rows block belong to the same pairs, in the same
    order, as group (n, e) of the carry block: the receiver can match them from counts alone."""
    dest, expert, keep, carry, _ = random_routing(40, 2, 3, 4, seed=5, carry_frac=0.5)
    plan = compact_plan(dest, expert, 3, 4, keep, carry, top_k=2)
    for n in range(3):
        s, kept = int(plan.start_N[n]), int(plan.counts_NE[n].sum())
        rows_offs = [0] + plan.offs_NE[n].tolist()
        carry_offs = [0] + plan.carry_offs_NE[n].tolist()
        for e in range(4):
            c = int(plan.carry_counts_NE[n, e])
            head = plan.pair_M[s + rows_offs[e]: s + rows_offs[e] + c]
            carried = plan.pair_M[s + kept + carry_offs[e]: s + kept + carry_offs[e] + c]
            assert torch.equal(head, carried)


def test_pack_then_unpack_is_identity_on_kept_pairs_forward_and_backward():
    """Megatron-style: unpack(pack(x)) = x on kept pairs (0 on dropped), and the gradient flows back the same."""
    T, k, N, E, D = 16, 2, 3, 4, 8
    dest, expert, keep, carry, g = random_routing(T, k, N, E, seed=1)
    plan = compact_plan(dest, expert, N, E, keep, top_k=k)
    x_PD = torch.randn(T * k, D, generator=g, dtype=torch.float64, requires_grad=True)
    y_PD = unpack(pack(x_PD, plan, backend="torch"), plan, per_token=False, backend="torch")
    assert torch.equal(y_PD, x_PD * keep[:, None])
    up = torch.randn(T * k, D, generator=g, dtype=torch.float64)
    (y_PD * up).sum().backward()
    assert torch.equal(x_PD.grad, up * keep[:, None])


def test_unpack_per_token_is_the_weighted_combine():
    T, k, N, E, D = 10, 3, 2, 3, 5
    dest, expert, keep, _, g = random_routing(T, k, N, E, seed=2)
    plan = compact_plan(dest, expert, N, E, keep, top_k=k)
    x_TD = torch.randn(T, D, generator=g)
    w_P = torch.rand(T * k, generator=g)
    y_TD = unpack(pack(x_TD, plan, backend="torch"), plan, w_P, backend="torch")
    ref_TD = ((w_P * keep).view(T, k, 1) * x_TD[:, None, :]).sum(1)
    torch.testing.assert_close(y_TD, ref_TD)


def test_gradcheck_float64_torch_path():
    T, k, N, E, D = 5, 2, 2, 3, 3
    dest, expert, keep, carry, g = random_routing(T, k, N, E, seed=3, carry_frac=0.5)
    plan = compact_plan(dest, expert, N, E, keep, carry, top_k=k)
    rows = torch.randn(T * k, D, generator=g, dtype=torch.float64, requires_grad=True)
    carry_rows = torch.randn(T, D, generator=g, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, b: pack(a, plan, b, backend="torch"), (rows, carry_rows))
    packed = torch.randn(plan.num_packed, D, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.rand(T * k, generator=g, dtype=torch.float64, requires_grad=True)
    for section in ("rows", "carry"):
        for per_token in (True, False):
            torch.autograd.gradcheck(lambda a, b: unpack(a, plan, b, section, per_token, backend="torch"),
                                     (packed, w))


@needs_interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["random", "none_dropped", "all_dropped", "empty_expert", "one_row"])
def test_interpreted_kernels_equal_torch_reference_exactly(dtype, case):
    """Copy kernels (pack, pack backward, unpack, unpack backward) are bit-identical to the torch reference,
    including D = 37 (not a multiple of the block) and 19 tokens (not a multiple of the row block)."""
    T, k, N, E, D = 19, 2, 3, 4, 37
    if case == "one_row":
        T, k = 1, 1
    dest, expert, keep, carry, g = random_routing(T, k, N, E, seed=7, carry_frac=0.4)
    if case == "none_dropped":
        keep = torch.ones_like(keep)
    if case == "all_dropped":
        keep, carry = torch.zeros_like(keep), torch.zeros_like(carry)
    if case == "empty_expert":
        expert = torch.where(expert == 2, 1, expert)
    carry = carry & keep
    plan = compact_plan(dest, expert, N, E, keep, carry, top_k=k)
    if case == "empty_expert":
        assert (plan.counts_NE[:, 2] == 0).all()
    rows = torch.randn(T * k, D, generator=g).to(dtype)
    carry_rows = torch.randn(T, D, generator=g).to(dtype)
    w = torch.rand(T * k, generator=g)
    out = {}
    for backend in ("torch", "interpret"):
        a = rows.clone().requires_grad_()
        b = carry_rows.clone().requires_grad_()
        packed = pack(a, plan, b, backend=backend)
        packed.backward(torch.ones_like(packed) * torch.arange(packed.shape[0], dtype=dtype)[:, None])
        p2 = packed.detach().clone().requires_grad_()
        w2 = w.clone().requires_grad_()
        tok = unpack(p2, plan, w2, backend=backend)
        pair = unpack(p2, plan, None, section="carry", per_token=False, backend=backend)
        (tok.float().sum() * 3 + (pair.float() * 2).sum()).backward()
        out[backend] = (packed.detach(), a.grad, b.grad, tok.detach(), pair.detach(), p2.grad, w2.grad)
    names = ["packed", "d rows", "d carry", "unpack tokens", "unpack carry pairs", "d packed", "d weight"]
    for name, ref, got in zip(names, out["torch"], out["interpret"]):
        if name == "d weight":  # a dot product: the kernel sums blocks of D in its own order
            torch.testing.assert_close(got, ref, msg=name)
        else:
            assert torch.equal(got, ref), name


@needs_interp
@given(T=st.integers(1, 9), k=st.integers(1, 3), N=st.integers(1, 3), E=st.integers(1, 3), D=st.integers(1, 40),
       seed=st.integers(0, 1000))
@settings(max_examples=25, deadline=None)
def test_interpreted_pack_unpack_random_shapes(T, k, N, E, D, seed):
    dest, expert, keep, carry, g = random_routing(T, k, N, E, seed)
    plan = compact_plan(dest, expert, N, E, keep, carry, top_k=k)
    rows, carry_rows = torch.randn(T, D, generator=g), torch.randn(T * k, D, generator=g)
    w = torch.randn(T * k, generator=g)
    ref = pack(rows, plan, carry_rows, backend="torch")
    got = pack(rows, plan, carry_rows, backend="interpret")
    assert torch.equal(got, ref)
    assert torch.equal(unpack(ref, plan, w, backend="interpret"), unpack(ref, plan, w, backend="torch"))


def test_deterministic_run_to_run():
    T, k, N, E, D = 64, 4, 4, 8, 16
    dest, expert, keep, carry, g = random_routing(T, k, N, E, seed=11)
    x = torch.randn(T, D, generator=g)
    w = torch.rand(T * k, generator=g)
    results = []
    for _ in range(2):
        plan = compact_plan(dest, expert, N, E, keep, top_k=k)
        results.append(unpack(pack(x, plan, backend="torch"), plan, w, backend="torch"))
    assert torch.equal(results[0], results[1])


def test_offs_feed_a_grouped_gemm():
    """offs_G delimits the (dest, expert) groups of the whole buffer (no carry): a grouped GEMM over it with
    one weight per group equals each pair's row times its group's weight."""
    from lrmoe.kernels.grouped_gemm import grouped_mm

    T, k, N, E, D, F = 12, 2, 2, 3, 4, 5
    dest, expert, keep, _, g = random_routing(T, k, N, E, seed=4)
    plan = compact_plan(dest, expert, N, E, keep, top_k=k)
    x = torch.randn(T, D, generator=g)
    w = torch.randn(N * E, D, F, generator=g)
    y = grouped_mm(pack(x, plan, backend="torch"), w, plan.offs_G, backend="torch")
    p = plan.pair_M
    ref = torch.einsum("md,mdf->mf", x[p // k], w[dest[p] * E + expert[p]])
    torch.testing.assert_close(y, ref)


def test_bad_input_raises_value_error():
    dest = torch.tensor([0, 1, 2])
    expert = torch.tensor([0, 0, 1])
    with pytest.raises(ValueError, match="dest_P"):
        compact_plan(dest, expert, 2, 2)
    with pytest.raises(ValueError, match="expert_P"):
        compact_plan(torch.tensor([0, 1, 1]), torch.tensor([0, 5, 1]), 2, 2)
    with pytest.raises(ValueError, match="carry_P"):
        compact_plan(torch.tensor([0, 1, 1]), expert, 2, 2, keep_P=torch.tensor([1, 0, 1], dtype=torch.bool),
                     carry_P=torch.tensor([0, 1, 0], dtype=torch.bool))
    with pytest.raises(ValueError, match="keep_P"):
        compact_plan(torch.tensor([0, 1, 1]), expert, 2, 2, keep_P=torch.tensor([1, 0, 1]))
    with pytest.raises(ValueError, match="top_k"):
        compact_plan(torch.tensor([0, 1, 1]), expert, 2, 2, top_k=2)
    with pytest.raises(ValueError, match="num_dests"):
        compact_plan(torch.tensor([0, 1, 1]), expert, 0, 2)
    plan = compact_plan(torch.tensor([0, 1, 1, 0]), torch.tensor([0, 0, 1, 1]), 2, 2, top_k=2,
                        carry_P=torch.tensor([1, 0, 0, 0], dtype=torch.bool))
    with pytest.raises(ValueError, match="rows_XD has 3 rows"):
        pack(torch.zeros(3, 4), plan, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="carry_YD"):
        pack(torch.zeros(4, 4), plan)
    with pytest.raises(ValueError, match="width and dtype"):
        pack(torch.zeros(4, 4), plan, torch.zeros(2, 3))
    with pytest.raises(ValueError, match="section"):
        unpack(torch.zeros(plan.num_packed, 4), plan, section="input")
    with pytest.raises(ValueError, match="weight_P"):
        unpack(torch.zeros(plan.num_packed, 4), plan, torch.ones(3))
    with pytest.raises(ValueError, match="packed_MD"):
        unpack(torch.zeros(2, 4), plan)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_triton_copies_equal_torch_on_gpu(dtype):
    """On a GPU: the compiled pack is bit-identical to the torch path; the weighted unpack agrees closely (the
    compiler may fuse multiply-adds)."""
    dest, expert, keep, carry, g = random_routing(300, 4, 4, 8, seed=9)
    plan = compact_plan(dest.cuda(), expert.cuda(), 4, 8, keep.cuda(), carry.cuda(), top_k=4)
    rows = torch.randn(1200, 136, generator=g).to(dtype).cuda()
    carry_rows = torch.randn(300, 136, generator=g).to(dtype).cuda()
    w = torch.rand(1200, generator=g).cuda()
    ref = pack(rows, plan, carry_rows, backend="torch")
    assert torch.equal(pack(rows, plan, carry_rows, backend="triton"), ref)
    torch.testing.assert_close(unpack(ref, plan, w, backend="triton"), unpack(ref, plan, w, backend="torch"))
