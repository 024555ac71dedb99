"""``flex``: FlexAttention with a block mask, compiled with torch.compile on CUDA.

Every mask kind is one band mask_mod (:mod:`attnselect.spec.masks`) whose bounds are tensors, so
one compiled kernel serves all masks of a given shape and head dims. Packed (thd) input runs
in one call with a document mask: a query sees keys of its own sequence only, inside the
band, which is placed per sequence (bottom-right bands use that sequence's lengths); tokens
in the gaps of padded offsets see nothing. Dense block masks are cached per (mask, lengths,
device); document masks once per cu_seqlens tensor while it and the mask do not change.
On the CPU flex runs eagerly (unfused, correct, slow). lse is natural-log, float32. On CUDA one
process compiles flex_attention for up to RECOMPILE_LIMIT shapes; past them a call raises (and the
guarded fallback runs the next candidate) rather than running unfused.
"""

from __future__ import annotations

import functools
import logging
import warnings

import torch

from attnselect.backends.base import ALL_DTYPES, Backend, Surface
from attnselect.backends.shape_cache import ShapeCache
from attnselect.memos import TensorMemo
from attnselect.spec import masks
from attnselect.spec.options import KernelCall, Packing

log = logging.getLogger("attnselect")

_BIG = 1 << 30  # "unbounded" band edge
GQA_MIN_QUERIES = 128  # flex_attention's default query block (BLOCK_M): below it GQA found no template on the H200


class Flex(Backend):
    name = "flex"
    summary = "FlexAttention (Triton, torch.compile): any mask as a block mask, d_qk != d_v, packed documents"
    layout = "bhsd"
    surfaces = {
        # Source: pytorch torch/nn/attention/flex_attention.py (value is (B, Hkv, S, Ev); head dims
        # rounded up to a power of two inside the Triton template, PR #133495); no dropout argument.
        # Measured limits on the H200: results/h200_rules_grid.md (576/512 runs out of shared memory).
        # CUDA graph capture not yet verified (compiles and builds block masks on first calls).
        # Its block masks are built with functorch's vmap, which fails under the dispatch mode AOTAutograd
        # keeps active while a compiled graph runs ("NYI: querying is_contiguous inside of vmap", and for
        # document masks a fake-tensor error in create_block_mask): measured on the H200 with torch 2.11
        # and on the CPU with torch 2.13, so no compiled graphs on either. Inductor's flex template
        # (torch/_inductor/kernel/flex_attention.py) refuses head dims below 16: "NYI: embedding dimension of the
        # query, key, and value must be at least 16". Softcap is a score_mod; its lse carries a gradient and
        # AuxRequest(max_scores=True) gives each row's largest logit on CUDA only ("Returning max scores is not
        # supported on CPU/MPS"): torch/nn/attention/flex_attention.py, torch/_higher_order_ops/flex_attention.py.
        "cuda": Surface(
            dtypes=ALL_DTYPES - {torch.float64},
            lse_gradient=True,
            softcap=True,
            max_logit=True,
            min_capability=(8, 0),
            max_head_dim=256,
            min_head_dim=16,
            dropout=False,
            packed=True,
            gaps=True,
            cuda_graphs=False,
            compiled_graphs=False,
        ),
        # Eager (unfused) on the CPU: "FlexAttention does not support backward on CPU" (torch 2.13).
        "cpu": Surface(
            dtypes=ALL_DTYPES,
            dropout=False,
            backward=False,
            packed=True,
            gaps=True,
            compiled_graphs=False,
            softcap=True,
        ),
    }

    # A packed call builds a document mask for every new boundary tensor: 3 to 26 ms a packing on the H200
    # (results/h200_thd_bench.md, 2026-11-29), paid every step of a loop that packs anew; on CUDA a new token
    # total also recompiles until torch.compile makes the totals dynamic (from the second, dynamic=None).
    evidence_required = frozenset({"cuda"})  # a young kernel: served where the correctness grid passed
    shape_cache = ShapeCache(
        builds="a block mask (on CUDA also a Triton compile per new shape)",
        keyed_on="the boundary tensors themselves (document masks) and the token totals (the compile)",
        source="attnselect.backends.flex (_document_block_mask, _compiled_flex)",
        rebuilds_per_packing=True,
    )

    def extra_reasons(self, p, t):
        # Correctness grid on the H200 (results/h200_correctness_grid.md, rows 10, 16 and 20, native and padded to
        # 128) and the peer sweep (results/h200_peer_sweep.md, FA2's d32 113x203 GQA case): with grouped K/V heads
        # and fewer than 128 queries, inductor's flex template found no valid configuration (NoValidChoicesError),
        # at every head dim tried; every such row failed, in both processes.
        if t.is_cuda and p.heads_q != p.heads_kv and p.seqlen_q < GQA_MIN_QUERIES:
            return [
                f"no inductor template for grouped K/V heads with fewer than {GQA_MIN_QUERIES} queries (got "
                f"{p.seqlen_q}; results/h200_correctness_grid.md)"
            ]
        return []

    def run(self, q, k, v, call: KernelCall):
        block_mask = _band_block_mask(call.mask, call.window, q.shape[-2], k.shape[-2], q.device)
        return _flex(q, k, v, block_mask, call, dynamic=False)

    def run_packed(self, q, k, v, call: KernelCall, packing: Packing):
        block_mask = _document_block_mask(packing, call.mask, call.window, q.shape[0], k.shape[0], q.device)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        # Packed totals change from step to step: torch.compile (dynamic=None) makes a dimension dynamic once it
        # changes. Heads and head dims stay static, so a process that ran flex at other head dims does not compile
        # symbolic ones (the GPU tests' packed flex training case failed on FakeTensors in such a process,
        # git show af40727:results/h200_gpu_tests_alone_fa4.txt; with this, it passed in
        # results/h200_gpu_tests_with_sweep_fa4.txt and results/h200_gpu_tests_with_sweep.txt).
        for t in (q, k, v):
            torch._dynamo.mark_static(t, 1)
            torch._dynamo.mark_static(t, 3)
        out, lse, *max_logit = _flex(q, k, v, block_mask, call, dynamic=None)
        return out[0].transpose(0, 1), (lse[0] if lse is not None else None), *max_logit


