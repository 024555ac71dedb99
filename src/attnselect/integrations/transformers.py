"""Hugging Face transformers: attnselect as an attention implementation, switched on in one line.

    import attnselect.integrations.transformers as attnselect_hf
    name = attnselect_hf.register()                      # "attnselect"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)

The name does not contain "flash", so models that pad V to the query width for FlashAttention
(DeepSeek-V3's attention in transformers 4.x pads whenever the implementation's name is
"flash_attention_2") hand attnselect the native 128-wide V, and attnselect decides.

The interface (transformers' AttentionInterface): query (B, Hq, Sq, Dqk), key (B, Hkv, Skv, Dqk),
value (B, Hkv, Skv, Dv); GQA through the module's key/value heads; ``attention_mask`` None, the
padding mask, or a 4-D mask the caller passed to the model; ``is_causal``, ``dropout``, ``scaling``;
returns ((B, Sq, Hq, Dv), None).

Masks: the registered mask function is transformers' own FlashAttention one, which hands the
attention a 2-D padding mask (B, Skv), True for real tokens, or None when nothing is padded. A
padded batch (batched generation with left padding, training with right padding) is unpadded into
packed sequences (thd, one host read of the lengths, as transformers' FlashAttention path does),
run with bottom-right causal alignment (queries are the last Sq positions of their keys) and
scattered back; padded query rows get zeros. Padding-free packed batches
(``cu_seq_lens_q``/``cu_seq_lens_k`` keyword arguments, as DataCollatorWithFlattening makes them)
run packed directly, as do batches marked only by ``position_ids`` restarting at each document.
A 4-D mask passed to the model (transformers hands it on unchanged), bool (True attends) or additive float, runs
through torch's SDPA with that mask, V still native, and the log says so once; it is used as given (as transformers'
own sdpa and eager do: a NaN in it gives NaN rows, and checking for one would cost a device sync per layer). Masks
of any other type, dtype, device or shape are refused by name; so is a T5-style ``position_bias``, which no
attnselect kernel applies. Logit soft-capping (Gemma 2's ``softcap``) and
attention sinks (GPT-OSS's ``s_aux``) pass through to :func:`attnselect.attention` (``softcap=``,
``sinks=``); with a 4-D mask they are refused with an error, not ignored.

Supported transformers: 4.56 to 5.x (tested: 4.56.2 and 5.24.0).
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch

from attnselect import api
from attnselect.errors import InvalidInputError
from attnselect.integrations import four_dim_tensors, integer_boundaries, optional_int
from attnselect.spec.validate import check_dropout, check_scale

NAME = "attnselect"


def register(name: str = NAME) -> str:
    """Register attnselect with transformers' attention and mask interfaces under ``name``; returns it."""
    if not isinstance(name, str) or not name:
        raise InvalidInputError(f"name: got {name!r}, expected a non-empty string")
    if "flash" in name:
        raise InvalidInputError(
            f"name: got {name!r}, expected a name without 'flash' (transformers pads V to the "
            "query width for implementations named like that)"
        )
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(
            f"attnselect.integrations.transformers.register needs transformers ({exc}): "
            "pip install 'attnselect[transformers]'"
        ) from exc

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])
    return name


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function contract on top of :func:`attnselect.attention`."""
    if kwargs.get("output_attentions") or kwargs.get("head_mask") is not None:
        raise InvalidInputError(
            "output_attentions/head_mask: got a request for attention weights, expected none "
            "(fused kernels do not form them; use attn_implementation='eager')"
        )
    if kwargs.get("position_bias") is not None:
        raise InvalidInputError(
            "position_bias: got a tensor, expected None (an additive position bias, as T5's, is applied by no "
            "attnselect kernel; use attn_implementation='sdpa' or 'eager' for this model)"
        )
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if not isinstance(causal, bool):
        raise InvalidInputError(f"is_causal: got {causal!r}, expected None (the module's is_causal), True or False")
    options = dict(
        causal="bottom_right" if causal else False,
        dropout_p=dropout,
        scale=scaling,
        softcap=kwargs.get("softcap"),  # Gemma 2's attn_logit_softcapping
        sinks=kwargs.get("s_aux"),  # GPT-OSS's learnable sinks, one logit per query head
    )
    window = kwargs.get("sliding_window")
    window = window if window is not None else getattr(module, "sliding_window", None) or None  # 0: none
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise InvalidInputError(f"sliding_window: got {window!r}, expected None or a positive int (keys a query sees)")
    if window:
        if not causal:
            raise InvalidInputError(
                f"sliding_window: got {window} without causal masking, expected causal attention "
                "(bidirectional windows are not supported)"
            )
        options["window"] = (window - 1, 0)  # keys in (q - window, q], as transformers' sliding_window_overlay
    if (attention_mask is not None or kwargs.get("position_ids") is not None or kwargs.get("cu_seq_lens_q") is not None
            or kwargs.get("cu_seq_lens_k") is not None):  # fmt: skip
        _check_tensors(query, key, value)  # read below before attnselect.attention would check them
    if kwargs.get("cu_seq_lens_q") is None and attention_mask is None:
        kwargs.update(_boundaries_from_positions(query, key, kwargs.get("position_ids")))
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        return _packed(query, key, value, kwargs, options), None
    if attention_mask is None:
        out = api.attention(query, key, value, layout="bhsd", **options)
        return out.transpose(1, 2), None
    _check_mask(attention_mask, query)
    if attention_mask.dim() == 4:
        for name in ("softcap", "s_aux"):  # torch's SDPA, which runs a 4-D mask, applies neither
            if kwargs.get(name) is not None:
                raise InvalidInputError(
                    f"{name}: got a value with a 4-D attention_mask, expected None (the explicit mask runs "
                    "through torch's SDPA, which applies neither softcap nor sinks)"
                )
        _check_explicit_call(query, key, value, dropout, scaling)
        return _with_explicit_mask(query, key, value, attention_mask, dropout, scaling), None
    if attention_mask.dim() != 2:
        raise InvalidInputError(
            f"attention_mask: got {attention_mask.dim()} dims, expected the 2-D padding mask of "
            f"the {NAME!r} mask function (B, Skv) or a 4-D mask (B or 1, 1 or Hq, Sq or 1, >= Skv)"
        )
    return _unpadded(query, key, value, _kept_tokens(attention_mask, query, key), options), None


def _check_tensors(query, key, value) -> None:
    """transformers' (B, H, S, D) tensors: one batch, keys and values of one length, query and key of one head dim
    (a few comparisons; attnselect.attention checks the rest, and torch's SDPA under a 4-D mask would broadcast a
    batch of one silently): on the paths where the integration reads them before attnselect.attention would."""
    four_dim_tensors({"query": query, "key": key, "value": value}, "batch, heads, sequence, head dim")
    if not (query.shape[0] == key.shape[0] == value.shape[0]):
        raise InvalidInputError(
            f"key/value batch: got {key.shape[0]} and {value.shape[0]}, expected the query's {query.shape[0]}"
        )
    if key.shape[2] != value.shape[2]:
        raise InvalidInputError(f"value.shape[2]: got {value.shape[2]}, expected the key's length {key.shape[2]}")
    if key.shape[3] != query.shape[3]:
        raise InvalidInputError(f"key.shape[3]: got {key.shape[3]}, expected the query's head dim {query.shape[3]}")


def _check_mask(mask, query) -> None:
    """A mask is a tensor on the query's device (a flex BlockMask, built for another implementation, is not)."""
    if not isinstance(mask, torch.Tensor):
        raise InvalidInputError(
            f"attention_mask: got {type(mask).__name__}, expected None or a tensor: the 2-D padding mask (B, Skv) of "
            f"the {NAME!r} mask function, or a 4-D mask (B or 1, 1 or Hq, Sq or 1, >= Skv)"
        )
    if mask.device != query.device:
        raise InvalidInputError(
            f"attention_mask: got a mask on {mask.device}, expected one on {query.device} (query's)"
        )


