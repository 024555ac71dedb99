"""torchtitan: every attention call of a torchtitan decoder model through :func:`attnselect.attention`.

    import attnselect.integrations.torchtitan as attnselect_titan
    model = attnselect_titan.apply(model)          # a built model: the same object, parameters and state-dict keys
    # or, before the model is built, as one of torchtitan's model converters:
    spec = model_registry("16B", converters=[attnselect_titan.AttnSelectConverter.Config()])

The hook point is each layer's ``attention.inner_attention`` (torchtitan 0.3.0, ``models/common/attention.py``):
``FlexAttention`` (the default), ``VarlenAttention`` or ``ScaledDotProductAttention``, called as ``(q, k, v, *,
attention_masks, scale, enable_gqa, ...)`` with (B, L, H, D) tensors. Each is swapped for a subclass of its own
class (``isinstance`` checks in torchtitan's trainer, compile, context parallelism and sharding still see what they
saw) whose forward calls :func:`attnselect.attention`; its arguments keep their names (tensor parallelism's
``local_map`` is keyed on them). DeepSeek-V3's MLA passes q/k 192 and a strided 128-wide v: they go in natively,
attnselect decides any padding. The model's dtype is kept (torchtitan's varlen path casts to bf16).

Masks keep their meaning, never silently plain causal:

- ``ScaledDotProductAttention``: ``is_causal`` (torchtitan's SDPA takes no mask);
- ``VarlenAttention``: its ``VarlenMetadata`` (cu_seqlens over the flattened B*L tokens) as the packed thd layout,
  causal, or its config's ``window_size`` (W, 0) as a causal sliding window;
- ``FlexAttention``: the ``BlockMask`` torchtitan builds for packed documents (``get_attention_masks``: causal and
  same-document, documents starting where ``positions == 0``). The documents are read back from its ``mask_mod``
  (token i starts one where it may not see token i - 1), the mask is checked on every (query, key) pair against
  causal within those documents, and they run as the packed thd layout; any other BlockMask is refused. They are
  worked out once per BlockMask and batch size (every layer of a step shares them). Rows of one document each run
  as a dense causal call.

Refused with :class:`~attnselect.errors.InvalidInputError`: a module that is not a torchtitan decoder, a flex
``score_mod``, masks missing where the inner attention needs them, ``out_transform`` in training (attnselect's lse
takes no gradient), and context parallelism (query and key lengths
differ, or DTensor inputs): torchtitan's context parallelism gathers K/V around flex or shards SDPA through
DTensor, neither of which this call follows (``attnselect.context_parallel`` is attnselect's own).

Supported torchtitan: 0.3.0 (tested on the CPU: the DeepSeek-V3, Llama 3 and Qwen3 debug models).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import re

import torch

from attnselect import api
from attnselect.errors import InvalidInputError
from attnselect.integrations import four_dim_tensors, optional_int


def apply(model):
    """Make every attention call of the torchtitan decoder ``model`` run through :func:`attnselect.attention`; returns
    the same model. The inner attention of each decoder layer and MTP layer changes class (to a subclass of its
    own), nothing else; other attention modules (a vision encoder's) are left alone."""
    classes = _classes()
    from torchtitan.models.common.decoder import Decoder

    if not isinstance(model, Decoder):
        raise InvalidInputError(
            f"model: got {type(model).__name__}, expected a torchtitan decoder model "
            "(torchtitan.models.common.decoder.Decoder: DeepSeek-V3, Llama 3, Qwen3, ...)"
        )
    found = []
    for name, module in model.named_modules():
        if not _LAYER_ATTENTION.fullmatch(name) or type(module) in classes.values():
            continue
        if type(module) not in classes:
            raise InvalidInputError(
                f"model.{name}: got {type(module).__name__}, expected torchtitan's FlexAttention, VarlenAttention "
                "or ScaledDotProductAttention (a subclass's own behaviour would be lost)"
            )
        if "forward" in module.__dict__:  # parallelize()'s local_map or context parallelism wrapped it
            raise InvalidInputError(
                f"model.{name}: got an inner attention whose forward torchtitan has wrapped (parallelize, context "
                "parallelism), expected apply() before parallelizing, or the converter (AttnSelectConverter)"
            )
        found.append(module)
    if not found and not any(type(m) in classes.values() for m in model.modules()):
        raise InvalidInputError(
            f"model: got a {type(model).__name__} without inner attention modules in its layers, expected a model "
            "whose layers hold torchtitan's FlexAttention, VarlenAttention or ScaledDotProductAttention"
        )
    for module in found:
        module.__class__ = classes[type(module)]
    return model


# The inner attention of a decoder layer or an MTP layer (torchtitan's Decoder.layers, DeepSeek-V3's mtp_layers).
_LAYER_ATTENTION = re.compile(r"(?:.*\.)?(?:layers|mtp_layers)\.[^.]+\.attention\.inner_attention")


def _forward(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, is_causal=True,
             score_mod=None, out_transform=None, **kwargs):  # fmt: skip
    """The inner attention's forward, through attnselect (the arguments of torchtitan's inner attentions)."""
    kind = self.attnselect_kind  # set on the class once (_classes)
    four_dim_tensors({"q_BLNH": q_BLNH, "k_BLNH": k_BLNH, "v_BLNH": v_BLNH}, "batch, length, heads, head dim")
    if score_mod is not None:
        raise InvalidInputError(
            "score_mod: got a function, expected None: attnselect runs masks it knows, not arbitrary score mods"
        )
    if any(type(t).__name__ == "DTensor" for t in (q_BLNH, k_BLNH, v_BLNH)) or q_BLNH.shape[1] != k_BLNH.shape[1]:
        raise InvalidInputError(
            f"q_BLNH, k_BLNH: got {q_BLNH.shape[1]} queries and {k_BLNH.shape[1]} keys a row"
            + (" as DTensors" if type(q_BLNH).__name__ == "DTensor" else "")
            + ", expected local tensors of equal lengths: torchtitan's context parallelism is not served through "
            "attnselect (attnselect.context_parallel is its own)"
        )
    packing, causal, window = None, True, None
    if kind == "sdpa":
        if attention_masks is not None:
            raise InvalidInputError("attention_masks: got a mask, expected None (ScaledDotProductAttention's)")
        if not isinstance(is_causal, bool):
            raise InvalidInputError(f"is_causal: got {is_causal!r}, expected True or False")
        causal = is_causal
    elif kind == "varlen":
        packing = _varlen_packing(attention_masks)
        causal, window = _varlen_mask(self.window_size)
    else:
        packing = _flex_packing(attention_masks, q_BLNH)
    batch, length = q_BLNH.shape[:2]
    lse = out_transform is not None
    if lse and torch.is_grad_enabled() and any(t.requires_grad for t in (q_BLNH, k_BLNH, v_BLNH)):
        raise InvalidInputError(
            "out_transform: got a function in training, expected None: attnselect's log-sum-exp takes no gradient "
            "(attention sinks go through attnselect.attention(sinks=))"
        )
    mask = dict(causal=causal) if window is None else dict(window=window)
    if packing is None:
        result = api.attention(q_BLNH, k_BLNH, v_BLNH, **mask, scale=scale, return_lse=lse)
        out, lse_BNL = (result[0], result[1]) if lse else (result, None)
        lse_BLN = lse_BNL.transpose(1, 2) if lse else None
    else:
        cu_q, cu_k, max_q, max_k = packing
        tokens = batch * length
        result = api.attention(
            q_BLNH.reshape(tokens, *q_BLNH.shape[2:]), k_BLNH.reshape(tokens, *k_BLNH.shape[2:]),
            v_BLNH.reshape(tokens, *v_BLNH.shape[2:]), layout="thd", cu_seqlens_q=cu_q,
            cu_seqlens_kv=cu_k, max_seqlen_q=max_q, max_seqlen_kv=max_k, **mask, scale=scale, return_lse=lse,
        )  # fmt: skip
        out, lse_NT = (result[0], result[1]) if lse else (result, None)
        out = out.view(batch, length, *out.shape[1:])
        lse_BLN = lse_NT.transpose(0, 1).reshape(batch, length, -1) if lse else None
    return out if out_transform is None else out_transform(out, lse_BLN)


def _varlen_mask(window_size) -> tuple[bool | str, tuple[int, int] | None]:
    """VarlenAttention's window_size as attnselect's mask: (-1, 0) causal, (-1, -1) none, (W, 0) a window, each
    bottom-right aligned as varlen_attn's."""
    if not (
        isinstance(window_size, (tuple, list))
        and len(window_size) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) for x in window_size)
    ):
        raise InvalidInputError(f"window_size: got {window_size!r}, expected (-1, 0), (-1, -1) or (W, 0)")
    left, right = window_size
    if (left, right) == (-1, 0):  # varlen_attn's causal mask is bottom-right aligned (FlashAttention's)
        return "bottom_right", None
    if (left, right) == (-1, -1):
        return False, None
    if left >= 0 and right == 0:
        return False, (left, 0)
    raise InvalidInputError(f"window_size: got {(left, right)}, expected (-1, 0), (-1, -1) or (W, 0)")


