"""What the packed (thd) kernels share: a kernel without padded offsets refuses gaps between sequences. Each
packed backend's own bindings are tested in its file (test_cudnn_frontend.py, test_varlen_fa2.py, test_flash_attn.py)
through the stand-ins of tests/packed_stand_ins.py; the kernels themselves against float64 on the GPU
(test_thd_gpu.py)."""

from __future__ import annotations

import attnselect
from attnselect.backends import get


def test_gaps_are_refused_by_kernels_without_offsets():
    h200 = attnselect.Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0"})
    gapped = attnselect.AttentionProblem(2, 64, 64, 4, 4, 192, 128, layout="thd", varlen_gaps=True)
    for name in ("cudnn_frontend", "varlen_fa2"):
        assert any("gaps" in r for r in get(name).not_supported_reasons(gapped.padded(192), h200))
    assert not get("flex").not_supported_reasons(gapped, h200)
