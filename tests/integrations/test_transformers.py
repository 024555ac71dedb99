"""attnselect as a transformers attention implementation, on a tiny randomly initialised DeepSeek-V3 (no download)."""

from __future__ import annotations

import pytest
import torch

from attnselect.errors import InvalidInputError

transformers = pytest.importorskip("transformers", reason="the test extra installs transformers")

from attnselect.integrations import transformers as attnselect_hf  # noqa: E402

NAME = attnselect_hf.register()


def _model(implementation: str, seed: int = 0):
    """Two layers, real MLA geometry scaled down: d_qk = 16 (nope) + 8 (rope) = 24 != d_v = 16."""
    config = transformers.DeepseekV3Config(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        attn_implementation=implementation,
    )
    torch.manual_seed(seed)
    return transformers.DeepseekV3ForCausalLM(config).eval()  # float32: the MoE grouped matmul has no float64


def test_register_returns_a_name_without_flash():
    assert NAME == "attnselect" and "flash" not in NAME
    with pytest.raises(ValueError, match="without 'flash'"):
        attnselect_hf.register("flash_attnselect")


@pytest.fixture
def calls(monkeypatch):
    """The (layout, value head dim) of every attnselect.attention call the model makes."""
    import attnselect

    seen, real = [], attnselect.attention

    def spy(q, k, v, **kwargs):
        seen.append((kwargs.get("layout"), v.shape[-1]))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(attnselect.api, "attention", spy)
    return seen


def test_logits_match_eager(calls):
    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    ours, eager = _model(NAME), _model("eager")
    assert ours.config._attn_implementation == NAME
    torch.testing.assert_close(ours(ids).logits, eager(ids).logits)
    assert calls == [("bhsd", 16)] * 2  # one call per layer, V native (16 wide, not padded to 24)


def test_left_padded_logits_match_eager_on_real_tokens(calls):
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    ids[0, :4] = 0
    ours, eager = (m(ids, attention_mask=mask).logits for m in (_model(NAME), _model("eager")))
    torch.testing.assert_close(ours[mask.bool()], eager[mask.bool()])
    assert calls == [("thd", 16)] * 2  # the padding mask is honoured by running the real tokens packed


def test_a_training_step_matches_eager():
    ids = torch.randint(3, 97, (2, 10), generator=torch.Generator().manual_seed(3))
    losses, grads = [], []
    for implementation in (NAME, "eager"):
        model = _model(implementation).train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    torch.testing.assert_close(losses[0], losses[1])
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


