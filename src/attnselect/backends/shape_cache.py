"""What a new shape costs a backend, and the packing buckets that keep a backend's shapes few.

Some kernels are built per shape: the cuDNN frontend's torch op builds a cuDNN graph for every new
(sequence count, max_seqlen, ...) of a packed call, flex builds a block mask for every new packing,
FlashAttention-4 compiles each configuration on first use. A training loop brings a new packing every
step, so a backend whose cache keys on what changes from step to step rebuilds every step. Each backend
states its cache as a :class:`ShapeCache`; where the cache keys on the sequence count and max_seqlen,
:class:`PackingBuckets` round them up before the call (empty trailing sequences, a larger bound), which
changes no result: an empty sequence adds no token, and max_seqlen only bounds the lengths.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from attnselect.memos import TensorMemo
from attnselect.spec.options import Packing


@dataclass(frozen=True)
class Rounding:
    """Round a count up to a value of a short series, so a loop meets few distinct values.

    ``per_doubling`` > 0: the geometric series ``floor * 2**(k / per_doubling)``, each value rounded up to a
    ``multiple`` (1: powers of two times ``floor``); 0: the multiples of ``multiple``. Values at or below
    ``floor`` become ``floor``.
    """

    floor: int = 1
    per_doubling: int = 1
    multiple: int = 1

    def __call__(self, n: int) -> int:
        return _rounded(n, self.floor, self.per_doubling, self.multiple)

    def describe(self) -> str:
        if self.per_doubling == 0:
            return f"a multiple of {self.multiple} (at least {self.floor})"
        series = "powers of two" if self.per_doubling == 1 else f"{self.per_doubling} steps per doubling"
        return f"{series} from {self.floor}" + (f", multiples of {self.multiple}" if self.multiple > 1 else "")


@functools.lru_cache(maxsize=8192)
def _rounded(n: int, floor: int, per_doubling: int, multiple: int) -> int:
    if n <= floor:
        return floor
    if per_doubling == 0:
        return -(-n // multiple) * multiple
    k = max(math.ceil(per_doubling * math.log2(n / floor)) - 1, 0)
    while True:  # the float log may land one step low; step up until the value covers n
        value = -(-math.ceil(floor * 2 ** (k / per_doubling)) // multiple) * multiple
        if value >= n:
            return value
        k += 1


@dataclass(frozen=True)
class PackingBuckets:
    """How a packed call's sequence count and max_seqlen are rounded before a backend sees them."""

    sequences: Rounding
    max_seqlen: Rounding

    def describe(self) -> str:
        return (
            f"the sequence count up to {self.sequences.describe()} (empty trailing sequences) and max_seqlen up "
            f"to {self.max_seqlen.describe()}"
        )


@dataclass(frozen=True)
class ShapeCache:
    """What a backend builds per shape, what that cache keys on, and what a new key costs.

    ``rebuilds_per_packing``: whether a new packing (new boundary values, at sizes already seen) costs a
    build, after ``buckets`` where given; the rules rank such a candidate after those on the same path
    that do not (:mod:`attnselect.choose.rules`). ``new_key_ms``: the measured cost of one new key, where measured.
    """

    builds: str
    keyed_on: str
    source: str
    rebuilds_per_packing: bool = False
    new_key_ms: float | None = None
    buckets: PackingBuckets | None = None

    def describe(self) -> str:
        cost = f", about {self.new_key_ms:g} ms each" if self.new_key_ms else ""
        text = f"builds {self.builds} per new key{cost}; keyed on {self.keyed_on}"
        if self.buckets:
            text += f"; attnselect rounds {self.buckets.describe()}"
        return text + ("; every new packing pays it" if self.rebuilds_per_packing else "")


# The bucketed boundaries of a packing tensor, once per tensor (every layer of a step shares them).
_PADDED_BOUNDARIES = TensorMemo()


def bucketed(packing, buckets: PackingBuckets):
    """``packing`` with its sequence count and max_seqlen rounded up: the boundaries gain empty trailing sequences
    (their last entry repeated, on the device: no host sync)."""
    count = packing.cu_seqlens_q.numel() - 1
    target = buckets.sequences(max(count, 1))
    cu_q = padded_boundaries(packing.cu_seqlens_q, count, target)
    same = packing.cu_seqlens_kv is packing.cu_seqlens_q
    cu_kv = cu_q if same else padded_boundaries(packing.cu_seqlens_kv, count, target)
    done = {id(packing.cu_seqlens_q): cu_q, id(packing.cu_seqlens_kv): cu_kv}  # offsets often are the boundaries
    offsets_q, offsets_kv = (
        done[id(t)] if id(t) in done else padded_boundaries(t, count, target)
        for t in (packing.offsets_q, packing.offsets_kv)
    )
    max_q, max_kv = (buckets.max_seqlen(max(m, 1)) for m in (packing.max_seqlen_q, packing.max_seqlen_kv))
    return Packing(cu_q, cu_kv, max_q, max_kv, offsets_q, offsets_kv)


def padded_boundaries(t: torch.Tensor, count: int, target: int) -> torch.Tensor:
    """Boundaries of ``count`` sequences as boundaries of ``target``: the last entry repeated, once per tensor."""
    if target == count:
        return t
    return _PADDED_BOUNDARIES.get((t,), target, lambda: torch.cat([t, t[-1:].expand(target - count)]))
