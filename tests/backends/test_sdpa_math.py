"""The math SDPA backend (attnselect.backends.sdpa_math): the portable fallback, every dtype and mask, no lse."""

from __future__ import annotations

import dataclasses

import torch

from attnselect import AttentionProblem, Target, backends
from attnselect.execution import kernel_call
from helpers import rel_err

MATH = backends.get("sdpa_math")
ABSORBED = AttentionProblem(2, 200, 128, 16, 1, 576, 512, mask="sliding_window", window=(8, 0), training=True)


def test_it_serves_every_dtype_mask_and_head_dim_pair_on_cuda_and_cpu_but_returns_no_lse():
    for target in (Target.preset("h200"), Target.preset("b200"), Target.preset("cpu")):
        for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            assert MATH.not_supported_reasons(dataclasses.replace(ABSORBED, dtype=dtype, dropout_p=0.1), target) == []
    h200 = Target.preset("h200")
    assert MATH.not_supported_reasons(dataclasses.replace(ABSORBED, return_lse=True), h200) == [
        "cannot return the log-sum-exp (return_lse=True)"
    ]
    assert MATH.not_supported_reasons(dataclasses.replace(ABSORBED, sinks=True), h200) == [
        "returns no log-sum-exp, which attnselect needs to apply sinks (sinks=)"
    ]
    assert MATH.not_supported_reasons(dataclasses.replace(ABSORBED, softcap=True), h200)


def test_it_forces_the_math_kernel_and_matches_the_reference(monkeypatch):
    from torch.nn.attention import SDPBackend

    from attnselect.backends import _sdpa

    forced, enter = [], _sdpa.only_kernel.__enter__
    monkeypatch.setattr(_sdpa.only_kernel, "__enter__", lambda self: forced.append(self.kernel) or enter(self))
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 30, 24, generator=g, dtype=torch.float64)  # grouped heads, d_qk 24 != d_v 16
    k = torch.randn(1, 2, 12, 24, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, 12, 16, generator=g, dtype=torch.float64)
    for kwargs in (dict(window=(2, 0)), dict(causal="bottom_right"), dict()):  # the first two leave rows keyless
        call = kernel_call(AttentionProblem.from_tensors(q, k, v, layout="bhsd", **kwargs))
        out, lse = MATH.run(q, k, v, call)
        assert lse is None and rel_err(out, backends.get("reference").run(q, k, v, call)[0]) < 1e-12
    assert forced == [SDPBackend.MATH] * 3