def test_generate_with_left_padding_gives_eagers_tokens():
    ids = torch.randint(3, 97, (3, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    for row, pad in ((0, 3), (1, 5)):
        ids[row, :pad], mask[row, :pad] = 0, 0
    tokens = [
        m.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
        for m in (_model(NAME), _model("eager"))
    ]
    assert torch.equal(tokens[0], tokens[1])


@pytest.mark.parametrize("form", ["additive", "bool"])
def test_a_4d_mask_passed_to_the_model_is_honoured(calls, caplog, form):
    # Two documents in one row, each causal within itself: an additive 4-D mask, as eager takes it, or a bool one, as
    # sdpa takes it (eager would add a bool mask: it is compared with sdpa).
    ids = torch.randint(3, 97, (1, 10), generator=torch.Generator().manual_seed(7))
    allowed = torch.zeros(10, 10, dtype=torch.bool)
    allowed[:6, :6] = allowed[6:, 6:] = True
    allowed &= torch.ones(10, 10, dtype=torch.bool).tril()
    additive = torch.zeros(1, 1, 10, 10).masked_fill(~allowed, torch.finfo(torch.float32).min)
    mask, reference = (additive, "eager") if form == "additive" else (allowed[None, None], "sdpa")
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    attnselect_hf._log_explicit_mask.cache_clear()  # logged once per process: once more for this test
    with caplog.at_level("INFO", logger="attnselect"):
        ours, theirs = (
            m(ids, attention_mask=mask, position_ids=positions).logits for m in (_model(NAME), _model(reference))
        )
    torch.testing.assert_close(ours, theirs)
    assert calls == []  # the mask is not one attnselect's kernels take: torch's SDPA ran it, and the log says so
    assert "4-D attention_mask" in caplog.text
    separate = _model(NAME)(ids[:, 6:]).logits  # the second document alone: the mask kept them apart
    torch.testing.assert_close(ours[:, 6:], separate)


@pytest.mark.parametrize("builder", ["sdpa", "eager"])
def test_every_mask_transformers_builds_is_read_as_its_own_sdpa_reads_it(builder):
    """transformers' own mask functions (sdpa's bool masks, eager's additive ones: 4-D, or None where nothing is
    masked), as its models build them for padded batches, sliding windows and cached generation: the attention
    function gives what transformers' sdpa_attention_forward (torch's SDPA) gives with the same mask."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    seen = set()

    def both(module, query, key, value, attention_mask, **kwargs):
        theirs, _ = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        ours, _ = attnselect_hf.attention_forward(module, query, key, value, attention_mask, **kwargs)
        torch.testing.assert_close(ours, theirs, equal_nan=True)
        if attention_mask is not None:
            seen.add((attention_mask.dim(), attention_mask.dtype, attention_mask.shape[-2] < attention_mask.shape[-1]))
        return theirs, None

    name = f"attnselect_beside_{'bool' if builder == 'sdpa' else 'additive'}_masks"  # a name with "sdpa" in it is sdpa
    AttentionInterface.register(name, both)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[builder])
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(2))
    padding = torch.ones_like(ids)
    ids[0, :4], padding[0, :4] = 0, 0
    deepseek = _model(name)
    deepseek(ids, attention_mask=padding)
    deepseek.generate(ids, attention_mask=padding, max_new_tokens=3, do_sample=False, pad_token_id=0)
    fields = dict(attn_logit_softcapping=None, query_pre_attn_scalar=16, sliding_window=4)  # GQA, sliding windows
    _tiny(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, name, **fields)(ids, attention_mask=padding)
    dtype = torch.bool if builder == "sdpa" else torch.float32
    assert {(4, dtype, False), (4, dtype, True)} <= seen  # 4-D masks of the prefill and of cached decoding


@pytest.mark.parametrize("causal", [True, False])
def test_the_interface_matches_transformers_eager_function(causal):
    """GQA through the module's key/value heads, a non-default scaling, causal or not, padded or not."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from attnselect.integrations.transformers import attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = causal, 2, False
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 7, 24, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 7, 24, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 7, 16, generator=g, dtype=torch.float64)
    keep = torch.ones(2, 7, dtype=torch.bool)
    keep[1, :3] = False  # left padding in the second row

    def additive(keep):  # eager's mask carries the causality too
        allowed = keep[:, None, None, :] & (torch.ones(7, 7, dtype=torch.bool).tril() if causal else True)
        return torch.zeros(2, 1, 7, 7, dtype=torch.float64).masked_fill(~allowed, float("-inf"))

    for ours_mask, eager_mask, rows in (
        (None, additive(torch.ones_like(keep)), slice(None)),
        (keep, additive(keep), keep),
        (keep.long(), additive(keep), keep),  # the tokenizer's integer mask
        (torch.zeros(2, 7, dtype=torch.float64).masked_fill(~keep, float("-inf")), additive(keep), keep),  # additive
        (torch.zeros(2, 7, dtype=torch.float32), additive(torch.ones_like(keep)), slice(None)),  # additive, all kept
    ):
        ours, _ = attention_forward(module, q, k, v, ours_mask, scaling=0.37, is_causal=causal)
        eager, _ = eager_attention_forward(module, q, k, v, eager_mask, scaling=0.37)
        assert ours.shape == (2, 7, 4, 16)
        torch.testing.assert_close(ours[rows], eager[rows], rtol=1e-5, atol=1e-6)  # eager's softmax is float32


@pytest.mark.parametrize(
    "mask,message",
    [
        (torch.ones(3, 7, dtype=torch.bool), r"got shape \(3, 7\), expected \(2, n\) with 7 <= n <= 7"),
        (torch.ones(2, 9, dtype=torch.bool), r"got shape \(2, 9\)"),
        (torch.ones(2, 7), r"got a float mask with values in \[1.0, 1.0\], expected an additive mask"),
    ],
)
def test_a_2d_mask_it_cannot_read_is_refused_by_name(mask, message):
    from attnselect.integrations.transformers import attention_forward

    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups, module.training = True, 1, False
    q, k, v = (torch.randn(2, 2, 7, 8, dtype=torch.float64) for _ in range(3))
    with pytest.raises(InvalidInputError, match="attention_mask: " + message):
        attention_forward(module, q, k, v, mask)


def _block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 7, 7, device="cpu")


