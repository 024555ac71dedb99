"""Checking the tensors of an attention call and reading what describes it (the fields of an AttentionProblem).

Every check raises :class:`~attnselect.errors.InvalidInputError` naming the argument, the
value seen and what was expected, before any kernel runs.
"""

from __future__ import annotations

import math

import torch

from attnselect.errors import InvalidInputError
from attnselect.memos import TensorMemo, warn_once
from attnselect.spec import masks
from attnselect.spec.options import DTYPES, INT32_MAX, LAYOUTS, CallOptions, Packing, mask_from_arguments

# (batch, seq, heads) positions of each dense layout; thd is (tokens, heads, dim).
DENSE_AXES = {"bshd": (0, 1, 2), "sbhd": (1, 0, 2), "bhsd": (0, 2, 1)}


def _fail(name: str, seen, expected: str):
    raise InvalidInputError(f"{name}: got {seen}, expected {expected}")


def read_call(q, k, v, options: CallOptions, *, context_parallel_size: int = 1) -> tuple[dict, Packing | None]:
    """Validate q, k, v and the options that describe the call (:data:`~attnselect.spec.options.DESCRIBING`); return the
    fields of its :class:`~attnselect.spec.problem.AttentionProblem` and, for thd, the packing.

    ``training`` is true when grad mode is on and any input requires grad; ``deterministic``
    follows ``torch.are_deterministic_algorithms_enabled()``. For ``thd`` the boundaries are
    read on the host (one sync on CUDA) unless both ``max_seqlen_*`` are given. ``scale`` and ``softcap`` are
    only validated (their values do not change the choice).
    """
    o = options
    if o.layout not in LAYOUTS:
        _fail("layout", repr(o.layout), f"one of {LAYOUTS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            _fail(name, type(t).__name__, "a torch.Tensor")
        if t.is_nested or t.layout is not torch.strided:
            _fail(name, "a nested tensor" if t.is_nested else f"layout {t.layout}", "a dense (strided) tensor")
        if t.dtype not in DTYPES:
            _fail(f"{name}.dtype", t.dtype, "one of float16, bfloat16, float32, float64")
    if not (q.dtype == k.dtype == v.dtype):
        _fail("k.dtype/v.dtype", f"q {q.dtype}, k {k.dtype}, v {v.dtype}", "the same dtype as q")
    if not (q.device == k.device == v.device):
        _fail("k.device/v.device", f"q {q.device}, k {k.device}, v {v.device}", "the same device as q")
    rank = 3 if o.layout == "thd" else 4
    shape_hint = (
        "(T, H, D)"
        if o.layout == "thd"
        else {"bshd": "(B, S, H, D)", "sbhd": "(S, B, H, D)", "bhsd": "(B, H, S, D)"}[o.layout]
    )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != rank:
            _fail(f"{name}.shape", tuple(t.shape), f"{rank} dims {shape_hint} for layout={o.layout!r}")
    if q.shape[-1] != k.shape[-1]:
        _fail("k.shape[-1]", k.shape[-1], f"q's head dim {q.shape[-1]} (q and k share d_qk)")
    capturing = q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if o.layout == "thd":
        if capturing and (o.max_seqlen_q is None or o.max_seqlen_kv is None):
            _fail(
                "max_seqlen_q/max_seqlen_kv",
                f"{o.max_seqlen_q}/{o.max_seqlen_kv}",
                "both integers under CUDA graph capture (reading cu_seqlens would need a host sync)",
            )
        seq_axis, head_axis = 0, 1
        packing, lengths = _packing(
            q,
            k,
            o.cu_seqlens_q,
            o.cu_seqlens_kv,
            o.max_seqlen_q,
            o.max_seqlen_kv,
            o.cu_seqlens_q_padded,
            o.cu_seqlens_kv_padded,
            capturing,
        )
        batch, sq, skv = packing.cu_seqlens_q.numel() - 1, packing.max_seqlen_q, packing.max_seqlen_kv
        if lengths[0] is not None:  # read anyway: the problem is the real one, not a generous bound (the kernels
            # still get the bound); the measure policy times the problem's size, 2 x 4096 tokens for 20 real ones
            sq, skv = max(lengths[0], default=0), max(lengths[1], default=0)
    else:
        b_axis, seq_axis, head_axis = DENSE_AXES[o.layout]
        if not (q.shape[b_axis] == k.shape[b_axis] == v.shape[b_axis]):
            _fail(
                "k/v batch size", f"q {q.shape[b_axis]}, k {k.shape[b_axis]}, v {v.shape[b_axis]}", "equal batch sizes"
            )
        for name, value in (
            ("cu_seqlens_q", o.cu_seqlens_q),
            ("cu_seqlens_kv", o.cu_seqlens_kv),
            ("cu_seqlens_q_padded", o.cu_seqlens_q_padded),
            ("cu_seqlens_kv_padded", o.cu_seqlens_kv_padded),
        ):
            if value is not None:
                _fail(name, "a tensor", f"None for layout={o.layout!r} (cu_seqlens belong to layout='thd')")
        for name, value in (("max_seqlen_q", o.max_seqlen_q), ("max_seqlen_kv", o.max_seqlen_kv)):
            if value is not None:
                _fail(name, _describe(value), f"None for layout={o.layout!r} (max_seqlen belongs to layout='thd')")
        batch, sq, skv = q.shape[b_axis], q.shape[seq_axis], k.shape[seq_axis]
        packing = None
    if k.shape[seq_axis] != v.shape[seq_axis]:
        _fail("v.shape", tuple(v.shape), f"as many key positions as k ({k.shape[seq_axis]})")
    hq, hkv = q.shape[head_axis], k.shape[head_axis]
    if v.shape[head_axis] != hkv:
        _fail("v heads", v.shape[head_axis], f"k's head count {hkv}")
    if hq == 0 or hkv == 0:
        _fail("q/k heads", f"q {hq}, k {hkv}", "at least one head each")
    if hq % hkv:
        _fail("q heads", hq, f"a multiple of the k/v head count {hkv} (GQA/MQA)")
    check_dropout(o.dropout_p)
    mask, window = mask_from_arguments(o.causal, o.window)
    if o.layout == "thd" and mask == "sliding_window_top_left" and lengths[0] is None and not lengths[2]:
        # The lengths were not read and cu_seqlens_kv is a tensor of its own: whether they match decides whether
        # the window is the one the fast kernels take, so they are compared here (once per pair, _shared_after_all).
        packing, lengths = _shared_after_all(packing, lengths, q, k, capturing)
        if not lengths[2] and not _told_apart(packing, q, k) and not _comparable(*packing[:2], capturing):
            warn_once(
                "unread-window",
                "attnselect: cu_seqlens_kv, a tensor of its own, could not be compared with cu_seqlens_q here (CUDA "
                "graph capture, torch.compile or inference tensors), so causal=True with window= stays anchored "
                "top-left, a mask FlashAttention does not serve; for self-attention pass cu_seqlens_kv=None",
            )
    facts = packing_facts(mask, window, *lengths) if o.layout == "thd" else {}
    check_scale(o.scale)
    for name, flag in (("return_lse", o.return_lse), ("return_max_logit", o.return_max_logit)):
        if not isinstance(flag, bool):
            _fail(name, repr(flag), "True or False")
    check_softcap(o.softcap)
    check_sinks(o.sinks, hq, q)
    training = torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad or (o.sinks is not None and o.sinks.requires_grad)
    )
    return dict(
        batch=batch,
        seqlen_q=sq,
        seqlen_kv=skv,
        heads_q=hq,
        heads_kv=hkv,
        head_dim_qk=q.shape[-1],
        head_dim_v=v.shape[-1],
        dtype=q.dtype,
        layout=o.layout,
        mask=mask,
        window=window,
        dropout_p=float(o.dropout_p),
        training=training,
        deterministic=torch.are_deterministic_algorithms_enabled(),
        return_lse=o.return_lse,
        softcap=o.softcap is not None,
        sinks=o.sinks is not None,
        return_max_logit=o.return_max_logit,
        context_parallel_size=context_parallel_size,
        varlen_gaps=packing is not None and packing.has_gaps,
        tokens=q.shape[0] if o.layout == "thd" else 0,
        cuda_graph_capture=capturing,
        **facts,
    ), packing


