"""Integrations with frameworks that run attnselect for you: Hugging Face transformers, Megatron-core, torchtitan
and Ray.
Each framework is an optional extra; this package holds what the integrations share."""

from __future__ import annotations

import numbers

import torch

from attnselect.errors import InvalidInputError
from attnselect.spec.options import INT32_MAX


def optional_int(value, name: str) -> int | None:
    """A framework's maximum sequence length ``name`` (an int, a 0-d integer tensor or None) as an int or None."""
    if value is None:
        return None
    if (
        isinstance(value, torch.Tensor)
        and value.numel() == 1
        and not value.is_floating_point()
        and value.dtype != torch.bool
    ):
        return int(value)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):  # numpy's integers too
        return int(value)
    shown = (
        f"a tensor of shape {tuple(value.shape)} and {value.dtype}" if isinstance(value, torch.Tensor) else repr(value)
    )
    raise InvalidInputError(f"{name}: got {shown}, expected None, an int or a one-element integer tensor")


def four_dim_tensors(tensors: dict, axes: str) -> None:
    """Refuse, by name, any of a framework's ``tensors`` ({name: value}) that is not a 4-D tensor of ``axes`` (e.g.
    "batch, heads, sequence, head dim"), where the integration reads their shapes before attnselect.attention would."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shown = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InvalidInputError(f"{name}: got {shown}, expected a 4-D tensor ({axes})")


def integer_boundaries(value, name: str) -> torch.Tensor:
    """A framework's sequence boundaries ``name`` as attnselect takes them: an integer tensor, as int32 (a float
    or bool tensor, or anything else, is refused by name rather than cast)."""
    if (
        not isinstance(value, torch.Tensor)
        or value.is_floating_point()
        or value.is_complex()
        or value.dtype == torch.bool
    ):
        shown = f"a {value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
        raise InvalidInputError(f"{name}: got {shown}, expected an integer tensor of sequence boundaries")
    # int32 holds every boundary a kernel indexes; a wider tensor's values are checked where reading them costs no
    # device sync (on the CPU), so a cast cannot wrap one silently
    if value.dtype != torch.int32 and value.is_cpu and value.numel():
        low, high = value.min().item(), value.max().item()
        if low < 0 or high > INT32_MAX:
            raise InvalidInputError(
                f"{name}: got boundaries from {low} to {high}, expected integers from 0 to 2**31 - 1 (int32)"
            )
    return value.int()
