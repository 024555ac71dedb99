"""The backend registry. Built-in backends register on import; nothing global is flipped.

``register(backend)`` adds or replaces one; every change forgets the memoized decisions
(:func:`attnselect.clear_cache`), which may have chosen or refused the backend.
"""

from __future__ import annotations

from attnselect.backends.base import Backend, Surface
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
from attnselect.memos import clear_cache
from attnselect.spec.options import KernelCall, Packing
from attnselect.spec.target import register_package, unregister_package

_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    """Add (or replace) a backend under ``backend.name``."""
    _REGISTRY[backend.name] = backend
    if backend.package is not None:  # Target.current reads its version from now on
        register_package(backend.package)
    clear_cache()


def unregister(name: str) -> None:
    gone = _REGISTRY.pop(name, None)
    if gone is not None and gone.package and not any(b.package == gone.package for b in _REGISTRY.values()):
        unregister_package(gone.package.distribution)
    clear_cache()


def all_backends() -> tuple[Backend, ...]:
    return tuple(_REGISTRY.values())


def get(name: str) -> Backend | None:
    return _REGISTRY.get(name)


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
