"""Property tests: random calls on every CPU-capable candidate against the float64 reference.

Layouts (dense and packed, with length-1 and zero-length sequences), GQA ratios, masks and
windows, head-dim pairs and forced padding; outputs, lse and the three gradients.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import attnselect
from attnselect.choose.candidates import judge
from attnselect.spec.options import CallOptions
from attnselect.spec.problem import describe_call
from attnselect.spec.target import Target

CPU = Target.preset("cpu")
HEAD_DIMS = [(8, 8), (16, 8), (8, 16), (24, 16), (12, 20)]
MASKS = st.one_of(
    st.just((False, None)),
    st.just((True, None)),
    st.just(("bottom_right", None)),
    st.tuples(st.sampled_from([False, True, "bottom_right"]), st.tuples(st.integers(-1, 4), st.integers(-1, 4))),
)


@st.composite
def calls(draw):
    layout = draw(st.sampled_from(["bshd", "sbhd", "bhsd", "thd"]))
    hkv = draw(st.integers(1, 2))
    hq = hkv * draw(st.integers(1, 3))
    dqk, dv = draw(st.sampled_from(HEAD_DIMS))
    causal, window = draw(MASKS)
    if window is not None and causal:
        window = (window[0], 0)
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    kwargs = dict(layout=layout, causal=causal, window=window, return_lse=draw(st.booleans()))
    kwargs["softcap"] = draw(st.sampled_from([None, None, 1.5, 4.0]))  # the variants, now and then
    if draw(st.integers(0, 2)) == 0:
        kwargs["sinks"] = torch.randn(hq, generator=g, dtype=torch.float64)
    if layout == "thd":
        lengths_q = draw(st.lists(st.integers(0, 7), min_size=1, max_size=4))
        same = draw(st.booleans())
        lengths_kv = lengths_q if same else [draw(st.integers(0, 7)) for _ in lengths_q]
        cu = lambda ls: torch.tensor([0, *itertools.accumulate(ls)], dtype=torch.int32)  # noqa: E731
        kwargs["cu_seqlens_q"] = cu(lengths_q)
        if not same:
            kwargs["cu_seqlens_kv"] = cu(lengths_kv)
        shapes = [(sum(lengths_q), hq, dqk), (sum(lengths_kv), hkv, dqk), (sum(lengths_kv), hkv, dv)]
    else:
        b, sq, skv = draw(st.integers(1, 2)), draw(st.integers(0, 9)), draw(st.integers(0, 9))
        order = {
            "bshd": lambda s, h, d: (b, s, h, d),
            "sbhd": lambda s, h, d: (s, b, h, d),
            "bhsd": lambda s, h, d: (b, h, s, d),
        }[layout]
        shapes = [order(sq, hq, dqk), order(skv, hkv, dqk), order(skv, hkv, dv)]
    tensors = [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]
    return tensors, kwargs, draw(st.booleans()), draw(st.integers(0, 10**6))


def _rel(a, b) -> float:
    if a.numel() == 0:
        return 0.0
    if not torch.equal(torch.isneginf(a), torch.isneginf(b)):
        return float("inf")
    a, b = a[~torch.isneginf(b)], b[~torch.isneginf(b)]
    return ((a - b).norm() / b.norm().clamp_min(1.0)).item()  # absolute where the reference is ~0


def _run(tensors, kwargs, training, **choice):
    leaves = [t.clone().requires_grad_(training) for t in tensors]
    result = attnselect.attention(*leaves, **kwargs, **choice)
    out, lse = result if isinstance(result, tuple) else (result, None)
    grads = None
    if training:
        g = torch.Generator().manual_seed(7)
        grads = torch.autograd.grad(
            out, leaves, torch.randn(out.shape, generator=g, dtype=out.dtype), allow_unused=True
        )
        grads = [torch.zeros_like(t) if d is None else d for t, d in zip(leaves, grads)]
    return out.detach(), lse, grads


@settings(max_examples=2000, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(calls())
def test_every_cpu_candidate_matches_the_float64_reference(case):
    tensors, kwargs, training, pick = case
    try:
        problem, _ = describe_call(*[t.requires_grad_(training) for t in tensors], CallOptions(**kwargs))
    except attnselect.InvalidInputError:
        assume(False)
    tensors = [t.detach() for t in tensors]
    supported = [v.candidate for v in judge(problem, CPU) if v.supported and v.candidate.backend != "reference"]
    assume(supported)
    candidate = supported[pick % len(supported)]
    out, lse, grads = _run(tensors, kwargs, training, backend=candidate.backend, pad=candidate.padded)
    ref, ref_lse, ref_grads = _run(tensors, kwargs, training, backend="reference")
    assert out.shape == ref.shape and _rel(out, ref) < 1e-9, candidate
    if kwargs["return_lse"]:
        assert lse.dtype == torch.float32 and lse.shape == ref_lse.shape and _rel(lse, ref_lse) < 1e-6, candidate
    if training:
        for g, rg in zip(grads, ref_grads):
            assert torch.isfinite(g).all() and _rel(g, rg) < 1e-9, candidate