@pytest.mark.parametrize(
    "mask,message",
    [
        (
            torch.zeros(2, 1, 6, 7),
            r"got shape \(2, 1, 6, 7\), expected \(B or 1, 1 or Hq, Sq or 1, >= Skv\) "
            r"= \(2 or 1, 1 or 4, 7 or 1, >= 7\)",
        ),
        (torch.zeros(2, 1, 7, 6, dtype=torch.bool), r"got shape \(2, 1, 7, 6\)"),  # fewer keys
        (torch.zeros(3, 1, 7, 7), r"got shape \(3, 1, 7, 7\)"),  # another batch
        (torch.zeros(2, 2, 7, 7, dtype=torch.bool), r"got shape \(2, 2, 7, 7\)"),  # K/V heads, not query heads
        (torch.ones(2, 1, 7, 7, dtype=torch.long), r"got a 4-D torch.int64 mask, expected bool .* or floating point"),
        (torch.ones(2, 7, 7, dtype=torch.bool), r"got 3 dims, expected the 2-D padding mask"),
        (torch.ones(2, 1, 1, 7, 7, dtype=torch.bool), r"got 5 dims"),
        (torch.ones(2, 1, 7, 7, dtype=torch.bool, device="meta"), r"got a mask on meta, expected one on cpu"),
        ([[True] * 7] * 2, r"got list, expected None or a tensor"),
        (_block_mask, r"got BlockMask, expected None or a tensor"),  # flex's, built for another implementation
    ],
)
def test_a_mask_of_another_form_is_refused_by_name(mask, message):
    """With GQA (4 query heads, 2 K/V heads), 7 queries and keys, batch 2."""
    from attnselect.integrations.transformers import attention_forward

    q = torch.randn(2, 4, 7, 8, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 7, 8, dtype=torch.float64) for _ in range(2))
    with pytest.raises(InvalidInputError, match="attention_mask: " + message):
        attention_forward(_bare_module(), q, k, v, mask() if callable(mask) else mask)


