"""torchtitan's decoder models through attnselect (attnselect.integrations.torchtitan): the debug models cut to two
layers, in float32, against torchtitan's own attention (SDPA for plain causal; flex's forward for packed documents)
and a float64 reference of the whole model for the logits and every parameter's gradient.

The criterion, per tensor, is the relative max error against float64: within 1e-4, or within twice the error of
the model's own float32 path (torchtitan's SDPA; for documents, whose flex has no CPU backward, the same model with
the documents' mask as a tensor) where that is larger: DeepSeek-V3's routed experts' weight gradients are 1.1e-3 off
float64 in float32 whatever the attention (their grouped matmuls), as FlashAttention's tests bound a kernel by twice
the naive reference's error."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import pickle

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask

# The test extra installs torchtitan (CI runs these); the GPU machine, which runs only the GPU tests, has none.
pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install -e '.[test]' installs it)")
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention  # noqa: E402

import attnselect
import attnselect.integrations.torchtitan as titan
from attnselect.errors import InvalidInputError

MODELS = ["deepseek_v3", "llama3", "qwen3"]
B, L = 2, 48
DOCUMENTS = [torch.cat([torch.arange(20), torch.arange(28)]), torch.cat([torch.arange(7), torch.arange(41)])]


def _config(name: str, backend: str = "flex", **registry):
    spec = importlib.import_module(f"torchtitan.models.{name}").model_registry("debugmodel", attn_backend=backend,
                                                                                **registry)  # fmt: skip
    config = spec.model
    for layer in [*config.layers, *(getattr(config, "mtp_layers", None) or [])]:
        if getattr(layer, "moe", None) is not None:  # torchtitan's debug routing: no top-k ties to flip
            layer.moe.router._debug_force_load_balance = True
    return dataclasses.replace(config, layers=config.layers[:2])


def _build(config):
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model


def _double(model):
    """``model`` in float64, its complex RoPE tables left complex."""
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_floating_point():
            tensor.data = tensor.data.double()
    return model


def _inner(model):
    return [m for m in model.modules() if isinstance(m, (FlexAttention, VarlenAttention, ScaledDotProductAttention))]


class _DenseReference(ScaledDotProductAttention):
    """A float64-capable reference: SDPA's math kernel with the packed documents' mask as a tensor."""

    allowed: torch.Tensor | None = None

    def forward(self, q, k, v, *, attention_masks=None, scale=None, **kwargs):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=_DenseReference.allowed[:, None], scale=scale)
        return out.transpose(1, 2)


def _documents_mask(positions):
    document = torch.cumsum(positions == 0, 1)
    same = document[:, :, None] == document[:, None, :]
    return same & torch.ones(L, L, dtype=torch.bool).tril()


def _loss_and_grads(model, tokens, positions, masks):
    out = model(tokens, positions, masks)
    loss = (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum()
    grads = torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)
    return out.detach(), grads


def _error(a, b) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12))


def _close(ours, reference, what, baseline=None):
    """Each of ``ours`` within 1e-4 of ``reference`` (relative max error), or within twice ``baseline``'s error."""
    for i, (name, a, b) in enumerate(zip(what, ours, reference)):
        if a is None and b is None:
            continue
        bound = 1e-4 if baseline is None else max(1e-4, 2 * _error(baseline[i], b))
        assert _error(a, b) <= bound, (name, _error(a, b), bound)


def _flat(result):
    return [result[0], *result[1]]


def _inputs():
    torch.manual_seed(1)
    return torch.randint(0, 2048, (B, L)), torch.stack(DOCUMENTS)


