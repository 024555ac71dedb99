"""The flash-attn package backends map our calls onto each package's documented flash_attn_func.

The packages are not installed here, so stand-ins with the documented semantics (bshd,
bottom-right causal, (left, right) windows, GQA, lse (B, H, Sq) with +inf on rows without
keys) check the argument mapping and the lse conversion against the reference backend.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

import attnselect
from attnselect.candidates import Candidate
from attnselect.execution import run_candidate
from helpers import dense_inputs, rel_err


def _documented_flash_attn_func(unbounded, lse_keyword, returns_tuple_always):
    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        deterministic=False, **kwargs):
        assert dropout_p == 0.0
        sq, skv = q.shape[1], k.shape[1]
        left, right = (-1 if w is unbounded else w for w in window_size)
        if causal:
            right = 0
        k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
        i = torch.arange(sq).unsqueeze(1) + skv - sq
        j = torch.arange(skv).unsqueeze(0)
        allowed = torch.ones(sq, skv, dtype=torch.bool)
        if right >= 0:
            allowed &= j <= i + right
        if left >= 0:
            allowed &= j >= i - left
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, -1)
        lse = lse.masked_fill(torch.isneginf(lse), float("inf"))      # softmax.h: sum == 0 ? INFINITY
        probs = torch.nan_to_num(torch.softmax(scores, -1))
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
        if kwargs.get(lse_keyword):
            return (out, lse, None) if lse_keyword == "return_attn_probs" else (out, lse)
        return (out, None) if returns_tuple_always else out
    return flash_attn_func


PACKAGES = {  # backend: (module, unbounded window edge, lse keyword, always returns a tuple)
    "flash_attn2": ("flash_attn", -1, "return_attn_probs", False),
    "flash_attn3": ("flash_attn_interface", -1, "return_attn_probs", False),
    "flash_attn4": ("flash_attn.cute", None, "return_lse", True),
}
CALLS = [
    dict(causal="bottom_right", return_lse=True),
    dict(causal=True),
    dict(window=(3, 1), return_lse=True),
    dict(window=(2, 0), causal="bottom_right"),
]


@pytest.mark.parametrize("backend", sorted(PACKAGES))
@pytest.mark.parametrize("kwargs", CALLS, ids=["bottom-right-lse", "causal", "window-lse", "causal-window"])
def test_argument_mapping_matches_the_reference(backend, kwargs, monkeypatch):
    module, unbounded, lse_keyword, always_tuple = PACKAGES[backend]
    stub = types.ModuleType(module)
    stub.flash_attn_func = _documented_flash_attn_func(unbounded, lse_keyword, always_tuple)
    monkeypatch.setitem(sys.modules, module, stub)
    sq, skv = (24, 9) if kwargs.get("causal") != True else (16, 16)   # noqa: E712 (True, not truthy)
    q, k, v = dense_inputs(sq=sq, skv=skv, hq=4, hkv=2, dqk=16, dv=16, requires_grad=False)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, **kwargs)
    out, lse = run_candidate(Candidate(backend), problem, q, k, v)
    ref, ref_lse = run_candidate(Candidate("reference"), problem, q, k, v)
    assert rel_err(out, ref) < 1e-12
    if kwargs.get("return_lse"):
        assert lse.dtype == torch.float32 and rel_err(lse, ref_lse) < 1e-6
        assert torch.isneginf(lse).any() == torch.isneginf(ref_lse).any()
