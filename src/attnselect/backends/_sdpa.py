"""Shared mechanism of the four SDPA backends: F.scaled_dot_product_attention with one kernel forced.

Masks other than none / top-left causal (and bottom-right causal on square problems, where
the two coincide) are passed as a boolean ``attn_mask`` built by :mod:`attnselect.masks`.
Queries such a mask leaves with no visible key get a zero output, as in every other
backend: cuDNN turns the boolean mask into -65504 (attention.cpp,
convert_boolean_attn_mask_cudnn), which gives those rows a uniform average instead; zeroing
them also zeroes their gradient, so the backward stays exact (measured on the H200 grid).
Grouped K/V heads go through ``enable_gqa`` unless the kernel refuses it, in which case
K/V are expanded first. SDPA does not return the log-sum-exp, so these surfaces say
``lse=False`` and the reference / flex backends serve ``return_lse``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, _backend_names

from attnselect import masks
from attnselect.backends.base import Backend, expand_kv_heads
from attnselect.call import KernelCall


class SdpaBackend(Backend):
    kernel: ClassVar[SDPBackend]
    native_gqa: ClassVar[bool] = True  # False: K/V heads are expanded before the call
    layout = "bhsd"

    def run(self, q, k, v, call: KernelCall):
        sq, skv = q.shape[-2], k.shape[-2]
        attn_mask, is_causal, no_key = None, False, None
        if masks.needs_explicit_mask(call.mask, sq == skv):
            attn_mask = masks.visible(call.mask, call.window, sq, skv, q.device)
            no_key = masks.rows_without_keys(call.mask, call.window, sq, skv, q.device)
        elif call.mask != "none":
            is_causal = True
        gqa = q.shape[1] != k.shape[1]
        if gqa and not self.native_gqa:
            k, v = expand_kv_heads(q, k, v)
            gqa = False
        with only_kernel(self.kernel):
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=call.dropout_p,
                is_causal=is_causal,
                scale=call.scale,
                enable_gqa=gqa,
            )
        if no_key is not None:
            out = out.masked_fill(no_key, 0.0)
        return out, None


# Each SDPA kernel's global switch, as torch.nn.attention.sdpa_kernel reads and sets them (its _backend_names).
_SWITCHES = tuple(
    (getattr(SDPBackend, kernel), getattr(torch._C, f"_get_{name}_sdp_enabled"),
     getattr(torch._C, f"_set_sdp_use_{name}"))
    for name, kernel in _backend_names.items()
)  # fmt: skip


class only_kernel:  # noqa: N801 (a context manager, named as sdpa_kernel is)
    """``sdpa_kernel([kernel])`` for one call at a fraction of its host cost: it sets only the switches that differ
    and puts them back (sdpa_kernel reads, sets and restores every switch through a generator context, about as
    long as a small kernel's launch: benchmarks/hot_path.py)."""

    __slots__ = ("kernel", "changed")

    def __init__(self, kernel: SDPBackend):
        self.kernel = kernel

    def __enter__(self):
        self.changed = []
        for kernel, enabled, switch in _SWITCHES:
            want = kernel == self.kernel
            if enabled() != want:
                switch(want)
                self.changed.append((switch, not want))
        return self

    def __exit__(self, *exc):
        for switch, was in self.changed:
            switch(was)
        return False
