"""The varlen_fa2 backend (attnselect.backends.varlen_fa2) on the CPU, through a stand-in of
aten._flash_attention_forward (tests/packed_stand_ins.py): argument mapping and refusals."""

from __future__ import annotations

import pytest

import attnselect
from attnselect.backends import get
from packed_stand_ins import CALLS, LENGTHS, check_packed, torch_flash_attention_forward


@pytest.mark.parametrize("kwargs", CALLS)
@pytest.mark.parametrize("lengths", LENGTHS, ids=["same-lengths", "kv-longer"])
def test_varlen_fa2_mapping_padded(kwargs, lengths, monkeypatch):
    from attnselect.backends import varlen_fa2

    monkeypatch.setattr(varlen_fa2, "flash_forward", torch_flash_attention_forward)
    check_packed("varlen_fa2", kwargs, lengths, dqk=24, pad=True)


@pytest.mark.parametrize(
    "kwargs,lengths",
    [
        # rows that see no key: FA2's lse is +inf there, attnselect's -inf
        (dict(causal="bottom_right", return_lse=True), ([5, 1, 4, 9, 3], [3, 2, 0, 12, 3])),
        (dict(window=(2, 0), return_lse=True), ([5, 1, 4, 9, 3], [3, 2, 0, 12, 3])),
        # one query at most, grouped heads, no mask, a sequence without queries: off FA2's one-query shortcut
        (dict(return_lse=True), ([1, 0, 1], [5, 3, 7])),
        (dict(), ([1, 1, 1], [5, 3, 7])),
        # causal, which FA2 drops at one query a sequence: its right edge of 0 keeps it off that shortcut
        (dict(causal="bottom_right"), ([1, 0, 1], [5, 3, 7])),
    ],
    ids=[
        "keyless-rows-causal",
        "keyless-rows-window",
        "one-query-with-an-empty-sequence",
        "one-query-each",
        "causal-one-query-with-an-empty-sequence",
    ],  # fmt: skip
)
def test_varlen_fa2_mapping_native(kwargs, lengths, monkeypatch):
    from attnselect.backends import varlen_fa2

    monkeypatch.setattr(varlen_fa2, "flash_forward", torch_flash_attention_forward)
    check_packed("varlen_fa2", kwargs, lengths, dqk=16, pad=False)


def test_varlen_fa2_refuses_dense_and_unequal_dims():
    h200 = attnselect.Target.preset("h200")
    dense = attnselect.AttentionProblem(2, 64, 64, 4, 4, 128, 128)
    assert any("packed input only" in r for r in get("varlen_fa2").not_supported_reasons(dense, h200))
    mla = attnselect.AttentionProblem(2, 64, 64, 4, 4, 192, 128, layout="thd")
    assert any("equal head dims" in r for r in get("varlen_fa2").not_supported_reasons(mla, h200))
    assert not get("varlen_fa2").not_supported_reasons(mla.padded(192), h200)