@pytest.mark.parametrize("name", MODELS)
def test_plain_causal_matches_torchtitans_sdpa_logits_and_every_gradient(name):
    config = _config(name)
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    reference = _build(config)
    ours = titan.apply(copy.deepcopy(reference))
    tokens, _ = _inputs()
    positions = torch.arange(L).repeat(B, 1)
    theirs = _loss_and_grads(reference, tokens, positions, None)
    got = _loss_and_grads(ours, tokens, positions, None)
    exact = _loss_and_grads(_double(copy.deepcopy(reference)), tokens, positions, None)
    names = ["logits", *(n for n, p in reference.named_parameters() if p.requires_grad)]
    _close(_flat(got), _flat(exact), names, baseline=_flat(theirs))
    _close([got[0]], [theirs[0]], ["logits against torchtitan's SDPA"])


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("backend", ["flex", "varlen"])
def test_packed_documents_match_flex_forward_and_a_float64_reference_for_gradients(name, backend):
    """Documents reach attnselect as packed sequences: from flex's BlockMask or from VarlenMetadata alike."""
    flex = _build(_config(name))
    model = titan.apply(_build(_config(name, backend)))
    model.load_state_dict(flex.state_dict())
    tokens, positions = _inputs()
    masks = model.get_attention_masks(positions)
    with torch.no_grad():
        expected_logits = flex(tokens, positions, flex.get_attention_masks(positions))
    got = _loss_and_grads(model, tokens, positions, masks)
    _close([got[0]], [expected_logits], ["logits against flex"])

    dense = copy.deepcopy(flex)
    for module in _inner(dense):
        module.__class__ = _DenseReference
    _DenseReference.allowed = _documents_mask(positions)
    baseline = _loss_and_grads(dense, tokens, positions, None)
    exact = _loss_and_grads(_double(dense), tokens, positions, None)
    names = ["logits", *(n for n, p in flex.named_parameters() if p.requires_grad)]
    _close(_flat(got), _flat(exact), names, baseline=_flat(baseline))


def test_plain_causal_rows_of_one_document_each_run_dense():
    model = titan.apply(_build(_config("llama3")))
    tokens, _ = _inputs()
    positions = torch.arange(L).repeat(B, 1)
    masks = model.get_attention_masks(positions)
    with torch.no_grad():
        model(tokens, positions, masks)
    assert masks.__dict__[titan._PACKING] == {(B, L): (None,)}


def test_the_same_model_object_parameters_and_state_dict_keys_and_every_attention_including_mtp():
    model = _build(_config("deepseek_v3", num_mtp_layers=1))
    parameters, keys = list(model.parameters()), list(model.state_dict())
    inner = _inner(model)
    assert titan.apply(model) is model
    assert list(model.parameters()) == parameters and list(model.state_dict()) == keys
    assert len(inner) == 3 and all(type(m).__name__ == "AttnSelectFlexAttention" for m in inner)
    assert all(isinstance(m, FlexAttention) for m in inner)  # torchtitan's isinstance checks still hold
    assert titan.apply(model) is model  # applied twice: nothing more to do


def test_the_converter_builds_the_model_with_attnselects_inner_attention_and_flex_masks():
    model = _build(_config("deepseek_v3", converters=[titan.AttnSelectConverter.Config()], num_mtp_layers=1))
    assert all(type(m).__name__ == "AttnSelectFlexAttention" for m in _inner(model)) and len(_inner(model)) == 3
    tokens, positions = _inputs()
    masks = model.get_attention_masks(positions)  # torchtitan still builds its BlockMask for the flex config
    reference = _build(_config("deepseek_v3", num_mtp_layers=1))
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        got, expected = model(tokens, positions, masks), reference(tokens, positions, masks)
    assert isinstance(got, list) and len(got) == len(expected) == 2  # the main head's and the MTP layer's logits
    _close(got, expected, ["logits", "MTP logits"])


def test_activation_checkpointing_of_a_layer_keeps_the_gradients():
    model = titan.apply(_build(_config("llama3")))
    tokens, positions = _inputs()
    masks = model.get_attention_masks(positions)
    plain = _loss_and_grads(model, tokens, positions, masks)
    for key, layer in list(model.layers.items()):
        model.layers[key] = _Checkpointed(layer)
    checkpointed = _loss_and_grads(model, tokens, positions, masks)
    _close(_flat(checkpointed), _flat(plain), ["logits", *range(len(plain[1]))])


class _Checkpointed(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.layer, *args, use_reentrant=False)


def test_a_module_that_is_not_a_torchtitan_decoder_is_refused():
    with pytest.raises(InvalidInputError, match="model: got Linear, expected a torchtitan decoder model"):
        titan.apply(torch.nn.Linear(2, 2))


def _flex_module_and_tensors():
    model = titan.apply(_build(_config("llama3")))
    inner = _inner(model)[0]
    q = torch.randn(B, L, 4, 16)
    return model, inner, q