def _kept_tokens(mask: torch.Tensor, query, key) -> torch.Tensor:
    """A 2-D padding mask (B, Skv) as bool, True for real tokens. Integer and bool masks keep their nonzero entries
    (the tokenizer's attention_mask); a float mask is additive, as transformers builds them (0 keeps a token, a large
    negative value or -inf masks it), and any other value is refused."""
    batch, sq, skv = query.shape[0], query.shape[2], key.shape[2]
    if mask.shape[0] != batch or not sq <= mask.shape[1] <= skv:
        raise InvalidInputError(
            f"attention_mask: got shape {tuple(mask.shape)}, expected ({batch}, n) with {sq} <= n <= {skv} "
            "(batch, key positions; the queries are the last positions)"
        )
    if not mask.is_floating_point():
        return mask.bool()
    kept = mask == 0
    if not bool((kept | (mask <= -1e4)).all()):
        raise InvalidInputError(
            f"attention_mask: got a float mask with values in [{mask.min().item()}, {mask.max().item()}], expected an "
            "additive mask of 0 (keep) and large negative values or -inf (masked), or a bool/integer padding mask"
        )
    return kept


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check_explicit_call(query, key, value, dropout, scaling) -> None:
    """What torch's SDPA would take silently (a NaN or negative scale) or refuse with an error of its own, checked
    as attnselect.attention checks its arguments, for the calls a 4-D mask sends to SDPA (a few comparisons: the
    full validation cost a third of such a call)."""
    check_scale(scaling, "scaling")
    check_dropout(dropout, "dropout")
    if query.dtype not in _FLOATS or key.dtype != query.dtype or value.dtype != query.dtype:
        raise InvalidInputError(
            f"query/key/value dtype: got {query.dtype}, {key.dtype}, {value.dtype}, expected one floating-point dtype "
            "(float16, bfloat16, float32 or float64)"
        )
    if key.shape[1] != value.shape[1] or key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        raise InvalidInputError(
            f"query/key/value heads: got {query.shape[1]}, {key.shape[1]}, {value.shape[1]}, expected key and value "
            "alike, their count dividing the query's (GQA/MQA)"
        )


