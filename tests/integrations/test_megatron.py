"""attnselect as Megatron-core's MLA core attention, with native V on packed input (runs on the GPU machine).

megatron-core 0.19 needs Python 3.12, so these tests run where its wheel is carried
(scripts/fetch_device_wheels.sh) and skip elsewhere with that reason.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core >= 0.19 needs Python 3.12: runs on the GPU machine with "
                                             "the wheel carried (scripts/fetch_device_wheels.sh)")

pytestmark = pytest.mark.gpu

from helpers import rel_err  # noqa: E402


sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
from megatron_mla import init_model_parallel, mla_layer, packed_params  # noqa: E402


@pytest.fixture(scope="module")
def megatron():
    init_model_parallel()
    from attnselect.integrations import megatron as integration
    return integration


def test_import_fails_loudly_without_the_pad_function(monkeypatch):
    import importlib
    import sys
    from megatron.core.transformer import multi_latent_attention
    monkeypatch.delattr(multi_latent_attention, "_prepare_mla_core_attention_value")
    monkeypatch.delitem(sys.modules, "attnselect.integrations.megatron", raising=False)
    with pytest.raises(ImportError, match="_prepare_mla_core_attention_value"):
        importlib.import_module("attnselect.integrations.megatron")


def test_packed_mla_layer_matches_sequence_by_sequence_and_keeps_v_native(megatron):
    lengths = [5, 1, 300, 77]
    seen = []
    real = megatron.CoreAttention.forward

    def spy(self, query, key, value, *args, **kwargs):
        seen.append(value.shape[-1])
        return real(self, query, key, value, *args, **kwargs)

    megatron.CoreAttention.forward = spy
    try:
        layer = mla_layer(megatron, patched=True)
        x = torch.randn(sum(lengths), 1, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        packed, _ = layer(x, None, packed_seq_params=packed_params(lengths))
        grad = torch.randn_like(packed)
        (dx,) = torch.autograd.grad(packed, x, grad)
        assert seen == [128]                                   # V reached the core attention 128 wide
        start = 0
        for n in lengths:                                      # the same layer, one dense sequence at a time
            piece = x[start:start + n].detach().requires_grad_()
            alone, _ = layer(piece, None)
            (d_alone,) = torch.autograd.grad(alone, piece, grad[start:start + n])
            assert rel_err(packed[start:start + n], alone) < 2e-2 and rel_err(dx[start:start + n], d_alone) < 2e-2
            start += n
        seen.clear()
        stock = mla_layer(megatron, patched=False)
        stock(x, None, packed_seq_params=packed_params(lengths))
        assert seen == [192]                                   # Megatron's own pad, for comparison
    finally:
        megatron.CoreAttention.forward = real
        megatron.skip_thd_value_pad()


def test_core_attention_refuses_what_it_cannot_serve(megatron):
    from megatron.core.transformer.enums import AttnMaskType
    layer = mla_layer(megatron, patched=True)
    q = torch.randn(8, 1, 16, 192, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(8, 1, 16, 128, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="attn_mask_type"):
        layer.core_attention(q, q, v, None, attn_mask_type=AttnMaskType.arbitrary)
    with pytest.raises(ValueError, match="attention_bias"):
        layer.core_attention(q, q, v, None, attention_bias=torch.zeros(1, device="cuda"))
