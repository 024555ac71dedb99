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
naive lse. Rows that see no key must give a zero output and an lse of -inf.

The correctness grid (benchmarks/correctness_grid.py) and the first-use self-check (:mod:`attnselect.self_check`)
both judge by this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attnselect.spec import masks
from attnselect.spec.options import KernelCall

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


def reference(q, k, v, dout, call: KernelCall, dtype: torch.dtype, *, lse: bool = True, dlse=None):
    """Attention of (S, h, D) query rows over (S_kv, 1, D) key rows in ``dtype``: (out, lse (h, S), dq, dk, dv),
    the gradients for ``dout`` (None: none) and, where given, ``dlse`` (h, S) on the lse too (sinks rescale the
    output by it). Chunked over queries so long sequences fit."""
    sq, skv = q.shape[0], k.shape[0]
    kk = k.detach().to(dtype).requires_grad_(dout is not None)
    vv = v.detach().to(dtype).requires_grad_(dout is not None)
    allowed = masks.visible(call.mask, call.window, sq, skv, q.device)
    outs, lses, dqs = [], [], []
    for begin in range(0, max(sq, 1), QUERY_CHUNK):
        end = min(sq, begin + QUERY_CHUNK)
        qq = q[begin:end].detach().to(dtype).requires_grad_(dout is not None)
        with torch.enable_grad() if dout is not None else torch.no_grad():
            # The scale goes on q first, as FlashAttention's attention_ref does: a product of unscaled fp16 rows
            # can overflow where the kernel's scaled logits do not.
            scores = torch.einsum("shd,thd->hst", qq * call.scale, kk.expand(-1, qq.shape[1], -1))
            if call.softcap is not None:
                scores = call.softcap * torch.tanh(scores / call.softcap)
            empty = None
            if allowed is not None:
                seen = allowed[begin:end]
                scores = scores.masked_fill(~seen, float("-inf"))
                empty = ~seen.any(-1)  # (chunk,)
                scores = scores.masked_fill(empty[:, None], 0.0)
            row_lse = torch.logsumexp(scores.float(), dim=-1) if lse else None
            probs = torch.softmax(scores.float(), dim=-1).to(dtype)
            if empty is not None:
                probs = probs.masked_fill(empty[:, None], 0.0)
                if row_lse is not None:
                    row_lse = row_lse.masked_fill(empty, float("-inf"))
            out = torch.einsum("hst,thd->shd", probs, vv.expand(-1, qq.shape[1], -1))
            if dout is not None and dlse is not None:
                torch.autograd.backward([out, row_lse], [dout[begin:end].to(dtype), dlse[:, begin:end].float()])
                dqs.append(qq.grad)
            elif dout is not None:
                out.backward(dout[begin:end].to(dtype))
                dqs.append(qq.grad)
        outs.append(out.detach())
        lses.append(row_lse.detach() if row_lse is not None else None)
    out = torch.cat(outs)
    row_lse = torch.cat(lses, dim=1) if lse else None
    if dout is None:
        return out, row_lse, None, None, None
    return out, row_lse, torch.cat(dqs), kk.grad, vv.grad


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

    def describe(self) -> str:
        return ", ".join(
            f"{name} max error {err:.3g} (bound {self.bounds[name]:.3g})" for name, err in self.errors.items()
        )

    def to_dict(self) -> dict:
        return {"errors": self.errors, "bounds": self.bounds, "passed": self.passed}


def compare(q, k, v, dout, call: KernelCall, got: dict, dlse=None) -> Judgement:
    """Judge ``got`` ({"out": ..., "lse": ..., "dq": ..., "dk": ..., "dv": ...}, each optional, the kernel's
    values on the slice: out/dq (S, h, D), dk/dv (S_kv, 1, D), lse (h, S)) for slice inputs q (S, h, Dqk),
    k/v (S_kv, 1, D) and, for gradients, dout (S, h, Dv) and, where the lse carries one, dlse (h, S)."""
    dtype = q.dtype
    exact_dtype = torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32
    # float64 inputs are judged at float32's precision: kernels compute them with float32-level error (PyTorch's CPU
    # flash kernel: 5e-8 to 9e-8 at 16/16), which a float64 naive reference would call wrong.
    naive_dtype = torch.float32 if dtype == torch.float64 else dtype
    grads = dout if any(name in got for name in ("dq", "dk", "dv")) else None
    dlse = dlse if grads is not None else None
    exact = dict(zip(("out", "lse", "dq", "dk", "dv"), reference(q, k, v, grads, call, exact_dtype, dlse=dlse)))
    naive = dict(zip(("out", "lse", "dq", "dk", "dv"), reference(q, k, v, grads, call, naive_dtype, dlse=dlse)))
    errors, bounds = {}, {}
    for name, value in got.items():
        ref, plain = exact[name], naive[name]
        factor = OUT_FACTOR if name in ("out", "lse") else GRAD_FACTOR
        if name == "lse":
            keyless = torch.isinf(ref)
            if bool((value[keyless] != float("-inf")).any()):
                errors[name], bounds[name] = float("inf"), 0.0  # a row that sees no key must have lse -inf
                continue
            value, ref, plain = value[~keyless], ref[~keyless], plain[~keyless]
        errors[name] = _max_error(value, ref)
        naive_error = _max_error(plain, ref)
        if not math.isfinite(naive_error):
            raise ValueError(f"the naive reference's {name} is not finite: no bound to judge by")
        rounding = 2 * _max_error((ref.to(naive_dtype) + 0.3 - 0.3).to(ref.dtype), ref) if name != "lse" else 1e-5
        # A floor where the naive reference is exact (a value that is exactly 0, as dk with one key): some units in
        # the last place of the kernels' float32 accumulation at the value's scale, which summation order alone can
        # differ by (PyTorch's CPU flash kernel: 2e-6 to 6e-6 on a dk of 0).
        floor = FLOOR_ULPS * torch.finfo(torch.float32).eps * max(1.0, float(ref.abs().max()) if ref.numel() else 1.0)
        bounds[name] = factor * naive_error + rounding + floor
    return Judgement(errors, bounds)


def _ratio(err: float, bound: float) -> float:
    return err / bound if bound > 0 else float("inf") if err > 0 else 0.0


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    diff = (a.double() - b.double()).abs()
    return float("inf") if not bool(torch.isfinite(a).all()) else float(diff.max())
