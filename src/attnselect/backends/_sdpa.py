"""Shared mechanism of the four SDPA backends: F.scaled_dot_product_attention with one kernel forced.

Repeated calls (attnselect.attention's memoized ones) avoid what forcing costs: the cuDNN and mem-efficient
kernels' aten ops called directly, as SDPA's dispatch calls them (outside autocast and TorchFunctionModes), or the
dispatch itself where it reaches the kernel (:meth:`SdpaBackend.runner`); on (batch, seq, heads, dim) tensors, the
mem-efficient and flash kernels' own ops, without the transposes SDPA's ops make around them
(:meth:`SdpaBackend.bshd_runner`).

Masks other than none / top-left causal (and bottom-right causal on square problems, where
the two coincide) are passed as a boolean ``attn_mask`` built by :mod:`attnselect.spec.masks`.
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
import warnings
from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, _backend_names

from attnselect.backends.base import Backend, expand_kv_heads
from attnselect.spec import masks
from attnselect.spec.options import KernelCall


class SdpaBackend(Backend):
    kernel: ClassVar[SDPBackend]
    native_gqa: ClassVar[bool] = True  # False: K/V heads are expanded before the call
    # The op SDPA's dispatch calls once it has chosen this kernel, where it takes (q, k, v, attn_bias,
    # compute_log_sumexp, dropout_p, is_causal, ..., *, scale) (aten native_functions.yaml); None: no such op.
    aten_op: ClassVar[Callable | None] = None
    # The kernel's own op, on (batch, seq, heads, dim) tensors, that SDPA's op calls between transposes: see
    # :meth:`bshd_runner`; None: no such op.
    bshd_op: ClassVar[Callable | None] = None
    bshd_op_devices: ClassVar[frozenset] = frozenset({"cuda"})  # the ops are the CUDA kernels' (attention.cu)
    layout = "bhsd"

    def run(self, q, k, v, call: KernelCall):
        return self._forced(q, k, v, call)

    def runner(self, call: KernelCall, *, repeated: bool = False, like: tuple | None = None):
        """Repeated calls skip what a single call pays to force the kernel (``sdpa_kernel``'s switches cost as
        much host time as a small kernel's launch):

        - with ``like`` and an ``aten_op``, and no mask tensor, grouped heads, autocast, TorchFunctionMode or tensor
          subclass, the op SDPA's dispatch would call, called directly once torch has confirmed that the kernel
          serves these inputs (dispatch's checks and its choice cost host time; the switches no longer matter, as
          for a forced call);
        - else torch's own dispatch where it reaches the kernel, asked once per state of the switches and their
          priority order (``torch._fused_sdp_choice``, sdp_utils.cpp select_sdp_backend, reads the shapes,
          strides and storage offsets, dtypes, options, gradients, switches and order; repeated calls share all
          but the last two), forced where it does not.

        Either call passes only the arguments that differ from the defaults: each one costs host time in torch's
        argument parser, a keyword more."""
        if not repeated:
            return lambda q, k, v: self._forced(q, k, v, call)
        arguments = self._arguments(*like[:2], call) if like is not None else None
        if like is not None:
            direct = self._direct(call, like, arguments)
            if direct is not None:
                return direct
        seen = [None, None, arguments]  # the previous call's switches and order; SDPA's call under them; _arguments
        if like is not None:  # asked now, where the calls' tensors are known: a call under a functorch transform
            # (vmap) could not ask torch's dispatch (_fused_sdp_choice has no batching rule)
            seen[:2] = (*map(_call, _ENABLED), _order()), self._dispatched(*like, call, arguments)

        def run(q, k, v):
            switches = (*map(_call, _ENABLED), _order())
            if switches != seen[0]:
                arguments = seen[2] or self._arguments(q, k, call)
                seen[:] = switches, self._dispatched(q, k, v, call, arguments), arguments
            out = seen[1](q, k, v)
            return (out if seen[2][3] is None else out.masked_fill(seen[2][3], 0.0)), None

        return run

    def bshd_runner(self, call: KernelCall, like: tuple):
        """``run(q, k, v)`` on (batch, seq, heads, dim) tensors through the kernel's own op (:attr:`bshd_op`),
        which SDPA's op reaches by transposing its inputs to that layout and its output back (attention.cu,
        _scaled_dot_product_efficient_attention_cuda and _scaled_dot_product_flash_attention_cuda): a bshd call
        then costs no transpose, forward or backward. None where there is no such op or it does not apply
        (:meth:`_suits_op`)."""
        if self.bshd_op is None or like[0].device.type not in self.bshd_op_devices:
            return None
        views = tuple(t.transpose(1, 2) for t in like)
        arguments = self._arguments(*views[:2], call)
        if not self._suits_op(views, call, arguments, grouped=self.native_gqa):
            return None
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in like)  # attention.cpp should_compute_logsumexp
        positional = self._bshd_arguments(call, like, arguments[1], lse)
        return None if positional is None else _first_output(self.bshd_op, positional, _scale_keyword(like[0], call))

    def _bshd_arguments(self, call: KernelCall, like: tuple, is_causal: bool, lse: bool) -> tuple | None:
        """:attr:`bshd_op`'s arguments after (q, k, v), as SDPA's op passes them for tensors like ``like``, or None
        where it cannot be called in its place (here: a kernel that names an op says how it calls it)."""
        return None

    def _suits_op(self, like, call: KernelCall, arguments, *, grouped: bool = False) -> bool:
        """Whether an op SDPA's dispatch calls may be called in its place for calls like ``like`` (bhsd): no mask
        tensor, no grouped heads unless the op takes them, nothing that acts on SDPA's call and not on the op's,
        and torch's dispatch taking the kernel for them."""
        attn_mask, _, gqa, _ = arguments
        return not (
            attn_mask is not None
            or (gqa and not grouped)
            # autocast (SDPA is on its lower-precision list), a TorchFunctionMode or a subclass's
            # __torch_function__ (which may intercept SDPA)
            or torch._C._is_any_autocast_enabled()
            or torch._C._is_torch_function_mode_enabled()
            or any(type(t) is not torch.Tensor for t in like)
            or not self._serves(*like, call, arguments)
        )

    def _direct(self, call: KernelCall, like, arguments):
        """``run(q, k, v)`` calling ``aten_op`` with the arguments SDPA would pass it (attention.cpp,
        scaled_dot_product_attention), or None where it does not apply."""
        q = like[0]
        is_causal = arguments[1]
        if self.aten_op is None or not self._suits_op(like, call, arguments):
            return None
        op = self.aten_op
        lse = torch.is_grad_enabled() and any(t.requires_grad for t in like)  # attention.cpp should_compute_logsumexp
        positional = (  # up to the last one that is not a default (dropout_p 0, is_causal False)
            (None, lse, call.dropout_p, True) if is_causal
            else (None, lse, call.dropout_p) if call.dropout_p
            else (None, lse)
        )  # fmt: skip
        keywords = _scale_keyword(q, call)
        if not keywords and len(positional) == 2:  # the common case, without unpacking (each * costs host time)
            return lambda q, k, v: (op(q, k, v, None, lse)[0], None)
        return _first_output(op, positional, keywords)

    def _serves(self, q, k, v, call: KernelCall, arguments) -> bool:
        """Whether torch's dispatch, with only this kernel enabled, takes these inputs (its checks, its warnings
        silenced: a refusal falls back to the dispatching runner)."""
        with only_kernel(self.kernel), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return _dispatch_choice(q, k, v, call, arguments) == self.kernel.value
            except RuntimeError:  # "No available kernel"
                return False

    def _dispatched(self, q, k, v, call: KernelCall, arguments):
        """``sdpa(q, k, v) -> out``: the SDPA call whose default dispatch reaches this kernel, passing only the
        arguments that differ from SDPA's defaults; the forced call where dispatch does not reach it."""
        attn_mask, is_causal, gqa, _ = arguments
        if not self._reaches_by_default(q, k, v, call, arguments):
            return lambda q, k, v: self._forced_out(q, k, v, call, arguments)
        positional = (  # up to the last one that is not SDPA's default (attn_mask None, dropout_p 0, is_causal False)
            (attn_mask, call.dropout_p, True) if is_causal
            else (attn_mask, call.dropout_p) if call.dropout_p
            else (attn_mask,) if attn_mask is not None
            else ()
        )  # fmt: skip
        keywords = {"enable_gqa": True} if gqa else {}
        keywords.update(_scale_keyword(q, call))
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

    def _forced(self, q, k, v, call: KernelCall):
        """The call with this backend's kernel forced: (out, None)."""
        arguments = self._arguments(q, k, call)
        out = self._forced_out(q, k, v, call, arguments)
        return (out if arguments[3] is None else out.masked_fill(arguments[3], 0.0)), None

    def _forced_out(self, q, k, v, call: KernelCall, arguments):
        attn_mask, is_causal, gqa, _ = arguments
        if gqa and not self.native_gqa:
            k, v = expand_kv_heads(q, k, v)
            gqa = False
        with only_kernel(self.kernel):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask, call.dropout_p, is_causal, scale=call.scale, enable_gqa=gqa
            )

    def _reaches_by_default(self, q, k, v, call: KernelCall, arguments) -> bool:
        if arguments[2] and not self.native_gqa:  # K/V are expanded on every call: forced
            return False
        return _dispatch_choice(q, k, v, call, arguments) == self.kernel.value


