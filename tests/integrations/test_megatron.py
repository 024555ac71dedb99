"""attnselect as Megatron-core's MLA core attention, with native V on packed input (runs on the GPU machine).

megatron-core 0.19 needs Python 3.12, so these tests run where its wheel is carried
(scripts/fetch_device_wheels.sh) and skip elsewhere with that reason.
"""

from __future__ import annotations

import pathlib
import re
import sys

import pytest
import torch

pytest.importorskip(
    "megatron.core",
    reason="megatron-core >= 0.19 needs Python 3.12: runs on the GPU machine with "
    "the wheel carried (scripts/fetch_device_wheels.sh)",
)

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


def test_layer_spec_is_the_one_line_switch():
    """layer_spec puts CoreAttention in and keeps V native (skip_thd_value_pad), unless told not to."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from attnselect.integrations import megatron as integration

    try:
        integration._mla._prepare_mla_core_attention_value = integration._STOCK_PREPARE_VALUE
        spec = integration.layer_spec(get_gpt_layer_local_spec(multi_latent_attention=True), keep_value_native=False)
        assert spec.submodules.self_attention.submodules.core_attention is integration.CoreAttention
        assert integration._mla._prepare_mla_core_attention_value is integration._STOCK_PREPARE_VALUE
        integration.layer_spec(get_gpt_layer_local_spec(multi_latent_attention=True))
        assert integration._mla._prepare_mla_core_attention_value is integration._prepare_value
    finally:
        integration.skip_thd_value_pad()


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
        assert seen == [128]  # V reached the core attention 128 wide
        start = 0
        for n in lengths:  # the same layer, one dense sequence at a time
            piece = x[start : start + n].detach().requires_grad_()
            alone, _ = layer(piece, None)
            (d_alone,) = torch.autograd.grad(alone, piece, grad[start : start + n])
            assert rel_err(packed[start : start + n], alone) < 2e-2 and rel_err(dx[start : start + n], d_alone) < 2e-2
            start += n
        seen.clear()
        stock = mla_layer(megatron, patched=False)
        stock(x, None, packed_seq_params=packed_params(lengths))
        assert seen == [192]  # Megatron's own pad, for comparison
    finally:
        megatron.CoreAttention.forward = real
        megatron.skip_thd_value_pad()


def _megatrons_own_mla_layer(ours):
    """The same MLA self-attention with Megatron's own local core attention (DotProductAttention: baddbmm, its
    masked softmax, bmm) and our layer's weights. megatron-core 0.19.2's DotProductAttention cannot be built by
    MLA as it is: MLA passes k_channels/v_channels, which it does not take, and it sizes its output from
    config.kv_channels (hidden / heads, not v_head_dim). The subclass gives it a config whose kv_channels is the
    value head dim and drops the two arguments; the arithmetic stays Megatron's. (Attention's base class first
    builds a core attention without the two, which MLA then replaces: that one takes config.v_head_dim.) Local
    refuses packed input, so it runs dense, one sequence at a time."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import build_module

    class MegatronUnfused(DotProductAttention):
        def __init__(
            self,
            config,
            layer_number,
            attn_mask_type,
            attention_type,
            attention_dropout=None,
            softmax_scale=None,
            k_channels=None,
            v_channels=None,
            cp_comm_type=None,
            pg_collection=None,
        ):
            config = copy.copy(config)
            config.kv_channels = v_channels if v_channels is not None else config.v_head_dim
            super().__init__(
                config,
                layer_number,
                attn_mask_type,
                attention_type,
                attention_dropout=attention_dropout,
                softmax_scale=softmax_scale,
                cp_comm_type=cp_comm_type,
                pg_collection=pg_collection,
            )

    spec = get_gpt_layer_local_spec(multi_latent_attention=True)
    spec.submodules.self_attention.submodules.core_attention = MegatronUnfused
    layer = build_module(spec.submodules.self_attention, config=ours.config, layer_number=1).cuda()
    missing, unexpected = layer.load_state_dict(ours.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    assert isinstance(layer.core_attention, DotProductAttention)
    return layer


def test_packed_layer_matches_megatrons_own_unfused_attention(megatron):
    """Our core attention on packed input (V native) against Megatron's own local attention run dense per sequence,
    forward, the input gradient and every weight's gradient (summed over the sequences), to bf16 tolerance."""
    lengths = [5, 1, 300, 77]
    layer = mla_layer(megatron, patched=True)
    reference = _megatrons_own_mla_layer(layer)
    try:
        x = torch.randn(sum(lengths), 1, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        packed, _ = layer(x, None, packed_seq_params=packed_params(lengths))
        grad = torch.randn_like(packed)
        names, weights = zip(*layer.named_parameters())
        dx, *d_weights = torch.autograd.grad(packed, (x, *weights), grad)
        theirs_weights = [p for _, p in reference.named_parameters()]
        assert [n for n, _ in reference.named_parameters()] == list(names)
        d_theirs_weights = [torch.zeros_like(p, dtype=torch.float32) for p in theirs_weights]
        start = 0
        for n in lengths:
            piece = x[start : start + n].detach().requires_grad_()
            theirs, _ = reference(piece, None)
            d_theirs, *d_w = torch.autograd.grad(theirs, (piece, *theirs_weights), grad[start : start + n])
            assert rel_err(packed[start : start + n], theirs) < 2e-2, n
            assert rel_err(dx[start : start + n], d_theirs) < 2e-2, n
            for total, part in zip(d_theirs_weights, d_w):
                total += part.float()
            start += n
        for name, ours, theirs in zip(names, d_weights, d_theirs_weights):
            assert rel_err(ours.float(), theirs) < 2e-2, name
    finally:
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


def test_qk_clip_reads_the_running_max_logit_and_learnable_offsets_are_trained_sinks(megatron):
    """config.qk_clip: current_max_attn_logits holds the per-head max over calls (as TEDotProductAttention keeps
    it for Megatron's clip_qk); softmax_type='learnable': a float32 (heads,) sink parameter with a gradient."""
    import attnselect

    layer = mla_layer(megatron, patched=True, qk_clip=True, softmax_type="learnable")
    core = layer.core_attention
    assert core.current_max_attn_logits is None and core.softmax_offset.shape == (16,)
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(64, 2, 16, 192, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(64, 2, 16, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    with torch.no_grad():
        core.softmax_offset.normal_()
    out = core(q, k, v, None)
    first = core.current_max_attn_logits.clone()
    core(q * 2, k, v, None)
    ref, ref_max = attnselect.attention(
        *(t.double() for t in (q, k, v)), layout="sbhd", causal=True, scale=core.softmax_scale,
        sinks=core.softmax_offset.detach().double(), return_max_logit=True, backend="reference",
    )  # fmt: skip
    assert rel_err(out.double(), ref.reshape(64, 2, -1)) < 2e-2 and rel_err(first, ref_max) < 1e-2
    assert torch.equal(core.current_max_attn_logits, torch.maximum(first, core.current_max_attn_logits))
    assert (core.current_max_attn_logits > first).all()  # doubled queries double every logit
    (grad,) = torch.autograd.grad(out.float().square().sum(), core.softmax_offset)
    assert grad.shape == (16,) and torch.isfinite(grad).all() and grad.abs().sum() > 0


def test_context_parallel_p2p_matches_the_single_process_shard():
    """config.context_parallel_size = 2 with cp_comm_type 'p2p' over pg_collection.cp: two gloo processes on the
    CPU (float64), dense sbhd and packed thd with Megatron's global PackedSeqParams; every rank's output and
    gradients equal the single-process attention's shard."""
    from helpers import run_group

    reports = run_group(str(pathlib.Path(__file__).with_name("_megatron_cp_worker.py")), 2)
    for rank in range(2):
        for layout in ("sbhd", "thd"):
            errors = reports[rank, layout]["errors"]
            assert set(errors) == {"out", "dq", "dk", "dv"} and max(errors.values()) < 1e-10, (rank, layout, errors)


def test_context_parallel_refuses_other_comm_types():
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from attnselect.integrations.megatron import CoreAttention

    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, context_parallel_size=2)
    for comm in ("a2a", "all_gather", "a2a+p2p"):
        with pytest.raises(ValueError, match=re.escape(f"cp_comm_type: got '{comm}', expected 'p2p' or None")):
            CoreAttention(config, 1, AttnMaskType.causal, "self", cp_comm_type=comm)


def test_context_parallel_packing_divides_the_global_boundaries_once_checked():
    from megatron.core.packed_seq_params import PackedSeqParams

    from attnselect.integrations import megatron as integration

    cu = torch.tensor([0, 8, 24, 32], dtype=torch.int32, device="cuda")
    args = integration._packing(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                max_seqlen_q=16, max_seqlen_kv=16), 4)  # fmt: skip
    assert args["cu_seqlens_q"].tolist() == [0, 2, 6, 8] and args["cu_seqlens_kv"] is args["cu_seqlens_q"]
    assert args["max_seqlen_q"] == args["max_seqlen_kv"] == 4
    bad = torch.tensor([0, 9, 16], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="expected multiples of 2 \\* context_parallel_size = 8"):
        integration._packing(PackedSeqParams(qkv_format="thd", cu_seqlens_q=bad, cu_seqlens_kv=bad), 4)
