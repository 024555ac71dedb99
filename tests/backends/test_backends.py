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
    assert not decision.chosen.padded
    if decision.predictions is None:  # the sm90 "tiny call" table: the SDPA kernels' host time is the least there
        assert decision.chosen == attnselect.Candidate("sdpa_efficient") and "tiny call" in decision.why
        large = attnselect.AttentionProblem(1, 8192, 8192, 16, 16, 192, 128, mask="causal", dtype=torch.bfloat16)
        expected = "flash_attn4" if target.version("flash-attn-4") else "sdpa_cudnn"  # the sm90 table: FA4 leads
        assert attnselect.select(large).chosen == attnselect.Candidate(expected)
    else:  # a fused kernel the size ladder measured fastest at small MLA calls (results/h200_ladder.md: B1 S256
        # 192/128 inference, sdpa_efficient and sdpa_cudnn native within 0.01 ms of F.sdpa's default), never a
        # compiled or unfused one at this size
        assert decision.chosen.backend in ("sdpa_efficient", "sdpa_cudnn"), decision.why
