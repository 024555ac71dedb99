"""Is a kernel's result right? A slice of it against a float reference, under the peers' half-precision criteria.

Attention is independent per sequence and per K/V head group, so one sequence and a few query heads of one K/V head,
at full length, are computed exactly by a reference that sees only them. :func:`slice_of` picks that slice,
:func:`compare` computes two references on it and judges the kernel's out, lse and gradients:

- the **exact** reference: float32 math (float64 for float32/float64 inputs) on the inputs as the kernel got them;
- the **naive** reference: the same math in the inputs' own dtype, a PyTorch user's plain implementation.

A value passes when its largest error against the exact reference is at most ``factor`` times the naive
reference's largest error, plus the rounding of the exact value to the inputs' dtype. Source: FlashAttention's
``tests/test_flash_attn.py`` ``test_flash_attn_output`` (out within 2x the naive error, gradients within 3x here as
the issue tracker's correctness criterion asks; FA3's ``hopper/test_flash_attn.py`` adds the rounding term,
``2 * (ref + 0.3 - 0.3 - ref).abs().max()``). lse, float32 in every kernel, is judged the same way against the
naive lse. A 16-bit call's dq and dk may instead match the exact gradients of a backward that reads back the output
the kernel returned, as fused kernels' backward does (:func:`_read_back_reference`). Rows that see no key must
give a zero output and an lse of -inf.

The correctness grid (benchmarks/correctness_grid.py) and the first-use self-check (:mod:`attnselect.self_check`)
both judge by this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnselect.spec import masks
from attnselect.spec.options import KernelCall

# This criterion's version: bumped when a change passes right kernels it failed before, so that a wrong result
# recorded under an earlier one is judged again (attnselect.choose.failures). 2: dq and dk against the read-back
# reference too (:func:`_read_back_reference`); 3: that reference reads back the output the kernel returned.
CRITERION = 3
OUT_FACTOR = 2.0
GRAD_FACTOR = 3.0
SLICE_HEADS = 4  # query heads of the one K/V head compared
QUERY_CHUNK = 2048  # query rows of the reference at once: (heads, chunk, Skv) scores
FLOOR_ULPS = 64


@dataclass(frozen=True)
class Slice:
    """Which part of a call's result is compared: one sequence (a batch row, or a packed sequence), one K/V head
    and some of the query heads of its group."""

    sequence: int
    kv_head: int
    q_heads: tuple[int, ...]
    start_q: int = 0  # thd: where the sequence starts in the packed tensors
    start_kv: int = 0
    length_q: int = 0  # thd: its lengths (dense: the tensors' sequence lengths)
    length_kv: int = 0


def slice_of(heads_q: int, heads_kv: int, sequence: int, *, kv_head: int = -1, starts=(0, 0), lengths=(0, 0)) -> Slice:
    """A K/V head (default the last) and up to :data:`SLICE_HEADS` query heads of its group (the group's first and
    last among them, so a kernel that mixes up heads inside a group is caught)."""
    group = heads_q // heads_kv
    kv_head = kv_head % heads_kv
    first = kv_head * group
    members = list(range(first, first + group))
    if group > SLICE_HEADS:
        members = members[: SLICE_HEADS - 1] + members[-1:]
    return Slice(sequence, kv_head, tuple(members), starts[0], starts[1], lengths[0], lengths[1])


def where(t: torch.Tensor, layout: str, s: Slice, heads, *, keys: bool = False) -> tuple:
    """The index of the slice's rows and ``heads`` in a q/k/v/out-like tensor in ``layout``: ``t[where(...)]`` reads
    them, assigning to it writes them."""
    index = torch.tensor([heads] if isinstance(heads, int) else list(heads), device=t.device)
    if layout == "thd":
        start, length = (s.start_kv, s.length_kv) if keys else (s.start_q, s.length_q)
        return slice(start, start + length), index
    return {"bshd": (s.sequence, slice(None), index), "sbhd": (slice(None), s.sequence, index)}.get(
        layout,
        (s.sequence, index),  # bhsd
    )


def rows(t: torch.Tensor, layout: str, s: Slice, heads, *, keys: bool = False) -> torch.Tensor:
    """The slice's rows of a q/k/v/out-like tensor in ``layout`` as (S, len(heads), D)."""
    picked = t[where(t, layout, s, heads, keys=keys)]
    return picked.transpose(0, 1) if layout == "bhsd" else picked


def lse_rows(lse: torch.Tensor, layout: str, s: Slice) -> torch.Tensor:
    """The slice's rows of an lse, (B, Hq, Sq) dense or (Hq, Tq) thd, as (len(q_heads), S)."""
    index = torch.tensor(s.q_heads, device=lse.device)
    if layout == "thd":
        return lse.index_select(0, index)[:, s.start_q : s.start_q + s.length_q]
    return lse[s.sequence].index_select(0, index)


