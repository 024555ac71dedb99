"""Megatron-core: attnselect as the core attention of MLA, and native V on the packed (thd) path.

    from attnselect.integrations import megatron as attnselect_mcore
    spec = attnselect_mcore.layer_spec(get_gpt_layer_local_spec(multi_latent_attention=True))   # V native too

:class:`CoreAttention` implements Megatron's core-attention contract (DotProductAttention /
TEDotProductAttention): built with (config, layer_number, attn_mask_type, attention_type,
attention_dropout, softmax_scale, k_channels, v_channels, cp_comm_type, pg_collection); called
with query [sq, b, np, hn], key/value [sk, b, ng, hn|hv] (or [t, np, hn] packed, with
``packed_seq_params`` in thd format and its cu_seqlens), ``attention_mask``, ``attn_mask_type``;
returns [sq, b, np * hv] (or [t, np * hv]). ``layer_spec`` puts it into a layer spec's attention
and, unless ``keep_value_native=False``, calls ``skip_thd_value_pad()``.

Context parallelism (``config.context_parallel_size`` > 1, ``cp_comm_type`` 'p2p' or None): attnselect's p2p ring
over ``pg_collection.cp`` (else Megatron's context-parallel group), on the shards Megatron's
get_batch_on_this_cp_rank makes, dense or packed (PackedSeqParams' global boundaries are divided by cp_size here).

QK-clip (``config.qk_clip`` or ``log_max_attention_logit``): as TEDotProductAttention, every forward keeps the
running per-head maximum logit of this rank's heads in ``current_max_attn_logits`` (float32, detached), which
Megatron's ``clip_qk`` all-reduces, uses and resets. ``config.softmax_type`` 'off-by-one' and 'learnable' are
TransformerEngine's softmax offsets, attnselect's sinks: a zero sink, or a learnable (heads per partition,)
float32 parameter ``softmax_offset`` (TE's name), zeros at the start.

``skip_thd_value_pad()`` replaces megatron-core's ``_prepare_mla_core_attention_value`` so that MLA
hands :class:`CoreAttention` V at its own width on packed input instead of zero-padded to the query
width (Megatron-LM #6240: 5.7-11.7% of an H200 training step, and no cuDNN backward at all on
Blackwell for the padded shape); other core attentions keep the stock pad. Importing this module
raises ImportError when megatron-core lacks that function (before 0.19), because skipping the patch
silently would bring back the failure it exists to fix. Megatron-core 0.19 needs Python 3.12.
"""

from __future__ import annotations

import contextlib
import math

import torch

from attnselect import api
from attnselect.errors import InvalidInputError
from attnselect.integrations import optional_int
from attnselect.memos import TensorMemo

try:
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer import multi_latent_attention as _mla
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.utils import is_layer_window_attention
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(f"attnselect.integrations.megatron needs megatron-core >= 0.19 (Python 3.12): {exc}") from exc

if not hasattr(_mla, "_prepare_mla_core_attention_value"):
    raise ImportError(
        "megatron-core has no multi_latent_attention._prepare_mla_core_attention_value (it arrived in "
        "0.19): attnselect cannot keep MLA's V native on packed input with this version"
    )

_STOCK_PREPARE_VALUE = _mla._prepare_mla_core_attention_value

# Megatron mask types in attnselect's terms; padding on packed input is carried by cu_seqlens.
_CAUSAL = {
    AttnMaskType.causal: True,
    AttnMaskType.padding_causal: True,
    AttnMaskType.causal_bottom_right: "bottom_right",
    AttnMaskType.no_mask: False,
}


