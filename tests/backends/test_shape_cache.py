"""What a new packing costs a backend (attnselect.backends.shape_cache): bucketed boundaries, rounding, and
each backend's statement of it."""

from __future__ import annotations

import pytest
import torch


def test_bucketed_boundaries_are_made_once_per_tensor(monkeypatch):
    from attnselect.backends.shape_cache import PackingBuckets, Rounding, bucketed
    from attnselect.spec.options import Packing

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    buckets = PackingBuckets(Rounding(floor=8), Rounding(floor=16))
    first, again = bucketed(Packing(cu, cu, 4, 4, cu, cu), buckets), bucketed(Packing(cu, cu, 4, 4, cu, cu), buckets)
    assert first.cu_seqlens_q.tolist() == [0, 3, 7, 7, 7, 7, 7, 7, 7] and first.max_seqlen_q == 16
    assert again.cu_seqlens_q is first.cu_seqlens_q and first.cu_seqlens_kv is first.cu_seqlens_q
    assert not first.has_gaps  # offsets that were the boundaries stay the (bucketed) boundaries


@pytest.mark.parametrize(
    "n,rounding,expected",
    [
        (5, dict(), 8),
        (16, dict(floor=16), 16),
        (17, dict(floor=16), 32),
        (3, dict(floor=16), 16),
        (4097, dict(floor=128, per_doubling=2, multiple=64), 5824),
        (9000, dict(floor=8, per_doubling=0, multiple=8), 9000),
        (9001, dict(floor=8, per_doubling=0, multiple=8), 9008),
    ],
)
def test_rounding_covers_and_stays_on_its_series(n, rounding, expected):
    from attnselect.backends.shape_cache import Rounding

    assert Rounding(**rounding)(n) == expected


def test_every_backend_states_what_a_new_shape_costs_it():
    from attnselect.backends import all_backends

    stated = {b.name: b.shape_cache for b in all_backends() if b.shape_cache is not None}
    assert {"cudnn_frontend", "flex", "sdpa_cudnn", "flash_attn4"} <= set(stated)
    for cache in stated.values():
        assert cache.source and cache.keyed_on and cache.describe()
    assert stated["cudnn_frontend"].buckets is not None and not stated["cudnn_frontend"].rebuilds_per_packing
    assert stated["flex"].rebuilds_per_packing
