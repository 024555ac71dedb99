"""Every backend that serves a problem on this machine matches the float64 reference.

Cases are collected from the verdicts, so a backend is tested wherever the rules say it
serves; unsupported (backend, problem) pairs are not generated rather than skipped.
"""

from __future__ import annotations

import pytest
import torch

import attnselect
from attnselect import backends
from attnselect.choose.candidates import judge
from attnselect.spec.target import Target
from helpers import dense_inputs, rel_err, run_with_grads

CPU_CASES = [  # (label, attention kwargs, input kwargs)
    ("mla", dict(causal=True), dict(dqk=24, dv=16)),
    ("equal", dict(), dict(dqk=16, dv=16)),
    ("gqa-bottom-right", dict(causal="bottom_right"), dict(sq=17, skv=40, hq=4, hkv=2, dqk=16, dv=16)),
    ("window", dict(window=(5, 3)), dict(dqk=24, dv=16)),
    ("lse", dict(return_lse=True, causal=True), dict(dqk=24, dv=16, hq=4, hkv=1)),
    ("rows-without-keys", dict(causal="bottom_right", return_lse=True), dict(sq=40, skv=17, dqk=16, dv=16)),
    ("rows-without-keys-sdpa", dict(causal="bottom_right"), dict(sq=40, skv=17, dqk=16, dv=16)),
    ("window-rows-without-keys", dict(window=(2, 0)), dict(sq=30, skv=12, dqk=16, dv=16)),
]


def _supported(device_type, cases, dtype, training):
    target = Target.current() if device_type == "cuda" else Target.preset("cpu")
    out = []
    for label, kwargs, shape in cases:
        q, k, v = dense_inputs(dtype=dtype, requires_grad=training, **shape)
        problem = attnselect.AttentionProblem.from_tensors(q, k, v, **kwargs)
        for verdict in judge(problem, target):
            if verdict.supported and verdict.candidate.backend != "reference":
                c = verdict.candidate
                out.append(pytest.param(c.backend, c.pad_to, kwargs, shape, id=f"{label}-{c}".replace(" ", "_")))
    return out


def _check(backend, pad_to, kwargs, shape, dtype, device, training, tol):
    q, k, v = dense_inputs(dtype=dtype, device=device, requires_grad=training, **shape)
    pad = None if pad_to is None else "always"
    ref_inputs = [t.detach().double().requires_grad_(training) for t in (q, k, v)]
    if training:
        out, lse, grads = run_with_grads(q, k, v, backend=backend, pad=pad, **kwargs)
        ref, ref_lse, ref_grads = run_with_grads(*ref_inputs, backend="reference", **kwargs)
        for g, rg in zip(grads, ref_grads):
            assert rel_err(g, rg) < tol
    else:
        result = attnselect.attention(q, k, v, backend=backend, pad=pad, **kwargs)
        ref_result = attnselect.attention(*ref_inputs, backend="reference", **kwargs)
        (out, lse), (ref, ref_lse) = [(r if isinstance(r, tuple) else (r, None)) for r in (result, ref_result)]
    assert out.shape == ref.shape and out.dtype == dtype
    assert rel_err(out, ref) < tol
    if kwargs.get("return_lse"):
        assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape
        assert rel_err(lse, ref_lse) < tol


@pytest.mark.parametrize("backend,pad_to,kwargs,shape", _supported("cpu", CPU_CASES, torch.float32, True))
def test_cpu_training_matches_reference(backend, pad_to, kwargs, shape):
    _check(backend, pad_to, kwargs, shape, torch.float32, "cpu", True, 1e-5)


@pytest.mark.parametrize("backend,pad_to,kwargs,shape", _supported("cpu", CPU_CASES, torch.float32, False))
def test_cpu_inference_matches_reference(backend, pad_to, kwargs, shape):
    _check(backend, pad_to, kwargs, shape, torch.float32, "cpu", False, 1e-5)


def test_every_cpu_capable_backend_is_exercised():
    exercised = {p.values[0] for p in _supported("cpu", CPU_CASES, torch.float32, False)}
    cpu_capable = {
        b.name
        for b in backends.all_backends()
        if "cpu" in b.surfaces
        and b.name != "reference"
        and not b.not_supported_reasons(
            attnselect.AttentionProblem(1, 8, 8, 1, 1, 16, 16, torch.float32), Target.preset("cpu")
        )
    }
    assert cpu_capable == exercised == {"sdpa_flash", "sdpa_math", "flex"}


