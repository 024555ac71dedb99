"""Context-parallel attention against single-process attention: gloo groups of 2, 3 and 4 CPU processes, float64.

Each group runs every case of _ring_worker.py once; each test checks one case on every rank: the output, lse,
max logit and gradients of its shard within 1e-10 of the single-process call's shard.
"""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from _ring_groups import SIZES, results  # noqa: E402
from _ring_worker import cases  # noqa: E402


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
