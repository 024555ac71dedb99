"""The SDPA backends' shared mechanism (attnselect.backends._sdpa): forcing one kernel, prepared runners."""

from __future__ import annotations

import pytest
import torch

import attnselect
from attnselect import backends
from helpers import dense_inputs, rel_err


def test_only_kernel_switches_one_sdpa_kernel_on_for_a_call_and_restores_every_switch():
    from torch.nn.attention import SDPBackend

    from attnselect.backends._sdpa import _SWITCHES, only_kernel

    before = [enabled() for _, enabled, _ in _SWITCHES]
    torch.backends.cuda.enable_math_sdp(False)  # a caller's own setting survives too
    try:
        with only_kernel(SDPBackend.MATH):
            assert [enabled() for _, enabled, _ in _SWITCHES] == [k == SDPBackend.MATH for k, _, _ in _SWITCHES]
        assert not torch.backends.cuda.math_sdp_enabled()
    finally:
        torch.backends.cuda.enable_math_sdp(True)
    assert [enabled() for _, enabled, _ in _SWITCHES] == before


def test_a_repeated_sdpa_runner_forces_its_kernel_only_where_torchs_dispatch_would_not_reach_it(monkeypatch):
    from torch.nn.attention import SDPBackend

    from attnselect.backends import _sdpa
    from attnselect.execution import kernel_call

    forced, asked = [], []
    enter, choice = _sdpa.only_kernel.__enter__, torch._fused_sdp_choice
    monkeypatch.setattr(_sdpa.only_kernel, "__enter__", lambda self: forced.append(self.kernel) or enter(self))
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *a, **kw: asked.append(1) or choice(*a, **kw))
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))  # bhsd, float32: torch's CPU dispatch picks flash
    call = kernel_call(attnselect.AttentionProblem.from_tensors(q, k, v, layout="bhsd"))
    flash, math = (backends.get(name).runner(call, repeated=True) for name in ("sdpa_flash", "sdpa_math"))
    expected = backends.get("reference").run(q, k, v, call)[0]
    for _ in range(3):
        assert rel_err(flash(q, k, v)[0], expected) < 1e-5 and rel_err(math(q, k, v)[0], expected) < 1e-5
    assert forced == [SDPBackend.MATH] * 3 and len(asked) == 2  # dispatch asked once per runner
    with torch.nn.attention.sdpa_kernel([SDPBackend.MATH]):  # new switches: asked again, and now forced
        flash(q, k, v)
    assert forced[3:] == [SDPBackend.FLASH_ATTENTION] and len(asked) == 3
    flash(q, k, v)  # torch's own switches again
    assert forced[4:] == [] and len(asked) == 4
    once = backends.get("sdpa_flash").runner(call)  # not repeated: forced on every call, dispatch never asked
    once(q, k, v)
    assert forced[4:] == [SDPBackend.FLASH_ATTENTION] and len(asked) == 4


def test_a_prepared_sdpa_runner_calls_the_kernels_aten_op_with_the_arguments_sdpa_would(monkeypatch):
    """Where a kernel has an aten op (cuDNN and mem-efficient, CUDA only), repeated calls whose inputs are known
    call it directly; here sdpa_flash stands in on the CPU, with an op that records its arguments."""
    import torch.nn.functional as F

    from attnselect.execution import kernel_call

    flash, calls = backends.get("sdpa_flash"), []

    def op(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
        calls.append(((attn_bias, compute_log_sumexp, dropout_p, is_causal), scale))
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale), "lse"

    monkeypatch.setattr(type(flash), "aten_op", staticmethod(op))
    for training, causal, scale in [(False, False, None), (True, True, None), (False, True, 0.5)]:
        q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=training) for _ in range(3))
        problem = attnselect.AttentionProblem.from_tensors(q, k, v, layout="bhsd", causal=causal)
        call = kernel_call(problem, scale)
        out, lse = flash.runner(call, repeated=True, like=(q, k, v))(q, k, v)
        assert calls[-1] == ((None, training, 0.0, causal), scale) and lse is None
        assert rel_err(out, backends.get("reference").run(q, k, v, call)[0]) < 1e-5
    seen = len(calls)
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    call = kernel_call(attnselect.AttentionProblem.from_tensors(q, k, v, layout="bhsd"))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # acts on SDPA's call, not on the op's: SDPA's dispatch
        assert flash.runner(call, repeated=True, like=(q, k, v))(q, k, v)[0].dtype == torch.bfloat16
    for kwargs, heads in [(dict(window=(3, 0)), 2), (dict(), 1)]:  # a mask tensor, grouped heads: SDPA's dispatch
        q, (k, v) = torch.randn(1, 2, 8, 16), (torch.randn(1, heads, 8, 16) for _ in range(2))
        call = kernel_call(attnselect.AttentionProblem.from_tensors(q, k, v, layout="bhsd", **kwargs))
        out, _ = flash.runner(call, repeated=True, like=(q, k, v))(q, k, v)
        assert rel_err(out, backends.get("reference").run(q, k, v, call)[0]) < 1e-5
    assert len(calls) == seen