GPU_CASES = [
    ("mla-causal", dict(causal=True), dict(sq=256, skv=256, hq=8, hkv=8, dqk=192, dv=128)),
    ("equal-gqa", dict(), dict(sq=128, skv=128, hq=8, hkv=2, dqk=128, dv=128)),
    ("mla-bottom-right", dict(causal="bottom_right"), dict(sq=64, skv=200, hq=8, hkv=8, dqk=192, dv=128)),
    ("mla-window-lse", dict(window=(32, 0), return_lse=True), dict(sq=128, skv=128, hq=8, hkv=2, dqk=192, dv=128)),
    ("rows-without-keys", dict(causal="bottom_right"), dict(sq=200, skv=64, hq=8, hkv=8, dqk=192, dv=128)),
    # Head dims that are not multiples of 8 or are below 16: kernels that need those take them padded (to 64, 16).
    ("odd-59-gqa-causal", dict(causal=True), dict(sq=128, skv=128, hq=8, hkv=2, dqk=59, dv=59)),
    ("below-16", dict(), dict(sq=128, skv=128, hq=8, hkv=8, dqk=15, dv=15)),
]
_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend,pad_to,kwargs,shape", _supported("cuda", GPU_CASES, torch.bfloat16, True) if _CUDA else []
)
def test_gpu_training_matches_reference(backend, pad_to, kwargs, shape):
    _check(backend, pad_to, kwargs, shape, torch.bfloat16, "cuda", True, 2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "backend,pad_to,kwargs,shape", _supported("cuda", GPU_CASES, torch.float16, False) if _CUDA else []
)
def test_gpu_inference_matches_reference(backend, pad_to, kwargs, shape):
    _check(backend, pad_to, kwargs, shape, torch.float16, "cuda", False, 2e-2)


@pytest.mark.gpu
def test_gpu_mla_choice_on_hopper_is_native():
    target = Target.current()
    if target.capability != (9, 0):
        pytest.skip(f"Hopper-specific expectation; this GPU is {target.arch}")
    q, k, v = dense_inputs(sq=256, skv=256, hq=8, hkv=8, dqk=192, dv=128, dtype=torch.bfloat16, device="cuda")
    decision = attnselect.select(attnselect.AttentionProblem.from_tensors(q, k, v, causal=True))
    expected = "flash_attn4" if target.version("flash-attn-4") else "sdpa_cudnn"  # FA4 leads where installed
    assert decision.chosen == attnselect.Candidate(expected)


def test_flex_document_masks_are_reused_per_cu_seqlens_and_dropped_with_it():
    import gc

    from attnselect.backends import flex
    from helpers import thd_inputs

    (q, k, v), cu, _ = thd_inputs([3, 0, 5])
    q, k, v = (t.detach() for t in (q, k, v))
    first = attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, backend="flex")
    causal = ("causal", None, 8, 8)
    masks = flex._DOCUMENT_MASKS.remembered
    cached = masks(cu)[causal]
    again = attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, backend="flex")
    assert masks(cu)[causal] is cached and torch.equal(first, again)
    other = attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, backend="flex")  # second mask, same owner
    assert masks(cu)[causal] is cached and len(masks(cu)) == 2
    assert not torch.equal(first, other)
    cu.add_(0)  # changed in place: a new version misses
    attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, backend="flex")
    assert masks(cu)[causal] is not cached
    key = id(cu)
    del cu
    gc.collect()
    assert key not in flex._DOCUMENT_MASKS._entries


def test_flex_packed_under_inference_mode_and_with_empty_packs():
    from helpers import thd_inputs

    (q, k, v), cu, _ = thd_inputs([3, 2])
    with torch.inference_mode():
        qi, ki, vi, cui = (t.detach().clone() for t in (q, k, v, cu))
        out, lse = attnselect.attention(
            qi, ki, vi, layout="thd", cu_seqlens_q=cui, causal=True, backend="flex", return_lse=True
        )
        ref, ref_lse = attnselect.attention(
            qi, ki, vi, layout="thd", cu_seqlens_q=cui, causal=True, backend="reference", return_lse=True
        )
    assert rel_err(out, ref) < 1e-12 and rel_err(lse, ref_lse) < 1e-6
    cu_kv = torch.zeros(3, dtype=torch.int32)
    no_keys = attnselect.attention(
        q.detach(),
        k.detach()[:0],
        v.detach()[:0],
        layout="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu_kv,
        backend="flex",
        return_lse=True,
    )
    assert torch.all(no_keys[0] == 0) and no_keys[1].shape == (4, 5) and torch.isneginf(no_keys[1]).all()