@pytest.mark.parametrize("builder", ["sdpa", "eager"])
def test_a_4d_mask_that_broadcasts_or_is_longer_reads_as_sdpa_reads_it(builder):
    """Shapes torch's SDPA broadcasts (batch, heads or queries of 1) and a static cache's longer key axis; with -inf
    as the additive mask's masked value, and NaN in it giving what transformers' sdpa gives (NaN rows: the mask is
    used as given, docs/transformers.md)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 7, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 4, 9, 8, generator=g, dtype=torch.float64) for _ in range(2))
    allowed = torch.rand(2, 4, 7, 12, generator=g) > 0.3
    allowed[..., 0] = True  # every query sees a key
    for keep in (allowed, allowed[:1], allowed[:, :1], allowed[:, :, :1], allowed[:1, :1, :1]):
        mask = (
            keep if builder == "sdpa" else torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, -torch.inf)
        )
        ours, _ = attnselect_hf.attention_forward(_bare_module(), q, k, v, mask)
        theirs, _ = sdpa_attention_forward(_bare_module(), q, k, v, mask[..., :9])  # it takes Skv keys
        torch.testing.assert_close(ours, theirs)
    if builder == "eager":
        mask = torch.zeros(2, 1, 7, 9, dtype=torch.float64)
        mask[1, 0, 3, 2] = torch.nan
        ours, theirs = (f(_bare_module(), q, k, v, mask)[0] for f in (attnselect_hf.attention_forward,
                                                                      sdpa_attention_forward))  # fmt: skip
        torch.testing.assert_close(ours, theirs, equal_nan=True)
        assert ours.isnan().any(-1).nonzero().tolist() == [[1, 3, h] for h in range(4)]


def test_a_t5_position_bias_is_refused_not_ignored():
    """T5 and MT5 hand their relative position bias to the attention function (transformers 5; 4.x ran their own
    attention): no attnselect kernel adds it, so the model is refused by name instead of running without it."""
    import inspect

    from transformers.models.mt5 import modeling_mt5

    q = k = v = torch.randn(1, 2, 5, 8)
    with pytest.raises(InvalidInputError, match="position_bias: got a tensor, expected None"):
        attnselect_hf.attention_forward(_bare_module(), q, k, v, None, position_bias=torch.zeros(1, 2, 5, 5))
    if "position_bias=position_bias" not in inspect.getsource(modeling_mt5.MT5Attention.forward):
        return  # this transformers' MT5 runs its own attention, not the registered one
    config = transformers.MT5Config(vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
                                    decoder_start_token_id=0, pad_token_id=0, attn_implementation=NAME)  # fmt: skip
    model = transformers.MT5ForConditionalGeneration(config).eval()
    ids = torch.randint(1, 50, (2, 7), generator=torch.Generator().manual_seed(12))
    with pytest.raises(InvalidInputError, match="position_bias: got a tensor, expected None"):
        model(input_ids=ids, decoder_input_ids=ids[:, :5])


def test_dropout_reaches_the_kernel():
    from attnselect.integrations.transformers import attention_forward

    module = torch.nn.Module()
    module.is_causal = True
    q, k, v = (torch.randn(1, 2, 6, d, generator=torch.Generator().manual_seed(9)) for d in (24, 24, 16))
    plain, _ = attention_forward(module, q, k, v, None)
    torch.manual_seed(0)
    dropped, _ = attention_forward(module, q, k, v, None, dropout=0.5)
    assert not torch.allclose(plain, dropped)


def test_padding_free_packed_batch_matches_separate_sequences():
    from attnselect.integrations.transformers import attention_forward

    module = torch.nn.Module()
    module.is_causal = True
    g = torch.Generator().manual_seed(5)
    q, k = (torch.randn(1, 4, 9, 24, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(1, 4, 9, 16, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    out, weights = attention_forward(
        module, q, k, v, None, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=5, max_length_k=5
    )
    assert weights is None and out.shape == (1, 9, 4, 16)
    for a, b in ((0, 4), (4, 9)):
        alone, _ = attention_forward(module, q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None)
        torch.testing.assert_close(out[:, a:b], alone)


def _bare_module():
    module = torch.nn.Module()
    module.is_causal = True
    return module


def test_documents_marked_by_position_ids_stay_apart():
    from attnselect.integrations.transformers import attention_forward

    g = torch.Generator().manual_seed(6)
    q, k = (torch.randn(1, 2, 7, 8, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 7, 8, generator=g)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    out, _ = attention_forward(_bare_module(), q, k, v, None, position_ids=positions)
    for a, b in ((0, 3), (3, 7)):
        alone, _ = attention_forward(_bare_module(), q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], None)
        torch.testing.assert_close(out[:, a:b], alone)
    plain, _ = attention_forward(_bare_module(), q, k, v, None, position_ids=torch.arange(7)[None])
    whole, _ = attention_forward(_bare_module(), q, k, v, None)
    torch.testing.assert_close(plain, whole)


def test_position_ids_are_read_once_per_forward_not_per_layer(monkeypatch):
    from attnselect.integrations import transformers as integration

    q = k = v = torch.randn(1, 2, 7, 8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    reads = []
    nonzero = torch.nonzero
    monkeypatch.setattr(torch, "nonzero", lambda *a, **kw: reads.append(1) or nonzero(*a, **kw))
    first, _ = integration.attention_forward(_bare_module(), q, k, v, None, position_ids=positions)
    second, _ = integration.attention_forward(_bare_module(), q, k, v, None, position_ids=positions)  # next layer
    assert len(reads) == 1
    torch.testing.assert_close(first, second)
    positions[0, 3:] = torch.arange(3, 7)  # changed in place (its version moves): read again, one document
    third, _ = integration.attention_forward(_bare_module(), q, k, v, None, position_ids=positions)
    assert len(reads) == 2
    torch.testing.assert_close(third, integration.attention_forward(_bare_module(), q, k, v, None)[0])
    with torch.inference_mode():  # no version counter: read on every call, never remembered
        packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
        for _ in range(2):
            torch.testing.assert_close(
                integration.attention_forward(_bare_module(), q, k, v, None, position_ids=packed)[0], first
            )
    assert len(reads) == 4


def test_compiled_calls_follow_new_position_ids():
    from attnselect.integrations import transformers as integration

    q = k = v = torch.randn(1, 2, 7, 8)

    def two_layers(q, k, v, positions):
        once, _ = integration.attention_forward(_bare_module(), q, k, v, None, position_ids=positions)
        twice, _ = integration.attention_forward(_bare_module(), q, k, v, None, position_ids=positions)
        return once + twice

    compiled = torch.compile(two_layers, backend="eager")
    torch._dynamo.reset()
    for positions in (
        torch.tensor([[0, 1, 2, 0, 1, 2, 3]]),
        torch.tensor([[0, 1, 0, 1, 2, 3, 4]]),
        torch.arange(7)[None],
    ):
        torch.testing.assert_close(compiled(q, k, v, positions), two_layers(q, k, v, positions))


def test_sliding_window_keyword_and_unsupported_features():
    import attnselect
    from attnselect.integrations.transformers import attention_forward

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    out, _ = attention_forward(_bare_module(), q, k, v, None, sliding_window=3)
    want = attnselect.attention(q, k, v, layout="bhsd", causal="bottom_right", window=(2, 0)).transpose(1, 2)
    torch.testing.assert_close(out, want)
    assert not torch.allclose(out, attention_forward(_bare_module(), q, k, v, None)[0])
    with pytest.raises(ValueError, match="output_attentions"):
        attention_forward(_bare_module(), q, k, v, None, output_attentions=True)
    mask = torch.zeros(1, 1, 6, 6)
    for kwargs in ({"softcap": 30.0}, {"s_aux": torch.zeros(2)}):  # a 4-D mask runs torch's SDPA: refused
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            attention_forward(_bare_module(), q, k, v, mask, **kwargs)
    module = _bare_module()
    module.is_causal = False
    with pytest.raises(ValueError, match="bidirectional windows"):
        attention_forward(module, q, k, v, None, sliding_window=3)


_CU = torch.tensor([0, 3, 6], dtype=torch.int32)


@pytest.mark.parametrize(
    "mask,kwargs,message",
    [
        (torch.zeros(1, 1, 6, 6), dict(scaling=float("nan")), r"^scaling: got nan"),  # a 4-D mask: checked alike
        (torch.zeros(1, 1, 6, 6), dict(scaling=-3.0), r"^scaling: got -3.0"),
        (torch.zeros(1, 1, 6, 6), dict(dropout=2.0), r"^dropout: got 2.0"),
        (None, dict(cu_seq_lens_q=_CU), r"^cu_seq_lens_k: got None, expected a tensor"),
        (None, dict(cu_seq_lens_q=[0, 3, 6], cu_seq_lens_k=_CU), r"^cu_seq_lens_q: got list, expected an integer"),
        (None, dict(cu_seq_lens_q=_CU.float(), cu_seq_lens_k=_CU), r"^cu_seq_lens_q: got a torch.float32 tensor"),
        (None, dict(cu_seq_lens_q=_CU, cu_seq_lens_k=_CU, max_length_q="abc"), r"^max_length_q: got 'abc'"),
        (None, dict(cu_seq_lens_q=_CU, cu_seq_lens_k=_CU, max_length_k=torch.tensor([3, 3])), r"^max_length_k: got a"),
        (None, dict(position_ids=[0, 1, 2, 0, 1, 2]), r"^position_ids: got list, expected None or a tensor"),
        (None, dict(sliding_window="4"), r"^sliding_window: got '4', expected None or a positive int"),
        (None, dict(sliding_window=0), r"^sliding_window: got 0"),
        (None, dict(sliding_window=-5), r"^sliding_window: got -5"),
        (None, dict(is_causal="no"), r"^is_causal: got 'no', expected None"),
        (
            None,
            dict(cu_seq_lens_q=torch.tensor([0, 2**32 + 6]), cu_seq_lens_k=_CU),  # int64: .int() would wrap it to 6
            r"^cu_seq_lens_q: got boundaries from 0 to 4294967302, expected integers from 0 to 2\*\*31 - 1",
        ),
    ],
)
def test_a_bad_argument_from_the_model_is_refused_by_name(mask, kwargs, message):
    """What a model passes the attention function is checked as attnselect.attention checks its own arguments, on
    every path (a 4-D mask runs torch's SDPA: its tensors and options are checked first all the same)."""
    from attnselect.integrations.transformers import attention_forward

    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    with pytest.raises(InvalidInputError, match=message):
        attention_forward(_bare_module(), q, k, v, mask, **kwargs)


@pytest.mark.parametrize(
    "shapes,dtype,message",
    [
        (((1, 4, 6, 8), (1, 3, 6, 8), (1, 3, 6, 8)), torch.float32, r"^query/key/value heads: got 4, 3, 3"),
        (((1, 2, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8)), torch.int64, r"^query/key/value dtype: got torch.int64"),
    ],
)
def test_a_4d_mask_call_s_tensors_are_checked_before_sdpa(shapes, dtype, message):
    from attnselect.integrations.transformers import attention_forward

    q, k, v = (torch.ones(s, dtype=dtype) for s in shapes)
    with pytest.raises(InvalidInputError, match=message):
        attention_forward(_bare_module(), q, k, v, torch.zeros(1, 1, 6, 6))


@pytest.mark.parametrize("mask", [None, torch.ones(1, 6, dtype=torch.bool), torch.zeros(1, 1, 6, 6)])
@pytest.mark.parametrize(
    "shapes,message",
    [
        (
            ((1, 2, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8)),
            r"^(key/value batch: got 2 and 2, expected the query's 1|k/v batch)",
        ),
        (
            ((1, 2, 6, 8), (1, 2, 6, 8), (1, 2, 5, 8)),
            r"^(value.shape\[2\]: got 5, expected the key's length 6|v.shape)",
        ),
        (((1, 2, 6, 8), (1, 2, 6, 16), (1, 2, 6, 8)), r"^(key.shape\[3\]: got 16, expected the query's|k.shape\[-1\])"),
        (((1, 6, 8), (1, 2, 6, 8), (1, 2, 6, 8)), r"^(query: got shape \(1, 6, 8\), expected a 4-D tensor|q.shape)"),
    ],
)
def test_tensors_that_do_not_fit_together_are_refused_on_every_mask_path(shapes, message, mask):
    """Before a 4-D mask's SDPA (which would broadcast a batch of one silently) or a padding mask's unpadding (which
    would index past them) by the integration; without a mask by attnselect.attention."""
    from attnselect.integrations.transformers import attention_forward

    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(InvalidInputError, match=message):
        attention_forward(_bare_module(), q, k, v, mask)
    with pytest.raises(InvalidInputError, match=r"^(query|q): got str, expected a"):
        attention_forward(_bare_module(), "q", k, v, mask)
    with pytest.raises(InvalidInputError, match=r"^query: got str, expected a 4-D tensor"):  # positions read first
        attention_forward(_bare_module(), "q", k, v, None, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]]))


