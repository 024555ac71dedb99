"""``flash_attn3``: FlashAttention-3 (Hopper), module flash_attn_interface, when it is installed."""

from __future__ import annotations

from attnselect.backends._flash_attn import FlashAttnPackageBackend
from attnselect.backends.base import HALF, Surface
from attnselect.spec.target import Package


class FlashAttn3(FlashAttnPackageBackend):
    name = "flash_attn3"
    summary = "FlashAttention-3 (hopper/) flash_attn_func: sm90, 192/128 natively, no dropout"
    package = Package("flash-attn-3", "flash_attn_interface")
    module = "flash_attn_interface"
    lse_argument = "return_attn_probs"  # returns (out, softmax_lse)
    # Source: Dao-AILab/flash-attention hopper/flash_api.cpp and hopper/flash_attn_interface.py:
    # Hopper only for different V head dims, head dims <= 256, no dropout argument; head dims multiples of
    # 16 bytes ("head_size should be a multiple of 8" in 16 bit; its interface does not pad them, FA2's does).
    # cuda_graphs=False: refused under CUDA graph capture until a GPU run verifies it; the flash-attn packages
    # are not on the H200 our capture tests (tests/test_api.py) run on.
    surfaces = {
        "cuda": Surface(
            dtypes=HALF,
            min_capability=(9, 0),
            max_capability=(9, 0),
            max_head_dim=512,
            head_dim_multiple=8,
            dropout=False,
            causal_is_bottom_right=True,
            cuda_graphs=False,
            softcap=True,  # hopper/flash_api.cpp SOFTCAP_SWITCH, forward and backward
        )
    }

    def extra_reasons(self, p, t):
        r = []
        dqk, dv = p.head_dim_qk, p.head_dim_v
        # hopper/flash_api.cpp: "we only support Q/K headdim in (128, 192] and V headdim in (96, 128],
        # or (Q/K <= 64 and V <= 512)"; equal dims up to 256.
        if dqk == dv:
            if dqk > 256:
                r.append(f"head dims up to 256, got {dqk}")
        elif not ((128 < dqk <= 192 and 96 < dv <= 128) or (dqk <= 64 and dv <= 512)):
            r.append(
                f"different head dims only as d_qk in (128, 192] with d_v in (96, 128], "
                f"or d_qk <= 64 with d_v <= 512; got {dqk}/{dv}"
            )
        if p.training and dv > 256:
            r.append(f"no backward kernel for d_v={dv} > 256")
        # TransformerEngine utils.py: FA3 is not deterministic in training for head dims >= 256.
        if p.training and p.deterministic and max(dqk, dv) >= 256:
            r.append("no deterministic backward for head dims >= 256")
        return r