class CoreAttention(MegatronModule):
    """Megatron core attention on :func:`attnselect.attention` (dense sbhd or packed thd)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout=None,
        softmax_scale=None,
        k_channels=None,
        v_channels=None,
        cp_comm_type=None,
        pg_collection=None,
        **unused,
    ):
        super().__init__(config=config)
        self.cp_size = config.context_parallel_size
        self.cp_group = None
        if self.cp_size > 1:  # attnselect's p2p ring (attnselect.context_parallel), Megatron's default comm type
            if cp_comm_type not in (None, "p2p"):
                raise InvalidInputError(
                    f"cp_comm_type: got {cp_comm_type!r}, expected 'p2p' or None (attnselect's context parallelism "
                    "is a p2p ring; all-to-all and all-gather are not served yet)"
                )
            group = getattr(pg_collection, "cp", None)
            self.cp_group = group if group is not None else parallel_state.get_context_parallel_group()
        softmax_type = getattr(config, "softmax_type", "vanilla")
        if softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise InvalidInputError(
                f"softmax_type: got {softmax_type!r}, expected 'vanilla', 'off-by-one' or 'learnable'"
            )
        # TransformerEngine's softmax offsets are attnselect's sinks: one logit per head of this rank.
        heads = config.num_attention_heads // config.tensor_model_parallel_size
        offset = torch.zeros(heads, dtype=torch.float32, device=torch.cuda.current_device())
        if softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(offset)
        else:
            self.register_buffer("softmax_offset", offset if softmax_type == "off-by-one" else None, persistent=False)
        # QK-clip reads the running max logit here, as TEDotProductAttention keeps it.
        self.track_max_logit = bool(
            getattr(config, "qk_clip", False) or getattr(config, "log_max_attention_logit", False)
        )
        self.current_max_attn_logits = None
        self.attn_mask_type = attn_mask_type
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.window = (
            tuple(config.window_size)
            if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
            else None
        )

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type=None,
        attention_bias=None,
        packed_seq_params=None,
        **unused,
    ):
        if attention_bias is not None:
            raise InvalidInputError("attention_bias: got a tensor, expected None (no bias in attnselect's kernels)")
        mask_type = attn_mask_type or self.attn_mask_type
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if mask_type not in _CAUSAL and not (packed and mask_type == AttnMaskType.padding):
            raise InvalidInputError(
                f"attn_mask_type: got {mask_type}, expected causal, padding_causal, "
                "causal_bottom_right or no_mask (arbitrary masks are not supported)"
            )
        if (
            not packed
            and attention_mask is not None
            and mask_type in (AttnMaskType.padding_causal, AttnMaskType.padding)
        ):
            raise InvalidInputError(
                f"attention_mask: got a padding mask with {mask_type} on dense input, expected "
                "packed input (thd) for padded batches"
            )
        options = dict(
            causal=_CAUSAL.get(mask_type, False),
            scale=self.softmax_scale,
            window=self.window,
            dropout_p=self.dropout_p if self.training else 0.0,
            sinks=self.softmax_offset,
            return_max_logit=self.track_max_logit,
            cp_group=self.cp_group,
        )
        # As Megatron's DotProductAttention: tensor-parallel ranks draw their own dropout masks.
        with tensor_parallel.get_cuda_rng_tracker().fork() if options["dropout_p"] else contextlib.nullcontext():
            if packed:
                packing = _packing(packed_seq_params, self.cp_size)
                out = api.attention(query, key, value, layout="thd", **packing, **options)
            else:
                out = api.attention(query, key, value, layout="sbhd", **options)
        if self.track_max_logit:
            out, max_logit = out
            seen = self.current_max_attn_logits
            self.current_max_attn_logits = max_logit if seen is None else torch.maximum(seen, max_logit)
        return out.reshape(*out.shape[:-2], -1)  # [sq, b, np * hv] or [t, np * hv]


def _packing(params, cp_size: int = 1) -> dict:
    """attnselect's thd arguments from Megatron's PackedSeqParams.

    Under context parallelism Megatron's boundaries and max_seqlen are the global ones (TransformerEngine divides
    them by cp_size, context_parallel.py): this rank's are those divided by ``cp_size``.

    Padded offsets that are the boundaries themselves, or declared without gaps
    (pad_between_seqs=False), are dropped, so kernels that cannot skip gaps stay eligible.
    With other padded offsets the boundaries are read on the host (max_seqlen is then not
    passed), so offsets equal in value are recognised as no gaps.
    """

    def boundaries(cu):  # the same local tensor for every layer of a step, so attnselect's per-tensor work is done once
        if cp_size == 1:
            return cu.int()
        return _LOCAL_BOUNDARIES.get((cu,), cp_size, lambda: _divided(cu, cp_size))

    longest = (
        optional_int(params.max_seqlen_q, "packed_seq_params.max_seqlen_q"),
        optional_int(params.max_seqlen_kv, "packed_seq_params.max_seqlen_kv"),
    )
    args = dict(
        cu_seqlens_q=boundaries(params.cu_seqlens_q),
        cu_seqlens_kv=boundaries(params.cu_seqlens_kv),
        max_seqlen_q=None if longest[0] is None else longest[0] // cp_size,
        max_seqlen_kv=None if longest[1] is None else longest[1] // cp_size,
    )
    gaps = getattr(params, "pad_between_seqs", None)
    for name, bounds in (("cu_seqlens_q_padded", params.cu_seqlens_q), ("cu_seqlens_kv_padded", params.cu_seqlens_kv)):
        offsets = getattr(params, name)
        if offsets is None or offsets is bounds or gaps is False:
            continue
        args[name] = boundaries(offsets)
        if gaps is None:
            args.update(max_seqlen_q=None, max_seqlen_kv=None)
    return args


_LOCAL_BOUNDARIES = TensorMemo()  # a global boundary tensor -> this rank's (divided by cp_size)


def _divided(cu: torch.Tensor, cp_size: int) -> torch.Tensor:
    """This rank's boundaries from the global ones, which must cut every sequence into 2 * cp_size equal chunks
    (checked with one host read per boundary tensor)."""
    if bool((cu % (2 * cp_size)).any()):
        raise InvalidInputError(
            f"packed_seq_params.cu_seqlens: got global boundaries {cu.tolist()[:8]}, expected multiples of "
            f"2 * context_parallel_size = {2 * cp_size} (pad each sequence to one)"
        )
    return torch.div(cu, cp_size, rounding_mode="floor").int()


def layer_spec(spec, *, keep_value_native: bool = True):
    """``spec`` (a ModuleSpec of a transformer layer) with :class:`CoreAttention` as its self-attention's core;
    ``keep_value_native`` (the default) also calls :func:`skip_thd_value_pad`, so this is the one-line switch
    (the patch leaves layers with other core attentions on Megatron's pad)."""
    attention = getattr(spec.submodules, "self_attention", None)
    if attention is None or not hasattr(attention.submodules, "core_attention"):
        raise InvalidInputError(
            "spec: got a layer spec without self_attention.submodules.core_attention, expected "
            "a transformer layer spec such as get_gpt_layer_local_spec(multi_latent_attention=True)"
        )
    attention.submodules.core_attention = CoreAttention
    if keep_value_native:
        skip_thd_value_pad()
    return spec


def skip_thd_value_pad() -> None:
    """Keep MLA's V native on packed input when the layer's core attention is :class:`CoreAttention`."""
    _mla._prepare_mla_core_attention_value = _prepare_value


def _prepare_value(parallel_attention, query, value, packed_seq_params):
    if isinstance(getattr(parallel_attention, "core_attention", None), CoreAttention) and value is not None:
        return value, False, value.shape[-1], value.shape[-1]
    return _STOCK_PREPARE_VALUE(parallel_attention, query, value, packed_seq_params)