def judge_slices(
    layout: str, pieces, call: KernelCall, out, lse, grads: dict, q, k, v, dout, dlse, *, read_back=None
) -> list:
    """Judge a call's result on ``pieces`` (slices of equal lengths and head counts) at once: the kernel's ``out``,
    ``lse`` (or None) and ``grads`` ({"dq": ..., "dk": ..., "dv": ...}, those it has) against the references on the
    call's q, k, v for the output gradient ``dout`` (and ``dlse``, where the lse carries one); ``read_back``: the
    output the run that gave ``grads`` returned, which its backward read (default ``out``). One :class:`Judgement`
    per slice, None where its naive reference is not finite (:func:`compare_batch`)."""

    def stack(t, heads_of, keys=False):
        return torch.stack([rows(t, layout, p, heads_of(p), keys=keys) for p in pieces])

    queries, kv_head = (lambda p: p.q_heads), (lambda p: p.kv_head)
    with torch.no_grad():
        got = {"out": stack(out, queries)}
        if lse is not None:
            got["lse"] = torch.stack([lse_rows(lse, layout, p) for p in pieces])
        for name, grad in grads.items():
            got[name] = stack(grad, queries if name == "dq" else kv_head, keys=name != "dq")
        sliced = (
            stack(q, queries).detach(),
            stack(k, kv_head, keys=True).detach(),
            stack(v, kv_head, keys=True).detach(),
            stack(dout, queries) if dout is not None else None,
        )
        dlse_rows = torch.stack([lse_rows(dlse, layout, p) for p in pieces]) if dlse is not None else None
        returned = stack(read_back, queries) if read_back is not None and grads else None
        return compare_batch(*sliced, call, got, dlse=dlse_rows, returned=returned)


def reference(q, k, v, dout, call: KernelCall, dtype: torch.dtype, *, lse: bool = True, dlse=None):
    """Attention of (S, h, D) query rows over (S_kv, 1, D) key rows in ``dtype``: (out, lse (h, S), dq, dk, dv),
    the gradients for ``dout`` (None: none) and, where given, ``dlse`` (h, S) on the lse too (sinks rescale the
    output by it). Chunked over queries so long sequences fit. Slices of equal lengths go as one batch: a leading
    dimension n on every tensor (q (n, S, h, D), lse (n, h, S), ...)."""
    if q.dim() == 3:
        batched = [t.unsqueeze(0) if t is not None else None for t in (q, k, v, dout, dlse)]
        return tuple(t[0] if t is not None else None for t in reference(*batched[:4], call, dtype, lse=lse,
                                                                          dlse=batched[4]))  # fmt: skip
    sq, skv = q.shape[1], k.shape[1]
    kk = k.detach().to(dtype).requires_grad_(dout is not None)
    vv = v.detach().to(dtype).requires_grad_(dout is not None)
    allowed = masks.visible(call.mask, call.window, sq, skv, q.device)
    outs, lses, dqs = [], [], []
    for begin in range(0, max(sq, 1), QUERY_CHUNK):
        end = min(sq, begin + QUERY_CHUNK)
        qq = q[:, begin:end].detach().to(dtype).requires_grad_(dout is not None)
        with torch.enable_grad() if dout is not None else torch.no_grad():
            # The scale goes on q first, as FlashAttention's attention_ref does: a product of unscaled fp16 rows
            # can overflow where the kernel's scaled logits do not.
            scores = torch.einsum("nshd,nthd->nhst", qq * call.scale, kk.expand(-1, -1, qq.shape[2], -1))
            if call.softcap is not None:
                scores = call.softcap * torch.tanh(scores / call.softcap)
            empty = None
            if allowed is not None:
                seen = allowed[begin:end]
                scores = scores.masked_fill(~seen, float("-inf"))
                empty = ~seen.any(-1)  # (chunk,)
                scores = scores.masked_fill(empty[:, None], 0.0)
            # No graph for an lse without a gradient: it would outlive this call's backward.
            lse_of = scores if dlse is not None else scores.detach()
            row_lse = torch.logsumexp(lse_of.float(), dim=-1) if lse else None
            probs = torch.softmax(scores.float(), dim=-1).to(dtype)
            if empty is not None:
                probs = probs.masked_fill(empty[:, None], 0.0)
                if row_lse is not None:
                    row_lse = row_lse.masked_fill(empty, float("-inf"))
            out = torch.einsum("nhst,nthd->nshd", probs, vv.expand(-1, -1, qq.shape[2], -1))
            if dout is not None and dlse is not None:
                torch.autograd.backward([out, row_lse], [dout[:, begin:end].to(dtype), dlse[:, :, begin:end].float()])
                dqs.append(qq.grad)
            elif dout is not None:
                out.backward(dout[:, begin:end].to(dtype))
                dqs.append(qq.grad)
        outs.append(out.detach())
        lses.append(row_lse.detach() if row_lse is not None else None)
    out = torch.cat(outs, dim=1)
    row_lse = torch.cat(lses, dim=2) if lse else None
    if dout is None:
        return out, row_lse, None, None, None
    return out, row_lse, torch.cat(dqs, dim=1), kk.grad, vv.grad


