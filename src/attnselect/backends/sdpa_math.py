"""``sdpa_math``: PyTorch SDPA with the MATH kernel forced (eager matmul + softmax in C++)."""

from __future__ import annotations

from torch.nn.attention import SDPBackend

from attnselect.backends._sdpa import SdpaBackend
from attnselect.backends.base import ALL_DTYPES, Surface

# Source: pytorch aten/src/ATen/native/transformers/attention.cpp (_scaled_dot_product_attention_math):
# any dtype and device, any mask, value head dim free; it returns no log-sum-exp.
_SURFACE = Surface(dtypes=ALL_DTYPES, lse=False)


class SdpaMath(SdpaBackend):
    name = "sdpa_math"
    summary = "PyTorch SDPA, MATH kernel forced: portable, materialises the score matrix"
    kernel = SDPBackend.MATH
    surfaces = {"cuda": _SURFACE, "cpu": _SURFACE}
