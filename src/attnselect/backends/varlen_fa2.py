"""``varlen_fa2``: torch's packed FlashAttention-2, the kernel under torch.nn.attention.varlen.varlen_attn.

One call for all sequences of a thd batch (cu_seqlens), forward and backward. FA2 needs
one head dim for q, k and v, so MLA reaches it through its padded candidate.
"""

from __future__ import annotations

import torch

from attnselect.backends.base import HALF, Backend, Surface
from attnselect.backends.sdpa_flash import fa2_backward_head_dim_reasons
from attnselect.spec import masks
from attnselect.spec.options import KernelCall, Packing

# The op varlen_attn's custom op calls (torch/nn/attention/varlen.py, _varlen_attn), with its autograd formula
# (FlashAttentionBackward0, derivatives.yaml). Called directly, a call skips the custom op's Python and its extra
# rng-state tensor (an allocation and a fill kernel), together 36-44 us of host time a call on the H200 (runs
# that left results/: git show af40727:results/h200_hot_path_ae12ec1.md and
# git show 6409a18^:results/h200_hot_path_ae12ec1_2.md).
# Read when a runner is built (tests stand in for it on the CPU, where the op has no kernel).
flash_forward = torch.ops.aten._flash_attention_forward.default


class VarlenFa2(Backend):
    name = "varlen_fa2"
    summary = "torch's packed FlashAttention-2 (varlen_attn's kernel, thd): equal head dims, one call per batch"
    # Source: pytorch torch/nn/attention/varlen.py (varlen_attn over aten._flash_attention_forward,
    # window_size=(left, right) with (-1, 0) for causal, bottom-right aligned as FA2; no dropout;
    # cu_seq_q/cu_seq_k are both the boundaries and the start offsets, with no separate padded offsets,
    # so no gaps between sequences) and FA2's mha_varlen_fwd/bwd (flash_api.cpp: v of shape (total_k,
    # num_heads_k, head_size), one head dim for q, k and v; num_heads_k dividing num_heads, so grouped K/V
    # heads go to the kernel as they are). Flash arch and dtype limits as sdpa_flash (sdp_utils.cpp).
    # Unlike SDPA, which pads the head dim to a multiple of 8 before its flash kernel (attention.cpp,
    # pad_last_dim), the op hands q/k/v to the kernel as they are, and mha_varlen_fwd raises "head_size
    # must be a multiple of 8".
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

    extra_reasons_read_sizes = False  # the torch version, the head dims, the phase and the GPU

    def extra_reasons(self, p, t):
        r = []
        # The op called with scale and window as torch 2.11's varlen_attn calls it (torch 2.10's passed is_causal
        # only): verified on torch 2.11 (results/h200_gpu_tests_with_sweep.txt), not on older ones.
        if not t.at_least("torch_version", "2.11"):
            r.append(f"attnselect runs torch's packed FlashAttention-2 on torch >= 2.11, where it was verified; the "
                     f"target has {t.torch_version}")  # fmt: skip
        return r + fa2_backward_head_dim_reasons(p, t)

    def run_packed(self, q, k, v, call: KernelCall, packing: Packing):
        return self.packed_runner(call)(q, k, v, packing)

    def packed_runner(self, call: KernelCall, *, repeated: bool = False):
        """``run(q, k, v, packing)``: the op called as varlen_attn calls it, its arguments worked out once."""
        # the overload's own function, without OpOverload.__call__'s Python frame around it (torch/_ops.py)
        forward = getattr(flash_forward, "_op", flash_forward)
        left, right = _window(call)
        is_causal = (left, right) == (-1, 0)  # varlen_attn's is_causal = window_size == (-1, 0)
        unbounded = (left, right) == (-1, -1)
        # Only the keywords that differ from the op's defaults, each one a parse more: an omitted window size is -1
        # (attention.cu, _flash_attention_forward and _flash_attention_backward: value_or(-1)). A causal call keeps
        # its right edge of 0: mha_varlen_fwd clears is_causal where max_seqlen_q is 1 (flash_api.cpp), and a right
        # edge of -1 would then send grouped heads down the one-query path below.
        keywords = {"scale": call.scale}
        if left != -1:
            keywords["window_size_left"] = left
        if right != -1:
            keywords["window_size_right"] = right

        def run(q, k, v, packing: Packing):  # the op returns (out, lse, rng state, unused, debug mask)
            max_q = packing.max_seqlen_q
            # With max_seqlen_q 1, grouped heads and no window, mha_varlen_fwd (flash_api.cpp,
            # seqlenq_ngroups_swapped) folds each query's head group into one sequence, which needs exactly one
            # query per sequence. max_seqlen_q is an upper bound: 2 keeps packs with empty sequences off that path.
            if unbounded and max_q == 1 and q.shape[1] != k.shape[1] and q.shape[0] != packing.cu_seqlens_q.numel() - 1:
                max_q = 2
            result = forward(
                q, k, v, packing.cu_seqlens_q, packing.cu_seqlens_kv, max_q, packing.max_seqlen_kv, 0.0, is_causal,
                False, **keywords,
            )  # fmt: skip
            if not call.return_lse:
                return result[0], None
            # FlashAttention writes +inf for rows that see no key (softmax.h: sum == 0 ? INFINITY); ours is -inf.
            return result[0], result[1].masked_fill(torch.isposinf(result[1]), float("-inf"))

        return run


def _window(call: KernelCall) -> tuple[int, int]:
    """FA2's (left, right) window, -1 unbounded, bottom-right aligned; (-1, 0) is causal."""
    band = masks.band(call.mask, call.window, 1, 1)
    if band is None:
        return (-1, -1)
    _, left, right = band
    return (-1 if left is None else left, -1 if right is None else right)
