"""One meaning for every mask kind, shared by all backends that build masks themselves.

Every mask of an :class:`~attnselect.AttentionProblem` is a band: key j is visible to query
i when ``i + offset - left <= j <= i + offset + right``. ``None`` bounds are unbounded.
"""

from __future__ import annotations

import torch

Band = tuple[int, int | None, int | None]  # (offset, left, right)


def band(mask: str, window: tuple[int, int] | None, seqlen_q: int, seqlen_kv: int) -> Band | None:
    """The band of a mask, or None when nothing is masked."""
    if mask == "none":
        return None
    if mask == "causal":
        return (0, None, 0)
    offset = 0 if mask == "sliding_window_top_left" else seqlen_kv - seqlen_q
    if mask == "causal_bottom_right":
        return (offset, None, 0)
    left, right = window
    return (offset, None if left < 0 else left, None if right < 0 else right)


def needs_explicit_mask(mask: str, square: bool) -> bool:
    """Whether SDPA-style kernels (is_causal = top-left) need a mask tensor for this mask.

    ``square``: as many queries as keys, where bottom-right causal equals top-left.
    """
    if mask in ("none", "causal"):
        return False
    return not (mask == "causal_bottom_right" and square)


def visible(
    mask: str, window: tuple[int, int] | None, seqlen_q: int, seqlen_kv: int, device: torch.device
) -> torch.Tensor | None:
    """Boolean (seqlen_q, seqlen_kv) tensor, True where a key is visible; None for no mask."""
    b = band(mask, window, seqlen_q, seqlen_kv)
    if b is None:
        return None
    offset, left, right = b
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_kv, device=device).unsqueeze(0)
    diagonal = i + offset
    allowed = torch.ones(seqlen_q, seqlen_kv, dtype=torch.bool, device=device)
    if right is not None:
        allowed &= j <= diagonal + right
    if left is not None:
        allowed &= j >= diagonal - left
    return allowed


def _keyless_rows(mask, window, seqlen_q: int, seqlen_kv: int) -> tuple[int, int] | None:
    """(front, back): queries i < front or i >= back see no key; None when every query sees one.

    Host arithmetic on the band: query i sees nothing when its band ends before key 0
    (i + offset + right < 0) or starts after the last key.
    """
    if seqlen_q == 0:
        return None
    b = band(mask, window, seqlen_q, seqlen_kv)
    if b is None:
        return None if seqlen_kv > 0 else (seqlen_q, seqlen_q)
    offset, left, right = b
    front = 0 if right is None else min(seqlen_q, max(0, -(offset + right)))
    back = seqlen_q if left is None else min(seqlen_q, max(0, seqlen_kv - offset + left))
    if seqlen_kv > 0 and front == 0 and back == seqlen_q:
        return None
    return (front, back) if seqlen_kv > 0 else (seqlen_q, seqlen_q)


def has_rows_without_keys(mask: str, window: tuple[int, int] | None, seqlen_q: int, seqlen_kv: int) -> bool:
    return _keyless_rows(mask, window, seqlen_q, seqlen_kv) is not None


def rows_without_keys(
    mask: str, window: tuple[int, int] | None, seqlen_q: int, seqlen_kv: int, device: torch.device
) -> torch.Tensor | None:
    """Boolean (seqlen_q, 1) tensor, True for queries that see no key; None when every query sees one."""
    rows = _keyless_rows(mask, window, seqlen_q, seqlen_kv)
    if rows is None:
        return None
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    return (i < rows[0]) | (i >= rows[1])