@pytest.mark.parametrize("name", [None, "", 5])
def test_register_refuses_a_name_that_is_not_a_string(name):
    with pytest.raises(InvalidInputError, match=f"^name: got {name!r}, expected a non-empty string"):
        attnselect_hf.register(name)


def _tiny(config_class, model_class, implementation, **fields):
    torch.manual_seed(0)
    config = config_class(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, pad_token_id=0,
        attn_implementation=implementation, **fields,
    )  # fmt: skip
    return model_class(config).eval()


@pytest.mark.parametrize("training", [False, True])
def test_gemma2_softcapping_matches_eager(training):
    fields = dict(attn_logit_softcapping=0.1, query_pre_attn_scalar=16, sliding_window=4)  # a cap that bites
    ids = torch.randint(3, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    models = [_tiny(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, n, **fields) for n in (NAME, "eager")]
    with torch.set_grad_enabled(training):
        ours, eager = (m(ids).logits for m in models)
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(eager, _tiny(transformers.Gemma2Config, transformers.Gemma2ForCausalLM, "eager",
                              **{**fields, "attn_logit_softcapping": None})(ids).logits, atol=1e-3)  # fmt: skip


def test_gpt_oss_sinks_match_eager_with_their_gradient():
    fields = dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
    ids = torch.randint(3, 97, (1, 11), generator=torch.Generator().manual_seed(2))
    models = [_tiny(transformers.GptOssConfig, transformers.GptOssForCausalLM, n, **fields) for n in (NAME, "eager")]
    for m in models:
        torch.manual_seed(5)
        for layer in m.model.layers:
            torch.nn.init.normal_(layer.self_attn.sinks)  # the checkpoint's sinks, not zeros
    ours, eager = (m(ids).logits for m in models)
    torch.testing.assert_close(ours, eager, rtol=1e-4, atol=1e-4)
    grads = [
        torch.autograd.grad(x.square().sum(), m.model.layers[0].self_attn.sinks)[0]
        for x, m in zip((ours, eager), models)
    ]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-3, atol=1e-5)


def test_without_transformers_register_says_what_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # imported as absent
    with pytest.raises(ImportError, match=r"needs transformers .*pip install 'attnselect\[transformers\]'"):
        attnselect_hf.register()
