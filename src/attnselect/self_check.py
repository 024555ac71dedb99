"""The first-use self-check: a kernel's first call of each signature in a process is checked at its real size.

A support surface is a claim; young kernels break claims in ways that depend on the process and the size
(FlashAttention-4 4.0.0b36's sm90 backward at 128/64 gave wrong gradients in three processes of four, at some sizes
only: docs/sources/h200-measurements-2026-12-02.md). So the first call of each (candidate, problem signature)
in a process (:attr:`AttentionProblem.signature`: head dims, GQA ratio, mask, layout kind, dtype, phase, size class)
runs as usual, and a slice of its result (one sequence at full length, up to four query heads of one K/V head) is
compared with references computed on that slice (:mod:`attnselect.correctness`). In training the kernel's backward
runs too, once, for a random output gradient (``torch.autograd.grad``, the graph kept for the caller's own
backward), and the slice's dq, dk and dv are compared. A pass is kept for this process only.

Where the result is wrong, attnselect raises :class:`WrongResultError` for a forced backend (``backend=``) or under
ATTNSELECT_STRICT=1; otherwise the candidate is marked failed for the signature (:mod:`attnselect.choose.failures`:
in the decision cache too where it is clearly wrong, :data:`CLEARLY_WRONG`; shown by ``explain``), one warning is
logged, and the call is recomputed on the next candidate, so the caller never receives the wrong values.

``ATTNSELECT_SELF_CHECK``: ``1`` (default) checks signatures the packaged correctness grid has not checked on this
GPU and these library versions (:func:`attnselect.backends.evidence.covers`); ``all`` checks every signature; ``0``
checks none. Not checked: calls with dropout (random by design), inside torch.compile graphs or CUDA graph capture (no
reference can run there: the warm-up call before capture is checked), and the reference backend itself.
"""

from __future__ import annotations

import logging
import math

import torch

from attnselect import correctness
from attnselect.backends import evidence
from attnselect.backends.base import get as backend_named
from attnselect.choose.failures import is_transient
from attnselect.choose.settings import MEMO_SIZE, self_check_mode
from attnselect.errors import AttnSelectError
from attnselect.memos import register_cache
from attnselect.spec.options import Candidate, KernelCall, Packing
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target

log = logging.getLogger("attnselect")
# (target, candidate, signature) checked and passed in this process. A pass is not carried to another process.
_PASSED: set = set()


class WrongResultError(AttnSelectError, RuntimeError):
    """A kernel's result did not match the reference at the self-check of its first call."""

    criterion = correctness.CRITERION  # what judged it: a record of it holds under this criterion only
    # whether it is clearly wrong (:data:`CLEARLY_WRONG`): recorded for later processes; else for this process only
    lasting = True


# A wrong result is recorded in the decision cache, for later processes (attnselect.choose.failures), only where it is
# clearly wrong: some value's error at least this multiple of its bound. Right fused kernels failed under earlier
# criteria at 1.0 to 1.5 times their bound (docs/limits.md: dq 0.0075 against 0.00655, 0.00536 against 0.00378;
# recorded, each demoted every fused kernel of its size class in later processes); FA4 4.0.0b36's wrong 128/64
# gradients reached 208 to 302 against bounds near 0.011 (results/h200_self_check_spread_fa4.txt). A result wrong by
# less is refused in this process alone (the call is recomputed on the next candidate all the same), and checked
# again by the next.
CLEARLY_WRONG = 4.0


def needed(problem: AttentionProblem, chosen: Candidate, target: Target) -> bool:
    """Whether this call, the first of its kind since the memo last decided it, is to be checked."""
    checking = self_check_mode()
    if checking == "0" or chosen.backend == "reference":
        return False
    if problem.dropout_p or problem.compiled_graph or problem.cuda_graph_capture or problem.fp8:
        return False
    if not has_work(problem):  # nothing to compare
        return False
    key = (target, chosen, problem.signature)
    if key in _PASSED:
        return False
    if checking == "all":
        return True
    covered = _COVERED.get(key)
    if covered is None:
        version = backend_named(chosen.backend).package_version(target)
        covered = evidence.covers(chosen.backend, chosen.pad_to, problem, target, version)
        if len(_COVERED) >= MEMO_SIZE:
            _COVERED.clear()
        _COVERED[key] = covered
    return not covered


# (target, candidate, signature) -> whether the packaged correctness grid covers it (evidence.covers: package data and
# the target's versions, fixed in a process): a packed loop asks at every new packing.
_COVERED: dict = {}
register_cache(_COVERED.clear)


def has_work(problem: AttentionProblem) -> bool:
    """Whether a call of ``problem`` has scores to compare."""
    return bool(problem.batch and problem.seqlen_q and problem.seqlen_kv)