def _varlen_packing(masks):
    from torchtitan.models.common.attention import VarlenMetadata

    if not isinstance(masks, VarlenMetadata):
        raise InvalidInputError(
            f"attention_masks: got {type(masks).__name__}, expected the VarlenMetadata of model.get_attention_masks"
        )
    return (masks.cu_seq_q, masks.cu_seq_k, optional_int(masks.max_q, "attention_masks.max_q"),
            optional_int(masks.max_k, "attention_masks.max_k"))  # fmt: skip


_PACKING = "_attnselect_packing"  # a BlockMask's documents, worked out once (every layer of a step shares them)


def _flex_packing(mask, q):
    """The documents of torchtitan's packed-document BlockMask, as (cu_seqlens, cu_seqlens, longest, longest) over
    the flattened tokens, or None where every row is one document (a dense causal call)."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(mask, BlockMask):
        raise InvalidInputError(
            f"attention_masks: got {type(mask).__name__}, expected the BlockMask of model.get_attention_masks"
        )
    cached = mask.__dict__.setdefault(_PACKING, {})  # by (batch, length): a batch-1 mask may serve any batch
    key = (q.shape[0], q.shape[1])
    if key not in cached:
        cached[key] = _documents(mask, *key, q.device)
    return cached[key][0]


def _documents(mask, batch: int, length: int, device) -> tuple:
    """(packing or None,): the documents of ``mask``, a causal same-document mask, checked on every (query, key)
    pair: token i starts a document where it may not see token i - 1, and the mask must be exactly causal within
    those documents (anything else is refused, never run as something it is not)."""
    if tuple(mask.seq_lengths) != (length, length) or mask.shape[0] not in (1, batch) or mask.shape[1] != 1:
        raise InvalidInputError(
            f"attention_masks: got a BlockMask of {tuple(mask.shape)} for {tuple(mask.seq_lengths)} query/key "
            f"positions, expected one of every head alike for ({batch}, 1, {length}, {length})"
        )
    positions = torch.arange(length, device=device)
    rows, wrong = [], torch.zeros((), dtype=torch.bool, device=device)  # read on the host once, at the end
    for b in range(batch):
        row = torch.full((length,), b if mask.shape[0] > 1 else 0, device=device)
        zero = torch.zeros_like(row)
        before = mask.mask_mod(row, zero, positions, (positions - 1).clamp(min=0)).to(torch.bool)
        starts = (positions == 0) | ~before
        document = torch.cumsum(starts.to(torch.int64), 0)
        for first in range(0, length, _CHECK_ROWS):  # the whole (query, key) table, a block of queries at a time
            q = positions[first : first + _CHECK_ROWS, None]
            seen = mask.mask_mod(row[: q.shape[0], None], zero[: q.shape[0], None], q, positions[None, :])
            expected = (positions[None, :] <= q) & (document[None, :] == document[q])
            wrong |= (seen.to(torch.bool) != expected).any()
        rows.append(starts.nonzero().flatten() + b * length)
    boundaries = torch.cat([*rows, torch.tensor([batch * length], device=device)])
    # the check's verdict and the longest document in one transfer (besides each row's document starts)
    lengths = boundaries[1:] - boundaries[:-1]
    longest = lengths.max() if lengths.numel() else lengths.new_zeros(())
    wrong, longest = torch.stack([wrong.to(torch.int64), longest]).tolist()
    if wrong:
        raise InvalidInputError(
            "attention_masks: got a BlockMask that is not causal within documents (torchtitan's packed-document "
            "mask), expected that mask: attnselect reads documents from it and runs nothing else"
        )
    if boundaries.numel() - 1 == batch:
        return (None,)
    cu = boundaries.to(torch.int32)
    return ((cu, cu, longest, longest),)


_CHECK_ROWS = 1024  # queries checked at once: 1024 x the length of (query, key) pairs


_KIND_OF = {"FlexAttention": "flex", "VarlenAttention": "varlen", "ScaledDotProductAttention": "sdpa"}


@functools.cache
def _classes() -> dict:
    """{torchtitan's inner attention class: attnselect's subclass of it}, made once."""
    attention = _torchtitan("models.common.attention")
    made = {}
    for name in _KIND_OF:
        base = getattr(attention, name)
        config = dataclasses.dataclass(kw_only=True, slots=True)(
            type("Config", (base.Config,), {"__module__": __name__, "__qualname__": f"AttnSelect{name}.Config"})
        )
        members = {"forward": _forward, "Config": config, "attnselect_kind": _KIND_OF[name], "__module__": __name__}
        made[base] = type(f"AttnSelect{name}", (base,), members)
        globals()[f"AttnSelect{name}"] = made[base]  # found by name: pickled models and configs load again
    return made


def _convert_config(config):
    """An inner attention config as attnselect's subclass of its class, its fields kept; others unchanged."""
    for base, ours in _classes().items():
        if type(config) is base.Config:
            return ours.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init})
    return config


