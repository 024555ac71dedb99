"""Shared mechanism of the FlashAttention package backends (flash-attn 2, 3 and 4).

Each package exposes ``flash_attn_func(q, k, v, ...)`` on (B, S, H, D) tensors with a
bottom-right causal flag and a (left, right) window; they differ in the module path, in
how they spell "unbounded" and in how they return the log-sum-exp.
"""

from __future__ import annotations

import importlib
from typing import ClassVar

import torch

from attnselect import masks
from attnselect.backends.base import Backend, KernelCall


class FlashAttnPackageBackend(Backend):
    layout = "bshd"
    module: ClassVar[str]
    unbounded: ClassVar[object] = -1     # how the package spells an open window edge
    dropout_argument: ClassVar[bool] = False
    lse_argument: ClassVar[str]          # keyword that asks for the lse

    def run(self, q, k, v, call: KernelCall):
        fn = importlib.import_module(self.module).flash_attn_func
        band = masks.band(call.mask, call.window, q.shape[1], k.shape[1])
        causal = call.mask in ("causal", "causal_bottom_right")
        window = (self.unbounded, self.unbounded)
        if call.mask == "sliding_window":
            left, right = band[1:]
            window = (self.unbounded if left is None else left, self.unbounded if right is None else right)
        kwargs = {"softmax_scale": call.scale, "causal": causal, "window_size": window,
                  "deterministic": call.deterministic, self.lse_argument: call.return_lse}
        if self.dropout_argument:
            kwargs["dropout_p"] = call.dropout_p
        result = fn(q, k, v, **kwargs)
        out, lse = (result[0], result[1]) if isinstance(result, tuple) else (result, None)
        if not call.return_lse:
            return out, None
        if lse is None:
            raise RuntimeError(f"{self.module}.flash_attn_func returned no log-sum-exp although it was requested")
        # FlashAttention writes +inf for rows that see no key (softmax.h: sum == 0 ? INFINITY); ours is -inf.
        return out, lse.float().masked_fill(torch.isposinf(lse), float("-inf"))
