"""attention(): the memoized fast path for repeated dense calls stays correct and controllable."""

from __future__ import annotations

import pytest
import torch

import attnselect
from attnselect import api


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 9, 2, d, generator=g, dtype=dtype) for d in (24, 24, 16)]


def test_repeated_call_takes_the_fast_path_with_the_same_result():
    q, k, v = _inputs()
    first = attnselect.attention(q, k, v, causal=True)
    assert len(api._CALLS) == 1
    assert torch.equal(attnselect.attention(q, k, v, causal=True), first)
    assert len(api._CALLS) == 1


def test_fast_path_follows_environment_and_clear_cache(monkeypatch):
    q, k, v = _inputs()
    attnselect.attention(q, k, v)
    problem, chosen, *_ = next(iter(api._CALLS.values()))
    assert chosen.backend == "sdpa_flash"
    monkeypatch.setenv("ATTNSELECT_BACKEND", "reference")
    attnselect.attention(q, k, v)
    assert {entry[1].backend for entry in api._CALLS.values()} == {"sdpa_flash", "reference"}
    attnselect.clear_cache()
    assert not api._CALLS


def test_fast_path_still_validates_what_changed():
    q, k, v = _inputs()
    attnselect.attention(q, k, v)
    with pytest.raises(attnselect.InvalidInputError, match="scale"):
        attnselect.attention(q, k, v, scale=float("inf"))
    with pytest.raises(attnselect.InvalidInputError, match="k.dtype/v.dtype"):
        attnselect.attention(q, k.float(), v)
    custom = attnselect.attention(q, k, v, scale=0.5)
    reference = attnselect.attention(q, k, v, scale=0.5, backend="reference")
    assert torch.allclose(custom, reference, atol=1e-12)


def test_iterators_and_lists_bypass_the_fast_path_without_being_consumed():
    q, k, v = _inputs()
    out = attnselect.attention(q, k, v, disable=iter(["sdpa_flash"]), window=[3, 0])
    assert not api._CALLS
    assert torch.allclose(out, attnselect.attention(q, k, v, window=(3, 0), backend="reference"), atol=1e-12)