def test_a_score_mod_missing_masks_and_context_parallel_shapes_are_refused():
    model, inner, q = _flex_module_and_tensors()
    _, positions = _inputs()
    masks = model.get_attention_masks(positions)
    with pytest.raises(InvalidInputError, match="score_mod: got a function"):
        inner(q, q, q, attention_masks=masks, score_mod=lambda s, b, h, i, j: s)
    with pytest.raises(InvalidInputError, match="attention_masks: got NoneType, expected the BlockMask"):
        inner(q, q, q, attention_masks=None)
    with pytest.raises(InvalidInputError, match="context parallelism is not served"):
        inner(q[:, : L // 2], q, q, attention_masks=masks)
    with pytest.raises(InvalidInputError, match=r"^q_BLNH: got NoneType, expected a 4-D tensor"):
        inner(None, q, q, attention_masks=masks)
    with pytest.raises(InvalidInputError, match=r"^v_BLNH: got shape \(\d+, \d+\), expected a 4-D tensor"):
        inner(q, q, q[0, 0], attention_masks=masks)


NOT_DOCUMENTS = {
    "sliding window": lambda b, h, i, j: (j <= i) & (i - j < 8),
    "bidirectional": lambda b, h, i, j: i >= 0,
    "dilated causal": lambda b, h, i, j: (j <= i) & ((i - j) % 2 == 0),
    "a sink and a window": lambda b, h, i, j: (j <= i) & ((i - j < 8) | (j == 0)),
    "documents and a global first token": lambda b, h, i, j: (j <= i) & ((j == 0) | ((i < 20) == (j < 20))),
}


@pytest.mark.parametrize("mask_mod", NOT_DOCUMENTS.values(), ids=NOT_DOCUMENTS.keys())
def test_a_block_mask_that_is_not_causal_within_documents_is_refused(mask_mod):
    _, inner, q = _flex_module_and_tensors()
    with pytest.raises(InvalidInputError, match="not causal within documents"):
        inner(q, q, q, attention_masks=create_block_mask(mask_mod, B, None, L, L, device="cpu"))


def test_a_mask_that_differs_by_head_is_refused():
    _, inner, q = _flex_module_and_tensors()
    per_head = create_block_mask(lambda b, h, i, j: (j <= i) & (h == 0), B, 4, L, L, device="cpu")
    with pytest.raises(InvalidInputError, match="expected one of every head alike"):
        inner(q, q, q, attention_masks=per_head)


def test_a_batch_one_mask_serves_every_batch_size_with_its_own_documents():
    _, inner, q = _flex_module_and_tensors()
    document = lambda b, h, i, j: (j <= i) & ((i < 20) == (j < 20))  # noqa: E731
    mask = create_block_mask(document, 1, None, L, L, device="cpu")
    with torch.no_grad():
        one, two = inner(q[:1], q[:1], q[:1], attention_masks=mask), inner(q, q, q, attention_masks=mask)
    assert torch.allclose(two[:1], one, atol=1e-6) and set(mask.__dict__[titan._PACKING]) == {(1, L), (B, L)}


def test_an_empty_batch_has_no_documents_to_read():
    mask = create_block_mask(lambda b, h, i, j: j <= i, 1, None, L, L, device="cpu")
    assert titan._documents(mask, 0, L, torch.device("cpu")) == (None,)


def test_out_transform_takes_the_lse_in_inference_and_is_refused_in_training():
    _, inner, q = _flex_module_and_tensors()
    _, positions = _inputs()
    masks = titan.apply(_build(_config("llama3"))).get_attention_masks(positions)
    with torch.no_grad():
        out, lse = inner(q, q, q, attention_masks=masks, out_transform=lambda out, lse: (out, lse))
    assert out.shape == q.shape and lse.shape == (B, L, 4)
    q.requires_grad_(True)
    with pytest.raises(InvalidInputError, match="out_transform: got a function in training"):
        inner(q, q, q, attention_masks=masks, out_transform=lambda out, lse: out)


def test_an_sdpa_module_s_is_causal_is_a_bool_or_refused():
    config = _config("llama3")
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    inner = _inner(titan.apply(_build(config)))[0]
    q = torch.randn(B, L, 4, 16)
    assert torch.equal(inner(q, q, q, is_causal=False), attnselect.attention(q, q, q))
    for junk in ("no", None, 1):
        with pytest.raises(InvalidInputError, match=f"^is_causal: got {junk!r}, expected True or False"):
            inner(q, q, q, is_causal=junk)


def test_varlen_window_sizes_map_to_attnselect_masks_bottom_right_as_varlen_attn():
    assert titan._varlen_mask((-1, 0)) == ("bottom_right", None)
    assert titan._varlen_mask((-1, -1)) == (False, None)
    assert titan._varlen_mask((64, 0)) == (False, (64, 0))
    for junk in ((4, 4), None, (1,), ("1", 0), (True, 0)):
        with pytest.raises(InvalidInputError, match="^window_size: got"):
            titan._varlen_mask(junk)


def test_apply_refuses_a_wrapped_forward_and_a_foreign_subclass_and_keeps_other_attention_modules():
    model = _build(_config("llama3"))
    inner = _inner(model)[0]
    inner.forward = lambda *a, **kw: None  # as torchtitan's parallelize and context parallelism wrap it
    with pytest.raises(InvalidInputError, match="whose forward torchtitan has wrapped"):
        titan.apply(model)
    model = _build(_config("llama3"))
    _inner(model)[0].__class__ = type("TheirFlex", (FlexAttention,), {})
    with pytest.raises(InvalidInputError, match="got TheirFlex, expected torchtitan's FlexAttention"):
        titan.apply(model)
    model = _build(_config("llama3"))
    model.add_module("vision", torch.nn.ModuleDict({"encoder": FlexAttention(FlexAttention.Config())}))
    titan.apply(model)
    assert type(model.vision.encoder) is FlexAttention  # a vision encoder's attention is not a decoder layer's


def test_an_applied_inner_attention_and_its_converted_config_pickle():
    """(torchtitan's models hold local functions and do not pickle; what apply() and the converter make does.)"""
    inner = _inner(titan.apply(_build(_config("llama3"))))[0]
    assert type(pickle.loads(pickle.dumps(inner))).__name__ == "AttnSelectFlexAttention"
    config = titan._convert_config(FlexAttention.Config(block_size=(256, 128)))
    again = pickle.loads(pickle.dumps(config))
    assert type(again) is type(config) and again.block_size == (256, 128)


@pytest.mark.parametrize("backend", ["flex", "varlen"])
def test_torch_compile_of_each_layer_as_torchtitan_compiles_them_keeps_the_logits(backend):
    model = titan.apply(_build(_config("llama3", backend)))
    tokens, positions = _inputs()
    with torch.no_grad():
        eager = model(tokens, positions, model.get_attention_masks(positions))
        for key, layer in list(model.layers.items()):  # torchtitan compiles per transformer block
            model.layers[key] = torch.compile(layer, backend="aot_eager")
        compiled = model(tokens, positions, model.get_attention_masks(positions))
    _close([compiled], [eager], ["logits"])


def test_the_converter_keeps_each_inner_attention_config_s_fields_tensor_parallel_sharding_included():
    from torchtitan.models.common.decoder_sharding import set_gqa_inner_attention_local_map

    config = _config("llama3")
    for layer in config.layers:
        set_gqa_inner_attention_local_map(layer.attention.inner_attention)  # what torchtitan's TP plan installs
    before = [layer.attention.inner_attention for layer in config.layers]
    titan.AttnSelectConverter.Config().build().convert(config)
    for old, layer in zip(before, config.layers):
        new = layer.attention.inner_attention
        assert type(new).__name__ == "Config" and isinstance(new, FlexAttention.Config)
        assert new.sharding_config is old.sharding_config and new.block_size == old.block_size
        assert type(new.build()).__name__ == "AttnSelectFlexAttention"


def test_without_torchtitan_the_integration_says_what_to_install(monkeypatch):
    """An optional extra, as Megatron's: an ImportError naming the install, not a model error or a bare one."""
    import sys

    from attnselect.integrations import torchtitan as titan

    for name in [m for m in sys.modules if m == "torchtitan" or m.startswith("torchtitan.")]:
        monkeypatch.setitem(sys.modules, name, None)  # imported as absent
    with pytest.raises(ImportError, match=r"needs torchtitan .*pip install 'attnselect\[torchtitan\]'"):
        titan._torchtitan("protocols.model")