# Each SDPA kernel's global switch, as torch.nn.attention.sdpa_kernel reads and sets them (its _backend_names).
_SWITCHES = tuple(
    (getattr(SDPBackend, kernel), getattr(torch._C, f"_get_{name}_sdp_enabled"),
     getattr(torch._C, f"_set_sdp_use_{name}"))
    for name, kernel in _backend_names.items()
)  # fmt: skip
_ENABLED = tuple(enabled for _, enabled, _ in _SWITCHES)


def _dispatch_choice(q, k, v, call: KernelCall, arguments) -> int:
    """The kernel torch's dispatch picks for this call under the current switches (sdp_utils.cpp select_sdp_backend)."""
    attn_mask, is_causal, gqa, _ = arguments
    return torch._fused_sdp_choice(
        q, k, v, attn_mask=attn_mask, dropout_p=call.dropout_p, is_causal=is_causal, enable_gqa=gqa
    )


def _first_output(op, positional: tuple, keywords: dict):
    """``run(q, k, v) -> (out, None)``: ``op(q, k, v, *positional, **keywords)``'s first output (its other outputs,
    the log-sum-exp and the RNG state, are autograd's)."""
    if keywords:
        return lambda q, k, v: (op(q, k, v, *positional, **keywords)[0], None)
    return lambda q, k, v: (op(q, k, v, *positional)[0], None)