@dataclass(frozen=True)
class Judgement:
    """The largest errors against the exact reference, with their bounds; ``failures`` names what missed."""

    errors: dict
    bounds: dict

    def worse(self, other: Judgement) -> Judgement:
        """Per value, the error of whichever judgement is further from its bound (two slices of one call)."""
        errors, bounds = dict(self.errors), dict(self.bounds)
        for name, err in other.errors.items():
            if name not in errors or _ratio(err, other.bounds[name]) > _ratio(errors[name], bounds[name]):
                errors[name], bounds[name] = err, other.bounds[name]
        return Judgement(errors, bounds)

    @property
    def failures(self) -> list[str]:
        return [name for name, err in self.errors.items() if not err <= self.bounds[name]]

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def excess(self) -> float:
        """The largest multiple of its bound that a value's error reached (inf for an error that is not finite, or
        past a bound of 0)."""
        bounds = self.bounds  # a NaN bound is no bound
        return max(
            (_ratio(err, bounds[n]) if math.isfinite(err) and bounds[n] == bounds[n] else math.inf
             for n, err in self.errors.items()),
            default=0.0,
        )  # fmt: skip

    def describe(self) -> str:
        return ", ".join(
            f"{name} max error {err:.3g} (bound {self.bounds[name]:.3g})" for name, err in self.errors.items()
        )

    def to_dict(self) -> dict:
        return {"errors": self.errors, "bounds": self.bounds, "passed": self.passed}


def compare(q, k, v, dout, call: KernelCall, got: dict, dlse=None) -> Judgement:
    """Judge ``got`` ({"out": ..., "lse": ..., "dq": ..., "dk": ..., "dv": ...}, each optional, the kernel's
    values on the slice: out/dq (S, h, D), dk/dv (S_kv, 1, D), lse (h, S)) for slice inputs q (S, h, Dqk),
    k/v (S_kv, 1, D) and, for gradients, dout (S, h, Dv) and, where the lse carries one, dlse (h, S). Raises
    ValueError where the naive reference is not finite (no bound to judge by)."""
    batch = [t.unsqueeze(0) if t is not None else None for t in (q, k, v, dout, dlse)]
    judgement = compare_batch(*batch[:4], call, {name: value.unsqueeze(0) for name, value in got.items()}, batch[4])[0]
    if judgement is None:
        raise ValueError("the naive reference is not finite: no bound to judge by")
    return judgement


