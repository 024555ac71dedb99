from __future__ import annotations

import itertools

import pytest
import torch

from attnselect.spec import masks

CPU = torch.device("cpu")
MASKS = [
    ("none", None),
    ("causal", None),
    ("causal_bottom_right", None),
    ("sliding_window", (3, 0)),
    ("sliding_window", (0, 2)),
    ("sliding_window", (-1, -1)),
    ("sliding_window", (2, -1)),
    ("sliding_window_top_left", (3, 0)),
    ("sliding_window_top_left", (1, 2)),
]


def test_mask_meanings():
    assert masks.visible("causal", None, 2, 4, CPU).tolist() == [
        [True, False, False, False],
        [True, True, False, False],
    ]
    assert masks.visible("causal_bottom_right", None, 2, 4, CPU).tolist() == [[True, True, True, False], [True] * 4]
    assert masks.visible("sliding_window", (1, 0), 3, 3, CPU).tolist() == [
        [True, False, False],
        [True, True, False],
        [False, True, True],
    ]
    assert masks.visible("none", None, 2, 2, CPU) is None
    # TransformerEngine's padding_causal with window_size (1, 0): anchored at the top-left diagonal
    assert masks.visible("sliding_window_top_left", (1, 0), 2, 4, CPU).tolist() == [
        [True, False, False, False],
        [True, True, False, False],
    ]
    assert masks.visible("sliding_window", (1, 0), 2, 4, CPU).tolist() == [
        [False, True, True, False],
        [False, False, True, True],
    ]


@pytest.mark.parametrize("mask,window", MASKS)
def test_rows_without_keys_agrees_with_the_mask(mask, window):
    for sq, skv in itertools.product([0, 1, 5, 9], [0, 1, 5, 9]):
        vis = masks.visible(mask, window, sq, skv, CPU)
        vis = torch.ones(sq, skv, dtype=torch.bool) if vis is None else vis
        expected = None if vis.any(-1).all() else ~vis.any(-1, keepdim=True)
        got = masks.rows_without_keys(mask, window, sq, skv, CPU)
        assert (got is None) == (expected is None)
        assert got is None or torch.equal(got, expected)
        assert masks.has_rows_without_keys(mask, window, sq, skv) == (got is not None)
