"""``flex``: FlexAttention with a block mask, compiled with torch.compile on CUDA.

Every mask kind is one band mask_mod (:mod:`attnselect.masks`) whose bounds are tensors, so
one compiled kernel serves all masks of a given shape and head dims. Block masks are built
once per (mask, window, lengths, device) and reused. On the CPU flex runs eagerly (unfused,
correct, slow). lse is natural-log, float32, (B, Hq, Sq).
"""

from __future__ import annotations

import functools

import torch

from attnselect import masks
from attnselect.backends.base import ALL_DTYPES, Backend, KernelCall, Surface

_BIG = 1 << 30   # "unbounded" band edge


class Flex(Backend):
    name = "flex"
    summary = "FlexAttention (Triton, torch.compile): any mask as a block mask, d_qk != d_v natively"
    layout = "bhsd"
    surfaces = {
        # Source: pytorch torch/nn/attention/flex_attention.py (value is (B, Hkv, S, Ev); head dims
        # rounded up to a power of two inside the Triton template, PR #133495); no dropout argument.
        # Measured limits on the H200: results/h200_rules_grid.md.
        "cuda": Surface(dtypes=ALL_DTYPES - {torch.float64}, min_capability=(8, 0), max_head_dim=256, dropout=False),
        # Eager (unfused) on the CPU: "FlexAttention does not support backward on CPU" (torch 2.13).
        "cpu": Surface(dtypes=ALL_DTYPES, dropout=False, backward=False),
    }

    def run(self, q, k, v, call: KernelCall):
        from torch.nn.attention.flex_attention import flex_attention
        sq, skv = q.shape[-2], k.shape[-2]
        block_mask = _block_mask(call.mask, call.window, sq, skv, q.device)
        fn = _compiled_flex() if q.is_cuda else flex_attention
        out, lse = fn(q, k, v, block_mask=block_mask, scale=call.scale,
                      enable_gqa=q.shape[1] != k.shape[1], return_lse=True)
        return out, (lse.float() if call.return_lse else None)


@functools.lru_cache(maxsize=None)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention, dynamic=False)


@functools.lru_cache(maxsize=64)
def _block_mask(mask, window, sq, skv, device):
    from torch.nn.attention.flex_attention import create_block_mask
    b = masks.band(mask, window, sq, skv)
    if b is None:
        b = (0, None, None)
    offset, left, right = (torch.tensor(x if x is not None else _BIG, device=device) for x in b)

    def band_mask(batch, head, q_idx, kv_idx):
        diagonal = q_idx + offset
        return (kv_idx <= diagonal + right) & (kv_idx >= diagonal - left)

    return create_block_mask(band_mask, B=None, H=None, Q_LEN=sq, KV_LEN=skv, device=device)
