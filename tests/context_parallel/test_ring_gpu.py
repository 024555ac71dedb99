"""Context-parallel attention on the GPU's own chunk kernels: two processes share one GPU (gloo; the ring's
transfers go through the host there), bfloat16 at MLA's 192/128, dense and packed, training and inference;
every rank's output and gradients against the float64 single-process attention's shard."""

import functools
import os

import pytest

from helpers import run_group

pytestmark = pytest.mark.gpu

WORKER = os.path.join(os.path.dirname(__file__), "_ring_worker.py")
CASES = ("bshd-mla-causal", "bshd-mla-full", "thd-mla-causal", "thd-mla-causal-max-seqlen-given",
         "bshd-mla-causal-inference", "thd-gqa-causal-inference")  # fmt: skip


@functools.cache
def results() -> dict:
    return run_group(WORKER, 2, "cuda")


@pytest.mark.parametrize("case", CASES)
def test_bfloat16_shards_match_the_float64_attention(case):
    for rank in range(2):
        report = results()[rank, case]
        assert "raised" not in report, report.get("raised")
        errors = report["errors"]
        assert set(errors) == ({"out"} if "inference" in case else {"out", "dq", "dk", "dv"}), errors
        assert max(errors.values()) < 2e-2, (rank, errors, report["chosen"])
        print(rank, case, report["chosen"], errors)
