"""The cuDNN frontend backend (attnselect.backends.cudnn_frontend) on the CPU, through a stand-in of
cudnn.sdpa_torch (tests/packed_stand_ins.py): argument mapping, surfaces, bucketed packings, the repeated runner."""

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
from packed_stand_ins import CALLS, LENGTHS, check_packed, cudnn_sdpa_torch


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


@pytest.mark.parametrize("kwargs", CALLS)
@pytest.mark.parametrize("lengths", LENGTHS, ids=["same-lengths", "kv-longer"])
def test_cudnn_frontend_packed_mapping(kwargs, lengths, monkeypatch):
    stub = types.ModuleType("cudnn")
    stub.sdpa_torch = cudnn_sdpa_torch
    monkeypatch.setitem(sys.modules, "cudnn", stub)
    check_packed("cudnn_frontend", kwargs, lengths, dqk=24, pad=False)


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
        out, lse = run(q, k, v, boundaries, 9, 9)
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
