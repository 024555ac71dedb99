"""``cudnn_frontend``: the cuDNN frontend's PyTorch ops (package nvidia-cudnn-frontend).

This release only detects the package: its kernel binding (dense and THD, forward and
backward) arrives with the packed-sequence release, so every verdict is negative.
"""

from __future__ import annotations

from attnselect.backends.base import HALF, Backend, Surface


class CudnnFrontend(Backend):
    name = "cudnn_frontend"
    summary = "cuDNN frontend torch ops: native THD (cu_seqlens) and 192/128 (binding not in this release)"
    package = ("cudnn_frontend_version", "nvidia-cudnn-frontend")
    surfaces = {"cuda": Surface(dtypes=HALF, min_capability=(8, 0))}

    def extra_reasons(self, p, t):
        return ["attnselect has no binding for the cuDNN frontend's ops in this release"]

    def run(self, q, k, v, call):
        raise RuntimeError("cudnn_frontend cannot run: attnselect has no binding for it in this release")
