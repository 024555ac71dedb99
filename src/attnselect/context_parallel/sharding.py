"""The load-balanced context-parallel layout: a sequence cut into 2N equal chunks, rank r holding chunks r and
2N-1-r in that order (Megatron-LM's get_batch_on_this_cp_rank and TransformerEngine's context_parallel.py use it, so
every rank gets the same share of a causal mask's work).

Dense layouts cut the sequence axis; thd cuts every packed sequence on its own, so rank r's shard packs, per
sequence, its chunk r then its chunk 2N-1-r, and its cu_seqlens are the global ones divided by N.
"""

from __future__ import annotations

import torch

from attnselect.spec.options import LAYOUTS, is_integer, require
from attnselect.spec.validate import DENSE_AXES, lengths_of


def shard(
    x: torch.Tensor,
    *,
    cp_size: int,
    rank: int,
    layout: str = "bshd",
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rank ``rank``'s shard of a full tensor: ``(local tensor, local cu_seqlens or None)``.

    ``x`` is in ``layout`` (bshd (B, S, H, D), sbhd, bhsd, or thd (T, H, D) with int32 ``cu_seqlens`` of the full
    packing); every sequence length must be a multiple of ``2 * cp_size``. The local cu_seqlens are the global ones
    divided by ``cp_size``, on the same device.
    """
    _check_group_arguments(cp_size, rank)
    chunks = 2 * cp_size
    if layout != "thd":
        axis = _sequence_axis(x, layout, cu_seqlens)
        _check_multiple("x.shape", x.shape[axis], chunks, f"sequence length (axis {axis})")
        pieces = x.chunk(chunks, dim=axis)
        return torch.cat([pieces[rank], pieces[chunks - 1 - rank]], dim=axis), None
    require(isinstance(x, torch.Tensor), "x", _seen(x), "a (T, H, D) tensor for layout='thd'")
    lengths = _thd_lengths(x, cu_seqlens, "cu_seqlens")
    for length in lengths:
        _check_multiple("cu_seqlens", length, chunks, "every sequence length")
    index = _thd_index(lengths, cp_size, [rank], x.device)[0]
    return x.index_select(0, index), torch.div(cu_seqlens, cp_size, rounding_mode="floor")


def unshard(
    shards: list[torch.Tensor] | tuple[torch.Tensor, ...],
    *,
    layout: str = "bshd",
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (the inverse of :func:`shard`).

    For thd, ``cu_seqlens`` are the global boundaries (the local ones times the number of shards).
    """
    require(
        isinstance(shards, (list, tuple)) and len(shards) >= 1 and all(isinstance(s, torch.Tensor) for s in shards),
        "shards",
        type(shards).__name__,
        "a list of tensors, one shard per rank in rank order",
    )
    cp_size, chunks = len(shards), 2 * len(shards)
    first = shards[0]
    for i, s in enumerate(shards):  # torch.cat would promote dtypes and fail late on devices; heads must agree
        require(s.dtype == first.dtype, f"shards[{i}].dtype", s.dtype, f"shards[0]'s {first.dtype}")
        require(s.device == first.device, f"shards[{i}].device", s.device, f"shards[0]'s {first.device}")
        require(s.shape[1:] == first.shape[1:] if layout == "thd" else True, f"shards[{i}].shape", tuple(s.shape),
                f"shards[0]'s heads and head dim {tuple(first.shape[1:])}")  # fmt: skip
    if layout != "thd":
        axis = _sequence_axis(shards[0], layout, cu_seqlens)
        for i, s in enumerate(shards):
            require(s.shape == shards[0].shape, f"shards[{i}].shape", tuple(s.shape), f"{tuple(shards[0].shape)}")
        _check_multiple("shards[0].shape", shards[0].shape[axis], 2, f"local sequence length (axis {axis})")
        pieces: list[torch.Tensor | None] = [None] * chunks
        for r, s in enumerate(shards):
            pieces[r], pieces[chunks - 1 - r] = s.chunk(2, dim=axis)
        return torch.cat(pieces, dim=axis)
    lengths = _thd_lengths(None, cu_seqlens, "cu_seqlens")
    for length in lengths:
        _check_multiple("cu_seqlens", length, chunks, "every sequence length")
    for i, s in enumerate(shards):
        require(s.dim() == 3 and s.shape[0] * cp_size == sum(lengths), f"shards[{i}].shape", tuple(s.shape),
                f"(T / {cp_size}, H, D) with T = {sum(lengths)} from cu_seqlens")  # fmt: skip
    full = shards[0].new_empty((sum(lengths), *shards[0].shape[1:]))
    for index, s in zip(_thd_index(lengths, cp_size, range(cp_size), full.device), shards):
        full.index_copy_(0, index, s)
    return full


def _thd_index(lengths: list[int], cp_size: int, ranks, device) -> list[torch.Tensor]:
    """Per rank, the global token indices its shard holds, in its order: a sequence's tokens in chunks r and
    2N-1-r, which in token order already come chunk r first."""
    chunks = 2 * cp_size
    sizes = torch.tensor(lengths, dtype=torch.long, device=device)
    sequence = torch.repeat_interleave(torch.arange(len(lengths), device=device), sizes)
    position = torch.arange(int(sizes.sum()), device=device) - (torch.cumsum(sizes, 0) - sizes)[sequence]
    chunk = position // (sizes // chunks).clamp(min=1)[sequence]
    return [torch.nonzero((chunk == r) | (chunk == chunks - 1 - r)).flatten() for r in ranks]


def _check_group_arguments(cp_size, rank) -> None:
    require(is_integer(cp_size) and cp_size >= 1, "cp_size", repr(cp_size), "an integer >= 1")
    require(is_integer(rank) and 0 <= rank < cp_size, "rank", repr(rank), f"an integer in [0, {cp_size})")


def _sequence_axis(x, layout: str, cu_seqlens) -> int:
    require(layout in LAYOUTS, "layout", repr(layout), f"one of {LAYOUTS}")
    require(isinstance(x, torch.Tensor) and x.dim() == 4, "x", _seen(x), f"a 4-D tensor for layout={layout!r}")
    require(cu_seqlens is None, "cu_seqlens", "a tensor", f"None for layout={layout!r} (it belongs to 'thd')")
    return DENSE_AXES[layout][1]


def _thd_lengths(x, cu_seqlens, name: str) -> list[int]:
    require(
        isinstance(cu_seqlens, torch.Tensor)
        and cu_seqlens.dtype == torch.int32
        and cu_seqlens.dim() == 1
        and not cu_seqlens.is_meta,
        name,
        _seen(cu_seqlens)
        + (" on the meta device" if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.is_meta else ""),
        "a 1-D torch.int32 tensor of sequence boundaries for layout='thd' (read on the host)",
    )
    bounds = cu_seqlens.tolist()
    require(bounds[:1] == [0] and all(b >= a for a, b in zip(bounds, bounds[1:])), name, bounds[:8],
            "non-decreasing boundaries from 0")  # fmt: skip
    if x is not None:
        require(x.dim() == 3 and x.shape[0] == bounds[-1], "x.shape", tuple(x.shape),
                f"(T, H, D) with T = {bounds[-1]}, the last entry of {name}")  # fmt: skip
    return lengths_of(bounds)


def _check_multiple(name: str, value: int, multiple: int, what: str) -> None:
    require(value % multiple == 0, name, f"{what} {value}", f"a multiple of {multiple} (2 chunks per rank)")


def _seen(x) -> str:
    return f"tensor(dtype={x.dtype}, shape={tuple(x.shape)})" if isinstance(x, torch.Tensor) else repr(x)