def _torchtitan(module: str):
    """torchtitan's ``module``, or an ImportError that says what to install (an optional extra, as megatron's)."""
    try:
        return importlib.import_module(f"torchtitan.{module}")
    except ImportError as exc:
        raise ImportError(
            f"attnselect.integrations.torchtitan needs torchtitan ({exc}): pip install 'attnselect[torchtitan]'"
        ) from exc


def _converter():
    ModelConfigConverter = _torchtitan("protocols.model").ModelConfigConverter  # noqa: N806

    class AttnSelectConverter(ModelConfigConverter):
        """torchtitan model converter: every layer's inner attention (MTP layers included) through attnselect."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(ModelConfigConverter.Config):
            pass

        def __init__(self, config: Config):
            pass

        def convert(self, model_config):
            for layer in [*getattr(model_config, "layers", []), *(getattr(model_config, "mtp_layers", None) or [])]:
                attention = getattr(layer, "attention", None)
                if attention is not None and hasattr(attention, "inner_attention"):
                    attention.inner_attention = _convert_config(attention.inner_attention)
            return model_config

    AttnSelectConverter.__module__ = __name__
    return AttnSelectConverter


def __getattr__(name: str):
    if name == "AttnSelectConverter":  # torchtitan is imported only when asked for
        converter = globals()["AttnSelectConverter"] = _converter()
        return converter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
