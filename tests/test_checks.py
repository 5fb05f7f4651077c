"""Shared helpers: argument checks raise naming the argument, and apportion splits integer totals exactly."""

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lrmoe.checks import (apportion, apportion_array, apportion_rows, apportion_rows_array, check_cf, check_fraction,
                          non_negative_fields, non_negative_int, positive_fields, positive_int)

# --- apportion ------------------------------------------------------------------------------------------------


def test_apportion_hand_cases():
    # segment 0: 5 over weights 1,1,1 (5/3 each); segment 1: 3 over weights 2,2,(item 6) 4 (.75, .75, 1.5)
    total = torch.tensor([5, 3, 0])
    weight = torch.tensor([1, 1, 1, 2, 2, 0, 4])
    segment = torch.tensor([0, 0, 0, 1, 1, 2, 1])
    # cumulative: floor(5·1/3)=1, floor(5·2/3)=3 (+2), 5 (+2); segment 1 in item order 3, 4, 6: 0, 1 (+1), 3 (+2)
    assert apportion(total, weight, segment).tolist() == [1, 2, 2, 0, 1, 0, 2]
    # largest remainder: floors 1,1,1 + the 2 leftovers to the first ties; segment 1: floors 0,0,1, leftovers to
    # the remainders .75, .75
    assert apportion(total, weight, segment, "largest_remainder").tolist() == [2, 2, 1, 1, 1, 0, 1]


@st.composite
def apportion_inputs(draw):
    S = draw(st.integers(1, 5))
    K = draw(st.integers(1, 25))
    segment = draw(st.lists(st.integers(0, S - 1), min_size=K, max_size=K))
    weight = draw(st.lists(st.integers(0, 50), min_size=K, max_size=K))
    W = [sum(w for w, s in zip(weight, segment) if s == t) for t in range(S)]
    total = [draw(st.integers(0, 2 * W[t] + 3)) if W[t] else 0 for t in range(S)]
    return torch.tensor(total), torch.tensor(weight), torch.tensor(segment)


@settings(max_examples=200, deadline=None)
@given(apportion_inputs(), st.sampled_from(["cumulative", "largest_remainder"]))
def test_apportion_properties(inputs, rule):
    total, weight, segment = inputs
    alloc = apportion(total, weight, segment, rule)
    S = len(total)
    assert torch.equal(torch.zeros(S, dtype=torch.long).index_add_(0, segment, alloc), total)  # exact sums
    W = torch.zeros(S, dtype=torch.long).index_add_(0, segment, weight)
    share = total[segment].double() * weight / W[segment].clamp(min=1)
    assert bool((alloc >= torch.floor(share - 1e-9)).all()) and bool((alloc <= torch.ceil(share + 1e-9)).all())
    assert bool((alloc[weight == 0] == 0).all())
    fits = total[segment] <= W[segment]
    assert bool((alloc[fits] <= weight[fits]).all())
    # the same items given sorted by segment get the same numbers (cumulative rounds in item order)
    order = torch.argsort(segment, stable=True)
    assert torch.equal(apportion(total, weight[order], segment[order], rule), alloc[order])


def test_apportion_rows_matches_apportion():
    weight_RK = torch.tensor([[3, 0, 5, 2], [1, 1, 1, 1], [0, 0, 0, 0]])
    total_R = torch.tensor([7, 3, 0])
    rows = apportion_rows(total_R, weight_RK)
    assert torch.equal(rows.flatten(), apportion(total_R, weight_RK.flatten(), torch.arange(3).repeat_interleave(4)))
    assert rows.sum(1).tolist() == [7, 3, 0]


def test_apportion_rejects():
    with pytest.raises(ValueError, match="segment 1 has total 2 but zero weight"):
        apportion(torch.tensor([1, 2]), torch.tensor([1, 0]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="rule"):
        apportion(torch.tensor([1]), torch.tensor([1]), torch.tensor([0]), "random")
    with pytest.raises(ValueError, match="row 0"):
        apportion_rows(torch.tensor([1]), torch.tensor([[0, 0]]))


def test_array_forms_match():
    total, weight, segment = np.array([5, 3]), np.array([1, 1, 1, 2, 2]), np.array([0, 0, 0, 1, 1])
    assert apportion_array(total, weight, segment).tolist() == [1, 2, 2, 1, 2]
    assert apportion_rows_array(np.array([3]), np.array([[1, 2]])).tolist() == [[1, 2]]


# --- argument checks --------------------------------------------------------------------------------------------

def test_checks_return_the_value():
    assert positive_int("n", 3) == 3 and non_negative_int("n", 0) == 0
    assert check_fraction("f", 1, None) == 1.0 and isinstance(check_fraction("f", 1, None), float)
    assert check_cf(1.25) == 1.25


@pytest.mark.parametrize("call, match", [
    (lambda: positive_int("slots", 0), "slots must be a positive int, got 0"),
    (lambda: positive_int("slots", True), "slots"),
    (lambda: positive_int("slots", 2.0), "slots"),
    (lambda: non_negative_int("extra", -1), "extra must be a non-negative int"),
    (lambda: check_fraction("gamma", 1.5, 1.0), "gamma must be in"),
    (lambda: check_fraction("eps", float("nan"), None), "eps must be a finite number"),
    (lambda: check_cf(0), "cf must be a positive finite number"),
    (lambda: check_cf(float("inf")), "cf"),
])
def test_checks_reject(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_field_checks_name_the_class_and_field():
    @dataclass
    class Cfg:
        width: int
        latency: float

    positive_fields(Cfg(1, 0.0), "width")
    non_negative_fields(Cfg(1, 0.0), "latency")
    with pytest.raises(ValueError, match="Cfg.width must be positive, got 0"):
        positive_fields(Cfg(0, 0.0), "width", "latency")
    with pytest.raises(ValueError, match="Cfg.latency must be non-negative"):
        non_negative_fields(Cfg(1, -1.0), "latency")