def compare_batch(q, k, v, dout, call: KernelCall, got: dict, dlse=None, returned=None) -> list[Judgement | None]:
    """:func:`compare` for n slices of equal lengths at once (a leading dimension n on every tensor): one judgement
    per slice, None for a slice whose naive reference is not finite (fp16 logits past 65504, say). The references
    run once for the batch and the errors come back to the host in one transfer. ``returned``: the output the
    backward that gave the gradients read (default ``got["out"]``: one run gave both)."""
    dtype = q.dtype
    exact_dtype = torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32
    # float64 inputs are judged at float32's precision: kernels compute them with float32-level error (PyTorch's CPU
    # flash kernel: 5e-8 to 9e-8 at 16/16), which a float64 naive reference would call wrong.
    naive_dtype = torch.float32 if dtype == torch.float64 else dtype
    grads = dout if any(name in got for name in ("dq", "dk", "dv")) else None
    dlse = dlse if grads is not None else None
    exact = dict(zip(("out", "lse", "dq", "dk", "dv"), reference(q, k, v, grads, call, exact_dtype, dlse=dlse)))
    naive = dict(zip(("out", "lse", "dq", "dk", "dv"), reference(q, k, v, grads, call, naive_dtype, dlse=dlse)))
    read_back = (
        _read_back_reference(
            q, k, v, grads, call, exact, exact_dtype, returned=returned if returned is not None else got.get("out")
        )
        if grads is not None and dtype in (torch.float16, torch.bfloat16) and ("dq" in got or "dk" in got)
        else {}
    )
    names, columns = list(got), []
    for name in names:
        value, ref, plain = got[name], exact[name], naive[name]
        factor = OUT_FACTOR if name in ("out", "lse") else GRAD_FACTOR
        misplaced = None
        if name == "lse":  # a row that sees no key must have lse -inf; the other rows are compared
            keyless = torch.isinf(ref)
            misplaced = ((value != float("-inf")) & keyless).flatten(1).any(1)
            value, ref, plain = (t.masked_fill(keyless, 0.0) for t in (value, ref, plain))
        error = _max_errors(value, ref)
        if name in read_back:  # right against either: the exact output read back, or rounded as the kernel returned it
            error = torch.minimum(error, _max_errors(value, read_back[name]))
        naive_error = _max_errors(plain, ref)
        rounding = (
            2 * _max_errors((ref.to(naive_dtype) + 0.3 - 0.3).to(ref.dtype), ref)
            if name != "lse"
            else torch.full_like(error, 1e-5)
        )
        # A floor where the naive reference is exact (a value that is exactly 0, as dk with one key): some units in
        # the last place of the kernels' float32 accumulation at the value's scale, which summation order alone can
        # differ by (PyTorch's CPU flash kernel: 2e-6 to 6e-6 on a dk of 0).
        scale = ref.abs().flatten(1).amax(1).double().clamp(min=1.0) if ref[0].numel() else torch.ones_like(error)
        bound = factor * naive_error + rounding + FLOOR_ULPS * torch.finfo(torch.float32).eps * scale
        if misplaced is not None:
            error = torch.where(misplaced, torch.full_like(error, float("inf")), error)
            bound = torch.where(misplaced, torch.zeros_like(bound), bound)
        columns.append(torch.stack([error, bound, naive_error]))
    if not columns:
        return [Judgement({}, {}) for _ in range(q.shape[0])]
    table = torch.stack(columns).tolist()  # (values, 3, n): one transfer
    judgements = []
    for i in range(q.shape[0]):
        if not all(math.isfinite(table[j][2][i]) for j in range(len(names))):
            judgements.append(None)
            continue
        judgements.append(
            Judgement(
                {n: table[j][0][i] for j, n in enumerate(names)}, {n: table[j][1][i] for j, n in enumerate(names)}
            )
        )
    return judgements


def _read_back_reference(
    q, k, v, dout, call: KernelCall, exact: dict, exact_dtype: torch.dtype, *, returned=None
) -> dict:
    """{"dq": ..., "dk": ...}: the exact gradients with the backward reading back the output the kernel returned
    (``returned``; where not given, the exact output rounded to the inputs' dtype), as fused kernels' backward does:
    D = rowsum(dO * O) on the O they returned (FlashAttention-2's and -4's flash_bwd_preprocess, cuDNN's
    compute_dot_do_o). A change dD of D moves the scores' gradient by -P * dD (softmax backward), the gradient of
    -dD * lse (d lse / d s = P): the reference's gradients for no output gradient and an lse gradient of -dD, added to
    the exact ones (dv does not read D). A kernel's dq and dk are judged against whichever of the two they are closer
    to. Judged against the exact ones alone, six kernels on an H100 (FA2, FA4, flex, the cuDNN frontend, SDPA's flash
    and mem-efficient) all failed one packed training self-check with the same dq error, 0.0075 against a bound of
    0.00655 (results/h100_self_check_read_back.md). Read back from the exact output rounded, they failed another alike
    (0.00522 against 0.00378, results/h100_self_check_short_sequences_9cbe6e3.md), likely because their output is not
    the exact one rounded: the forward rounds the softmax's numerators to the inputs' dtype before multiplying them by
    V (the matrix units take 16-bit operands), and the backward reads that output back (a model on the CPU,
    results/cpu_self_check_model.md; on that packing on an H100, four kernels' worst slice at 0.962 to 1.095 of the
    bound read back so, none above 0.456 reading back their own output, results/h100_self_check_probe_50926a7.md).
    The cost: dq and dk no longer catch an output error that
    the out check lets through (within twice the naive error); a backward's own error still fails them."""
    out = exact["out"]
    read = (returned if returned is not None else out).to(q.dtype).to(out.dtype)
    shift = -(dout.to(out.dtype) * (read - out)).sum(-1).transpose(1, 2)  # (n, S, h) -> (n, h, S), as the lse
    moved = reference(q, k, v, torch.zeros_like(dout), call, exact_dtype, dlse=shift.float())
    return {name: exact[name] + change.to(exact[name].dtype) for name, change in zip(("dq", "dk"), moved[2:4])}


def _ratio(err: float, bound: float) -> float:
    return err / bound if bound > 0 else float("inf") if err > 0 else 0.0


def _max_errors(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The largest absolute difference per slice (leading dimension), float64; inf where ``a`` is not finite."""
    if a[0].numel() == 0:
        return torch.zeros(a.shape[0], dtype=torch.float64, device=a.device)
    diff = (a.double() - b.double()).abs().flatten(1).amax(1)
    return torch.where(torch.isfinite(a).flatten(1).all(1), diff, torch.full_like(diff, float("inf")))
