"""The backends. The built-in ones register on import (:mod:`attnselect.backends.base` holds the registry);
nothing global is flipped.

``register(backend)`` adds or replaces one; every change forgets the memoized decisions
(:func:`attnselect.clear_cache`), which may have chosen or refused the backend.
"""

from __future__ import annotations

from attnselect.backends.base import Backend, Surface, all_backends, get, register, unregister
from attnselect.backends.cudnn_frontend import CudnnFrontend
from attnselect.backends.flash_attn2 import FlashAttn2
from attnselect.backends.flash_attn3 import FlashAttn3
from attnselect.backends.flash_attn4 import FlashAttn4
from attnselect.backends.flex import Flex
from attnselect.backends.reference import Reference
from attnselect.backends.sdpa_cudnn import SdpaCudnn
from attnselect.backends.sdpa_efficient import SdpaEfficient
from attnselect.backends.sdpa_flash import SdpaFlash
from attnselect.backends.sdpa_math import SdpaMath
from attnselect.backends.varlen_fa2 import VarlenFa2
from attnselect.spec.options import KernelCall, Packing

for _cls in (
    SdpaCudnn,
    CudnnFrontend,
    FlashAttn3,
    FlashAttn4,
    FlashAttn2,
    VarlenFa2,
    SdpaFlash,
    Flex,
    SdpaEfficient,
    SdpaMath,
    Reference,
):
    register(_cls())

__all__ = [
    "Backend",
    "KernelCall",
    "Packing",
    "Surface",
    "register",
    "unregister",
    "all_backends",
    "get",
]
