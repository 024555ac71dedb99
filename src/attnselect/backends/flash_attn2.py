"""``flash_attn2``: the flash-attn package (FlashAttention-2), when it is installed."""

from __future__ import annotations

from attnselect.backends._flash_attn import FlashAttnPackageBackend
from attnselect.backends.base import HALF, Surface
from attnselect.spec.target import Package


class FlashAttn2(FlashAttnPackageBackend):
    name = "flash_attn2"
    summary = "flash-attn 2.x flash_attn_func: equal head dims <= 256, sm80+"
    package = Package("flash-attn", "flash_attn", shared_module=True)  # flash-attn-4 installs flash_attn too
    module = "flash_attn"
    dropout_argument = True
    lse_argument = "return_attn_probs"  # returns (out, softmax_lse, S_dmask)
    # Source: Dao-AILab/flash-attention csrc/flash_attn/flash_api.cpp (CHECK_SHAPE(v, ..., head_size):
    # v shares q's head dim; head_size <= 256) and flash_attn/flash_attn_interface.py (window_size,
    # deterministic, return_attn_probs).
    # cuda_graphs=False: refused under CUDA graph capture until a GPU run verifies it; the flash-attn packages
    # are not on the H200 our capture tests (tests/test_api.py) run on.
    surfaces = {
        "cuda": Surface(
            dtypes=HALF,
            min_capability=(8, 0),
            max_head_dim=256,
            equal_head_dims=True,
            causal_is_bottom_right=True,
            cuda_graphs=False,
            softcap=True,  # flash_attn_interface.py softcap=, forward and backward
        )
    }

    def extra_reasons(self, p, t):
        r = []
        # TransformerEngine utils.py: sliding windows need flash-attn 2.3+.
        if p.mask == "sliding_window" and not t.at_least("flash-attn", "2.3"):
            r.append(f"sliding windows need flash-attn >= 2.3, the target has {t.version('flash-attn')}")
        # csrc/flash_attn/flash_api.cpp: "Softcapping does not support dropout for now".
        if p.softcap and p.dropout_p:
            r.append("cannot softcap with dropout (flash_api.cpp); drop one of softcap= and dropout_p=")
        return r
