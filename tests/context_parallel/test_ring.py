"""Context-parallel attention against single-process attention: gloo groups of 2, 3 and 4 CPU processes, float64.

Each group runs every case of _ring_worker.py once; each test checks one case on every rank: the output, lse,
max logit and gradients of its shard within 1e-10 of the single-process call's shard.
"""

import functools
import os
import sys

import pytest

from helpers import run_group

WORKER = os.path.join(os.path.dirname(__file__), "_ring_worker.py")
sys.path.insert(0, os.path.dirname(__file__))
from _ring_worker import cases  # noqa: E402

SIZES = (2, 3, 4)


@functools.cache
def results(n: int) -> dict:
    """(rank, case) -> the worker's report, from one run of a group of ``n`` processes."""
    return run_group(WORKER, n)


def case_ids():
    return [(n, name) for n in SIZES for name in [*cases(n), "group-of-one", "edges"]]


@pytest.mark.parametrize(("n", "case"), case_ids(), ids=[f"cp{n}-{name}" for n, name in case_ids()])
def test_every_rank_matches_the_single_process_shard(n, case):
    for rank in range(n):
        report = results(n)[rank, case]
        assert "raised" not in report, report.get("raised")
        assert report["errors"], report
        if case not in ("thd-causal-inference", "group-of-one", "edges"):
            assert {"out", "lse", "dq", "dk", "dv"} <= set(report["errors"])
        if "sinks" in case:
            assert {"max_logit", "dsinks"} <= set(report["errors"])
        assert max(report["errors"].values()) < 1e-10, (rank, report["errors"])


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