def _flex(q, k, v, block_mask, call, dynamic):
    """flex_attention for one call: ``(out, lse)``, and the per-head max logit after them where asked for."""
    from torch.nn.attention import flex_attention as flex

    fn = _compiled_flex(dynamic) if q.is_cuda else _eager_flex
    if not q.is_cuda and not torch.is_grad_enabled():  # eager flex refuses inputs that require grad even under
        q, k, v = q.detach(), k.detach(), v.detach()  # no_grad ("does not support backward on CPU", torch 2.13)
    options = dict(block_mask=block_mask, scale=call.scale, enable_gqa=q.shape[1] != k.shape[1])
    if call.softcap is not None:
        options["score_mod"] = _softcap_mod(call.softcap)
    if not (call.return_lse or call.return_max_logit):
        return fn(q, k, v, **options), None
    if not hasattr(flex, "AuxRequest"):  # torch before 2.9: return_lse only
        if call.return_max_logit:  # raised, the guarded fallback logs it and runs the next candidate
            raise RuntimeError("this torch's flex_attention has no max_scores (AuxRequest, torch 2.9+)")
        out, lse = fn(q, k, v, return_lse=True, **options)
        return out, _as_float(lse)
    # max_scores: each row's largest logit after score_mod and the mask (-inf where none is visible)
    request = flex.AuxRequest(lse=call.return_lse, max_scores=call.return_max_logit)
    out, aux = fn(q, k, v, return_aux=request, **options)
    lse = _as_float(aux.lse) if call.return_lse else None
    if not call.return_max_logit:
        return out, lse
    return out, lse, aux.max_scores.detach().float().amax(dim=(0, 2))


def _as_float(lse):
    """float32, or float64 where it is (float64 input: the precision sinks rescale by)."""
    return lse if lse.dtype == torch.float64 else lse.float()


