"""The caller's controls (attnselect.choose.settings): the ATTNSELECT_* variables, keyword controls and overrides()."""

from __future__ import annotations

import pytest
import torch

import attnselect
from attnselect import Candidate
from helpers import CPU, SELECTION_PROBLEM

P = SELECTION_PROBLEM


def test_unknown_forced_backend_lists_known_ones(monkeypatch):
    with pytest.raises(attnselect.ForcedChoiceError, match="backend: got 'nope', expected one of .*sdpa_cudnn"):
        attnselect.select(P, target=CPU, backend="nope")
    monkeypatch.setenv("ATTNSELECT_BACKEND", "nope")
    with pytest.raises(attnselect.ForcedChoiceError, match="ATTNSELECT_BACKEND: got 'nope'"):
        attnselect.select(P, target=CPU)


@pytest.mark.parametrize(
    "variable,value",
    [("ATTNSELECT_PAD", "sometimes"), ("ATTNSELECT_POLICY", "guess"), ("ATTNSELECT_DISABLE", "sdpa_fast")],
)
def test_bad_environment_values_name_the_variable(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(attnselect.InvalidInputError, match=variable):
        attnselect.select(P, target=CPU)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"pad": ["always"]}, "pad"),
        ({"backend": ["reference"]}, "backend"),
        ({"disable": [1]}, "disable"),
        ({"policy": 3}, "policy"),
    ],
)
def test_control_of_the_wrong_type_names_the_argument(kwargs, name):
    with pytest.raises(attnselect.InvalidInputError, match=f"^{name}: got"):
        attnselect.select(P, target=CPU, **kwargs)


def test_overrides_block_like_sdpa_kernel(monkeypatch):
    assert attnselect.select(P, target=CPU).chosen == Candidate("sdpa_flash", 24)
    with attnselect.overrides(pad=False):
        assert attnselect.select(P, target=CPU).chosen == Candidate("sdpa_math")
        with attnselect.overrides(backend="reference"):  # nested: adds a field, keeps pad
            assert attnselect.select(P, target=CPU).chosen == Candidate("reference")
        assert attnselect.select(P, target=CPU, pad=True).chosen == Candidate("sdpa_flash", 24)  # keyword wins
    monkeypatch.setenv("ATTNSELECT_BACKEND", "sdpa_math")
    with attnselect.overrides(backend="reference"):  # the block wins over the environment
        assert attnselect.select(P, target=CPU).chosen.backend == "reference"
    assert attnselect.select(P, target=CPU).chosen.backend == "sdpa_math"


def test_overrides_are_checked_on_entry():
    with pytest.raises(attnselect.ForcedChoiceError, match="backend: got 'nope'"):
        with attnselect.overrides(backend="nope"):
            pass
    with pytest.raises(attnselect.InvalidInputError, match="disable"):
        with attnselect.overrides(disable=["sdpa_fast"]):
            pass


def test_overrides_reach_the_attention_fast_path():
    q, k, v = (torch.randn(1, 8, 2, d, dtype=torch.float64) for d in (24, 24, 16))
    attnselect.attention(q, k, v)
    with attnselect.overrides(backend="reference", disable="sdpa_flash"):
        inside = attnselect.attention(q, k, v)
    from attnselect import dispatch

    assert {known.chosen.backend for known in dispatch.known_calls()} == {"sdpa_flash", "reference"}
    assert torch.allclose(inside, attnselect.attention(q, k, v), atol=1e-12)
