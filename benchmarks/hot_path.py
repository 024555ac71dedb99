"""Microbenchmark: what attnselect.attention adds to a call of the chosen kernel, on tiny CPU shapes.

    python benchmarks/hot_path.py [--calls 20000] [--repeats 7]

A memoized dense call (same shapes, dtypes, devices and options as before) against the same
kernel called directly: SDPA with the FLASH kernel forced on (B, H, S, D) views of the same
bshd tensors. Prints the median added microseconds per call and the spread over repeats, then
what validating a packed (thd) call costs (packed calls are validated on every call).
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import attnselect
from attnselect.inputs import describe_call


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    assert attnselect.select(attnselect.AttentionProblem.from_tensors(q, k, v)).chosen.backend == "sdpa_flash"

    def direct():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(
                1, 2
            )

    def ours():
        return attnselect.attention(q, k, v)

    assert torch.allclose(ours(), direct())
    added = []
    for _ in range(a.repeats):
        t_ours = timeit.timeit(ours, number=a.calls) / a.calls * 1e6
        t_direct = timeit.timeit(direct, number=a.calls) / a.calls * 1e6
        added.append(t_ours - t_direct)
    print(
        f"direct {t_direct:.1f} us/call; attnselect adds {statistics.median(added):.1f} us/call "
        f"(min {min(added):.1f}, max {max(added):.1f} over {a.repeats} repeats of {a.calls} calls) "
        f"on torch {torch.__version__}"
    )
    # Packed calls are validated on every call (their boundaries may change each step): its cost.
    tq, tk, tv = torch.randn(12, 2, 16), torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    validate = lambda: describe_call(
        tq,
        tk,
        tv,
        layout="thd",
        cu_seqlens_q=cu,
        causal=True,  # noqa: E731
        max_seqlen_q=7,
        max_seqlen_kv=7,
    )
    costs = [timeit.timeit(validate, number=a.calls) / a.calls * 1e6 for _ in range(a.repeats)]
    print(
        f"packed (thd) validation: {statistics.median(costs):.1f} us/call (min {min(costs):.1f}, "
        f"max {max(costs):.1f}; CPU boundaries, read and checked on the host)"
    )


if __name__ == "__main__":
    main()
