"""``cudnn_frontend``: the cuDNN frontend's PyTorch op (package nvidia-cudnn-frontend, ``cudnn.sdpa_torch``).

Dense (B, H, S, D) and packed thd (T, H, D) + cu_seqlens in one call, forward and backward
(its ``register_autograd``), top-left and bottom-right causal, (left, right) windows, GQA,
lse. d_qk != d_v natively, so MLA 192/128 runs unpadded, packed sequences included.
"""

from __future__ import annotations

import torch

from attnselect.backends.base import HALF, Backend, Surface
from attnselect.backends.shape_cache import PackingBuckets, Rounding, ShapeCache
from attnselect.spec import masks
from attnselect.spec.options import MASKS, KernelCall, Packing
from attnselect.spec.target import Package


class CudnnFrontend(Backend):
    name = "cudnn_frontend"
    summary = "cuDNN frontend torch op: dense and packed thd (cu_seqlens), 192/128 natively, fwd+bwd"
    layout = "bhsd"
    package = Package("nvidia-cudnn-frontend", "cudnn")
    # Source: cudnn-frontend python/cudnn/sdpa/fwd/torch_op.py (1.32: torch.ops.cudnn.sdpa_fwd/sdpa_bwd;
    # fp16/bf16 only, no dropout argument, dense BHSD or THD with cu_seqlens and max_seqlen, no separate
    # ragged offsets, so no gaps between sequences); head dims multiples of 8
    # (include/cudnn_frontend/node/sdpa_support_surface.h).
    # CUDA graph capture not yet verified (the op builds and caches cuDNN graphs in Python on first calls).
    surfaces = {
        "cuda": Surface(
            dtypes=HALF,
            min_capability=(8, 0),
            head_dim_multiple=8,
            max_head_dim=576,
            # its band is anchored bottom-right here (_mask_arguments); a top-left anchored one is unmeasured
            masks=frozenset(MASKS) - {"sliding_window_top_left"},
            dropout=False,
            packed=True,
            cuda_graphs=False,
        )
    }
    # Above 256: sdpa_support_surface.h sets no fp16/bf16 forward cap on Hopper from cuDNN 9.10 (the
    # backend's plans decide) and the backward caps sm90 at 256 (scaled_dot_product_flash_attention.h).
    # The H200 grid (results/h200_rules_grid.md, cuDNN 9.19) ran and matched absorbed MLA 576/512 and
    # its padded 576/576 forward; other dims above 256 are unmeasured, so refused.
    wide_forward = frozenset({(576, 512), (576, 576)})
    # Source: cudnn-frontend 1.32 python/cudnn/sdpa/fwd/torch_op.py, _graph_cache (a FIFO of 128 graphs): the
    # forward's key holds B (the sequence count of a packed call), the head counts, S_q and S_kv (max_seqlen),
    # the head dims, the strides, the scale and the mask flags; the backward's also the token totals rounded
    # to 64. A new key cost 110-130 ms of graph build on the H200 (docs/sources/h200-measurements-2026-12.md),
    # so a loop whose packing changes every step built a graph every step. Buckets (results/h200_packing_buckets.md,
    # MLA 16 heads, 32k tokens a step): max_seqlen rounded to a power of two costs nothing measurable (6.50 against
    # 6.78 ms for a long-tailed packing), twice that 5-15% and the token total up to 2.5x on short documents;
    # sequence counts rounded to a power of two (at least 16) cost up to 8% at twice the documents. Of eight
    # schemes, this one had the least expected step over 2000 steps (steady step plus 122 ms a build): 8 graphs
    # in 2000 long-tailed steps instead of 1857.
    evidence_required = frozenset({"cuda"})  # a young kernel: served where the correctness grid passed
    shape_cache = ShapeCache(
        builds="a cuDNN graph (and one for the backward when training)",
        keyed_on="the sequence count, max_seqlen, heads, head dims, strides, scale and mask (the backward also on "
        "the token totals rounded to 64)",
        source="cudnn-frontend 1.32 cudnn/sdpa/fwd/torch_op.py (_graph_cache, FIFO of 128)",
        new_key_ms=120.0,
        buckets=PackingBuckets(sequences=Rounding(floor=16), max_seqlen=Rounding(floor=128)),
    )

    def extra_reasons(self, p, t):
        r = []
        cc, d = t.capability, max(p.head_dim_qk, p.head_dim_v)
        if d > 256 and not (
            (p.head_dim_qk, p.head_dim_v) in self.wide_forward
            and cc == (9, 0)
            and not p.training
            and t.at_least("cudnn_version", "9.19.0")
        ):
            r.append(
                f"head dims {p.head_dim_qk}/{p.head_dim_v} above 256: only a 576/512 forward (inference) on sm90, "
                f"cuDNN >= 9.19; here {t.arch}, {t.cudnn_version}" + (", training" if p.training else "")
            )
        # sdpa_support_surface.h: THD needs Hopper or newer, Ampere from cuDNN 9.18.1.
        if p.layout == "thd" and cc < (9, 0) and not t.at_least("cudnn_version", "9.18.1"):
            r.append(
                f"packed (thd) input needs sm90+, or cuDNN >= 9.18.1 on {t.arch}; the target has "
                f"cuDNN {t.cudnn_version}"
            )
        # sdpa_support_surface.h: forward caps on older cuDNN: Ampere <= 128 (up to 9.9), Blackwell <= 128 below 9.9.
        if d > 128 and (cc[0] == 8 or cc[0] >= 10) and not t.at_least("cudnn_version", "9.10.0"):
            r.append(f"head dims above 128 need cuDNN >= 9.10 on {t.arch}")
        # scaled_dot_product_flash_attention.h (backward): sm90 <= 256; sm100 (cuDNN >= 9.11) 192/128 or
        # both <= 128 (plus 256/256 through the CuTe DSL d256 engines); other archs <= 128.
        # scaled_dot_product_flash_attention.h: "Sliding window attention is only supported with
        # max_s_q <= max_s_kv" without a padding mask (dense input).
        if p.mask == "sliding_window" and p.window[0] >= 0 and p.layout != "thd" and p.seqlen_q > p.seqlen_kv:
            r.append("a sliding window with more queries than keys is not supported on dense input")
        # cudnn/_sdpa_validate.py (_validate_backward) and the backward node's C++ validation: "s_q = s_kv = 1
        # is not supported" (the graph's sequence dims: the lengths, or max_seqlen for thd); hit on the H200 by a
        # dense one-token sequence in training (tests/integrations/test_megatron.py).
        if p.training and p.seqlen_q == 1 and p.seqlen_kv == 1:
            r.append("cuDNN has no backward for one query against one key (s_q = s_kv = 1); other backends serve it")
        # Not yet measured: how the op treats queries that see no key (sdpa_cudnn's backward gave NaN there).
        if p.may_have_rows_without_keys:
            r.append(
                "queries that see no key (this mask and these lengths may leave some) are not verified for this op yet"
            )
        if p.training and d > 128:
            if cc[0] == 10:
                pairs = ((192, 128), (256, 256)) if t.at_least("cudnn_version", "9.11.0") else ()
                if (p.head_dim_qk, p.head_dim_v) not in pairs:
                    r.append(
                        f"cuDNN has no backward kernel for head dims {p.head_dim_qk}/{p.head_dim_v} on "
                        f"{t.arch} (above 128 only 192/128 and 256/256)"
                    )
            elif cc != (9, 0):
                r.append(f"cuDNN's backward serves head dims up to 128 on {t.arch}")
        return r

    def run(self, q, k, v, call: KernelCall):
        import cudnn

        need_lse = _needs_lse(call, q, k, v)
        result = cudnn.sdpa_torch(q, k, v, return_lse=need_lse, **_options(call))
        return (result[0], result[1][..., 0] if call.return_lse else None) if need_lse else (result, None)

    def run_packed(self, q, k, v, call: KernelCall, packing: Packing):
        if q.shape[0] == 0:
            return q.new_zeros(0, q.shape[1], v.shape[-1]), q.new_zeros(q.shape[1], 0, dtype=torch.float32)
        return self.packed_runner(call)(q, k, v, packing)

    def packed_runner(self, call: KernelCall, *, repeated: bool = False):
        """``run(q, k, v, packing)``; ``repeated``: the first call's gradients bind the options of every call (each
        packing's max_seqlen is read from it)."""
        import cudnn

        op, options = cudnn.sdpa_torch, _options(call)
        bound = [None]  # repeated: the options of every call, set once as a whole (threads may race to set it)

        def run(q, k, v, packing: Packing):
            kwargs = bound[0]
            if kwargs is None:
                kwargs = dict(options, return_lse=_needs_lse(call, q, k, v))
                if repeated:
                    bound[0] = kwargs
            result = op(
                q, k, v, cu_seqlens_q=packing.cu_seqlens_q, cu_seqlens_kv=packing.cu_seqlens_kv,
                max_seqlen_q=max(packing.max_seqlen_q, 1), max_seqlen_kv=max(packing.max_seqlen_kv, 1), **kwargs,
            )  # fmt: skip
            if not kwargs["return_lse"]:
                return result, None
            return result[0], (result[1][..., 0].transpose(0, 1) if call.return_lse else None)  # (T, H, 1) -> (H, T)

        return run


def _needs_lse(call: KernelCall, q, k, v) -> bool:
    """Whether to ask the op for its statistics: asked for, or training (the op's backward consumes them)."""
    return call.return_lse or (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


def _options(call: KernelCall) -> dict:
    return dict(scale=call.scale, **_mask_arguments(call))


def _mask_arguments(call: KernelCall) -> dict:
    """Our masks in the op's terms: is_causal (top-left), causal_bottom_right re-anchors a band.

    The op's window_left is cuDNN's left bound, a window *length* (graph_analyzer.py:
    window_left = left_bound - 1; attn_score_modifiers.h keeps column + window_size > row), so
    our inclusive ``left`` keys become left + 1; window_right is an inclusive offset.
    """
    if call.mask == "none":
        return {}
    if call.mask == "causal":
        return {"is_causal": True}
    if call.mask == "causal_bottom_right":
        return {"is_causal": True, "causal_bottom_right": True}
    _, left, right = masks.band(call.mask, call.window, 1, 1)
    if left is None and right is None:
        return {}
    return {
        "window_left": -1 if left is None else left + 1,
        "window_right": -1 if right is None else right,
        "causal_bottom_right": True,
    }
