"""The reports of _ring_worker.py's CPU groups, one run per group size, shared by test_ring.py and test_call.py."""

import functools
import os

from helpers import run_group

WORKER = os.path.join(os.path.dirname(__file__), "_ring_worker.py")
SIZES = (2, 3, 4)


@functools.cache
def results(n: int) -> dict:
    """(rank, case) -> the worker's report, from one run of a group of ``n`` processes."""
    return run_group(WORKER, n)
