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

import math
import operator
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
        return self._forced(q, k, v, call)

    def runner(self, call: KernelCall, *, repeated: bool = False):
        """Forces the kernel only where torch's own dispatch would not reach it (forcing costs as much host time
        as a small kernel's launch). Dispatch (``torch._fused_sdp_choice``, sdp_utils.cpp select_sdp_backend)
        reads the shapes, strides and storage offsets (cuDNN's layout checks, mem-efficient's alignment),
        dtypes, options, gradients, every kernel's switch and their priority order; a ``repeated`` runner's calls
        share all but the switches and the order (attnselect.attention memoizes one per call key), so dispatch is
        asked once per switch state, and the call passes only the arguments that differ from SDPA's defaults
        (each keyword costs torch's argument parser host time)."""
        if not repeated:
            return lambda q, k, v: self._forced(q, k, v, call)
        seen = [None, None, None, None]  # the previous call's switches and order; SDPA's call; rows to zero; arguments

        def run(q, k, v):
            switches = (*map(_call, _ENABLED), _order())
            if switches != seen[0]:
                arguments = seen[3] or self._arguments(q, k, call)
                seen[:] = switches, self._dispatched(q, k, v, call, arguments), arguments[3], arguments
            if seen[1] is None:
                return self._forced(q, k, v, call, seen[3])
            out = seen[1](q, k, v)
            return (out if seen[2] is None else out.masked_fill(seen[2], 0.0)), None

        return run

    def _dispatched(self, q, k, v, call: KernelCall, arguments):
        """``sdpa(q, k, v)``: the SDPA call whose default dispatch reaches this kernel, passing only the arguments
        that differ from SDPA's defaults (each one costs host time in torch's argument parser, a keyword more);
        None where dispatch does not reach it."""
        attn_mask, is_causal, gqa, _ = arguments
        if not self._reaches_by_default(q, k, v, call, arguments):
            return None
        positional = (  # up to the last one that is not SDPA's default (attn_mask None, dropout_p 0, is_causal False)
            (attn_mask, call.dropout_p, True) if is_causal
            else (attn_mask, call.dropout_p) if call.dropout_p
            else (attn_mask,) if attn_mask is not None
            else ()
        )  # fmt: skip
        keywords = {"enable_gqa": True} if gqa else {}
        if call.scale != 1.0 / math.sqrt(q.shape[-1]):  # SDPA's default scale (sdp_utils calculate_scale)
            keywords["scale"] = call.scale
        sdpa = F.scaled_dot_product_attention
        if keywords:
            return lambda q, k, v: sdpa(q, k, v, *positional, **keywords)
        return (lambda q, k, v: sdpa(q, k, v, *positional)) if positional else sdpa

    def _arguments(self, q, k, call: KernelCall):
        """(attn_mask, is_causal, enable_gqa, rows without keys or None) of a call with these shapes."""
        sq, skv = q.shape[-2], k.shape[-2]
        attn_mask, is_causal, no_key = None, False, None
        if masks.needs_explicit_mask(call.mask, sq == skv):
            attn_mask = masks.visible(call.mask, call.window, sq, skv, q.device)
            no_key = masks.rows_without_keys(call.mask, call.window, sq, skv, q.device)
        elif call.mask != "none":
            is_causal = True
        return attn_mask, is_causal, q.shape[1] != k.shape[1], no_key

    def _forced(self, q, k, v, call: KernelCall, arguments=None):
        """The call with this backend's kernel forced (the runner calls torch's dispatch itself where it reaches
        the kernel)."""
        attn_mask, is_causal, gqa, no_key = arguments or self._arguments(q, k, call)
        if gqa and not self.native_gqa:
            k, v = expand_kv_heads(q, k, v)
            gqa = False
        with only_kernel(self.kernel):
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask, call.dropout_p, is_causal, scale=call.scale, enable_gqa=gqa
            )
        if no_key is not None:
            out = out.masked_fill(no_key, 0.0)
        return out, None

    def _reaches_by_default(self, q, k, v, call: KernelCall, arguments) -> bool:
        attn_mask, is_causal, gqa, _ = arguments
        if gqa and not self.native_gqa:  # K/V are expanded on every call: forced
            return False
        choice = torch._fused_sdp_choice(
            q, k, v, attn_mask=attn_mask, dropout_p=call.dropout_p, is_causal=is_causal, enable_gqa=gqa
        )
        return choice == self.kernel.value


# Each SDPA kernel's global switch, as torch.nn.attention.sdpa_kernel reads and sets them (its _backend_names).
_SWITCHES = tuple(
    (getattr(SDPBackend, kernel), getattr(torch._C, f"_get_{name}_sdp_enabled"),
     getattr(torch._C, f"_set_sdp_use_{name}"))
    for name, kernel in _backend_names.items()
)  # fmt: skip
_ENABLED = tuple(enabled for _, enabled, _ in _SWITCHES)
_call = getattr(operator, "call", lambda f: f())  # operator.call: Python 3.11+
_order = torch._C._get_sdp_priority_order  # the order default dispatch tries the kernels in


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
