"""What one attention call carries besides q, k and v: its options as one object (:class:`CallOptions`), the
vocabulary of its arguments (layouts, masks, dtypes), the per-call kernel options (:class:`KernelCall`) and, for
packed input, its :class:`Packing`.

The lowest layer of the package: validation (:mod:`attnselect.spec.validate`), the problem and the backends build on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from attnselect.errors import InvalidInputError

LAYOUTS = ("bshd", "sbhd", "bhsd", "thd")
MASKS = ("none", "causal", "causal_bottom_right", "sliding_window", "sliding_window_top_left")
# A window anchored where causal is: bottom-right for no mask and bottom-right causal (FlashAttention's window_size),
# top-left for top-left causal (TransformerEngine's padding_causal with window_size, dot_product_attention/utils.py
# get_full_mask). The two differ only where a sequence has fewer queries than keys or more.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class CallOptions(NamedTuple):
    """:func:`attnselect.attention`'s keyword options as one frozen object, in its signature's order and with its
    defaults (tests/test_api.py keeps the two in step). attention() hands it on whole to validation, to the traced
    call under torch.compile and to context parallelism; its fallback calls attention() again with its fields."""

    layout: str = "bshd"
    causal: bool | str = False
    window: tuple[int, int] | None = None
    scale: float | None = None
    dropout_p: float = 0.0
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_kv: torch.Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    cu_seqlens_q_padded: torch.Tensor | None = None
    cu_seqlens_kv_padded: torch.Tensor | None = None
    return_lse: bool = False
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    return_max_logit: bool = False
    cp_group: object = None  # a torch.distributed ProcessGroup
    backend: str | None = None
    pad: bool | str | None = None
    disable: object = None  # backend names: a comma-separated string or an iterable


# The options that choose how a call runs, not what it computes: the rest describe its problem
# (AttentionProblem.from_tensors takes those).
CONTROLS = ("cp_group", "backend", "pad", "disable")
DESCRIBING = tuple(name for name in CallOptions._fields if name not in CONTROLS)


@dataclass(frozen=True)
class KernelCall:
    """The per-call options a kernel needs beyond q, k and v."""

    mask: str
    window: tuple[int, int] | None
    scale: float
    dropout_p: float
    return_lse: bool
    deterministic: bool = False
    softcap: float | None = None  # logits become softcap * tanh(logits / softcap)
    return_max_logit: bool = False  # also return the per-head maximum logit, float32 (Hq,)


class Packing(NamedTuple):  # a tuple: built on every packed call, cheaper than a frozen dataclass
    """How sequences are packed in thd tensors: int32 boundaries on the tensors' device.

    ``cu_seqlens_*`` hold the lengths (B + 1 prefix sums); ``offsets_*`` where each sequence
    starts in the packed tensors, equal to ``cu_seqlens_*`` unless the packing has gaps
    (Megatron's cu_seqlens_*_padded). ``max_seqlen_*`` bound every length.
    """

    cu_seqlens_q: torch.Tensor
    cu_seqlens_kv: torch.Tensor
    max_seqlen_q: int
    max_seqlen_kv: int
    offsets_q: torch.Tensor
    offsets_kv: torch.Tensor

    @property
    def has_gaps(self) -> bool:
        return self.offsets_q is not self.cu_seqlens_q or self.offsets_kv is not self.cu_seqlens_kv


INT32_MAX = 2**31 - 1  # sizes, lengths and windows: the kernels index in int32 (cu_seqlens are int32)


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).replace("torch.", "")


def dtype_names(dtypes) -> str:
    return ", ".join(sorted(dtype_name(d) for d in dtypes))


DTYPE_CHOICES = f"one of {dtype_names(DTYPES)}"


def is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require(ok: bool, name: str, seen, expected: str) -> None:
    if not ok:
        raise InvalidInputError(f"{name}: got {seen}, expected {expected}")


def mask_from_arguments(causal: bool | str, window: tuple[int, int] | None) -> tuple[str, tuple[int, int] | None]:
    """Turn the user-facing ``causal=`` / ``window=`` arguments into (mask, window).

    ``causal`` is False, True (top-left, as SDPA), "top_left" or "bottom_right". A window is anchored where the
    causal diagonal is: top-left with top-left causal (``sliding_window_top_left``), else bottom-right
    (``sliding_window``); with causal it must have right == 0 (or -1, taken as 0). Where every sequence has as many
    queries as keys the two coincide: :class:`AttentionProblem` names that mask ``sliding_window``.
    """
    kinds = {False: "none", True: "causal", "top_left": "causal", "bottom_right": "causal_bottom_right"}
    require(
        isinstance(causal, (bool, str)) and causal in kinds,
        "causal",
        repr(causal),
        "False, True, 'top_left' or 'bottom_right'",
    )
    mask = kinds[causal]
    if window is None:
        return mask, None
    require(
        isinstance(window, (tuple, list))
        and len(window) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and -1 <= x <= INT32_MAX for x in window),
        "window",
        window,
        "a (left, right) pair of integers from -1 (unbounded) to 2**31 - 1 (the kernels' int32)",
    )
    left, right = window
    if mask != "none":
        require(
            right in (0, -1),
            "window",
            window,
            f"right = 0 or -1 with causal={causal!r} (a causal window cannot look ahead)",
        )
        right = 0
    return ("sliding_window_top_left" if mask == "causal" else "sliding_window"), (left, right)


@dataclass(frozen=True)
class Candidate:
    """A way to run a call: a backend, native (``pad_to`` None) or with Q/K/V zero-padded to ``pad_to``."""

    backend: str
    pad_to: int | None = None

    @property
    def padded(self) -> bool:
        return self.pad_to is not None

    def __str__(self) -> str:
        return f"{self.backend} padded to {self.pad_to}" if self.padded else f"{self.backend} native"

    def to_dict(self) -> dict:
        return {"backend": self.backend, "pad_to": self.pad_to}


@dataclass(frozen=True)
class Verdict:
    """A candidate and why it cannot serve a call (no reasons: it can)."""

    candidate: Candidate
    reasons: tuple[str, ...]

    @property
    def supported(self) -> bool:
        return not self.reasons