def check(problem, chosen, target, call: KernelCall, result, q, k, v, packing: Packing | None, rerun) -> None:
    """Judge the kernel's ``result`` ((out, lse, ...) as its runner returned it, before sinks) of the call on
    q, k, v (``rerun(q, k, v)`` runs it again); raise :class:`WrongResultError` when it is wrong. A failure of the
    kernel's backward propagates (the caller treats it as the kernel failing at run time); a failure of the reference
    only skips the check, with one warning."""
    try:
        judgement = judge(problem, call, result, q, k, v, packing, check_slices(problem, packing), rerun)
    except ReferenceFailed as exc:
        log.warning("attnselect: the self-check of %s on %s could not run (%s); not checked", chosen,
                    problem.describe(), exc)  # fmt: skip
        return
    if not judgement.passed:
        error = WrongResultError(
            f"self-check of {chosen} at signature {format_signature(problem)}: {', '.join(judgement.failures)} "
            f"wrong ({judgement.describe()})"
        )
        error.lasting = judgement.excess >= CLEARLY_WRONG
        raise error
    _PASSED.add((target, chosen, problem.signature))


class ReferenceFailed(Exception):
    """The references could not be computed (out of memory, say): no verdict on the kernel."""


def judge(problem, call: KernelCall, result, q, k, v, packing: Packing | None, slices, rerun) -> correctness.Judgement:
    """The judgement of a kernel's ``result`` of a call on q, k, v over ``slices`` (the worst of them): its out, its
    lse where it returned one and, in training, the gradients of a second run, ``rerun(q, k, v)`` on detached copies
    (the caller's graph is left alone: a compiled backward, flex's, runs once only), for a random output gradient.

    Raises what the kernel's rerun raises, and :class:`ReferenceFailed` where no verdict can be had: no element to
    compare, the check out of memory (its rerun holds a second graph beside the caller's), or references that
    overflow. The caller's saved-tensor hooks (activation checkpointing) do not see the check's own tensors."""
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        raise ReferenceFailed("no element to compare")
    # Packed detached: a saved output packed as itself holds its own graph in a cycle that gc cannot break, and a
    # graph left without a backward (an lse) stayed alive: 8.5 GiB a check at 8k tokens on the H200.
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t):
        grads, dout, dlse, again = {}, None, None, None
        if problem.training:
            try:
                leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
                again, again_lse = rerun(*leaves)[:2]
                dout = _output_gradient(again, problem, slices)
                outputs, gradients = [again], [dout]
                if problem.sinks and again_lse is not None:  # the caller's backward goes through the lse too
                    generator = torch.Generator(device=again_lse.device).manual_seed(0x51)
                    dlse = torch.randn(again_lse.shape, generator=generator, device=again_lse.device)
                    dlse = dlse.masked_fill(~torch.isfinite(again_lse.detach()), 0.0)  # rows that see no key
                    if again_lse.requires_grad:  # else the kernel's lse gives no gradient, which the check finds
                        outputs.append(again_lse)
                        gradients.append(dlse.to(again_lse.dtype))
                grads = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(outputs, leaves, gradients)))
            except Exception as exc:
                if is_transient(exc):
                    raise ReferenceFailed(f"the check ran out of memory ({type(exc).__name__}: {exc})") from exc
                raise
        # the gradients' backward read the rerun's output back (correctness._read_back_reference), not the first run's
        read_back = again.detach() if again is not None else None
        return _judge_slices(problem, call, result, q, k, v, dout, grads, slices, dlse, read_back)


def _judge_slices(problem, call, result, q, k, v, dout, grads, slices, dlse, read_back=None) -> correctness.Judgement:
    """The worst judgement over the slices whose references could be computed; :class:`ReferenceFailed` where none
    could (a slice whose naive reference overflows, say, leaves the others to judge). Slices of equal lengths are
    judged together, as many at once as :data:`BATCH_ELEMENTS` allows."""
    judgement, failed = None, None
    batches = _batches(slices)
    while batches:
        batch = batches.pop(0)
        try:
            found = correctness.judge_slices(
                problem.layout, batch, call, result[0], result[1], grads, q, k, v, dout, dlse, read_back=read_back
            )
        except Exception as exc:
            if len(batch) > 1 and is_transient(exc):  # out of memory: one slice at a time fits where a batch did not
                batches[:0] = [[piece] for piece in batch]
                continue
            failed = f"{type(exc).__name__}: {exc}"  # its text: the exception would hold this frame's tensors
            continue
        for one in found:
            if one is None:
                failed = failed or "ValueError: the naive reference is not finite: no bound to judge by"
                continue
            judgement = one if judgement is None else judgement.worse(one)
        if judgement is not None and judgement.excess >= CLEARLY_WRONG:  # clearly wrong: no need to look further
            break  # (one just past its bound reads on: a slice further on may be clearly wrong)
    if judgement is None:
        raise ReferenceFailed(failed)
    return judgement


# Reference score elements (slices x query heads x query rows of a chunk x keys) judged at once: slices of equal
# lengths go as one batch (one reference, one transfer of the errors) up to this size (2**24: about 300 MB of float32
# scores, softmax and gradients); a batch that runs out of memory is judged again slice by slice.
BATCH_ELEMENTS = 2**24