def test_compiled_flex_raises_past_its_recompile_limit_instead_of_running_eagerly(monkeypatch):
    from attnselect.backends import flex

    limit = torch._dynamo.config.recompile_limit
    monkeypatch.setattr(flex, "RECOMPILE_LIMIT", 2)
    double = flex._failing_past_recompile_limit(torch.compile(lambda x: x * 2, backend="eager", dynamic=False))
    assert torch.equal(double(torch.ones(1)), torch.full((1,), 2.0)) and double(torch.ones(2)).shape == (2,)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        double(torch.ones(3))  # a third shape: eagerly, flex would materialise every score
    assert torch._dynamo.config.recompile_limit == limit  # the user's setting is left as it was


def test_flex_recompile_limit_uses_the_setting_names_of_the_installed_torch(monkeypatch):
    import types

    from attnselect.backends import flex

    old_torch = types.SimpleNamespace(cache_size_limit=8, fail_on_cache_limit_hit=False)  # before torch 2.7
    monkeypatch.setattr(torch._dynamo, "config", old_torch)
    assert flex._recompile_settings() == {"cache_size_limit": flex.RECOMPILE_LIMIT, "fail_on_cache_limit_hit": True}
    monkeypatch.setattr(torch._dynamo, "config", types.SimpleNamespace())  # neither: torch's own behaviour
    compiled = object()
    assert flex._recompile_settings() is None and flex._failing_past_recompile_limit(compiled) is compiled


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


def test_flex_refuses_grouped_heads_with_few_queries_on_cuda():
    """Every flex row of the H200 correctness grid with grouped K/V heads and under 128 queries failed to compile."""
    from attnselect.backends import get
    from attnselect.spec.problem import AttentionProblem
    from attnselect.spec.target import Target

    flex, h200 = get("flex"), Target.preset("h200")
    few = AttentionProblem(1, 77, 77, 4, 1, 64, 64)
    assert flex.extra_reasons(few, h200) == [
        "no inductor template for grouped K/V heads with fewer than 128 queries (got 77; "
        "results/h200_correctness_grid.md)"
    ]
    assert flex.extra_reasons(AttentionProblem(1, 128, 128, 4, 1, 64, 64), h200) == []
    assert flex.extra_reasons(AttentionProblem(1, 77, 77, 4, 4, 64, 64), h200) == []
    assert flex.extra_reasons(few, Target.preset("cpu")) == []


def test_a_package_backend_is_its_module_and_one_registration():
    """A backend that needs a pip package declares it (Backend.package); registering it is all it takes for the
    target to know the package's version and for its verdicts to say when it is missing."""
    from attnselect.backends.reference import Reference
    from attnselect.spec.target import Package

    class Packaged(Reference):
        name = "packaged_reference"
        package = Package("attnselect-test-distribution", "json")  # imports, with no metadata: "unknown"

    class Missing(Reference):
        name = "missing_reference"
        package = Package("attnselect-missing-distribution", "attnselect_no_such_module")

    problem = attnselect.AttentionProblem(1, 8, 8, 1, 1, 16, 16, torch.float32)
    try:
        attnselect.backends.register(Packaged())
        attnselect.backends.register(Missing())
        target = Target.current("cpu")
        assert target.version("attnselect-test-distribution") == "unknown"
        assert "attnselect-test-distribution unknown" in target.describe()
        assert Packaged().not_supported_reasons(problem, target) == []
        assert Missing().not_supported_reasons(problem, target) == [
            "package attnselect-missing-distribution is not installed"
        ]
    finally:
        attnselect.backends.unregister("packaged_reference")
        attnselect.backends.unregister("missing_reference")
    assert Target.current("cpu").version("attnselect-test-distribution") is None
