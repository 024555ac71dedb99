"""Shared mechanism of the FlashAttention package backends (flash-attn 2, 3 and 4).

Each package exposes ``flash_attn_func(q, k, v, ...)`` on (B, S, H, D) tensors, and
``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...)`` on packed
(T, H, D) tensors, with a bottom-right causal flag and a (left, right) window; they differ in the module
path, in how they spell "unbounded" and in how they return the log-sum-exp ((B, H, S) dense, (H, T) packed).
Which of them serves packed input in one call is each backend's ``Surface.packed``.
"""

from __future__ import annotations

import importlib
from typing import ClassVar

import torch

from attnselect.backends.base import Backend
from attnselect.spec import masks
from attnselect.spec.options import KernelCall, Packing


class FlashAttnPackageBackend(Backend):
    layout = "bshd"
    module: ClassVar[str]
    unbounded: ClassVar[object] = -1  # how the package spells an open window edge
    dropout_argument: ClassVar[bool] = False
    lse_argument: ClassVar[str]  # keyword that asks for the lse
    # FlashAttention-2 writes +inf as the lse of rows that see no key (csrc/flash_attn/src/softmax.h:
    # sum == 0 ? INFINITY), FA3 too where it does not split (hopper/softmax.h); ours is -inf, so theirs is mapped
    keyless_lse_posinf: ClassVar[bool] = True

    def _module(self):
        """The package's module, imported on first use."""
        return importlib.import_module(self.module)

    def run(self, q, k, v, call: KernelCall):
        return self._lse(call, self._module().flash_attn_func(q, k, v, **self._options(call, q.shape[1], k.shape[1])))

    def run_packed(self, q, k, v, call: KernelCall, packing: Packing):
        return self.packed_runner(call)(q, k, v, packing)

    def runner(self, call: KernelCall, *, repeated: bool = False, like: tuple | None = None):
        if call.mask == "sliding_window":  # its window edges depend on the sequence lengths
            return super().runner(call)
        function, options = self._module().flash_attn_func, self._options(call, 1, 1)
        return lambda q, k, v: self._lse(call, function(q, k, v, **options))

    def packed_runner(self, call: KernelCall, *, repeated: bool = False):
        function, options = self._module().flash_attn_varlen_func, self._options(call, 1, 1)

        def run(q, k, v, packing: Packing):
            result = function(
                q,
                k,
                v,
                cu_seqlens_q=packing.cu_seqlens_q,
                cu_seqlens_k=packing.cu_seqlens_kv,
                max_seqlen_q=packing.max_seqlen_q,
                max_seqlen_k=packing.max_seqlen_kv,
                **options,
            )
            return self._lse(call, result)

        return run

    def _options(self, call: KernelCall, sq: int, skv: int) -> dict:
        causal = call.mask in ("causal", "causal_bottom_right")
        window = (self.unbounded, self.unbounded)
        if call.mask == "sliding_window":
            left, right = masks.band(call.mask, call.window, sq, skv)[1:]
            window = (self.unbounded if left is None else left, self.unbounded if right is None else right)
        options = {
            "softmax_scale": call.scale,
            "causal": causal,
            "window_size": window,
            "deterministic": call.deterministic,
            "softcap": call.softcap or 0.0,  # 0 is off (every package's flash_attn_func)
            self.lse_argument: call.return_lse,
        }
        if self.dropout_argument:
            options["dropout_p"] = call.dropout_p
        return options

    def _lse(self, call: KernelCall, result):
        out, lse = (result[0], result[1]) if isinstance(result, tuple) else (result, None)
        if not call.return_lse:
            return out, None
        if lse is None:
            raise RuntimeError(f"{self.module} returned no log-sum-exp although it was requested")
        if not self.keyless_lse_posinf:  # already ours: no kernel launched
            return out, lse.float()
        return out, lse.float().masked_fill(torch.isposinf(lse), float("-inf"))
