"""Integrations with frameworks that run attnselect for you: Hugging Face transformers, Megatron-core, torchtitan
and Ray.
Each framework is an optional extra; this package holds what the integrations share."""

from __future__ import annotations


def optional_int(value) -> int | None:
    """A framework's maximum sequence length (an int, a 0-d tensor or None) as an int or None."""
    return int(value) if value is not None else None
