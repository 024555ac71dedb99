"""``varlen_fa2``: torch.nn.attention.varlen.varlen_attn, PyTorch's packed FlashAttention-2.

One call for all sequences of a thd batch (cu_seqlens), forward and backward. FA2 needs
one head dim for q, k and v, so MLA reaches it through its padded candidate.
"""

from __future__ import annotations

import functools
import inspect

import torch

from attnselect import masks
from attnselect.backends.base import HALF, Backend, Surface, expand_kv_heads
from attnselect.backends.sdpa_flash import fa2_backward_head_dim_reasons
from attnselect.call import KernelCall, Packing


class VarlenFa2(Backend):
    name = "varlen_fa2"
    summary = "torch varlen_attn (FlashAttention-2, packed thd): equal head dims, one call per batch"
    # Source: pytorch torch/nn/attention/varlen.py (varlen_attn over aten._flash_attention_forward:
    # "v must have shape (total_k, num_heads_k, head_size_og)", window_size=(left, right) with
    # (-1, 0) for causal, bottom-right aligned as FA2; no dropout argument; lse through
    # return_aux=AuxRequest(lse=True); cu_seq_q/cu_seq_k are both the boundaries and the start offsets,
    # with no separate padded offsets, so no gaps between sequences). Flash arch and dtype limits as
    # sdpa_flash (sdp_utils.cpp). Unlike SDPA, which pads the head dim to a multiple of 8 before its flash
    # kernel (attention.cpp, pad_last_dim), varlen_attn hands q/k/v to the kernel as they are, and FA2's
    # mha_varlen_fwd (flash_api.cpp) raises "head_size must be a multiple of 8".
    surfaces = {
        "cuda": Surface(
            dtypes=HALF,
            min_capability=(8, 0),
            max_capability=(12, 1),
            max_head_dim=256,
            head_dim_multiple=8,
            equal_head_dims=True,
            dropout=False,
            deterministic_backward=False,
            causal_is_bottom_right=True,
            dense=False,
            packed=True,
        )
    }

    def extra_reasons(self, p, t):
        r = []
        # torch 2.10's varlen_attn took only is_causal (no scale, no window_size); 2.11 has both.
        if not t.at_least("torch_version", "2.11"):
            r.append(f"varlen_attn with scale and window_size needs torch >= 2.11, the target has {t.torch_version}")
        return r + fa2_backward_head_dim_reasons(p, t)

    def run_packed(self, q, k, v, call: KernelCall, packing: Packing):
        return self.packed_runner(call)(q, k, v, packing)

    def packed_runner(self, call: KernelCall, *, repeated: bool = False):
        """``run(q, k, v, packing)`` with varlen_attn's keyword arguments worked out once for ``call``."""
        from torch.nn.attention import varlen

        accepts = _accepted_keywords()
        if not {"scale", "window_size"} <= accepts:
            raise RuntimeError(
                "this torch's varlen_attn takes no scale/window_size (torch < 2.11); "
                "the varlen_fa2 rules should have refused it"
            )
        kwargs = {"scale": call.scale, "window_size": _window(call)}
        if call.return_lse:
            kwargs["return_aux"] = varlen.AuxRequest(lse=True)
        grouped = {**kwargs, "enable_gqa": True} if "enable_gqa" in accepts else None
        attend = varlen.varlen_attn

        def run(q, k, v, packing: Packing):
            options = kwargs
            if q.shape[1] != k.shape[1]:
                if grouped is not None:
                    options = grouped
                else:
                    k, v = expand_kv_heads(q, k, v)
            result = attend(
                q, k, v, packing.cu_seqlens_q, packing.cu_seqlens_kv, packing.max_seqlen_q, packing.max_seqlen_kv,
                **options,
            )  # fmt: skip
            if not call.return_lse:
                return result, None
            out, lse = result
            lse = lse.float()
            # FlashAttention writes +inf for rows that see no key (softmax.h: sum == 0 ? INFINITY); ours is -inf.
            return out, lse.masked_fill(torch.isposinf(lse), float("-inf"))

        return run


def _window(call: KernelCall) -> tuple[int, int]:
    """FA2's (left, right) window, -1 unbounded, bottom-right aligned; (-1, 0) is causal."""
    band = masks.band(call.mask, call.window, 1, 1)
    if band is None:
        return (-1, -1)
    _, left, right = band
    return (-1 if left is None else left, -1 if right is None else right)


@functools.cache
def _accepted_keywords() -> frozenset:
    from torch.nn.attention import varlen

    return frozenset(inspect.signature(varlen.varlen_attn).parameters)