def _with_explicit_mask(query, key, value, mask, dropout, scaling):
    """A 4-D mask the caller built and passed to the model (transformers hands it on unchanged): bool (True
    attends) or additive float (0 attends, a large negative value or -inf masks), (B or 1, 1 or Hq, Sq or 1, >= Skv),
    as transformers' sdpa and eager mask functions build them, or a model its own. attnselect's kernels take causal,
    window and padding masks, not arbitrary ones, so this runs torch's SDPA with the mask, which carries the
    causality too (as transformers' own sdpa implementation does); logged once per process. The mask's values are
    used as given: a check for NaN would read them on the host, a device sync per layer."""
    batch, heads, sq, skv = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise InvalidInputError(
            f"attention_mask: got a 4-D {mask.dtype} mask, expected bool (True attends) or floating point "
            "(additive: 0 attends, a large negative value or -inf masks)"
        )
    if (
        mask.shape[0] not in (1, batch)
        or mask.shape[1] not in (1, heads)
        or mask.shape[2] not in (1, sq)
        or mask.shape[3] < skv
    ):
        raise InvalidInputError(
            f"attention_mask: got shape {tuple(mask.shape)}, expected (B or 1, 1 or Hq, Sq or 1, >= Skv) "
            f"= ({batch} or 1, 1 or {heads}, {sq} or 1, >= {skv})"
        )
    _log_explicit_mask()
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask[..., :skv] if mask.dtype == torch.bool else mask[..., :skv].to(query.dtype),
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=key.shape[1] != query.shape[1],
    )
    return out.transpose(1, 2)


@functools.cache
def _log_explicit_mask() -> None:
    logging.getLogger("attnselect").info(
        "attnselect: a 4-D attention_mask was passed to the model; attnselect's kernels take causal, window and "
        "padding masks only, so these calls run torch's scaled_dot_product_attention with that mask"
    )