@pytest.mark.gpu
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", ["sdpa_cudnn", "sdpa_efficient"])
def test_gpu_repeated_sdpa_calls_run_the_kernels_aten_op_as_sdpa_would(name, training, monkeypatch):
    """The op called directly gives what SDPA gives with the kernel forced, gradients included, and SDPA itself
    is not called."""
    import torch.nn.functional as F

    from attnselect.backends._sdpa import only_kernel
    from attnselect.execution import kernel_call

    backend = backends.get(name)
    q, k, v = dense_inputs(sq=256, skv=256, hq=8, hkv=8, dqk=192, dv=128, dtype=torch.bfloat16, device="cuda")
    q, k, v = (t.transpose(1, 2).detach().requires_grad_(training) for t in (q, k, v))  # bhsd views
    for causal, scale in [(False, None), (True, 0.1)]:
        call = kernel_call(attnselect.AttentionProblem.from_tensors(q, k, v, layout="bhsd", causal=causal), scale)
        with only_kernel(backend.kernel):
            expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=call.scale)
        runner = backend.runner(call, repeated=True, like=(q, k, v))
        with monkeypatch.context() as m:
            m.setattr(F, "scaled_dot_product_attention", None)  # a call through SDPA would raise
            out, _ = runner(q, k, v)
        assert torch.equal(out, expected)
        if training:
            grad = torch.randn_like(out)
            grads, expected_grads = (torch.autograd.grad(o, (q, k, v), grad) for o in (out, expected))
            assert all(rel_err(a, b) < 1e-2 for a, b in zip(grads, expected_grads))


