"""``sdpa_flash``: PyTorch SDPA with the FLASH_ATTENTION kernel forced (bundled FlashAttention-2 on CUDA)."""

from __future__ import annotations

from torch.nn.attention import SDPBackend

from attnselect.backends._sdpa import SdpaBackend, aten_overload
from attnselect.backends.base import ALL_DTYPES, HALF, Surface


class SdpaFlash(SdpaBackend):
    name = "sdpa_flash"
    summary = "PyTorch SDPA, FLASH_ATTENTION kernel forced: FlashAttention-2 on CUDA, equal head dims only"
    kernel = SDPBackend.FLASH_ATTENTION
    bshd_op = aten_overload("_flash_attention_forward")
    surfaces = {
        # Source: pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, can_use_flash_attention:
        # sm80..sm121, fp16/bf16, q/k/v share one head dim <= 256 (attention.cpp pads it to a multiple of 8),
        # no attn_mask (check_for_attn_mask), is_causal only when Sq == Skv. Its backward runs with
        # deterministic=true under torch.use_deterministic_algorithms (attention_backward.cu).
        "cuda": Surface(
            dtypes=HALF,
            min_capability=(8, 0),
            max_capability=(12, 1),
            max_head_dim=256,
            equal_head_dims=True,
            masks=frozenset({"none", "causal", "causal_bottom_right"}),
            lse=False,
        ),
        # Source: pytorch aten/src/ATen/native/transformers/sdp_utils_cpp.cpp, use_flash_attention_cpp:
        # any float dtype, equal head dims, masks allowed, no dropout.
        "cpu": Surface(dtypes=ALL_DTYPES, equal_head_dims=True, dropout=False, lse=False),
    }

    def extra_reasons(self, p, t):
        if not t.is_cuda:
            return []
        r = []
        if p.mask == "causal" and not p.square:
            r.append("top-left causal needs as many queries as keys on CUDA (check_flash_causal_non_square_seqlens)")
        if p.mask == "causal_bottom_right" and p.needs_mask_tensor:
            r.append(
                "bottom-right causal with fewer or more queries than keys needs a mask tensor, "
                "which this kernel refuses"
            )
        return r + fa2_backward_head_dim_reasons(p, t)

    def _bshd_arguments(self, call, like, is_causal, lse):
        # as attention.cu's _scaled_dot_product_flash_attention_cuda calls it: dense, the tensors' lengths, no debug
        # mask; head dims SDPA pads to a multiple of 8 first (attention.cpp pad_last_dim) are left to SDPA
        q, k, v = like
        if q.shape[-1] % 8 or v.shape[-1] % 8:
            return None
        return None, None, q.shape[1], k.shape[1], call.dropout_p, is_causal, False


def fa2_backward_head_dim_reasons(p, t) -> list[str]:
    """sdp_utils.cpp check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120."""
    d = max(p.head_dim_qk, p.head_dim_v)
    if not (p.training and t.is_cuda and (t.capability in ((8, 6), (8, 7), (8, 9)) or t.capability >= (12, 0))):
        return []
    if 192 < d <= 224 or (d > 224 and p.dropout_p):
        return [
            f"on {t.arch} FlashAttention-2's backward does not serve head dim {d}{' with dropout' if d > 224 else ''}"
        ]
    return []
