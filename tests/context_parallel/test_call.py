"""A context-parallel call's checks (attnselect.context_parallel.call): bad calls raise on all ranks before the ring."""

import os
import sys

import pytest
import torch

import attnselect

sys.path.insert(0, os.path.dirname(__file__))
from _ring_groups import SIZES, results  # noqa: E402


def test_cp_group_must_be_a_process_group():
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(attnselect.InvalidInputError, match="cp_group: got str, expected None or a torch.distributed"):
        attnselect.attention(q, q, q, cp_group="context")


EXPECTED_ERRORS = {
    "odd-dense-length": "q.shape: got a local sequence length of",
    "odd-thd-length": "cu_seqlens_q: got local sequence lengths [3], expected even ones",
    "window": "window: got (2, 0) with context_parallel_size=",
    "bottom-right": "causal: got mask 'causal_bottom_right' with context_parallel_size=",
    "dropout": "dropout_p: got 0.1 with context_parallel_size=",
    "mismatched-shards": "cp_group: got ranks whose calls differ",
    "mismatched-boundaries": "cp_group: got ranks whose calls differ",
    "training-on-one-rank": "cp_group: got ranks whose calls differ",
}


@pytest.mark.parametrize("n", SIZES)
def test_a_refusal_on_one_rank_raises_on_every_rank(n):
    for rank in range(n):
        error = results(n)[rank, "bad-calls"]["errors"]["refused-on-one-rank"]
        expected = "cu_seqlens_q: got local sequence lengths [3]" if rank == 1 else "cp_group: got a call another rank"
        assert expected in error, (rank, error)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("call", EXPECTED_ERRORS)
def test_bad_calls_raise_on_every_rank_before_the_ring(n, call):
    for rank in range(n):
        assert EXPECTED_ERRORS[call] in results(n)[rank, "bad-calls"]["errors"][call]
