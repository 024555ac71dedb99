"""``sdpa_cudnn``: PyTorch SDPA with the CUDNN_ATTENTION kernel forced."""

from __future__ import annotations

from torch.nn.attention import SDPBackend

from attnselect.backends._sdpa import SdpaBackend, kernel_op
from attnselect.backends.base import HALF, Surface
from attnselect.backends.shape_cache import ShapeCache
from attnselect.spec.target import version_tuple

# cuDNN backward head-dim pairs above 128 on sm10x: cudnn-frontend
# include/cudnn_frontend/node/scaled_dot_product_flash_attention.h and pytorch sdp_utils.cpp
# check_cudnn_d256_bprop_head_dim: (<=128, <=128), (192, 128), (256, 256).
BLACKWELL_BACKWARD_PAIRS = ((192, 128), (256, 256))


class SdpaCudnn(SdpaBackend):
    name = "sdpa_cudnn"
    summary = "PyTorch SDPA, CUDNN_ATTENTION kernel forced: cuDNN fused attention, 192/128 natively"
    kernel = SDPBackend.CUDNN_ATTENTION
    aten_op = kernel_op("_scaled_dot_product_cudnn_attention")
    # Source: pytorch aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, can_use_cudnn_attention:
    # sm80..sm121, fp16/bf16, masks allowed, GQA allowed, refused under deterministic algorithms
    # (check_cudnn_deterministic), head dims multiples of 8 (check_cudnn_tensor_shapes).
    surfaces = {
        "cuda": Surface(
            dtypes=HALF,
            min_capability=(8, 0),
            max_capability=(12, 1),
            head_dim_multiple=8,
            lse=False,
            deterministic_backward=False,
        )
    }

    # PyTorch caches one cuDNN graph per MHAParams (aten/src/ATen/native/cudnn/MHA.cpp: batch, heads, s_q,
    # s_kv, head dims, strides, dropout, causal); packed input runs sequence by sequence, so every new
    # sequence length of a loop that packs anew builds a graph.
    shape_cache = ShapeCache(
        builds="a cuDNN graph",
        keyed_on="batch, heads, both sequence lengths, head dims, "
        "strides, dropout and causal (packed input runs per sequence: every new length)",
        source="pytorch aten/src/ATen/native/cudnn/MHA.cpp (MHAParams)",
        rebuilds_per_packing=True,
    )

    def extra_reasons(self, p, t):
        r = []
        if p.deterministic:
            r.append("is refused by PyTorch while deterministic algorithms are on (deterministic=True)")
        r += _head_dim_reasons(p, t)
        if p.dropout_p:
            # check_cudnn_dropout, and the dropout gate of can_use_cudnn_attention (cuDNN 9.11-9.13).
            if abs(p.dropout_p * 16 - round(p.dropout_p * 16)) > 1e-9:
                r.append(f"dropout_p must be a multiple of 1/16, got {p.dropout_p}")
            if t.at_least("cudnn_version", "9.11.1") and not t.at_least("cudnn_version", "9.14.0"):
                r.append(f"PyTorch disables cuDNN dropout with cuDNN {t.cudnn_version} (9.11-9.13)")
            if p.seqlen_q == 1:
                r.append("dropout with seqlen_q == 1 is refused (check_cudnn_tensor_shapes)")
        if p.training and p.may_have_rows_without_keys:
            # Measured on the H200 (torch 2.11, cuDNN 9.19): bottom-right causal with Sq=200 > Skv=64 gave
            # NaN dq in the rows that see no key (Sq=256, Skv=128 did not), so refuse the whole class.
            r.append(
                "its backward can give NaN gradients to queries that see no key, as this mask and these lengths "
                "may leave (H200)"
            )
        if p.single_key:
            r.append("a key sequence of length 1 is refused (check_cudnn_tensor_shapes)")
        if max(p.batch, p.heads_q) > 65535:
            r.append("batch and heads must be <= 65535")
        return r


def _head_dim_reasons(p, t) -> list[str]:
    dqk, dv = p.head_dim_qk, p.head_dim_v
    if max(dqk, dv) <= 128:
        return []
    cc = t.capability
    hopper, blackwell = cc == (9, 0), cc[0] == 10
    pair = f"{dqk}/{dv}"
    if hopper and version_tuple(t.torch_version) < (2, 12):
        # Measured: torch 2.11 + cuDNN 9.19 on an H200 runs cuDNN up to 256, fwd and bwd
        # (results/h200_rules_grid.md).
        if max(dqk, dv) <= 256:
            return []
        return [f"head dims up to 256 on sm90, got {pair}"]
    if hopper or blackwell:
        # Newer torch: sdp_utils.cpp check_cudnn_tensor_shapes (stored @001f694a, not measured by us).
        r = []
        wide = t.at_least("cudnn_version", "9.22.1") and max(dqk, dv) <= 256
        mla = (dqk, dv) == (192, 128) and t.at_least("cudnn_version", "9.11.0")
        if not (wide or mla):
            r.append(
                f"head dims {pair} on {t.arch} need cuDNN > 9.22 (only 192/128 is served from 9.11); the target "
                f"has cuDNN {t.cudnn_version}"
            )
        if blackwell and p.training and (dqk, dv) not in BLACKWELL_BACKWARD_PAIRS:
            r.append(
                f"cuDNN has no backward kernel for head dims {pair} on {t.arch} "
                "(above 128 only 192/128 and 256/256), so it cannot train"
            )
        return r
    return [f"head dims above 128 are not served on {t.arch}, got {pair}"]
