"""TensorMemo: a value is computed once per unchanged tensor, and never handed to a call it could harm."""

from __future__ import annotations

import torch

from attnselect.memos import TensorMemo


def _counting():
    calls = []
    return calls, lambda: calls.append(1) or torch.ones(3)


def test_a_value_is_computed_once_per_unchanged_tensor_and_again_after_an_in_place_change():
    memo, (calls, compute) = TensorMemo(), _counting()
    t = torch.arange(4)
    first = memo.get((t,), "config", compute)
    assert memo.get((t,), "config", compute) is first and len(calls) == 1
    t.add_(1)  # a new version
    assert memo.get((t,), "config", compute) is not first and len(calls) == 2
    memo.get((t,), "another config", compute)
    memo.get((t.clone(),), "config", compute)  # equal values, another tensor
    assert len(calls) == 4


def test_nothing_is_remembered_for_inference_tensors_or_in_inference_mode():
    memo, (calls, compute) = TensorMemo(), _counting()
    t = torch.arange(4)
    with torch.inference_mode():
        made_inside = memo.get((t,), "config", compute)
        memo.get((t,), "config", compute)
        inference = torch.arange(4)
        memo.get((inference,), "config", compute)
        memo.get((inference,), "config", compute)
    assert len(calls) == 4 and made_inside.is_inference()
    outside = memo.get((t,), "config", compute)  # an inference result would fail autograd's save for backward
    assert not outside.is_inference() and memo.get((t,), "config", compute) is outside and len(calls) == 5


def test_entries_leave_with_their_owner():
    memo, (_, compute) = TensorMemo(), _counting()
    t = torch.arange(4)
    memo.get((t,), "config", compute)
    assert memo.remembered(t)
    del t
    assert memo._entries == {}