def _batches(slices) -> list[list[correctness.Slice]]:
    groups: dict = {}
    for piece in slices:
        groups.setdefault((piece.length_q, piece.length_kv, len(piece.q_heads)), []).append(piece)
    out = []
    for (length_q, length_kv, heads), members in groups.items():
        each = heads * max(min(length_q, correctness.QUERY_CHUNK), 1) * max(length_kv, 1)
        size = max(1, BATCH_ELEMENTS // each)
        out += [members[i : i + size] for i in range(0, len(members), size)]
    return out


# The self-check's slices: up to this many, and this many reference score elements (query rows x keys x query heads)
# in all. FlashAttention-4 4.0.0b36's wrong 128/64 gradients (B32 H16 S640) sat in one (sequence, head) pair, the
# first: one slice, the last sequence's last K/V head, passed in a process where the gradients were wrong
# (results/h200_self_check_one_slice_fa4.txt); slices spread over every sequence and K/V head caught it in each of
# four processes (results/h200_self_check_spread_fa4.txt).
CHECK_SLICES = 32
CHECK_ELEMENTS = 2**30


def check_slices(problem: AttentionProblem, packing: Packing | None) -> list[correctness.Slice]:
    """Slices spread over the call: the last (thd: longest) sequence's last K/V head, then the i-th sequence mod B
    with K/V head i mod Hkv, walking diagonals (max(B, Hkv) slices cover every sequence and every K/V head; more
    cover more pairs), as many as :data:`CHECK_SLICES` and :data:`CHECK_ELEMENTS` allow (a sequence with no query,
    or too long for what is left, is passed over), one at least."""
    placed = _placement(problem, packing)
    lengths = placed[0]
    chosen = [_slice_at(problem, placed, _last(placed))]
    heads = len(chosen[0].q_heads)
    cost = lambda sequence: heads * max(lengths[sequence][0] * lengths[sequence][1], 1)  # noqa: E731
    spent = cost(chosen[0].sequence) if lengths else 0
    batch, kv_heads = len(lengths), problem.heads_kv
    for i in range(batch * kv_heads):
        if len(chosen) >= CHECK_SLICES:
            break
        sequence = i % batch
        if lengths[sequence][0] == 0 or spent + cost(sequence) > CHECK_ELEMENTS:  # nothing to see, or too long
            continue
        kv_head = (i + i // math.lcm(batch, kv_heads)) % kv_heads  # the next diagonal after each full lap
        piece = _slice_at(problem, placed, sequence, kv_head=kv_head)
        if piece not in chosen:
            chosen.append(piece)
            spent += cost(sequence)
    return chosen


def _placement(problem: AttentionProblem, packing: Packing | None) -> tuple[list, list]:
    """Each sequence's (q, kv) lengths and (q, kv) starts in the tensors; thd reads the boundaries once (a first call
    only)."""
    if packing is None:
        return [(problem.seqlen_q, problem.seqlen_kv)] * problem.batch, [(0, 0)] * problem.batch
    bounds_q, bounds_kv = packing.cu_seqlens_q.tolist(), packing.cu_seqlens_kv.tolist()
    lengths = [(bounds_q[i + 1] - bounds_q[i], bounds_kv[i + 1] - bounds_kv[i]) for i in range(len(bounds_q) - 1)]
    return lengths, list(zip(packing.offsets_q.tolist(), packing.offsets_kv.tolist()))


def _last(placed) -> int:
    """The last batch row; for thd, the longest sequence."""
    lengths = placed[0]
    return max(range(len(lengths)), key=lambda i: (lengths[i][0] * max(lengths[i][1], 1), i), default=0)


def _slice_at(problem, placed, sequence: int, kv_head: int = -1) -> correctness.Slice:
    lengths, starts = placed
    if not lengths:
        return correctness.slice_of(problem.heads_q, problem.heads_kv, 0, kv_head=kv_head)
    return correctness.slice_of(
        problem.heads_q, problem.heads_kv, sequence, kv_head=kv_head, starts=starts[sequence], lengths=lengths[sequence]
    )


def format_signature(problem: AttentionProblem) -> str:
    dqk, dv, ratio, mask, layout, dtype, phase, size, options = problem.signature
    extra = f" {'+'.join(options)}" if options else ""
    return f"{layout} {dqk}/{dv} GQA {ratio} {mask} {dtype} {phase} size class {size}{extra}"


def _output_gradient(out: torch.Tensor, problem: AttentionProblem, pieces) -> torch.Tensor:
    """A random output gradient, zero for the query heads of each slice's K/V group that the slice leaves out (so
    the slice's dk and dv come from its own query heads alone)."""
    generator = torch.Generator(device=out.device).manual_seed(0x5E1F)
    dout = torch.randn(out.shape, generator=generator, device=out.device, dtype=torch.float32).to(out.dtype)
    group = problem.heads_q // problem.heads_kv
    for piece in pieces:
        left_out = [h for h in range(piece.kv_head * group, (piece.kv_head + 1) * group) if h not in piece.q_heads]
        if not left_out:
            continue
        dout[correctness.where(dout, problem.layout, piece, left_out)] = 0
    return dout
