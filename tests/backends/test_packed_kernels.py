"""The packed (thd) GPU kernels' bindings, checked on the CPU through stand-ins with their documented semantics.

``cudnn.sdpa_torch`` (cuDNN frontend) and ``aten._flash_attention_forward`` (torch) run only on CUDA; the
stand-ins below compute what their docs say (masks, layouts, lse shapes and conventions)
with the reference backend, so these tests check our argument mapping and output
conversion. The kernels themselves are tested against float64 on the GPU (test_thd_gpu.py).
"""

from __future__ import annotations

import dataclasses
import sys
import types

import pytest
import torch

import attnselect
from attnselect.backends import get
from attnselect.execution import run_candidate
from attnselect.spec.options import CallOptions, Candidate
from attnselect.spec.problem import describe_call
from helpers import rel_err, thd_inputs


def _attend(q, k, v, scale, top_left_causal, band):
    """(B, H, S, D) attention with an explicit visible-key rule; lse (B, H, S) with -inf on empty rows."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    sq, skv = q.shape[2], k.shape[2]
    i, j = torch.arange(sq).unsqueeze(1), torch.arange(skv).unsqueeze(0)
    allowed = torch.ones(sq, skv, dtype=torch.bool)
    if top_left_causal:
        allowed &= j <= i
    if band is not None:
        left, right = band
        diagonal = i + skv - sq
        if right >= 0:
            allowed &= j <= diagonal + right
        if left >= 0:
            allowed &= j >= diagonal - left
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    return torch.nan_to_num(scores.softmax(-1)) @ v, lse


def _packed(fn, q, k, v, cu_q, cu_kv):
    """Run a dense (B, H, S, D) function per sequence of (T, H, D) tensors; lse (T, H)."""
    outs, lses = [], []
    bq, bk = cu_q.tolist(), cu_kv.tolist()
    for i in range(len(bq) - 1):
        o, lse = fn(
            *(
                t.transpose(0, 1).unsqueeze(0)
                for t in (q[bq[i] : bq[i + 1]], k[bk[i] : bk[i + 1]], v[bk[i] : bk[i + 1]])
            )
        )
        outs.append(o[0].transpose(0, 1))
        lses.append(lse[0].transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)


def cudnn_sdpa_torch(
    q,
    k,
    v,
    *,
    scale=None,
    is_causal=False,
    causal_bottom_right=False,
    window_left=-1,
    window_right=-1,
    cu_seqlens_q=None,
    cu_seqlens_kv=None,
    max_seqlen_q=0,
    max_seqlen_kv=0,
    return_lse=False,
):
    """cudnn-frontend 1.32 python/cudnn/sdpa/fwd/torch_op.py and graph_analyzer.py, with the op's own checks.

    window_left is cuDNN's left bound, a window length: key j is kept when j > diagonal - window_left.
    """
    if causal_bottom_right and not (is_causal or window_left >= 0 or window_right >= 0):
        raise ValueError("causal_bottom_right only re-anchors an active diagonal band")
    if is_causal and window_right > 0:
        raise ValueError("is_causal masks every future column but window_right admits some")
    if window_left == 0:
        raise ValueError("sliding-window length must be >= 1")
    if causal_bottom_right:
        band = (window_left - 1 if window_left > 0 else -1, 0 if is_causal else window_right)
    else:
        assert window_left == window_right == -1, "a top-left window is not used by attnselect"
        band = None

    def dense(q, k, v):
        return _attend(q, k, v, scale, is_causal and not causal_bottom_right, band)

    if cu_seqlens_q is not None:
        assert max_seqlen_q > 0 and max_seqlen_kv > 0
        out, lse = _packed(dense, q, k, v, cu_seqlens_q, cu_seqlens_kv)
        lse = lse.unsqueeze(-1)  # stats are (T, H, 1)
    else:
        out, lse = dense(q, k, v)
        lse = lse.unsqueeze(-1)  # stats are (B, H, S, 1)
    return (out, lse.float()) if return_lse else out


def torch_flash_attention_forward(
    q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale, window_size_left,
    window_size_right,
):  # fmt: skip
    """aten._flash_attention_forward's packed path (attention.cpp, FA2's mha_varlen_fwd in flash_api.cpp): causal
    and windows bottom-right aligned, grouped K/V heads as they are, max_seqlen an upper bound, lse (H, T) float32
    with +inf on empty rows, five outputs; and its one-query shortcut (seqlenq_ngroups_swapped), which reshapes q
    as one query per sequence."""
    assert k.shape[-1] == q.shape[-1] and v.shape == (*k.shape[:2], q.shape[-1]) and q.shape[1] % k.shape[1] == 0
    assert dropout_p == 0.0 and not return_debug_mask
    assert max_q >= int((cu_q[1:] - cu_q[:-1]).max()) and max_k >= int((cu_k[1:] - cu_k[:-1]).max())
    window = (window_size_left, 0 if is_causal else window_size_right)
    if max_q == 1 and q.shape[1] > k.shape[1] and window == (-1, -1) and q.shape[0] != cu_q.numel() - 1:
        raise RuntimeError(f"shape '[{cu_q.numel() - 1}, {k.shape[1]}, ...]' is invalid for input of size {q.numel()}")
    out, lse = _packed(lambda a, b, c: _attend(a, b, c, scale, False, window), q, k, v, cu_q, cu_k)
    lse = lse.transpose(0, 1).masked_fill(torch.isneginf(lse.transpose(0, 1)), float("inf")).float()
    empty = q.new_empty(0)
    return out, lse, empty, empty, empty


CALLS = [
    dict(causal=True),
    dict(causal="bottom_right", return_lse=True),
    dict(window=(2, 1), return_lse=True),
    dict(window=(3, 0), causal=True),
    dict(),
]
LENGTHS = [([5, 1, 0, 9, 3], [5, 1, 0, 9, 3]), ([5, 1, 0, 9, 3], [7, 2, 0, 12, 3])]


def _check(backend, kwargs, lengths, dqk, pad):
    (q, k, v), cu_q, cu_kv = thd_inputs(*lengths, dqk=dqk, dv=16)
    q, k, v = (t.detach() for t in (q, k, v))
    if kwargs.get("causal") is True and lengths[0] != lengths[1]:
        cu_kv = cu_q
        k, v = k[: q.shape[0]], v[: q.shape[0]]
    problem, packing = describe_call(
        q, k, v, CallOptions(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **kwargs)
    )
    out, lse = run_candidate(
        Candidate(backend, dqk if pad else None),
        problem,
        q,
        k,
        v,
        packing=packing,
        target=attnselect.Target.preset("h200"),
    )
    ref, ref_lse = run_candidate(Candidate("reference"), problem, q, k, v, packing=packing)
    assert out.shape == ref.shape and rel_err(out, ref) < 1e-12
    if kwargs.get("return_lse"):
        assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape and rel_err(lse, ref_lse) < 1e-6


@pytest.mark.parametrize("kwargs", CALLS)
@pytest.mark.parametrize("lengths", LENGTHS, ids=["same-lengths", "kv-longer"])
def test_cudnn_frontend_packed_mapping(kwargs, lengths, monkeypatch):
    stub = types.ModuleType("cudnn")
    stub.sdpa_torch = cudnn_sdpa_torch
    monkeypatch.setitem(sys.modules, "cudnn", stub)
    _check("cudnn_frontend", kwargs, lengths, dqk=24, pad=False)


@pytest.mark.parametrize("kwargs", CALLS)
def test_cudnn_frontend_dense_mapping(kwargs, monkeypatch):
    stub = types.ModuleType("cudnn")
    stub.sdpa_torch = cudnn_sdpa_torch
    monkeypatch.setitem(sys.modules, "cudnn", stub)
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(2, s, h, d, generator=g, dtype=torch.float64) for s, h, d in ((12, 4, 24), (20, 2, 24), (20, 2, 16))
    )
    if kwargs.get("causal") is True:
        k, v = k[:, :12], v[:, :12]
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, **kwargs)
    out, lse = run_candidate(Candidate("cudnn_frontend"), problem, q, k, v, target=attnselect.Target.preset("h200"))
    ref, ref_lse = run_candidate(Candidate("reference"), problem, q, k, v)
    assert rel_err(out, ref) < 1e-12
    if kwargs.get("return_lse"):
        assert lse.shape == ref_lse.shape and rel_err(lse, ref_lse) < 1e-6


@pytest.mark.parametrize("kwargs", CALLS)
@pytest.mark.parametrize("lengths", LENGTHS, ids=["same-lengths", "kv-longer"])
def test_varlen_fa2_mapping_padded(kwargs, lengths, monkeypatch):
    from attnselect.backends import varlen_fa2

    monkeypatch.setattr(varlen_fa2, "flash_forward", torch_flash_attention_forward)
    _check("varlen_fa2", kwargs, lengths, dqk=24, pad=True)


@pytest.mark.parametrize(
    "kwargs,lengths",
    [
        # rows that see no key: FA2's lse is +inf there, attnselect's -inf
        (dict(causal="bottom_right", return_lse=True), ([5, 1, 4, 9, 3], [3, 2, 0, 12, 3])),
        (dict(window=(2, 0), return_lse=True), ([5, 1, 4, 9, 3], [3, 2, 0, 12, 3])),
        # one query at most, grouped heads, no mask, a sequence without queries: off FA2's one-query shortcut
        (dict(return_lse=True), ([1, 0, 1], [5, 3, 7])),
        (dict(), ([1, 1, 1], [5, 3, 7])),
    ],
    ids=["keyless-rows-causal", "keyless-rows-window", "one-query-with-an-empty-sequence", "one-query-each"],
)
def test_varlen_fa2_mapping_native(kwargs, lengths, monkeypatch):
    from attnselect.backends import varlen_fa2

    monkeypatch.setattr(varlen_fa2, "flash_forward", torch_flash_attention_forward)
    _check("varlen_fa2", kwargs, lengths, dqk=16, pad=False)


def test_varlen_fa2_refuses_dense_and_unequal_dims():
    h200 = attnselect.Target.preset("h200")
    dense = attnselect.AttentionProblem(2, 64, 64, 4, 4, 128, 128)
    assert any("packed input only" in r for r in get("varlen_fa2").not_supported_reasons(dense, h200))
    mla = attnselect.AttentionProblem(2, 64, 64, 4, 4, 192, 128, layout="thd")
    assert any("equal head dims" in r for r in get("varlen_fa2").not_supported_reasons(mla, h200))
    assert not get("varlen_fa2").not_supported_reasons(mla.padded(192), h200)


def test_gaps_are_refused_by_kernels_without_offsets():
    h200 = attnselect.Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0"})
    gapped = attnselect.AttentionProblem(2, 64, 64, 4, 4, 192, 128, layout="thd", varlen_gaps=True)
    for name in ("cudnn_frontend", "varlen_fa2"):
        assert any("gaps" in r for r in get(name).not_supported_reasons(gapped.padded(192), h200))
    assert not get("flex").not_supported_reasons(gapped, h200)


def test_cudnn_frontend_serves_absorbed_mla_forward_only_where_measured():
    h200 = attnselect.Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0"})
    absorbed = attnselect.AttentionProblem(2, 1, 4096, 16, 1, 576, 512, mask="causal_bottom_right")
    assert not get("cudnn_frontend").not_supported_reasons(absorbed, h200)
    assert not get("cudnn_frontend").not_supported_reasons(absorbed.padded(576), h200)
    refused = [
        (absorbed, h200.with_versions(cudnn_version="9.18.0")),
        (absorbed.padded(640), h200),
        (dataclasses.replace(absorbed, training=True), h200),
        (absorbed, attnselect.Target.preset("b200", packages={"nvidia-cudnn-frontend": "1.32.0"})),
    ]
    for problem, target in refused:
        assert any("above 256" in r for r in get("cudnn_frontend").not_supported_reasons(problem, target))


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_cudnn_frontend_refuses_the_backward_of_one_query_and_one_key(layout):
    h200 = attnselect.Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0"})
    single = attnselect.AttentionProblem(3, 1, 1, 4, 4, 192, 128, layout=layout, mask="causal", training=True)
    assert any("s_q = s_kv = 1" in r for r in get("cudnn_frontend").not_supported_reasons(single, h200))
    for served in (dataclasses.replace(single, training=False), dataclasses.replace(single, seqlen_kv=2)):
        assert not get("cudnn_frontend").not_supported_reasons(served, h200)


def _recording_stub(monkeypatch):
    """The cudnn stand-in, recording the sequence count and max_seqlen of every packed call."""
    seen = []

    def recording(q, k, v, **kwargs):
        if kwargs.get("cu_seqlens_q") is not None:
            seen.append(
                (
                    kwargs["cu_seqlens_q"].numel() - 1,
                    kwargs["max_seqlen_q"],
                    kwargs["cu_seqlens_kv"].numel() - 1,
                    kwargs["max_seqlen_kv"],
                )
            )
        return cudnn_sdpa_torch(q, k, v, **kwargs)

    stub = types.ModuleType("cudnn")
    stub.sdpa_torch = recording
    monkeypatch.setitem(sys.modules, "cudnn", stub)
    return seen


@pytest.mark.parametrize("lengths", LENGTHS, ids=["same-lengths", "kv-longer"])
@pytest.mark.parametrize("kwargs", [dict(causal="bottom_right", return_lse=True), dict(window=(2, 1), return_lse=True)])
def test_cudnn_frontend_bucketed_packing_equals_unbucketed(lengths, kwargs, monkeypatch):
    """Empty trailing sequences and a larger max_seqlen change nothing: output, lse and all three gradients."""
    from attnselect.backends.shape_cache import PackingBuckets, Rounding

    seen = _recording_stub(monkeypatch)
    frontend = get("cudnn_frontend")
    (q, k, v), cu_q, cu_kv = thd_inputs(*lengths, dqk=24, dv=16)
    problem, packing = describe_call(
        q, k, v, CallOptions(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, **kwargs)
    )
    runs = []
    for buckets in (PackingBuckets(Rounding(floor=16), Rounding(floor=64)), None):
        monkeypatch.setattr(frontend, "shape_cache", dataclasses.replace(type(frontend).shape_cache, buckets=buckets))
        out, lse = run_candidate(
            Candidate("cudnn_frontend"), problem, q, k, v, packing=packing, target=attnselect.Target.preset("h200")
        )
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        runs.append((out, lse, grads))
    assert seen == [(16, 64, 16, 64), (5, max(lengths[0]), 5, max(lengths[1]))]  # what the op was handed
    (out, lse, grads), (out0, lse0, grads0) = runs
    assert torch.equal(out, out0) and torch.equal(lse, lse0) and all(map(torch.equal, grads, grads0))
    assert cu_q.tolist() == [0, 5, 6, 6, 15, 18]  # the caller's boundaries are untouched


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


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_cudnn_frontend_repeated_packed_runner_serves_each_call_s_own_boundaries(training, return_lse, monkeypatch):
    """attention()'s memoized packed calls: options bound at the first call (statistics asked for only where the
    call needs them), every call on its own boundaries (bucketed once each), as the reference computes them."""
    from attnselect.execution import kernel_call, packed_runner
    from attnselect.spec.options import Packing

    asked = []  # return_lse of each call of the op

    def recording(q, k, v, **kwargs):
        asked.append(kwargs["return_lse"])
        return cudnn_sdpa_torch(q, k, v, **kwargs)

    stub = types.ModuleType("cudnn")
    stub.sdpa_torch = recording
    monkeypatch.setitem(sys.modules, "cudnn", stub)
    (q, k, v), cu, _ = thd_inputs([5, 1, 0, 9, 3], hq=4, hkv=4)
    q, k, v = (t.detach().requires_grad_(training) for t in (q, k, v))
    problem, first = describe_call(
        q,
        k,
        v,
        CallOptions(layout="thd", cu_seqlens_q=cu, max_seqlen_q=9, max_seqlen_kv=9, causal=True, return_lse=return_lse),
    )
    call = kernel_call(problem)
    run = packed_runner(get("cudnn_frontend"), None, call, like=(q, k, v, first))
    for bounds in ([0, 5, 6, 6, 15, 18], [0, 9, 10, 12, 15, 18], [0, 9, 10, 12, 15, 18]):
        boundaries = torch.tensor(bounds, dtype=torch.int32)
        out, lse = run(q, k, v, boundaries)
        packing = Packing(boundaries, boundaries, 9, 9, boundaries, boundaries)
        ref, ref_lse = run_candidate(Candidate("reference"), problem, q, k, v, packing=packing)
        assert rel_err(out, ref) < 1e-12
        assert (lse is None) != return_lse and (not return_lse or rel_err(lse, ref_lse) < 1e-6)  # (H, T)
        if training:
            grads = torch.autograd.grad(out.sum(), (q, k, v))
            assert all(rel_err(g, r) < 1e-10 for g, r in zip(grads, torch.autograd.grad(ref.sum(), (q, k, v))))
    assert asked == [training or return_lse] * 3


def test_cudnn_frontend_packed_runner_not_repeated_binds_nothing(monkeypatch):
    """A runner built for one call at a time asks every call what it needs: here an inference call, then a
    training one, whose backward needs the op's statistics."""
    from attnselect.execution import kernel_call

    asked = []

    def recording(q, k, v, **kwargs):
        asked.append((kwargs["return_lse"], kwargs["max_seqlen_q"]))
        return cudnn_sdpa_torch(q, k, v, **kwargs)

    stub = types.ModuleType("cudnn")
    stub.sdpa_torch = recording
    monkeypatch.setitem(sys.modules, "cudnn", stub)
    (q, k, v), cu, _ = thd_inputs([5, 1, 0, 9, 3], hq=4, hkv=4)
    problem, packing = describe_call(q, k, v, CallOptions(layout="thd", cu_seqlens_q=cu, causal=True))
    run = get("cudnn_frontend").packed_runner(kernel_call(problem))
    with torch.no_grad():
        run(q, k, v, packing)
    run(q, k, v, packing._replace(max_seqlen_q=16, max_seqlen_kv=16))
    assert asked == [(False, 9), (True, 16)]