def _scale_keyword(q, call: KernelCall) -> dict:
    """``{"scale": call.scale}``, or nothing where it is SDPA's default (sdp_utils calculate_scale: 1/sqrt(d_qk))."""
    return {} if call.scale == 1.0 / math.sqrt(q.shape[-1]) else {"scale": call.scale}


_call = getattr(operator, "call", lambda f: f())  # operator.call: Python 3.11+
# The order default dispatch tries the kernels in; a torch without it cannot change the order.
_order = getattr(torch._C, "_get_sdp_priority_order", lambda: None)


def aten_overload(name: str):
    """``torch.ops.aten.<name>.default``, or None where this torch has no such op."""
    return getattr(getattr(torch.ops.aten, name, None), "default", None)


def kernel_op(name: str):
    """``torch.<name>`` where its schema starts (query, key, value, attn_bias, compute_log_sumexp, dropout_p,
    is_causal) and takes a keyword ``scale``, as :attr:`SdpaBackend.aten_op` is called; else None (the runner
    then calls SDPA)."""
    schema = getattr(getattr(torch.ops.aten, name, None), "default", None)
    names = [a.name for a in schema._schema.arguments] if schema is not None else []
    expected = ["query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal"]
    return getattr(torch, name, None) if names[:7] == expected and "scale" in names else None


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
