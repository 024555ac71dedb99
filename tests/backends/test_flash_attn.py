"""The flash-attn package backends map our calls onto each package's documented flash_attn_func.

The packages are not installed here, so stand-ins with the documented semantics (bshd,
bottom-right causal, (left, right) windows, GQA, lse (B, H, Sq) with +inf on rows without
keys, -inf in FlashAttention-4) check the argument mapping and the lse conversion against the reference backend.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest
import torch

import attnselect
from attnselect.choose.candidates import kernel_reasons
from attnselect.execution import run_candidate
from attnselect.spec.options import CallOptions, Candidate
from helpers import dense_inputs, rel_err


def _documented_flash_attn_func(unbounded, lse_keyword, returns_tuple_always, keyless_lse):
    def flash_attn_func(
        q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), deterministic=False, **kwargs
    ):
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
        lse = lse.masked_fill(torch.isneginf(lse), keyless_lse)  # FA2/3 softmax.h: sum == 0 ? INFINITY
        probs = torch.nan_to_num(torch.softmax(scores, -1))
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
        if kwargs.get(lse_keyword):
            return (out, lse, None) if lse_keyword == "return_attn_probs" else (out, lse)
        return (out, None) if returns_tuple_always else out

    return flash_attn_func


PACKAGES = {  # backend: (module, unbounded window edge, lse keyword, always returns a tuple, keyless rows' lse)
    "flash_attn2": ("flash_attn", -1, "return_attn_probs", False, float("inf")),
    "flash_attn3": ("flash_attn_interface", -1, "return_attn_probs", False, float("inf")),
    "flash_attn4": ("flash_attn.cute", None, "return_lse", True, float("-inf")),
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
    module, *documented = PACKAGES[backend]
    stub = types.ModuleType(module)
    stub.flash_attn_func = _documented_flash_attn_func(*documented)
    monkeypatch.setitem(sys.modules, module, stub)
    sq, skv = (24, 9) if kwargs.get("causal") != True else (16, 16)  # noqa: E712 (True, not truthy)
    q, k, v = dense_inputs(sq=sq, skv=skv, hq=4, hkv=2, dqk=16, dv=16, requires_grad=False)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, **kwargs)
    out, lse = run_candidate(Candidate(backend), problem, q, k, v)
    ref, ref_lse = run_candidate(Candidate("reference"), problem, q, k, v)
    assert rel_err(out, ref) < 1e-12
    if kwargs.get("return_lse"):
        assert lse.dtype == torch.float32 and rel_err(lse, ref_lse) < 1e-6
        assert torch.isneginf(lse).any() == torch.isneginf(ref_lse).any()


def test_flash_attn4_s_lse_is_returned_as_it_comes(monkeypatch):
    """FA4's lse is float32 and -inf on rows that see no key, as ours (flash_attn/cute/softmax.py): its own tensor is
    returned, no kernel converts it (FA2's and FA3's +inf are mapped: the test above)."""
    documented, returned = _documented_flash_attn_func(*PACKAGES["flash_attn4"][1:]), []

    def flash_attn_func(*args, **kwargs):
        out, lse = documented(*args, **kwargs)
        returned.append(lse.float())
        return out, returned[-1]

    stub = types.ModuleType("flash_attn.cute")
    stub.flash_attn_func = flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn.cute", stub)
    q, k, v = dense_inputs(sq=24, skv=9, hq=4, hkv=2, dqk=16, dv=16, requires_grad=False)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, causal="bottom_right", return_lse=True)
    out, lse = run_candidate(Candidate("flash_attn4"), problem, q, k, v)
    assert lse is returned[-1] and torch.isneginf(lse).any()


def _documented_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    softmax_scale=None,
    causal=False,
    window_size=(None, None),
    deterministic=False,
    softcap=0.0,
    return_lse=False,
):
    """flash_attn.cute.flash_attn_varlen_func as documented: (T, H, D) in and out, lse (H, T), per sequence."""
    assert softcap == 0.0  # 0 is off
    dense = _documented_flash_attn_func(*PACKAGES["flash_attn4"][1:])
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q >= max(b - a for a, b in zip(bq, bq[1:])) and max_seqlen_k >= max(
        b - a for a, b in zip(bk, bk[1:])
    )
    outs, lses = [], []
    for i in range(len(bq) - 1):
        o, lse = dense(
            *(t.unsqueeze(0) for t in (q[bq[i] : bq[i + 1]], k[bk[i] : bk[i + 1]], v[bk[i] : bk[i + 1]])),
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            return_lse=True,
        )
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), (torch.cat(lses, dim=1) if return_lse else None)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(causal=True),
        dict(causal="bottom_right", return_lse=True),
        dict(window=(2, 1), return_lse=True),
        dict(window=(3, 0), causal="bottom_right"),
    ],
)
@pytest.mark.parametrize(
    "lengths", [([5, 1, 0, 9, 3], None), ([5, 1, 0, 9, 3], [7, 2, 0, 12, 3])], ids=["same-lengths", "kv-longer"]
)
def test_flash_attn4_packed_mapping_matches_the_reference(kwargs, lengths, monkeypatch):
    from attnselect.spec.problem import describe_call
    from helpers import thd_inputs

    stub = types.ModuleType("flash_attn.cute")
    stub.flash_attn_varlen_func = _documented_flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn.cute", stub)
    if kwargs.get("causal") is True:
        lengths = (lengths[0], None)  # top-left causal is served where it equals bottom-right: same lengths
    (q, k, v), cu_q, cu_kv = thd_inputs(*lengths, hq=4, hkv=2, dqk=24, dv=16)
    q, k, v = (t.detach() for t in (q, k, v))
    problem, packing = describe_call(
        q, k, v, CallOptions(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **kwargs)
    )
    fa4 = attnselect.Target.preset("h200", packages={"flash-attn-4": "4.0.0b36"})
    assert attnselect.backends.get("flash_attn4").packs_thd(fa4)
    out, lse = run_candidate(Candidate("flash_attn4"), problem, q, k, v, packing=packing, target=fa4)
    ref, ref_lse = run_candidate(Candidate("reference"), problem, q, k, v, packing=packing)
    assert rel_err(out, ref) < 1e-12
    if kwargs.get("return_lse"):
        assert lse.shape == ref_lse.shape == (4, q.shape[0]) and rel_err(lse, ref_lse) < 1e-6


def test_flash_attn4_leads_on_hopper_where_installed_dense_and_packed():
    """The H200 measured FA4 ahead of cuDNN on every dense problem and on packed MLA (h200-measurements-2026-12)."""
    fa4 = attnselect.Target.preset("h200", packages={"flash-attn-4": "4.0.0b36", "nvidia-cudnn-frontend": "1.32.0"})
    mla = dict(
        batch=2, seqlen_q=4096, seqlen_kv=4096, heads_q=16, heads_kv=16, head_dim_qk=192, head_dim_v=128, mask="causal"
    )
    for layout in ("bshd", "thd"):
        for training in (True, False):
            problem = attnselect.AttentionProblem(**mla, layout=layout, training=training)
            assert attnselect.select(problem, target=fa4).chosen == Candidate("flash_attn4")
    non_square = attnselect.AttentionProblem(**dict(mla, seqlen_q=1024), training=True)  # top-left, Sq < Skv
    assert attnselect.select(non_square, target=fa4).chosen == Candidate("sdpa_cudnn")
    blackwell = attnselect.Target.preset("b200", packages={"flash-attn-4": "4.0.0b36"})
    assert attnselect.select(attnselect.AttentionProblem(**mla, training=True), target=blackwell).chosen == Candidate(
        "sdpa_cudnn"
    )


def test_flash_attn4_keeps_its_compiled_kernels_under_attnselects_cache(monkeypatch, tmp_path):
    from attnselect.backends import flash_attn4

    monkeypatch.delenv(flash_attn4.CACHE_ENABLED, raising=False)
    monkeypatch.delenv(flash_attn4.CACHE_DIR, raising=False)
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    flash_attn4._enable_compile_cache()
    assert os.environ[flash_attn4.CACHE_ENABLED] == "1"
    assert os.environ[flash_attn4.CACHE_DIR] == str(tmp_path / "flash_attn_cute")
    monkeypatch.setenv(flash_attn4.CACHE_ENABLED, "0")  # the caller's choice stands
    monkeypatch.setenv(flash_attn4.CACHE_DIR, "/elsewhere")
    flash_attn4._enable_compile_cache()
    assert os.environ[flash_attn4.CACHE_ENABLED] == "0" and os.environ[flash_attn4.CACHE_DIR] == "/elsewhere"


def test_flash_attn4_refuses_the_sm90_gqa_backward_of_unequal_head_dims():
    fa4 = attnselect.Target.preset("h200", packages={"flash-attn-4": "4.0.0b36"})
    gqa = attnselect.AttentionProblem(2, 128, 128, 8, 2, 192, 128, mask="causal", training=True)
    reasons = attnselect.backends.get("flash_attn4").not_supported_reasons(gqa, fa4)
    assert any("GQA" in r and "padding to 192" in r for r in reasons)
    decision = attnselect.select(gqa, target=fa4)
    assert Candidate("flash_attn4", 192) in decision.ranked
    for served in (dataclasses.replace(gqa, training=False), dataclasses.replace(gqa, heads_kv=8), gqa.padded(192)):
        assert not attnselect.backends.get("flash_attn4").not_supported_reasons(served, fa4)


@pytest.mark.parametrize(
    "head_dim,trains", [(16, False), (48, False), (112, False), (32, True), (96, True), (128, True)]
)
def test_flash_attn4_trains_on_sm90_only_the_head_dims_whose_gradients_matched_on_the_h200(head_dim, trains):
    fa4 = attnselect.Target.preset("h200", packages={"flash-attn-4": "4.0.0b36"})
    p = attnselect.AttentionProblem(2, 128, 128, 8, 8, head_dim, head_dim, mask="causal", training=True)
    reasons = attnselect.backends.get("flash_attn4").not_supported_reasons(p, fa4)
    assert (not reasons) == trains and all("correct gradients on the H200 only" in r for r in reasons)
    assert not attnselect.backends.get("flash_attn4").not_supported_reasons(dataclasses.replace(p, training=False), fa4)
    b200 = attnselect.Target.preset(
        "b200", packages={"flash-attn-4": "4.0.0b36"}
    )  # measured on sm90 only: no grid there
    assert kernel_reasons(attnselect.backends.get("flash_attn4"), p, b200) == [
        "no correctness grid has passed it on sm100 (benchmarks/correctness_grid.py)"
    ]
