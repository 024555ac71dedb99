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


def test_a_packed_shard_s_half_pairs_hold_the_rows_their_queries_take():
    """The causal ring's later steps: all queries against the keys' first halves, and the queries' second halves (half
    q's rows) against all keys: each problem's tokens are its queries' rows, which with its lengths give its work."""
    from attnselect.context_parallel.call import _thd_halves_pairs
    from attnselect.context_parallel.ring import thd_halves
    from attnselect.spec.options import Packing

    cu = torch.tensor([0, 4, 12], dtype=torch.int32)
    base = attnselect.AttentionProblem(2, 8, 8, 2, 2, 16, 16, layout="thd", mask="causal", tokens=12)
    pairs = _thd_halves_pairs(base, Packing(cu, cu, 8, 8, cu, cu), thd_halves(cu, 12), ([4, 8], [4, 8]))
    assert pairs["kv_half"][0].tokens == 12 and pairs["kv_half"][0].seqlen_kv == 4
    assert pairs["q_half"][0].tokens == 6 and pairs["q_half"][0].seqlen_q == 4