def test_a_bshd_call_reaches_the_kernels_own_op_with_no_transpose_where_it_suits(monkeypatch):
    """Where a kernel has an op on (batch, seq, heads, dim) tensors (mem-efficient and flash, CUDA only), a
    repeated bshd call through attention() gets it with its tensors as they are, and an sbhd call with one swap of
    axes; here sdpa_flash stands in on the CPU with an op that records what it gets."""
    import torch.nn.functional as F

    flash, calls = backends.get("sdpa_flash"), []

    def op(q, k, v, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, debug_mask, *, scale=None):
        calls.append((q.stride(), (cum_q, cum_k, max_q, max_k, dropout_p, is_causal, debug_mask), scale))
        views = (t.transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(*views, is_causal=is_causal, scale=scale).transpose(1, 2), "lse"

    monkeypatch.setattr(type(flash), "bshd_op", staticmethod(op))
    monkeypatch.setattr(type(flash), "bshd_op_devices", frozenset({"cpu"}))
    for layout, causal, scale in [("bshd", False, None), ("bshd", True, 0.5), ("sbhd", True, None)]:
        attnselect.clear_cache()
        q, k, v = dense_inputs(layout, b=2, sq=8, skv=8, hq=2, hkv=2, dqk=16, dv=16, dtype=torch.float32)
        for _ in range(2):
            out = attnselect.attention(q, k, v, layout=layout, causal=causal, scale=scale, backend="sdpa_flash")
        expected = attnselect.attention(q, k, v, layout=layout, causal=causal, scale=scale, backend="reference")
        assert rel_err(out, expected) < 1e-5
        assert calls[-1][1:] == ((None, None, 8, 8, 0.0, causal, False), scale)
        bshd = q if layout == "bshd" else q.transpose(0, 1)
        assert calls[-1][0] == bshd.stride() and len(calls) == 2  # both calls: the first prepares the runner
        out.sum().backward()  # the op's own backward (here the stand-in's)
        calls.clear()
    # a TorchDispatchMode (selective activation checkpointing's, whose save lists name SDPA's ops) or a functorch
    # transform (vmap: the kernel's own op has no batching rule) gets the backend's runner, call by call
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    attnselect.clear_cache()
    q, k, v = dense_inputs("bshd", b=2, sq=8, skv=8, hq=2, hkv=2, dqk=16, dv=16, dtype=torch.float32)
    attnselect.attention(q, k, v, causal=True, backend="sdpa_flash")  # known from here on, through the op
    calls.clear()
    saved = []

    def policy(ctx, op, *args, **kwargs):
        saved.append(str(op))
        return CheckpointPolicy.MUST_SAVE

    context = functools.partial(create_selective_checkpoint_contexts, policy)
    out = checkpoint(lambda q: attnselect.attention(q, k, v, causal=True, backend="sdpa_flash"), q,
                     use_reentrant=False, context_fn=context)  # fmt: skip
    out.sum().backward()
    assert calls == [] and any("scaled_dot_product" in op for op in saved)
    expected = attnselect.attention(q, k, v, causal=True, backend="reference")
    assert rel_err(out, expected) < 1e-5
    q, k, v = q.detach(), k.detach(), v.detach()
    with torch.no_grad():
        known = attnselect.attention(q, k, v, causal=True, backend="sdpa_flash")
        assert len(calls) == 1  # outside them, the op: known from here on, without gradients
        batch = torch.stack([q] * 3)  # per sample, the known call's shapes and strides: its runner
        batched = torch.func.vmap(lambda q: attnselect.attention(q, k, v, causal=True, backend="sdpa_flash"))(batch)
    assert len(calls) == 1 and all(rel_err(b, known) < 1e-5 for b in batched)
    calls.clear()
    # what the op does not suit goes the way it went: the backend's own layout (its runner permutes nothing), a
    # mask tensor, head dims SDPA pads, another device
    cases = [("bhsd", {}, 16, True), ("bshd", dict(window=(3, 0)), 16, True), ("bshd", {}, 12, True)]
    for layout, kwargs, dim, on_cpu in [*cases, ("bshd", {}, 16, False)]:
        attnselect.clear_cache()
        if not on_cpu:
            monkeypatch.setattr(type(flash), "bshd_op_devices", frozenset({"cuda"}))
        q, k, v = dense_inputs(layout, b=1, sq=8, skv=8, hq=2, hkv=2, dqk=dim, dv=dim, dtype=torch.float32)
        for _ in range(2):
            out = attnselect.attention(q, k, v, layout=layout, backend="sdpa_flash", **kwargs)
        expected = attnselect.attention(q, k, v, layout=layout, backend="reference", **kwargs)
        assert rel_err(out, expected) < 1e-5
    assert calls == []


@pytest.mark.gpu
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", ["sdpa_efficient", "sdpa_flash"])
def test_gpu_repeated_bshd_calls_run_the_kernels_own_op_as_sdpa_would(name, training):
    """attention() on bshd tensors, its kernel's own op called with no transpose: what SDPA gives with the kernel
    forced, gradients included, and the output's autograd node is the kernel's op's (no transpose's)."""
    import torch.nn.functional as F

    from attnselect.backends._sdpa import only_kernel

    backend = backends.get(name)
    node = {"sdpa_efficient": "EfficientAttentionBackward0", "sdpa_flash": "FlashAttentionBackward0"}[name]
    dims = (192, 128) if name == "sdpa_efficient" else (128, 128)
    for causal, scale, heads_kv in [(False, None, 8), (True, 0.1, 8), (True, None, 2)]:
        if heads_kv != 8 and not backend.native_gqa:
            continue
        attnselect.clear_cache()
        q, k, v = dense_inputs("bshd", b=2, sq=256, skv=256, hq=8, hkv=heads_kv, dqk=dims[0], dv=dims[1],
                               dtype=torch.bfloat16, device="cuda", requires_grad=training)  # fmt: skip
        with only_kernel(backend.kernel):
            views = [t.transpose(1, 2) for t in (q, k, v)]
            expected = F.scaled_dot_product_attention(
                *views, is_causal=causal, scale=scale, enable_gqa=heads_kv != 8
            ).transpose(1, 2)
        for _ in range(2):  # the second call is the memoized one
            out = attnselect.attention(q, k, v, causal=causal, scale=scale, backend=name)
        assert torch.equal(out, expected)
        if training:
            assert type(out.grad_fn).__name__ == node
            grad = torch.randn_like(out)
            grads, expected_grads = (torch.autograd.grad(o, (q, k, v), grad) for o in (out, expected))
            assert all(rel_err(a, b) < 1e-2 for a, b in zip(grads, expected_grads))
