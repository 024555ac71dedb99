"""Running candidates exactly: padding, layouts, packed views, the per-sequence THD path."""

from __future__ import annotations

import pytest
import torch

import attnselect
from attnselect.spec.options import CallOptions
from helpers import dense_inputs, rel_err, run_with_grads, thd_inputs

EXACT = 1e-10
PADDING_CASES = [
    ("bshd-causal", dict(layout="bshd", causal=True), dict(layout="bshd")),
    ("bhsd-none", dict(layout="bhsd"), dict(layout="bhsd")),
    ("sbhd-window", dict(layout="sbhd", window=(4, 2)), dict(layout="sbhd")),
    ("gqa-causal", dict(causal=True), dict(hq=6, hkv=2)),
    ("mqa-bottom-right", dict(causal="bottom_right"), dict(sq=19, skv=41, hq=4, hkv=1)),
    ("bottom-right-sq>skv", dict(causal="bottom_right"), dict(sq=41, skv=19)),
    ("dv>dqk", dict(causal=True), dict(dqk=16, dv=40)),
]


@pytest.mark.parametrize("label,kwargs,shape", PADDING_CASES, ids=[c[0] for c in PADDING_CASES])
@pytest.mark.parametrize("padded_backend", ["reference", "sdpa_math", "sdpa_flash"])
def test_padding_is_exact_in_float64(label, kwargs, shape, padded_backend):
    q, k, v = dense_inputs(**shape)
    lse_wanted = padded_backend == "reference"
    native = run_with_grads(q, k, v, backend="reference", return_lse=lse_wanted, **kwargs)
    padded = run_with_grads(q, k, v, backend=padded_backend, pad=True, return_lse=lse_wanted, **kwargs)
    decision = attnselect.select(
        attnselect.AttentionProblem.from_tensors(q, k, v, return_lse=lse_wanted, **kwargs),
        backend=padded_backend,
        pad=True,
    )
    assert decision.chosen.pad_to == -(-max(q.shape[-1], v.shape[-1]) // 8) * 8
    assert padded[0].shape == native[0].shape and padded[0].shape[-1] == v.shape[-1]
    assert rel_err(padded[0], native[0]) < EXACT
    for g, gn, t in zip(padded[2], native[2], (q, k, v)):
        assert g.shape == t.shape  # gradients reach only the original widths
        assert rel_err(g, gn) < EXACT
    if lse_wanted:
        assert rel_err(padded[1], native[1]) < EXACT


def test_padded_lse_equals_native_lse_through_flex():
    q, k, v = [t.detach() for t in dense_inputs(dqk=24, dv=16)]
    out_n, lse_n = attnselect.attention(q, k, v, causal=True, return_lse=True, backend="reference")
    out_p, lse_p = attnselect.attention(q, k, v, causal=True, return_lse=True, backend="flex", pad=True)
    assert rel_err(out_p, out_n) < EXACT and rel_err(lse_p, lse_n) < EXACT
    assert lse_p.shape == (2, 4, 33) and lse_p.dtype == torch.float32 == lse_n.dtype


def test_scale_stays_that_of_the_original_head_dim():
    q, k, v = dense_inputs(dqk=24, dv=16, requires_grad=False)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 24**0.5
    expected = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
    assert rel_err(attnselect.attention(q, k, v, backend="sdpa_flash", pad=True), expected) < EXACT
    custom = attnselect.attention(q, k, v, scale=0.5, backend="sdpa_flash", pad=True)
    expected = torch.einsum("bhqk,bkhd->bqhd", (scores * 24**0.5 * 0.5).softmax(-1), v)
    assert rel_err(custom, expected) < EXACT


def test_views_of_one_packed_buffer_match_separate_tensors():
    qkv = torch.randn(2, 33, 3, 4, 24, dtype=torch.float64)
    q, k, v = qkv.unbind(2)
    v = v[..., :16]
    separate = [t.contiguous() for t in (q, k, v)]
    for backend in ("sdpa_flash", "sdpa_math", "reference"):
        a = attnselect.attention(q, k, v, causal=True, backend=backend)
        b = attnselect.attention(*separate, causal=True, backend=backend)
        assert rel_err(a, b) < EXACT


def _per_sequence_reference(q, k, v, cu_q, cu_kv, **kwargs):
    outs, lses = [], []
    bq, bk = cu_q.tolist(), cu_kv.tolist()
    for i in range(len(bq) - 1):
        qi, ki, vi = (t.unsqueeze(0) for t in (q[bq[i] : bq[i + 1]], k[bk[i] : bk[i + 1]], v[bk[i] : bk[i + 1]]))
        if qi.shape[1] == 0:
            continue
        out, lse = attnselect.attention(qi, ki, vi, backend="reference", return_lse=True, **kwargs)
        outs.append(out[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
@pytest.mark.parametrize(
    "backend,pad",
    [("reference", False), ("reference", True), ("sdpa_flash", True), ("sdpa_math", False), ("flex", False)],
)
def test_thd_matches_a_per_sequence_reference(causal, backend, pad):
    lengths_q, lengths_kv = [5, 1, 0, 9, 3], [5, 1, 0, 9, 3] if causal != "bottom_right" else [7, 1, 2, 12, 3]
    (q, k, v), cu_q, cu_kv = thd_inputs(lengths_q, lengths_kv)
    want_lse = backend in ("reference", "flex")
    if backend == "flex":  # no backward on the CPU
        q, k, v = (t.detach() for t in (q, k, v))
    result = attnselect.attention(
        q,
        k,
        v,
        layout="thd",
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_kv,
        causal=causal,
        backend=backend,
        pad=pad,
        return_lse=want_lse,
    )
    out, lse = result if want_lse else (result, None)
    ref_out, ref_lse = _per_sequence_reference(q.detach(), k.detach(), v.detach(), cu_q, cu_kv, causal=causal)
    assert out.shape == (18, 4, 16)
    assert rel_err(out, ref_out) < EXACT
    if want_lse:
        assert lse.shape == (4, 18) and rel_err(lse, ref_lse) < EXACT


def test_thd_padding_is_exact_including_gradients():
    (q, k, v), cu, _ = thd_inputs([4, 0, 1, 7])
    native = run_with_grads(q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, backend="reference", return_lse=True)
    padded = run_with_grads(
        q, k, v, layout="thd", cu_seqlens_q=cu, causal=True, backend="reference", pad=True, return_lse=True
    )
    assert rel_err(padded[0], native[0]) < EXACT and rel_err(padded[1], native[1]) < EXACT
    for g, gn in zip(padded[2], native[2]):
        assert rel_err(g, gn) < EXACT


def test_thd_all_sequences_empty():
    (q, k, v), cu, _ = thd_inputs([0, 0])
    out, lse = attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, return_lse=True)
    assert out.shape == (0, 4, 16) and lse.shape == (4, 0)


def test_rows_without_keys_give_zero_output_and_minus_inf_lse():
    q, k, v = dense_inputs(sq=10, skv=4, dqk=16, dv=16)
    out, lse, grads = run_with_grads(q, k, v, causal="bottom_right", return_lse=True)
    assert torch.all(out[:, :6] == 0) and torch.all(torch.isneginf(lse[:, :, :6]))
    assert torch.all(grads[0][:, :6] == 0) and all(torch.isfinite(g).all() for g in grads)


def test_last_dim_not_contiguous_is_copied_for_the_kernel():
    base = torch.randn(2, 9, 3, 48, dtype=torch.float64)
    q = k = v = base[..., ::2]
    assert q.stride(-1) == 2
    for backend in ("sdpa_flash", "sdpa_math", "reference"):
        assert (
            rel_err(
                attnselect.attention(q, k, v, backend=backend),
                attnselect.attention(q.contiguous(), k.contiguous(), v.contiguous(), backend="reference"),
            )
            < EXACT
        )


def test_zero_keys_dense():
    q, k, v = dense_inputs(sq=3, skv=0)
    out, lse, grads = run_with_grads(q, k, v, return_lse=True)
    assert torch.all(out == 0) and out.shape == (2, 3, 4, 16) and torch.all(torch.isneginf(lse))
    assert torch.all(grads[0] == 0)


def _gapped(lengths, gaps, hq=4, hkv=2, dqk=24, dv=16):
    """Inputs packed with `gaps[i]` padding tokens after sequence i, and the same without gaps."""
    (q, k, v), cu, _ = thd_inputs(lengths, hq=hq, hkv=hkv, dqk=dqk, dv=dv)
    q, k, v = (t.detach() for t in (q, k, v))
    starts, rows, cursor = [0], [], 0
    for n, gap in zip(lengths, gaps):
        rows += list(range(cursor, cursor + n))
        cursor += n + gap
        starts.append(cursor)
    index = torch.tensor(rows, dtype=torch.long)
    spread = lambda t: t.new_zeros(cursor, *t.shape[1:]).index_copy(0, index, t)  # noqa: E731
    return (q, k, v, cu), (spread(q), spread(k), spread(v), torch.tensor(starts, dtype=torch.int32)), index


@pytest.mark.parametrize("backend", ["flex", "sdpa_math", "reference"])
@pytest.mark.parametrize("causal", [False, True])
def test_padded_offsets_leave_gaps_untouched(backend, causal):
    (q, k, v, cu), (gq, gk, gv, offsets), index = _gapped([5, 0, 3, 1], [2, 1, 0, 3])
    want_lse = backend != "sdpa_math"
    dense = attnselect.attention(
        q, k, v, layout="thd", cu_seqlens_q=cu, causal=causal, backend="reference", return_lse=True
    )
    result = attnselect.attention(
        gq,
        gk,
        gv,
        layout="thd",
        cu_seqlens_q=cu,
        cu_seqlens_q_padded=offsets,
        causal=causal,
        backend=backend,
        return_lse=want_lse,
    )
    out, lse = result if want_lse else (result, None)
    assert out.shape == (gq.shape[0], 4, 16)
    assert rel_err(out[index], dense[0]) < EXACT
    gap = torch.ones(gq.shape[0], dtype=torch.bool)
    gap[index] = False
    assert torch.all(out[gap] == 0)
    if want_lse:
        assert rel_err(lse[:, index], dense[1]) < EXACT and torch.all(torch.isneginf(lse[:, gap]))


@pytest.mark.parametrize(
    "offsets,message",
    [
        ([0, 7, 8, 11, 15], r"cu_seqlens_q_padded: got room 1 for sequence 1"),
        ([0, 7, 8, 11, 14], r"cu_seqlens_q_padded: got first 0, last 14, expected 0 and the token count 15"),
    ],
)
def test_bad_padded_offsets_name_the_argument(offsets, message):
    (_, _, _, cu), (gq, gk, gv, _), _ = _gapped([5, 2, 3, 1], [2, 0, 0, 2])
    with pytest.raises(attnselect.InvalidInputError, match=message):
        attnselect.attention(
            gq, gk, gv, layout="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=torch.tensor(offsets, dtype=torch.int32)
        )


def test_max_seqlen_given_on_cpu_still_checks_values():
    (q, k, v), cu, _ = thd_inputs([4, 6])
    with pytest.raises(attnselect.InvalidInputError, match="max_seqlen_q: got 5"):
        attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, max_seqlen_q=5, max_seqlen_kv=6)


def test_padded_offsets_equal_to_the_boundaries_mean_no_gaps():
    (q, k, v), cu, _ = thd_inputs([4, 0, 6])
    problem, packing = attnselect.spec.problem.describe_call(
        q,
        k,
        v,
        CallOptions(layout="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu.clone(), cu_seqlens_kv_padded=cu.clone()),
    )
    assert not problem.varlen_gaps and not packing.has_gaps


def test_regression_empty_pack_in_training_keeps_autograd_connected():
    # Found by tests/test_properties.py: a thd batch whose sequences are all empty returned an output
    # that autograd could not differentiate.
    (q, k, v), cu, _ = thd_inputs([0, 0])
    out = attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu, backend="sdpa_math")
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert out.shape == (0, 4, 16) and dq.shape == q.shape and dv.shape == v.shape


class _RecordingPackedBackend:
    """A packed backend whose kernel records the q and packing it is given, with the cuDNN frontend's buckets."""

    def __init__(self, buckets=True):
        from attnselect.backends import get

        self.shape_cache = get("cudnn_frontend").shape_cache if buckets else None
        self.seen = []
        self.kernel = lambda q, k, v, packing: self.seen.append((q, packing)) or (q[..., :4], None)

    def packed_runner(self, call, *, repeated=False):
        return self.kernel


def test_a_repeated_packed_runner_buckets_each_new_boundary_tensor_once():
    from attnselect.backends.shape_cache import bucketed
    from attnselect.execution import packed_runner
    from attnselect.spec.options import Packing

    q = torch.randn(10, 2, 8)
    first, later = (torch.tensor(b, dtype=torch.int32) for b in ([0, 3, 10], [0, 6, 10]))
    backend = _RecordingPackedBackend()
    run = packed_runner(backend, None, None, like=(q, q, q, Packing(first, first, 7, 7, first, first)))
    run(q, q, q, later, 7, 7)
    expected = bucketed(Packing(later, later, 7, 7, later, later), backend.shape_cache.buckets)
    got = backend.seen[-1][1]
    assert torch.equal(got.cu_seqlens_q, expected.cu_seqlens_q) and got.cu_seqlens_q.numel() == 17  # 16 sequences
    assert got.cu_seqlens_kv is got.offsets_q is got.offsets_kv is got.cu_seqlens_q
    assert (got.max_seqlen_q, got.max_seqlen_kv) == (expected.max_seqlen_q, expected.max_seqlen_kv) == (128, 128)
    run(q, q, q, later, 7, 7)  # the next layer of the step: the same boundaries, bucketed once
    assert backend.seen[-1][1] is got
    later[1] = 4  # changed in place: bucketed again
    run(q, q, q, later, 7, 7)
    assert backend.seen[-1][1] is not got and backend.seen[-1][1].cu_seqlens_q[1] == 4
    with torch.inference_mode():  # inference tensors have no version, inference results no autograd: not kept
        fresh = torch.tensor([0, 5, 10], dtype=torch.int32)
        run(q, q, q, fresh, 7, 7)
        run(q, q, q, fresh, 7, 7)
        run(q, q, q, later, 7, 7)
    assert backend.seen[-1][1] is not backend.seen[-2][1] is not backend.seen[-3][1]
    assert torch.equal(backend.seen[-2][1].cu_seqlens_q[:3], fresh)
    run(q, q, q, later, 7, 7)  # outside: bucketed anew, not the inference-mode copy
    assert not backend.seen[-1][1].cu_seqlens_q.is_inference()
    kept = backend.seen[-1][1]
    run(q, q, q, later, 200, 7)  # the same boundaries at other sizes (another packing's call): its own bucket
    got = backend.seen[-1][1]
    assert got is not kept and (got.max_seqlen_q, got.max_seqlen_kv) == (256, 128)
    unbucketed = _RecordingPackedBackend(buckets=False)
    packed_runner(unbucketed, None, None, like=(q, q, q, Packing(first, first, 7, 7, first, first)))(
        q, q, q, later, 7, 7
    )
    got = unbucketed.seen[-1][1]  # the caller's own boundaries
    assert all(t is later for t in (got.cu_seqlens_q, got.cu_seqlens_kv, got.offsets_q, got.offsets_kv))
    assert (got.max_seqlen_q, got.max_seqlen_kv) == (7, 7)


@pytest.mark.parametrize("why", ["padded", "no tokens"])
def test_a_repeated_packed_runner_that_cannot_pass_its_tensors_as_they_are_runs_the_general_path(why):
    from attnselect.execution import packed_runner
    from attnselect.spec.options import KernelCall, Packing

    q, cu = torch.randn(10, 2, 8), torch.tensor([0, 3, 10], dtype=torch.int32)
    q = q[:0] if why == "no tokens" else q
    backend = _RecordingPackedBackend()
    call = KernelCall(mask="none", window=None, scale=0.3, dropout_p=0.0, return_lse=False)
    run = packed_runner(backend, 16 if why == "padded" else None, call, like=(q, q, q, Packing(cu, cu, 7, 7, cu, cu)))
    out, _ = run(q, q, q, cu, 7, 7)
    if why == "padded":
        ((padded, packing),) = backend.seen
        assert padded.shape == (10, 2, 16) and torch.equal(padded[..., :8], q) and not padded[..., 8:].any()
        assert packing.cu_seqlens_q.numel() == 17 and out.shape == (10, 2, 4)
    else:
        assert backend.seen == [] and out.shape == (0, 2, 8)  # zero rows without a kernel call


def test_a_repeated_packed_runner_needs_one_boundary_tensor():
    from attnselect.execution import packed_runner
    from attnselect.spec.options import Packing

    q, cu = torch.randn(10, 2, 8), torch.tensor([0, 3, 10], dtype=torch.int32)
    with pytest.raises(ValueError, match="one boundary tensor"):
        packed_runner(_RecordingPackedBackend(), None, None, like=(q, q, q, Packing(cu, cu.clone(), 7, 7, cu, cu)))


def test_a_repeated_packed_runner_keeps_a_few_packings_worked_out():
    """Packings that alternate (a pipeline's micro-batches, recomputation) are bucketed once each, up to
    execution.RECENT_PACKINGS of them; one more pushes the oldest out."""
    from attnselect.execution import RECENT_PACKINGS, packed_runner
    from attnselect.spec.options import Packing

    q = torch.randn(10, 2, 8)
    first = torch.tensor([0, 3, 10], dtype=torch.int32)
    backend = _RecordingPackedBackend()
    run = packed_runner(backend, None, None, like=(q, q, q, Packing(first, first, 7, 7, first, first)))
    packings = [torch.tensor([0, 1 + i, 10], dtype=torch.int32) for i in range(RECENT_PACKINGS + 1)]
    for _ in range(3):
        for cu in packings[:RECENT_PACKINGS]:
            run(q, q, q, cu, 7, 7)
    given = [packing for _, packing in backend.seen]
    assert len({id(p) for p in given}) == RECENT_PACKINGS  # each bucketed once, then found
    run(q, q, q, packings[-1], 7, 7)
    run(q, q, q, packings[0], 7, 7)  # pushed out by the newest: bucketed again
    assert backend.seen[-1][1] is not given[0] and torch.equal(backend.seen[-1][1].cu_seqlens_q, given[0].cu_seqlens_q)