def _packed(query, key, value, kwargs, options):
    """A padding-free batch: (1, H, T, D) tensors with the sequences' boundaries."""
    if query.shape[0] != 1:
        raise InvalidInputError(f"query.shape[0]: got {query.shape[0]}, expected 1 with cu_seq_lens_q (packed)")
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if kwargs.get(name) is None:
            raise InvalidInputError(f"{name}: got None, expected a tensor with cu_seq_lens_q and cu_seq_lens_k both")
    to_thd = lambda t: t[0].transpose(0, 1)  # noqa: E731   (1, H, T, D) -> (T, H, D)
    out = api.attention(
        to_thd(query),
        to_thd(key),
        to_thd(value),
        layout="thd",
        cu_seqlens_q=integer_boundaries(kwargs["cu_seq_lens_q"], "cu_seq_lens_q"),
        cu_seqlens_kv=integer_boundaries(kwargs["cu_seq_lens_k"], "cu_seq_lens_k"),
        max_seqlen_q=optional_int(kwargs.get("max_length_q"), "max_length_q"),
        max_seqlen_kv=optional_int(kwargs.get("max_length_k"), "max_length_k"),
        **options,
    )
    return out.unsqueeze(0)  # (1, T, H, Dv)


_last_positions: tuple = (lambda: None, -1, {})  # (weakref to position_ids, its version, what they said)


def _boundaries_from_positions(query, key, position_ids) -> dict:
    """A padding-free batch marked only by position_ids restarting at each document (DataCollatorWithFlattening).

    As transformers' FlashAttention path: one row of more than one query whose positions do not
    simply count up is packed; its boundaries are where a position does not follow the previous
    one, and its longest document. Reading them is two host syncs, only for such single-row calls; every layer of a
    forward gets the same position_ids tensor, so it is read once per forward, not once per layer
    (the same tensor object, unchanged since: its version counter). Inference-mode tensors have no
    version counter and traced calls no identity, so those are read every time.
    """
    global _last_positions
    if position_ids is not None and not isinstance(position_ids, torch.Tensor):
        raise InvalidInputError(f"position_ids: got {type(position_ids).__name__}, expected None or a tensor")
    if position_ids is None or query.shape[0] != 1 or query.shape[2] < 2 or key.shape[2] != query.shape[2]:
        return {}  # not a single packed row (a KV cache, where keys outnumber queries, is never packed)
    remember = not torch.compiler.is_compiling() and not position_ids.is_inference()
    seen, version, found = _last_positions
    if remember and seen() is position_ids and position_ids._version == version:
        return found
    positions = position_ids.reshape(-1)
    restarts = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
    found = {}
    if restarts.numel():
        total = positions.new_tensor([positions.numel()])
        cu = torch.cat([positions.new_zeros(1), restarts, total]).int()
        # the longest document too, read with the restarts (as transformers' prepare_fa_kwargs_from_position_ids):
        # a packed call given both max lengths reads no boundaries, and under torch.compile needs them
        longest = int((cu[1:] - cu[:-1]).max())
        found = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
    if remember:
        _last_positions = (weakref.ref(position_ids), position_ids._version, found)
    return found


def _unpadded(query, key, value, keep, options):
    """Run a padded batch as packed sequences of its real tokens; padded query rows get zeros."""
    batch, heads, sq, _ = query.shape
    skv = key.shape[2]
    if keep.shape[1] < skv:  # a static cache longer than the tokens seen so far
        key, value, skv = key[:, :, : keep.shape[1]], value[:, :, : keep.shape[1]], keep.shape[1]
    keep_q = keep[:, skv - sq :]  # the queries are the last Sq positions
    lengths_q, lengths_kv = keep_q.sum(1, dtype=torch.int32), keep.sum(1, dtype=torch.int32)
    cu_q, cu_kv = (torch.nn.functional.pad(n.cumsum(0, dtype=torch.int32), (1, 0)) for n in (lengths_q, lengths_kv))
    tokens = lambda t, rows: t.transpose(1, 2)[rows]  # noqa: E731   (B, H, S, D) -> (T, H, D)
    packed = api.attention(
        tokens(query, keep_q),
        tokens(key, keep),
        tokens(value, keep),
        layout="thd",
        cu_seqlens_q=cu_q,
        cu_seqlens_kv=cu_kv,
        **options,
    )
    out = packed.new_zeros(batch, sq, heads, value.shape[-1])
    out[keep_q] = packed
    return out
