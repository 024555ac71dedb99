"""Softcap, learnable sinks and the max logit against an independent float64 oracle (gpt-oss's and Gemma 2's eager
attention, TransformerEngine's max_logit), alone and with MLA dims, GQA, thd and padding; gradients included."""

from __future__ import annotations

import pytest
import torch

import attnselect
from attnselect.spec.options import Candidate
from helpers import rel_err, thd_inputs


def oracle(q, k, v, *, causal=False, scale=None, softcap=None, sinks=None):
    """(out, lse, max_logit) of bhsd float64 tensors, written as the models' eager code does it."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    logits = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if softcap is not None:  # Gemma 2: cap, then mask
        logits = softcap * torch.tanh(logits / softcap)
    if causal:
        sq, skv = logits.shape[-2:]
        logits = logits.masked_fill(torch.ones(sq, skv, dtype=torch.bool).triu(1), float("-inf"))
    max_logit = logits.amax(dim=(0, 2, 3))
    if sinks is not None:  # gpt-oss: a sink column joins the softmax and is dropped
        column = sinks.reshape(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        logits = torch.cat([logits, column], dim=-1)
    probs = torch.softmax(logits, dim=-1)
    lse = torch.logsumexp(logits, dim=-1)
    return probs[..., : v.shape[-2]] @ v, lse, max_logit


def _inputs(b=2, s=9, hq=4, hkv=2, dqk=24, dv=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64) for h, d in ((hq, dqk), (hkv, dqk), (hkv, dv)))
    sinks = torch.randn(hq, generator=g, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, sinks)]


VARIANTS = {
    "softcap": dict(softcap=2.0),
    "sinks": dict(sinks=True),
    "max_logit": dict(return_max_logit=True),
    "all": dict(softcap=3.0, sinks=True, return_max_logit=True),
}


@pytest.mark.parametrize("dims", [(24, 16, 4, 2), (192, 128, 4, 4), (64, 64, 8, 1)], ids=["small", "mla", "mqa"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("variant", VARIANTS)
def test_each_variant_matches_the_oracle_with_its_gradients(variant, causal, dims):
    dqk, dv, hq, hkv = dims
    q, k, v, sinks = _inputs(hq=hq, hkv=hkv, dqk=dqk, dv=dv)
    options = dict(VARIANTS[variant])
    options["sinks"] = sinks if options.get("sinks") else None
    result = attnselect.attention(q, k, v, layout="bhsd", causal=causal, return_lse=True, **options)
    out, lse = result[0], result[1]
    ref, ref_lse, ref_max = oracle(q, k, v, causal=causal, softcap=options.get("softcap"), sinks=options["sinks"])
    assert rel_err(out, ref) < 1e-10 and rel_err(lse, ref_lse.float()) < 1e-6 and lse.dtype == torch.float32
    if options.get("return_max_logit"):
        max_logit = result[2]
        assert max_logit.shape == (hq,) and max_logit.dtype == torch.float32 and not max_logit.requires_grad
        assert rel_err(max_logit, ref_max.float()) < 1e-6
    tensors = [q, k, v] + ([sinks] if options["sinks"] is not None else [])
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, tensors, grad)
    theirs = torch.autograd.grad(ref, tensors, grad)
    assert all(rel_err(a, b) < 1e-9 for a, b in zip(ours, theirs))


@pytest.mark.parametrize("variant", VARIANTS)
def test_zero_padding_leaves_every_variant_exact(variant):
    q, k, v, sinks = _inputs(dqk=24, dv=16)
    options = dict(VARIANTS[variant], return_lse=True)
    options["sinks"] = sinks if options.get("sinks") else None
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, layout="bhsd", causal=True, **options)
    call = dict(softcap=options.get("softcap"))
    native = _run(Candidate("reference"), problem, q, k, v, sinks=options["sinks"], **call)
    padded = _run(Candidate("reference", 32), problem, q, k, v, sinks=options["sinks"], **call)
    for a, b in zip(native, padded):
        assert torch.equal(a, b) if a.dtype == torch.float32 else rel_err(a, b) < 1e-14
    tensors = [q, k, v] + ([sinks] if options["sinks"] is not None else [])
    grad = torch.randn_like(native[0])
    for a, b in zip(torch.autograd.grad(native[0], tensors, grad), torch.autograd.grad(padded[0], tensors, grad)):
        assert rel_err(a, b) < 1e-13


def _run(candidate, problem, q, k, v, *, sinks, softcap):
    from attnselect.execution import apply_sinks, kernel_call, run_call

    out, lse, *maxima = run_call(candidate, problem, kernel_call(problem, softcap=softcap), q, k, v)
    if sinks is not None:
        out, lse = apply_sinks(out, lse, sinks, problem.layout)
    return [out, lse, *maxima]


def test_thd_variants_match_each_sequence_and_the_max_logit_spans_every_sequence():
    (q, k, v), cu, _ = thd_inputs([5, 0, 9, 1], hq=4, hkv=2, dqk=24, dv=16)
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    out, lse, max_logit = attnselect.attention(
        q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, softcap=2.5, sinks=sinks, return_lse=True,
        return_max_logit=True,
    )  # fmt: skip
    bounds, maxima = cu.tolist(), []
    for a, b in zip(bounds, bounds[1:]):
        if a == b:
            continue
        piece = [t[a:b].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        ref, ref_lse, ref_max = oracle(*piece, causal=True, softcap=2.5, sinks=sinks)
        assert rel_err(out[a:b], ref[0].transpose(0, 1)) < 1e-10 and rel_err(lse[:, a:b], ref_lse[0].float()) < 1e-6
        maxima.append(ref_max)
    assert rel_err(max_logit, torch.stack(maxima).amax(0).float()) < 1e-6
    (g,) = torch.autograd.grad(out.sum(), [sinks])
    assert g.shape == (4,) and torch.isfinite(g).all() and g.abs().sum() > 0


def test_flex_on_the_cpu_serves_softcap_and_inference_sinks_but_not_the_max_logit():
    q, k, v, sinks = (t.detach() for t in _inputs(dqk=16, dv=16, hkv=4))
    with torch.no_grad():
        out = attnselect.attention(q, k, v, layout="bhsd", softcap=2.0, sinks=sinks, backend="flex")
    assert rel_err(out, oracle(q, k, v, softcap=2.0, sinks=sinks)[0]) < 1e-10
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, layout="bhsd", return_max_logit=True)
    report = attnselect.explain(problem, show_all=True)
    assert "cannot return the max logit" in report and "chosen:  reference" in report


def test_candidates_that_cannot_serve_a_variant_say_why_and_are_not_chosen():
    target = attnselect.Target.preset("h200", packages={"flash-attn": "2.8.3", "flash-attn-3": "3.0.0"})
    mla = dict(batch=1, seqlen_q=4096, seqlen_kv=4096, heads_q=16, heads_kv=16, head_dim_qk=128, head_dim_v=128)
    verdicts = {
        (v.candidate.backend, v.candidate.padded): v
        for v in attnselect.select(attnselect.AttentionProblem(**mla, softcap=True), target=target).verdicts
    }
    assert "no logit softcapping" in verdicts[("sdpa_cudnn", False)].reasons[0]
    assert verdicts[("flash_attn3", False)].supported and verdicts[("flex", False)].supported
    trained_sinks = attnselect.AttentionProblem(**mla, sinks=True, training=True)
    decision = attnselect.select(trained_sinks, target=target)
    reasons = {v.candidate.backend: v.reasons for v in decision.verdicts if not v.supported}
    assert any("carries no gradient" in r for r in reasons["flash_attn3"])
    assert any("returns no log-sum-exp" in r for r in reasons["sdpa_cudnn"])
    assert decision.chosen.backend in ("flex", "reference")
    max_logit = attnselect.AttentionProblem(**mla, return_max_logit=True)
    assert attnselect.select(max_logit, target=target).chosen.backend in ("flex", "reference")


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(softcap=-1.0), "softcap: got -1.0"),
        (dict(softcap=True), "softcap: got True"),
        (dict(sinks=torch.zeros(3)), r"sinks.shape: got \(3,\), expected \(4,\)"),
        (dict(sinks=torch.zeros(4, dtype=torch.int64)), "sinks.dtype"),
        (dict(sinks=[0.0] * 4), "sinks: got list"),
        (dict(sinks=torch.zeros(4, device="meta")), "sinks.device"),
        (dict(return_max_logit="yes"), "return_max_logit: got 'yes'"),
    ],
)
def test_bad_variant_arguments_fail_with_the_librarys_error_before_any_kernel_runs(options, message):
    q, k, v, _ = (t.detach() for t in _inputs())
    with pytest.raises(attnselect.InvalidInputError, match=message):
        attnselect.attention(q, k, v, layout="bhsd", **options)


def test_a_forced_backend_that_cannot_give_the_max_logit_is_refused_with_its_reason():
    q, k, v, _ = (t.detach() for t in _inputs())
    with pytest.raises(attnselect.ForcedChoiceError, match="cannot return the max logit"):
        attnselect.attention(q, k, v, layout="bhsd", return_max_logit=True, backend="sdpa_math")


# (variant, backend, training, layouts): every GPU candidate that serves a variant, trained where it can be
GPU_VARIANTS = [
    ("softcap", "flex", True, "bshd thd"), ("sinks", "flex", True, "bshd thd"), ("max_logit", "flex", True, "bshd thd"),
    ("all", "flex", True, "bshd thd"), ("softcap", "flash_attn4", True, "bshd thd"),
    ("sinks", "flash_attn4", True, "bshd thd"), ("softcap", "flash_attn2", True, "bshd thd"),
    ("softcap", "flash_attn3", True, "bshd thd"), ("sinks", "flash_attn2", False, "bshd thd"),
    ("sinks", "flash_attn3", False, "bshd thd"), ("sinks", "cudnn_frontend", False, "bshd thd"),
    ("sinks", "varlen_fa2", False, "thd"),
]  # fmt: skip
GPU_CASES = [(v, b, t, layout) for v, b, t, layouts in GPU_VARIANTS for layout in layouts.split()]


@pytest.mark.gpu
@pytest.mark.parametrize("variant, backend, training, layout", GPU_CASES)
def test_gpu_candidates_serving_a_variant_match_the_float64_oracle(variant, backend, training, layout):
    chosen = attnselect.backends.get(backend)
    if chosen.package and chosen.package_version(attnselect.Target.current()) is None:
        pytest.skip(f"{chosen.package.distribution} is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, lengths = 8, 2, [64, 0, 200, 17]
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
               for h, d in ((hq, 128), (hkv, 128), (hkv, 128)))  # fmt: skip
    sinks = torch.randn(hq, device="cuda", generator=g, dtype=torch.float32)
    tensors = [t.requires_grad_(training) for t in (q, k, v, sinks)]
    options = dict(VARIANTS[variant])
    options["sinks"] = sinks if options.get("sinks") else None
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    if layout == "thd":
        call = dict(layout="thd", cu_seqlens_q=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        inputs = (q, k, v)
    else:  # one sequence of the packing as a batch of one
        call, inputs = dict(layout="bshd"), tuple(t[64:264].unsqueeze(0) for t in (q, k, v))
    problem = attnselect.AttentionProblem.from_tensors(*inputs, causal=True, **call, **options)
    verdict = next(x for x in attnselect.select(problem).verdicts if x.candidate == Candidate(backend))
    assert verdict.supported, verdict.reasons
    result = attnselect.attention(*inputs, causal=True, backend=backend, **call, **options)
    result = result if isinstance(result, tuple) else (result,)
    reference = attnselect.attention(
        *(t.double() for t in inputs), causal=True, backend="reference", **call,
        **{**options, "sinks": None if options["sinks"] is None else sinks.double()},
    )  # fmt: skip
    reference = reference if isinstance(reference, tuple) else (reference,)
    assert rel_err(result[0].double(), reference[0]) < 2e-2
    if options.get("return_max_logit"):
        assert rel_err(result[-1], reference[-1]) < 1e-2
    if not training:
        return
    grad = torch.randn_like(result[0])
    ours = torch.autograd.grad(result[0], tensors[:3] + ([sinks] if options["sinks"] is not None else []), grad)
    theirs = torch.autograd.grad(
        reference[0], tensors[:3] + ([sinks] if options["sinks"] is not None else []), grad.double()
    )
    assert all(rel_err(a.double(), b) < 3e-2 for a, b in zip(ours, theirs))
