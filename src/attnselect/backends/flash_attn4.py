"""``flash_attn4``: FlashAttention-4 (CuTe DSL), module flash_attn.cute, when it is installed."""

from __future__ import annotations

from attnselect.backends._flash_attn import FlashAttnPackageBackend
from attnselect.backends.base import HALF, Surface
from attnselect.backends.shape_cache import ShapeCache


class FlashAttn4(FlashAttnPackageBackend):
    name = "flash_attn4"
    summary = "FlashAttention-4 (flash_attn.cute) flash_attn_func: sm90-sm11x, 192/128 natively"
    package = ("flash_attn4_version", "flash-attn-4")
    module = "flash_attn.cute"
    unbounded = None
    lse_argument = "return_lse"          # always returns (out, lse)
    # Source: Dao-AILab/flash-attention flash_attn/cute/interface.py: fp16/bf16, arch 9.x-11.x,
    # head dims multiples of 8; backward arch 9-12; no dropout argument.
    # cuda_graphs=False: refused under CUDA graph capture until a GPU run verifies it; the flash-attn packages
    # are not on the H200 our capture tests (tests/test_api.py) run on.
    surfaces = {"cuda": Surface(dtypes=HALF, min_capability=(9, 0), max_capability=(11, 9), head_dim_multiple=8,
                                max_head_dim=512, dropout=False, causal_is_bottom_right=True, cuda_graphs=False)}

    # interface.py _flash_attn_fwd: cute.compile once per compile_key (dtype, head dims, GQA ratio, causal,
    # window, varlen, lse, tile sizes and split choices derived from the lengths), not per length.
    shape_cache = ShapeCache(builds="a CuTe DSL kernel compile",
                             keyed_on="dtype, head dims, GQA ratio, causal, window, varlen and the tile sizes "
                                      "chosen from the lengths, not the lengths themselves",
                             source="flash-attention flash_attn/cute/interface.py (compile_key)")

    def extra_reasons(self, p, t):
        r = []
        dqk, dv = p.head_dim_qk, p.head_dim_v
        # interface.py _validate_head_dims: SM90 any pair in 8..256; SM100/110 both <= 128,
        # 192/128, (64 or dv)/512 and 256/256.
        if t.capability[0] == 9:
            ok = max(dqk, dv) <= 256
        else:
            ok = (max(dqk, dv) <= 128 or (dqk, dv) in ((192, 128), (256, 256))
                  or (dv == 512 and dqk in (64, 512)))
        if not ok:
            r.append(f"head dims {dqk}/{dv} are not served on {t.arch}")
        return r