@functools.lru_cache(maxsize=16)
def _softcap_mod(softcap: float):
    """Gemma 2's logit softcap as a score_mod (one function per value, so compiled flex reuses its graph)."""

    def softcap_mod(score, batch, head, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return softcap_mod


def _eager_flex(q, k, v, **options):
    """flex_attention unfused, as it runs on the CPU: torch warns on every such call that it materialises the
    scores ("SOLUTION: Use torch.compile"); attnselect says it once, in its own words, and filters torch's."""
    from torch.nn.attention import flex_attention as flex

    _say_eager()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        warnings.filterwarnings("ignore", message=".*materializes the full scores matrix.*")
        return flex.flex_attention(q, k, v, **options)


@functools.cache
def _say_eager() -> None:
    log.info("attnselect: flex runs unfused on the CPU (it materialises the scores: fine for small calls)")


RECOMPILE_LIMIT = 64  # shapes one process may compile flex_attention for (torch's default is 8)


@functools.cache
def _compiled_flex(dynamic):
    from torch.nn.attention.flex_attention import flex_attention

    return _failing_past_recompile_limit(torch.compile(flex_attention, dynamic=dynamic))


def _failing_past_recompile_limit(compiled):
    """``compiled`` with room for RECOMPILE_LIMIT shapes, raising past them: torch.compile would otherwise
    run flex_attention eagerly, which materialises every score (64 GiB for 16k tokens and 64 heads) and is
    many times slower, silently; raised, the guarded fallback logs it and runs the next candidate. The
    settings are patched per call (about 15 us), leaving the user's own torch.compile settings alone."""
    settings = _recompile_settings()
    if settings is None:
        log.info(
            "attnselect: this torch has no dynamo setting to fail past a recompile limit; flex keeps "
            "torch's own limit and its eager fallback"
        )
        return compiled

    def call(*args, **kwargs):
        with torch._dynamo.config.patch(**settings):
            return compiled(*args, **kwargs)

    return call


def _recompile_settings():
    """The dynamo settings for a hard recompile limit, by their names in this torch (renamed in 2.7), or None; with
    every float a constant where this torch has the setting (``specialize_float``).

    Floats: under ``dynamic=None`` (packed calls) torch.compile traces a float it has seen with a second value (the
    softcap in the score_mod's closure, the scale) as a symbolic one, and torch 2.11's flex training then fails in
    create_fw_bw_graph ("all unwrapped values must be FakeTensor, int, or SymInt"): on the H200, packed softcap-50
    training after a softcap-15 call, and passes with floats constant (results/h200_flex_probe_softcap_pair.md;
    the peer sweep's case, results/h200_peer_sweep_replay_shard1of6.jsonl). Dense calls compile with
    ``dynamic=False``, where floats stay constants anyway. A packed call pays one compile per softcap and scale,
    which a model keeps."""
    config = torch._dynamo.config
    for limit, fail in (
        ("recompile_limit", "fail_on_recompile_limit_hit"),
        ("cache_size_limit", "fail_on_cache_limit_hit"),
    ):
        if hasattr(config, limit) and hasattr(config, fail):
            floats = {"specialize_float": True} if hasattr(config, "specialize_float") else {}
            return {limit: RECOMPILE_LIMIT, fail: True, **floats}
    return None


def _band_edges(mask, window, device):
    """(left, right) band edges as tensors (_BIG when unbounded), and whether the band is bottom-right."""
    _, left, right = masks.band(mask, window, 1, 1) or (0, None, None)
    # torch.full fills on the device: no host-to-device copy, no sync.
    as_tensor = lambda x: torch.full((), _BIG if x is None else x, device=device)  # noqa: E731
    return as_tensor(left), as_tensor(right), mask in ("causal_bottom_right", "sliding_window")


@functools.lru_cache(maxsize=64)
def _band_block_mask(mask, window, sq, skv, device):
    from torch.nn.attention.flex_attention import create_block_mask

    left, right, bottom_right = _band_edges(mask, window, device)
    offset = torch.full((), skv - sq if bottom_right else 0, device=device)

    def band_mask(batch, head, q_idx, kv_idx):
        diagonal = q_idx + offset
        return (kv_idx <= diagonal + right) & (kv_idx >= diagonal - left)

    return create_block_mask(band_mask, B=None, H=None, Q_LEN=sq, KV_LEN=skv, device=device)


def _documents(cu_seqlens, offsets, total, device):
    """Per token: its sequence (-1 in a gap), its position in it, and that sequence's length. No host sync."""
    token = torch.arange(total, device=device, dtype=torch.int32)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if lengths.numel() == 0:
        return torch.full_like(token, -1), token, token
    doc = torch.searchsorted(offsets[1:], token, right=True).clamp_max(lengths.numel() - 1)
    position = token - offsets[doc]
    length = lengths[doc]
    return torch.where(position < length, doc, -1), position, length


# Document masks, once per packing tensor while it and the mask do not change (attnselect.memos).
_DOCUMENT_MASKS = TensorMemo()


def _document_block_mask(packing: Packing, mask, window, total_q, total_kv, device):
    tensors = (packing.cu_seqlens_q, packing.cu_seqlens_kv, packing.offsets_q, packing.offsets_kv)
    return _DOCUMENT_MASKS.get(
        tensors,
        (mask, window, total_q, total_kv),
        lambda: _build_document_mask(packing, mask, window, total_q, total_kv, device),
    )


def _build_document_mask(packing, mask, window, total_q, total_kv, device):
    from torch.nn.attention.flex_attention import create_block_mask

    doc_q, pos_q, len_q = _documents(packing.cu_seqlens_q, packing.offsets_q, total_q, device)
    doc_kv, pos_kv, _ = _documents(packing.cu_seqlens_kv, packing.offsets_kv, total_kv, device)
    left, right, bottom_right = _band_edges(mask, window, device)
    diagonal = pos_q
    if bottom_right:  # align each sequence's diagonal to its last key
        lengths_kv = packing.cu_seqlens_kv[1:] - packing.cu_seqlens_kv[:-1]
        diagonal = pos_q + lengths_kv[doc_q.clamp_min(0)] - len_q if lengths_kv.numel() else pos_q

    def document_mask(batch, head, q_idx, kv_idx):
        same = (doc_q[q_idx] == doc_kv[kv_idx]) & (doc_q[q_idx] >= 0)
        d = diagonal[q_idx]
        return same & (pos_kv[kv_idx] <= d + right) & (pos_kv[kv_idx] >= d - left)

    # Compiled on CUDA so the T x T mask is evaluated block by block, not materialised.
    return create_block_mask(
        document_mask, B=None, H=None, Q_LEN=total_q, KV_LEN=total_kv, device=device, _compile=device.type == "cuda"
    )