def _positive_number(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value) and value > 0
    except OverflowError:  # an int past a float's range
        return False


def check_softcap(softcap) -> None:
    if softcap is not None and not _positive_number(softcap):
        _fail("softcap", _describe(softcap), "None or a finite number > 0 (logits become softcap*tanh(logits/softcap))")


def check_sinks(sinks, heads_q: int, q) -> None:
    """Learnable sinks: one logit per query head, a floating tensor on q's device."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        _fail("sinks", type(sinks).__name__, f"None or a tensor of shape ({heads_q},), one logit per query head")
    if tuple(sinks.shape) != (heads_q,):
        _fail("sinks.shape", tuple(sinks.shape), f"({heads_q},): one logit per query head")
    if sinks.dtype not in DTYPES:
        _fail("sinks.dtype", sinks.dtype, "one of float16, bfloat16, float32, float64")
    if sinks.device != q.device:
        _fail("sinks.device", sinks.device, f"q's device {q.device}")


def check_dropout(dropout, name: str = "dropout_p") -> None:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        _fail(name, _describe(dropout), "a number in [0, 1)")


def check_scale(scale, name: str = "scale") -> None:
    if scale is not None and not _positive_number(scale):
        _fail(name, _describe(scale), "None or a finite number > 0")


def packing_facts(
    mask: str, window, lengths_q: list[int] | None, lengths_kv: list[int] | None, shared_boundaries: bool = False
) -> dict:
    """The thd facts of an :class:`AttentionProblem` (its ``varlen_*`` fields) from the sequence lengths.

    Exact when the lengths were read; without them (None) they are taken conservatively:
    lengths match only when q and kv share their boundaries, some sequence may have one key,
    and some query may see no key unless the lengths match (every mask keeps the diagonal).
    """
    if lengths_q is None:
        return {
            "varlen_seqlens_match": shared_boundaries,
            "varlen_single_key": True,
            "varlen_rows_without_keys": not shared_boundaries,
        }
    return {
        "varlen_seqlens_match": lengths_q == lengths_kv,
        "varlen_single_key": 1 in lengths_kv,
        "varlen_rows_without_keys": any(
            masks.has_rows_without_keys(mask, window, n_q, n_kv) for n_q, n_kv in set(zip(lengths_q, lengths_kv))
        ),
    }


def placement(cu_q, cu_kv, offsets_q, offsets_kv):
    """(cu_seqlens_kv, offsets_q, offsets_kv, shared) with the defaults filled in.

    cu_seqlens_kv defaults to cu_seqlens_q (shared: also when the very same tensor is passed),
    offsets to the boundaries, and keys share the queries' offsets when they share their boundaries.
    """
    same = cu_kv is None or cu_kv is cu_q
    cu_kv = cu_q if cu_kv is None else cu_kv
    offsets_q = cu_q if offsets_q is None else offsets_q
    if offsets_kv is None:
        offsets_kv = offsets_q if same else cu_kv
    return cu_kv, offsets_q, offsets_kv, same


def _packing(q, k, cu_q, cu_kv, max_q, max_kv, offsets_q, offsets_kv, capturing=False):
    """The packing of a thd call and the (q, kv) lengths with whether they share their boundaries.

    The boundaries are read on the host (one sync on CUDA) unless both max_seqlen_* are given
    and cu_seqlens live on the GPU; then the lengths are (None, None, shared) and the values
    are not checked (the caller vouches for them).
    """
    if cu_q is None:
        _fail("cu_seqlens_q", None, "an int32 tensor of sequence boundaries for layout='thd'")
    cu_kv, offsets_q, offsets_kv, same = placement(cu_q, cu_kv, offsets_q, offsets_kv)
    for name, cu in (
        ("cu_seqlens_q", cu_q),
        ("cu_seqlens_kv", cu_kv),
        ("cu_seqlens_q_padded", offsets_q),
        ("cu_seqlens_kv_padded", offsets_kv),
    ):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            _fail(name, _describe(cu), "a 1-D torch.int32 tensor [0, ..., T]")
        if cu.device != q.device:
            _fail(f"{name}.device", cu.device, f"q's device {q.device}")
        if cu.numel() != cu_q.numel():
            _fail(name, f"{cu.numel()} entries", f"as many as cu_seqlens_q ({cu_q.numel()})")
    for name, value in (("max_seqlen_q", max_q), ("max_seqlen_kv", max_kv)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            _fail(name, _describe(value), "an integer >= 0")
        if value is not None and value > INT32_MAX:
            _fail(name, _describe(value), "at most 2**31 - 1 (the kernels index in int32)")
    if same and offsets_kv is offsets_q and k.shape[0] != q.shape[0]:  # shapes alone: no host read
        _fail("k.shape[0]", k.shape[0], f"q's token count {q.shape[0]} (k shares q's cu_seqlens and offsets)")
    if _lengths_unread(cu_q, max_q, max_kv):
        # No host read: q/kv lengths are known to match only when they share their boundaries (or hold equal ones).
        if (
            not same
            and offsets_q is cu_q
            and offsets_kv is cu_kv
            and _comparable(cu_q, cu_kv, capturing)
            and _equal_boundaries(cu_q, cu_kv, max_q, max_kv, q, k)
        ):
            cu_kv, offsets_kv, same = cu_q, cu_q, True
        return Packing(cu_q, cu_kv, max_q, max_kv, offsets_q, offsets_kv), (None, None, same)
    bounds_q = cu_q.tolist()  # host sync on CUDA
    bounds_kv = bounds_q if same else cu_kv.tolist()
    if not same and bounds_kv == bounds_q and offsets_kv is cu_kv and offsets_q is cu_q:  # equal values: share
        cu_kv, offsets_kv, same = cu_q, cu_q, True
    lengths_q, lengths_kv = lengths_of(bounds_q), lengths_of(bounds_kv)
    sq = max(lengths_q, default=0) if max_q is None else max_q
    skv = max(lengths_kv, default=0) if max_kv is None else max_kv
    placed = []
    for name, bounds, cu, offsets, total, longest, max_name in (
        ("cu_seqlens_q", bounds_q, cu_q, offsets_q, q.shape[0], sq, "max_seqlen_q"),
        ("cu_seqlens_kv", bounds_kv, cu_kv, offsets_kv, k.shape[0], skv, "max_seqlen_kv"),
    ):
        starts = bounds if offsets is cu_q or offsets is cu_kv else offsets.tolist()
        if starts == bounds:  # padded offsets equal to the boundaries (as Megatron passes them): no gaps
            offsets = cu
        check_boundaries(name, bounds, None if offsets is not cu else total, longest, max_name)
        if offsets is not cu:
            check_offsets(f"{name}_padded", starts, lengths_of(bounds), total)
        placed.append(offsets)
    return Packing(cu_q, cu_kv, sq, skv, *placed), (lengths_q, lengths_kv, same)


def _lengths_unread(cu_q, max_q, max_kv) -> bool:
    """Whether a thd call's boundaries stay unread: both max_seqlen given and cu_seqlens off the CPU, where reading
    them would be a host sync (the CPU reads them anyway: it costs nothing there and checks the values)."""
    return max_q is not None and max_kv is not None and cu_q.device.type != "cpu"


# Whether a pair of boundary tensors holds equal values, once per pair (attnselect.memos).
_EQUAL = TensorMemo()


def _comparable(cu_q, cu_kv, capturing: bool) -> bool:
    """Whether two boundary tensors may be compared by value here: on a GPU (not the meta tensors of a traced call),
    not while a CUDA graph is captured (no host read then), and not for inference tensors, whose lack of a version
    counter would make the comparison run again for every layer. Elsewhere they count as different boundaries."""
    return cu_q.device.type == "cuda" and not capturing and not cu_q.is_inference() and not cu_kv.is_inference()


def _equal_boundaries(cu_q, cu_kv, max_q, max_kv, q, k) -> bool:
    """Whether ``cu_kv``, a tensor of its own, holds the values of ``cu_q`` (collators, TE and Megatron often
    pass such a copy for self-attention). Only asked where nothing else tells them apart (both max_seqlen
    given and equal, as many keys as queries): one host read (a sync on CUDA) per new pair of tensors, shared
    by every layer that gets the same pair; pass the same tensor, or cu_seqlens_kv=None, to avoid it."""
    if max_q != max_kv or k.shape[0] != q.shape[0]:
        return False  # told apart without a read
    return _EQUAL.get((cu_q, cu_kv), None, lambda: torch.equal(cu_q, cu_kv))


def _shared_after_all(packing: Packing, lengths: tuple, q, k, capturing: bool) -> tuple[Packing, tuple]:
    """(packing, lengths) for a thd call whose lengths were not read (both max_seqlen given on the GPU) and whose
    cu_seqlens_kv is a tensor of its own, where whether every sequence has as many queries as keys decides the mask:
    top-left causal with a window is the bottom-right window that FlashAttention and cuDNN take only then, else a
    top-left one that a mask must express (flex, the SDPA kernels with a mask tensor, the reference). Equal boundary
    values make it self-attention: then cu_seqlens_kv becomes cu_seqlens_q (the offsets, padded or not, stay as
    given), else nothing changes.

    TransformerEngine's test_dpa_qkv_layout_thd (tests/pytorch/attention/test_attention.py, configs layout_4_0 and
    layout_4_1: padding_causal, window_size=(4, 0), thd, pad_between_seqs True and False) makes such calls: it
    builds cu_seqlens_kv as a tensor of its own equal to cu_seqlens_q, passes both max_seqlen (2048) and always
    passes cu_seqlens_q_padded / cu_seqlens_kv_padded, tensors of their own too (equal to the boundaries without
    pad_between_seqs). _packing compares boundaries only for unpadded offsets and equal max_seqlen, where the answer
    also sharpens the facts of every call; here it is asked for these calls alone, padded offsets and unequal
    max_seqlen (bounds, not lengths) included: one host read (a sync on CUDA) per new pair of tensors, shared with
    _packing's memo, and none where it cannot be made (_comparable: CUDA graph capture, traced calls, inference
    tensors) or where the token totals tell the lengths apart (no gaps, unequal totals)."""
    cu_q, cu_kv = packing.cu_seqlens_q, packing.cu_seqlens_kv
    if _told_apart(packing, q, k) or not _comparable(cu_q, cu_kv, capturing):
        return packing, lengths
    if not _EQUAL.get((cu_q, cu_kv), None, lambda: torch.equal(cu_q, cu_kv)):
        return packing, lengths
    offsets_kv = cu_q if packing.offsets_kv is cu_kv else packing.offsets_kv  # unpadded keys stay unpadded
    return packing._replace(cu_seqlens_kv=cu_q, offsets_kv=offsets_kv), (None, None, True)


def _told_apart(packing: Packing, q, k) -> bool:
    """Whether q/kv lengths are known to differ from shapes alone: without gaps the token totals are the sums of
    the lengths. (Unequal max_seqlen are bounds, not the lengths, and with gaps the totals include the gaps.)"""
    unpadded = packing.offsets_q is packing.cu_seqlens_q and packing.offsets_kv is packing.cu_seqlens_kv
    return unpadded and k.shape[0] != q.shape[0]


def lengths_of(bounds: list[int]) -> list[int]:
    """Sequence lengths from cu_seqlens boundaries."""
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _describe(x) -> str:
    return f"tensor(dtype={x.dtype}, shape={tuple(x.shape)})" if isinstance(x, torch.Tensor) else repr(x)


def check_boundaries(name: str, bounds: list[int], total: int | None, longest: int, max_name: str) -> None:
    """Host-side checks of cu_seqlens values; ``total`` None when padded offsets place the sequences."""
    if bounds[0] != 0:
        _fail(name, bounds[:4], "a first entry of 0")
    if any(b > a for a, b in zip(bounds[1:], bounds[:-1])):
        _fail(name, bounds, "non-decreasing boundaries")
    if total is not None and bounds[-1] != total:
        _fail(name, f"last entry {bounds[-1]}", f"the token count {total}")
    worst = max(lengths_of(bounds), default=0)
    if worst > longest:
        _fail(max_name, longest, f">= the longest sequence ({worst})")


def check_offsets(name: str, offsets: list[int], lengths: list[int], total: int) -> None:
    """Padded offsets start at 0, end at the token count, and leave room for each sequence."""
    if offsets[0] != 0 or offsets[-1] != total:
        _fail(name, f"first {offsets[0]}, last {offsets[-1]}", f"0 and the token count {total}")
    for i, n in enumerate(lengths):
        if offsets[i] + n > offsets[i + 1]:
            _fail(name, f"room {offsets[i + 1] - offsets[i]} for sequence {i}", f">= its length {n}")
