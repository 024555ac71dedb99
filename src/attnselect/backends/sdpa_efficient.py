"""``sdpa_efficient``: PyTorch SDPA with the memory-efficient (xFormers/CUTLASS) kernel forced."""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend

from attnselect.backends._sdpa import SdpaBackend, aten_overload, kernel_op
from attnselect.backends.base import Surface
from attnselect.spec.options import dtype_name


class SdpaEfficient(SdpaBackend):
    name = "sdpa_efficient"
    summary = "PyTorch SDPA, EFFICIENT_ATTENTION kernel forced: takes d_qk != d_v, any length"
    kernel = SDPBackend.EFFICIENT_ATTENTION
    aten_op = kernel_op("_scaled_dot_product_efficient_attention")
    bshd_op = aten_overload("_efficient_attention_forward")
    # torch 2.11 refused enable_gqa for this kernel on the H200 (docs/sources/h200-measurements.md).
    native_gqa = False
    # Source: pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, can_use_mem_efficient_attention:
    # sm50..sm121, fp16/bf16/fp32 (bf16 from sm80), q and k share a head dim, v may differ, masks allowed.
    # Its backward is deterministic under torch.use_deterministic_algorithms (attention_backward.cu forces
    # num_splits_key = 1).
    surfaces = {
        "cuda": Surface(
            dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
            min_capability=(5, 0),
            max_capability=(12, 1),
            lse=False,
        )
    }

    extra_reasons_read_sizes = False  # the head dims and the dtype

    def extra_reasons(self, p, t):
        # check_head_dim_size_mem_efficient: head dims divisible by the GEMM alignment,
        # 8 for fp16/bf16, 4 for fp32 on sm80+.
        align = 4 if p.dtype == torch.float32 else 8
        if p.head_dim_qk % align or p.head_dim_v % align:
            return [
                f"head dims must be multiples of {align} for {dtype_name(p.dtype)}, got {p.head_dim_qk}/{p.head_dim_v}"
            ]
        return []

    def _bshd_arguments(self, call, like, is_causal, lse):
        # as attention.cu's _scaled_dot_product_efficient_attention_cuda calls it: dense (no cu_seqlens, its
        # max_seqlen the tensors'), sdp::CustomMaskType CausalFromTopLeft (1) or NoCustomMask (0)
        return None, None, None, None, None, call.dropout_p, int(is_causal), lse
