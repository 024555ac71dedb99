"""Peer-like attention calls through attnselect, each judged: no chosen kernel may crash, refuse or be wrong.

    python benchmarks/peer_sweep.py --out results/h200_peer_sweep --deadline 170     # a GPU: every family
    python benchmarks/peer_sweep.py --device cpu --quick --out /tmp/peer               # the CPU smoke test

The calls are those the peers' own test suites make, parameters taken from their sources (each family's generator
names the file and the test), run through ``attnselect.attention(..., return_lse=True)`` with ATTNSELECT_STRICT=1 (a
chosen kernel that fails raises instead of falling back) and, in training, a backward for the peer's kind of random
output gradient:

- ``fa2``: FlashAttention-2, ``tests/test_flash_attn.py`` ``test_flash_attn_output`` and
  ``test_flash_attn_varlen_output``: their head dims, (seqlen_q, seqlen_k) pairs, causal (bottom-right), local
  windows, MHA/MQA/GQA, fp16/bf16, softcap; a covering sample, every value of every axis, not the full product.
- ``fa3``: FlashAttention-3, ``hopper/test_flash_attn.py``, the same two tests: its (d, dv) pairs (192/128, 64/256,
  64/512 forward only, ...), sizes down to one key, zero-length key sequences and unused tokens (seqused) in varlen.
- ``te``: TransformerEngine, ``tests/pytorch/attention/test_attention.py`` ``test_dpa_mla`` (model_configs_mla) and
  ``test_dpa_qkv_layout_thd`` (model_configs_layout_thd, with and without pad_between_seqs).
- ``torch``: PyTorch, ``test/test_transformers.py`` ``test_cudnn_attention_different_dk_dv``,
  ``test_flash_attention_vs_math_ref_grads`` and ``test_mem_efficient_attention_vs_math_ref_grads`` (odd head dims).

**Judgement.** Every sequence (batch row, or packed sequence) is recomputed by a reference written here from the
peer's own mask definition (FlashAttention's construct_local_mask, SDPA's top-left is_causal, TransformerEngine's
get_full_mask), not from attnselect's: float32 math (float64 for float32 inputs) on the inputs as rounded, and the
same math in the inputs' dtype (the naive reference). out, lse, dq, dk and dv pass when their largest error against
the float reference is at most 2x (out, lse) or 3x (gradients) the naive reference's, plus the rounding of the
float reference to the dtype (FlashAttention-2's test_flash_attn_output criterion, FA3's rounding term:
attnselect.correctness). Rows that see no key must give 0 and an lse of -inf; tokens in gaps between packed
sequences a zero output and zero gradients.

**Status** of a case: ``ok``; ``wrong`` (a value out of bounds, a nonzero gap token, or attnselect's own self-check
raising WrongResultError); ``raised`` (the chosen kernel raised, or its process died); ``refused`` (attnselect raised
InvalidInputError or NoSupportedCandidateError: a finding too, as no valid call should be refused); ``unjudged``
(this script could not build or judge the case, or the deadline stopped it mid-case).

The cases run in a worker process that the parent restarts after a crash or a CUDA error (which spoils the context);
the case it died on is recorded as ``raised``. ATTNSELECT_CACHE_DIR is a fresh directory unless ``--cache-dir`` is
given, so earlier runs' recorded failures and compiled kernels do not carry in. Writes ``PREFIX.jsonl`` (a line per
case) and ``PREFIX.md``; the last printed lines summarise. ``--no-lse`` makes the calls without return_lse (out and
gradients judged), which kernels that return no lse serve too: on the CPU only attnselect's reference backend returns
an lse in training, so the smoke test runs both ways.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

FAMILIES = ("fa2", "fa3", "te", "torch")
GRACE_S = 45.0  # a worker still running this long after the deadline is stopped
CUDA_ERRORS = ("CUDA error", "cudaError", "illegal memory access", "CUBLAS_STATUS", "device-side assert")
OUT_FACTOR, GRAD_FACTOR = 2.0, 3.0  # attnselect.correctness: FlashAttention-2's criterion


@dataclass(frozen=True)
class Case:
    """One peer-like call: the tensors' geometry, attnselect's arguments and the peer's own mask for the reference."""

    family: str
    test: str  # "<repository> <file>::<test>"
    name: str  # the peer's parameters
    dtype: str
    layout: str  # attnselect's layout: bshd, sbhd, bhsd or thd
    heads_q: int
    heads_kv: int
    d_qk: int
    d_v: int
    lengths_q: tuple  # one per sequence (dense: the batch's rows, all alike)
    lengths_kv: tuple
    pads_q: tuple | None = None  # thd: gap tokens after each sequence, passed as cu_seqlens_*_padded (None: not passed)
    pads_kv: tuple | None = None
    max_seqlen: tuple | None = None  # thd: (max_seqlen_q, max_seqlen_kv) as the peer passes them
    causal: bool | str = False  # attnselect's arguments for the peer's mask
    window: tuple | None = None
    band: tuple | None = None  # the peer's mask: (diagonal "top_left"/"bottom_right", left, right), None bounds open
    mask: str = "none"  # the peer's name for it
    scale: float | None = None
    softcap: float | None = None
    training: bool = True
    init: str = "randn"  # randn, rand (torch.rand, PyTorch's tests) or te (0.1 * randn)
    q_mult: float = 1.0  # q scaled (FlashAttention's softcap tests)
    grad: str = "randn"  # the output gradient: randn, rand, or te (0.001 * randint(0, 200))
    te_layout: str | None = None  # TransformerEngine's qkv_layout: q/k/v are views of packed buffers
    known: str | None = None  # a refusal attnselect documents
    quick: bool = False

    @property
    def id(self) -> str:
        return f"{self.family}/{self.name}"

    @property
    def configuration(self) -> tuple:
        """What a compiled kernel depends on: head dims, dtype, mask kind, window, GQA ratio, layout kind, phase."""
        ratio = "mqa" if self.heads_kv == 1 < self.heads_q else self.heads_q // self.heads_kv
        layout = "dense" if self.layout != "thd" else "thd gaps" if self.pads_q and any(self.pads_q) else "thd"
        return (self.d_qk, self.d_v, self.dtype, str(self.causal), self.window is not None, ratio, layout,
                self.training, self.softcap is not None)  # fmt: skip


class Fit:
    """Sizes for the device: unchanged on a GPU; on the CPU (or with --max-seqlen/--max-batch) sequence lengths scaled
    down to a cap, keeping the peer's ratio and whether q and kv lengths differ, and batches capped."""

    def __init__(self, max_seqlen: int | None, max_batch: int | None):
        self.max_seqlen, self.max_batch = max_seqlen, max_batch

    def seq(self, sq: int, sk: int) -> tuple[int, int]:
        cap = self.max_seqlen
        if cap is None or max(sq, sk) <= cap:
            return sq, sk
        f = cap / max(sq, sk)
        a, b = max(1, round(sq * f)), max(1, round(sk * f))
        if sq != sk and a == b:  # (1023, 1024) stays unequal
            a, b = (max(1, a - 1), b) if sq < sk else (a, max(1, b - 1))
        return a, b

    def batch(self, b: int) -> int:
        return b if self.max_batch is None else min(b, self.max_batch)


def _spread(values: list, n: int, rng: random.Random) -> list:
    """n values using each of ``values`` about equally often, shuffled: one axis of a covering sample."""
    out: list = []
    while len(out) < n:
        block = list(values)
        rng.shuffle(block)
        out += block
    return out[:n]


def _mark_quick(cases: list[Case], count: int, *wanted) -> list[Case]:
    """Mark ``count`` evenly spaced cases for --quick, and the first case each of the ``wanted`` predicates picks."""
    n = len(cases)
    picks = {round(i * (n - 1) / max(1, count - 1)) for i in range(count)} if n else set()
    picks |= {next((i for i, c in enumerate(cases) if want(c)), -1) for want in wanted}
    return [dataclasses.replace(c, quick=i in picks) for i, c in enumerate(cases)]


def _fa_mask(causal: bool, local: bool, window: list[int]) -> dict:
    """FlashAttention's mask as attnselect's arguments and as the reference's band. FlashAttention aligns causal and
    local windows bottom-right (construct_local_mask: key j is masked when j > i + sk - sq + right or
    j < i + sk - sq - left); with causal the window's right edge is 0 (attention_ref)."""
    left, right = window
    if causal and local:
        band = ("bottom_right", left, 0)
        return dict(causal="bottom_right", window=(left, 0), band=band, mask=f"causal+local({left},0)")
    if causal:
        return dict(causal="bottom_right", band=("bottom_right", None, 0), mask="causal")
    if local:
        return dict(window=(left, right), band=("bottom_right", left, right), mask=f"local({left},{right})")
    return dict(mask="none")


def _heads(mha: str, heads: int, gqa_kv: int) -> tuple[int, int]:
    return heads, heads if mha == "mha" else 1 if mha == "mqa" else gqa_kv


# -- FlashAttention-2 ------------------------------------------------------------------------------------------------
# Dao-AILab/flash-attention tests/test_flash_attn.py (main, 2026-08): test_flash_attn_output parametrizes
# d in [32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256] and 10 (seqlen_q, seqlen_k) pairs;
# test_flash_attn_varlen_output d in [32, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256] and 11 pairs (with (1, 147)).
# Both: batch 4, nheads 6 (4 with softcap), nheads_k 6 / 1 (mqa) / 2 (gqa), causal x local, fp16/bf16, softcap 0/50
# (q scaled by softcap), q/k/v randn, output gradient randn_like, window_size = torch.randint(0, seqlen_k, (2,)) right
# after torch.random.manual_seed(0) (reproduced here). Varlen: lengths randint(max(1, s - 20), s + 1) per sequence
# (generate_random_padding_mask "random"), packed without gaps, max_seqlen the longest. Dropout, alibi and
# deterministic are left out (attnselect judges no dropout; it has no alibi).
FA2 = "Dao-AILab/flash-attention tests/test_flash_attn.py::"
FA2_DIMS = [32, 40, 59, 64, 96, 111, 128, 160, 192, 224, 256]
FA2_VARLEN_DIMS = [32, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256]
FA2_SEQLENS = [(113, 203), (128, 217), (113, 211), (108, 256), (256, 512), (512, 256), (1024, 1024), (1023, 1024),
               (1024, 1023), (2048, 2048)]  # fmt: skip
FA2_VARLEN_SEQLENS = [(1, 147), *FA2_SEQLENS]
MASKS4 = [(False, False), (True, False), (False, True), (True, True)]  # (causal, local)


def fa2_cases(fit: Fit) -> list[Case]:
    cases = []
    for test, dims, seqlens, per in (
        ("test_flash_attn_output", FA2_DIMS, FA2_SEQLENS, 4),
        ("test_flash_attn_varlen_output", FA2_VARLEN_DIMS, FA2_VARLEN_SEQLENS, 3),
    ):
        rng = random.Random(test)
        n = len(dims) * per
        axes = dict(
            seq=_spread(seqlens, n, rng),
            mask=_spread(MASKS4, n, rng),
            mha=_spread(["mha", "mqa", "gqa"], n, rng),
            dtype=_spread(["float16", "bfloat16"], n, rng),
            softcap=_spread([0.0] * 5 + [50.0], n, rng),
            training=_spread([True, True, True, False], n, rng),  # a quarter forward only: the inference choice
        )
        varlen = "varlen" in test
        found = []
        for i in range(n):
            d = dims[i // per]
            (psq, psk), (causal, local), mha, dtype, softcap, training = (axes[a][i] for a in axes)
            sq, sk = fit.seq(psq, psk)
            window = torch.randint(0, sk, (2,), generator=torch.Generator().manual_seed(0)).tolist()
            heads_q, heads_kv = _heads(mha, 6 if softcap == 0.0 else 4, 2)
            batch = fit.batch(4)
            mask = _fa_mask(causal, local, window)
            name = f"{test}[d{d} {psq}x{psk} {mha} {mask['mask']} {dtype}{' softcap50' if softcap else ''}"
            name += f"{'' if training else ' fwd'}]"
            geometry = dict(layout="bshd", lengths_q=(sq,) * batch, lengths_kv=(sk,) * batch)
            if varlen:
                rows = random.Random(name)
                lq = tuple(rows.randint(max(1, sq - 20), sq) for _ in range(batch))
                lk = tuple(rows.randint(max(1, sk - 20), sk) for _ in range(batch))
                geometry = dict(layout="thd", lengths_q=lq, lengths_kv=lk, max_seqlen=(max(lq), max(lk)))
            found.append(
                Case("fa2", FA2 + test, name, dtype, heads_q=heads_q, heads_kv=heads_kv, d_qk=d, d_v=d,
                     softcap=softcap or None, q_mult=softcap or 1.0, training=training, **geometry, **mask)
            )  # fmt: skip
        cases += _mark_quick(found, 3, lambda c: c.d_qk == 59 and c.mask.startswith("causal+local"))
    return cases


# -- FlashAttention-3 ------------------------------------------------------------------------------------------------
# Dao-AILab/flash-attention hopper/test_flash_attn.py (main, 2026-08): test_flash_attn_output and
# test_flash_attn_varlen_output parametrize d over COMPILED_HDIMS [64, 96, 128, 192, 256] with
# dv_vals = [128, d] for 128 < d <= 192, [256, 512, d] for d <= 64, else [d]; nheads 6, nheads_kv 6 / 2 (gqa) / 1;
# batch 9 (2 above 2048 tokens); bf16/fp16 (fp8 left out); softcap 0/15 (q scaled by softcap / 4); causal x local;
# backward only where dv <= 256 (so 64/512 runs forward only). pack_gqa and num_splits are FlashAttention-3's own
# kernel switches, which attnselect's call has no argument for: GQA/MQA cases cover what they serve. The window is
# torch.randint(0, seqlen_k, (2,)) drawn after the attention_chunk draw, per (dv, attention_chunk) iteration, from
# manual_seed(0) (output) or manual_seed(seqlen_q + seqlen_k + d + 2 * causal + local) (varlen); reproduced here for
# attention_chunk = 0 (attnselect has no chunked attention). Varlen: query lengths randint(max(1, s - 20), s + 1),
# key lengths randint(max(0, s - 20), s + 1) with zero-length keys at every 5th sequence and the last
# (generate_random_padding_mask zero_lengths=True); add_unused_qkv leaves each sequence's slot partly unused
# (seqused_q/k), passed to attnselect as cu_seqlens = the used lengths and cu_seqlens_*_padded = the slots.
FA3 = "Dao-AILab/flash-attention hopper/test_flash_attn.py::"
FA3_PAIRS = [(64, 64), (64, 256), (64, 512), (96, 96), (128, 128), (192, 128), (192, 192), (256, 256)]
FA3_SEQLENS = [(1, 1), (64, 128), (128, 192), (256, 256), (239, 1), (799, 3), (113, 203), (113, 128), (128, 217),
               (113, 211), (108, 256), (256, 512), (384, 256), (640, 128), (512, 256), (1024, 1024), (1023, 1024),
               (1024, 1023), (4096, 4096), (4224, 4224)]  # fmt: skip
FA3_VARLEN_SEQLENS = [(1, 1), (1, 3), (2, 1), (511, 1), (3, 513), (64, 128), (128, 128), (256, 256), (113, 203),
                      (128, 217), (113, 211), (108, 256), (256, 512), (307, 256), (640, 128), (512, 256), (1024, 1024),
                      (1023, 1024), (1024, 1023), (2048, 2048), (4096, 4096)]  # fmt: skip


def _fa3_dv_vals(d: int) -> list[int]:
    return [128, d] if 128 < d <= 192 else [256, 512, d] if d <= 64 else [d]


def _fa3_window(seed: int, sk: int, d: int, dv: int, chunk_drawn: bool) -> list[int]:
    """The window FlashAttention-3's test draws for (dv, attention_chunk=0)."""
    g = torch.Generator().manual_seed(seed)
    if chunk_drawn:
        torch.randint(1, sk * 2, (1,), generator=g)
    for value, chunk in itertools.product(_fa3_dv_vals(d), ("drawn", 0)):
        window = torch.randint(0, sk, (2,), generator=g).tolist()
        if value == dv and chunk == 0:
            return window
    raise AssertionError((d, dv))


def fa3_cases(fit: Fit) -> list[Case]:
    cases = []
    for test, seqlens, per in (
        ("test_flash_attn_output", FA3_SEQLENS, 4),
        ("test_flash_attn_varlen_output", FA3_VARLEN_SEQLENS, 3),
    ):
        rng = random.Random("fa3 " + test)
        n = len(FA3_PAIRS) * per
        axes = dict(
            seq=_spread(seqlens, n, rng),
            mask=_spread(MASKS4, n, rng),
            mha=_spread(["mha", "mqa", "gqa"], n, rng),
            dtype=_spread(["bfloat16", "float16"], n, rng),
            softcap=_spread([0.0] * 5 + [15.0], n, rng),
            training=_spread([True, True, True, False], n, rng),
            unused=_spread([False, True], n, rng),
        )
        varlen = "varlen" in test
        found = []
        for i in range(n):
            d, dv = FA3_PAIRS[i // per]
            (psq, psk), (causal, local), mha, dtype, softcap, training, unused = (axes[a][i] for a in axes)
            training = training and dv <= 256  # the test's backward skips dv > 256
            sq, sk = fit.seq(psq, psk)
            seed = psq + psk + d + 2 * causal + local if varlen else 0
            window = _fa3_window(seed, sk, d, dv, chunk_drawn=not varlen or psq <= psk)
            heads_q, heads_kv = _heads(mha, 6, 2)
            peer_batch = 9 if (psq if varlen else psk) <= 2048 else 2
            batch = fit.batch(peer_batch)
            mask = _fa_mask(causal, local, window)
            name = f"{test}[d{d} dv{dv} {psq}x{psk} {mha} {mask['mask']} {dtype}{' softcap15' if softcap else ''}"
            name += f"{' unused' if varlen and unused else ''}{'' if training else ' fwd'}]"
            geometry = dict(layout="bshd", lengths_q=(sq,) * batch, lengths_kv=(sk,) * batch)
            if varlen:
                rows = random.Random(name)  # the peer's batch, of which a capped batch keeps the first sequences
                slot_q = [rows.randint(max(1, sq - 20), sq) for _ in range(peer_batch)][:batch]
                slot_k = [rows.randint(max(0, sk - 20), sk) for _ in range(peer_batch)]
                for s in range(peer_batch):  # zero-length keys every 5 sequences and the last
                    if s % 5 == 0 or s == peer_batch - 1:
                        slot_k[s] = 0
                slot_k = slot_k[:batch]
                used_q, used_k = list(slot_q), list(slot_k)
                if unused:  # padding_mask & another_mask are used, their xor unused: used = min, slot = max
                    other_q = [rows.randint(max(1, sq - 20), sq) for _ in range(batch)]
                    other_k = [rows.randint(max(1, sk - 20), sk) for _ in range(batch)]
                    used_q, slot_q = list(map(min, slot_q, other_q)), list(map(max, slot_q, other_q))
                    used_k, slot_k = list(map(min, slot_k, other_k)), list(map(max, slot_k, other_k))
                geometry = dict(layout="thd", lengths_q=tuple(used_q), lengths_kv=tuple(used_k),
                                max_seqlen=(max(slot_q), max(slot_k)))  # fmt: skip
                if unused:
                    geometry.update(pads_q=tuple(s - u for s, u in zip(slot_q, used_q)),
                                    pads_kv=tuple(s - u for s, u in zip(slot_k, used_k)))  # fmt: skip
            found.append(
                Case("fa3", FA3 + test, name, dtype, heads_q=heads_q, heads_kv=heads_kv, d_qk=d, d_v=dv,
                     softcap=softcap or None, q_mult=softcap / 4 if softcap else 1.0, training=training,
                     **geometry, **mask)
            )  # fmt: skip
        cases += _mark_quick(
            found,
            3,
            lambda c: (c.d_qk, c.d_v) == (192, 128) and c.training,
            lambda c: " unused" in c.name and c.training,
        )
    return cases


# -- TransformerEngine -----------------------------------------------------------------------------------------------
# NVIDIA/TransformerEngine tests/pytorch/attention/test_attention.py (main, 2026-08), ModelConfig from
# tests/pytorch/utils.py: ModelConfig(batch_size, max_seqlen_q, num_heads, head_dim_qk, max_seqlen_kv=, num_gqa_groups=,
# head_dim_v=, attn_mask_type=, window_size=); attn_type is "cross" when max_seqlen_kv differs. test_dpa_mla runs
# model_configs_mla (below) in fp16 and bf16 through test_dot_product_attention: qkv_layout sbhd_sbhd_sbhd for
# self-attention MLA, bshd_bshd_bshd for cross; training; inputs 0.1 * randn, output gradient 0.001 * randint(0, 200).
# test_dpa_qkv_layout_thd runs model_configs_layout_thd in bf16 over the qkv_layouts_thd (t3hd, th3d, thd_t2hd,
# thd_th2d, thd_thd_thd; the 3 layouts not for GQA/MQA or cross), pad_between_seqs True and False:
# _run_dot_product_attention draws seqlens randint(1, max_seqlen) (kv the same tensor's values for self-attention),
# pad_len randint(0, 4) with pad_between_seqs, passes cu_seqlens_q/kv (two tensors), cu_seqlens_*_padded (always; clones
# without padding) and max_seqlen as the config's. TE's masks: "causal"/"padding_causal" top-left, "causal_bottom_right"
# and "padding"/"padding_causal_bottom_right" bottom-right (windows too); padding_causal with a window in
# cross-attention (layout_4_2) has no bottom-right equivalent: attnselect refuses it (tests/test_te_thd_layouts.py).
TE = "NVIDIA/TransformerEngine tests/pytorch/attention/test_attention.py::"
TE_MLA = {  # name: (b, sq, hq, dqk, skv, dv, attn_mask_type)
    "mla_1_0": (8, 128, 16, 64, 128, 128, "no_mask"),
    "mla_1_1": (4, 128, 16, 64, 256, 128, "no_mask"),
    "mla_1_2": (4, 128, 16, 192, 256, 128, "no_mask"),
    "mla_2_0": (2, 2048, 24, 128, 2048, 64, "causal"),
    "mla_2_1": (1, 2048, 24, 128, 4096, 64, "causal"),
    "mla_2_2": (1, 2048, 24, 192, 4096, 128, "causal"),
    "mla_3_0": (8, 1, 16, 128, 2048, 64, "no_mask"),
    "mla_3_1": (8, 1, 16, 256, 2048, 128, "no_mask"),
    "mla_3_2": (8, 1, 16, 192, 2048, 128, "no_mask"),
    "mla_3_3": (8, 1, 16, 160, 2048, 128, "no_mask"),
    "mla_3_4": (8, 1, 16, 160, 2048, 160, "no_mask"),
}
TE_THD_SIZES = {"0": (2, 2048, 16, 64, 2048, 16), "1": (2, 2048, 24, 128, 2048, 1), "2": (2, 2048, 24, 128, 4096, 24)}
TE_THD_MASKS = {  # family: (attn_mask_type, window_size)
    "layout_0": ("padding", None),
    "layout_1": ("padding_causal", None),
    "layout_2": ("padding_causal_bottom_right", None),
    "layout_3": ("padding", (4, 4)),
    "layout_4": ("padding_causal", (4, 0)),
    "layout_5": ("padding_causal_bottom_right", (4, 0)),
}
TE_LAYOUTS = ("thd_thd_thd", "t3hd", "thd_th2d", "th3d", "thd_t2hd")


def _te_mask(mask_type: str, window) -> dict:
    top_left = mask_type in ("causal", "padding_causal")
    bottom_right = mask_type in ("causal_bottom_right", "padding_causal_bottom_right")
    left, right = window if window is not None else (None, None)
    if top_left or bottom_right:
        band = ("top_left" if top_left else "bottom_right", left, 0)
        return dict(causal=True if top_left else "bottom_right", window=window, band=band, mask=mask_type)
    if window is not None:
        return dict(window=window, band=("bottom_right", left, right), mask=mask_type)
    return dict(mask=mask_type)


def te_cases(fit: Fit) -> list[Case]:
    mla = []
    for config, (b, psq, hq, dqk, pskv, dv, mask_type) in TE_MLA.items():
        sq, skv = fit.seq(psq, pskv)
        layout = "sbhd" if psq == pskv else "bshd"  # test_dot_product_attention's qkv_layout for MLA
        for dtype in ("float16", "bfloat16"):
            mla.append(
                Case("te", TE + "test_dpa_mla", f"test_dpa_mla[{config} {dqk}/{dv} {mask_type} {dtype}]", dtype,
                     layout, hq, hq, dqk, dv, (sq,) * fit.batch(b), (skv,) * fit.batch(b), init="te", grad="te",
                     **_te_mask(mask_type, None))
            )  # fmt: skip
    thd = []
    for (family, (mask_type, window)), (variant, (b, pmax_q, hq, d, pmax_kv, hkv)) in itertools.product(
        TE_THD_MASKS.items(), TE_THD_SIZES.items()
    ):
        config = f"{family}_{variant}"
        max_q, max_kv = fit.seq(pmax_q, pmax_kv)
        b = fit.batch(b)
        layouts = [lay for lay in TE_LAYOUTS if "3" not in lay or (hq == hkv and pmax_q == pmax_kv)]
        for pad_between_seqs in (True, False):
            name = f"test_dpa_qkv_layout_thd[{config} {mask_type}{' ' + str(window) if window else ''}"
            te_layout = layouts[(len(thd) // 2 + pad_between_seqs) % len(layouts)]
            name += f" {te_layout}{' pad_between_seqs' if pad_between_seqs else ''}]"
            rows = random.Random(name)
            lq = tuple(rows.randint(1, max(1, max_q - 1)) for _ in range(b))  # torch.randint(1, max_seqlen)
            lk = lq if pmax_q == pmax_kv else tuple(rows.randint(1, max(1, max_kv - 1)) for _ in range(b))
            pad = tuple(rows.randint(0, 3) if pad_between_seqs else 0 for _ in range(b))
            known = None
            thd.append(
                Case("te", TE + "test_dpa_qkv_layout_thd", name, "bfloat16", "thd", hq, hkv, d, d, lq, lk,
                     pads_q=pad, pads_kv=pad, max_seqlen=(max_q, max_kv), init="te", grad="te", te_layout=te_layout,
                     known=known, **_te_mask(mask_type, window))
            )  # fmt: skip
    mla = _mark_quick(mla, 3, lambda c: "mla_1_2" in c.name and c.dtype == "bfloat16")
    thd = _mark_quick(thd, 3, lambda c: "layout_4_0" in c.name and "pad_between" in c.name,
                      lambda c: "layout_4_2" in c.name)  # fmt: skip
    return mla + thd


# -- PyTorch ---------------------------------------------------------------------------------------------------------
# pytorch/pytorch test/test_transformers.py (the stored version, commit 00030eb8): test_cudnn_attention_different_dk_dv
# (bf16, torch.rand inputs, B32 H16 S640, d_qk 128, d_v 64, not causal; the test runs the forward: here also with a
# backward); test_flash_attention_vs_math_ref_grads (batch [1, 8], seq_len_q [4, 8, 64, 143, 256, 512, 1024, 2048],
# seq_len_k [4, 8, 64, 128, 256, 587, 1024, 2048], head_dim [8, 16, 21, 32, 64, 72, 96, 128, 160, 192, 203, 256],
# is_causal only where seq_len_q == seq_len_k, fp16/bf16, scale None or 1/head_dim, n_heads 4, torch.rand inputs and
# output gradient); test_mem_efficient_attention_vs_math_ref_grads (seq lengths [4, 8, 64, 128, 256, 512, 1024, 2048],
# head_dim [8, 16, 32, 64, 72, 96, 128], is_causal any lengths, fp16/bf16/fp32). SDPA's is_causal is top-left;
# layout (B, H, S, D); dropout left out.
PT = "pytorch/pytorch test/test_transformers.py::"
PT_FLASH_DIMS = [8, 16, 21, 32, 64, 72, 96, 128, 160, 192, 203, 256]
PT_FLASH_Q = [4, 8, 64, 143, 256, 512, 1024, 2048]
PT_FLASH_K = [4, 8, 64, 128, 256, 587, 1024, 2048]
PT_EFF_DIMS = [8, 16, 32, 64, 72, 96, 128]
PT_EFF_SEQ = [4, 8, 64, 128, 256, 512, 1024, 2048]


def torch_cases(fit: Fit) -> list[Case]:
    test = "test_cudnn_attention_different_dk_dv"
    sq, _ = fit.seq(640, 640)
    cases = [
        Case("torch", PT + test, f"{test}[B32 H16 S640 128/64 bf16{'' if training else ' fwd'}]", "bfloat16", "bhsd",
             16, 16, 128, 64, (sq,) * fit.batch(32), (sq,) * fit.batch(32), init="rand", grad="rand",
             training=training, quick=training)
        for training in (True, False)
    ]  # fmt: skip
    for test, dims, seq_q, seq_k, dtypes in (
        ("test_flash_attention_vs_math_ref_grads", PT_FLASH_DIMS, PT_FLASH_Q, PT_FLASH_K, ["float16", "bfloat16"]),
        ("test_mem_efficient_attention_vs_math_ref_grads", PT_EFF_DIMS, PT_EFF_SEQ, PT_EFF_SEQ,
         ["float16", "bfloat16", "float32"]),
    ):  # fmt: skip
        rng = random.Random(test)
        n = len(dims) * 2
        axes = dict(
            batch=_spread([1, 8], n, rng),
            sq=_spread(seq_q, n, rng),
            sk=_spread(seq_k, n, rng),
            causal=_spread([True, False], n, rng),
            dtype=_spread(dtypes, n, rng),
            scale=_spread([None, "l1"], n, rng),
        )
        found = []
        for i in range(n):
            d = dims[i // 2]
            batch, psq, psk, causal, dtype, scale = (axes[a][i] for a in axes)
            if causal and "flash" in test:
                psk = psq  # "Flash V2 does not accept is_casual when seq_len_q != seq_len_k": the test skips those
            sq, sk = fit.seq(psq, psk)
            name = f"{test}[d{d} B{batch} {psq}x{psk} {'causal' if causal else 'none'} {dtype} scale={scale}]"
            found.append(
                Case("torch", PT + test, name, dtype, "bhsd", 4, 4, d, d, (sq,) * fit.batch(batch),
                     (sk,) * fit.batch(batch), causal=causal, band=("top_left", None, 0) if causal else None,
                     mask="is_causal" if causal else "none", scale=1 / d if scale else None, init="rand", grad="rand")
            )  # fmt: skip
        cases += _mark_quick(found, 2, lambda c: c.d_qk in (21, 203))
    return cases


GENERATORS = {"fa2": fa2_cases, "fa3": fa3_cases, "te": te_cases, "torch": torch_cases}


def all_cases(families, fit: Fit, quick: bool) -> list[Case]:
    """The cases, interleaved across families and tests, so a run the deadline cuts short still covers each."""
    lists = []
    for family in families:
        by_test: dict = {}
        for case in GENERATORS[family](fit):
            if case.quick or not quick:
                by_test.setdefault(case.test, []).append(case)
        lists.append([c for group in itertools.zip_longest(*by_test.values()) for c in group if c is not None])
    cases = [c for group in itertools.zip_longest(*lists) for c in group if c is not None]
    ids = Counter(c.id for c in cases)
    assert all(n == 1 for n in ids.values()), [i for i, n in ids.items() if n > 1]
    return cases


# -- one case: the call ----------------------------------------------------------------------------------------------


def _te_views(te_layout: str, tq: int, tkv: int, hq: int, hkv: int, d: int, draw) -> list[torch.Tensor]:
    """q, k, v as TransformerEngine makes them for a thd qkv_layout: views of packed buffers (t3hd: one (t, 3, h, d)
    buffer; thd_th2d: q (t, h, d) and one (t_kv, h_kv, 2, d) buffer; ...)."""
    tensors = []
    for i, part in enumerate(te_layout.split("_")):
        t, h = (tq, hq) if i == 0 else (tkv, hkv)
        shape = {"t3hd": (t, 3, h, d), "th3d": (t, h, 3, d), "t2hd": (t, 2, h, d), "th2d": (t, h, 2, d)}.get(part)
        buffer = draw(shape or (t, h, d))
        split = next((j for j, c in enumerate(part[1:]) if c.isdigit()), None)  # 3hd -> 0, h3d -> 1
        tensors += [buffer] if split is None else [x.squeeze(split + 1) for x in buffer.split(1, split + 1)]
    return tensors


def build(case: Case, device: str, with_lse: bool = True):
    """(q, k, v, output gradient, attention()'s keyword arguments, geometry) of a case, seeded by its id."""
    dtype = getattr(torch, case.dtype)
    g = torch.Generator(device=device).manual_seed(zlib.crc32(case.id.encode()))

    def draw(shape):
        x = torch.rand(shape, generator=g, device=device) if case.init == "rand" else (
            torch.randn(shape, generator=g, device=device))  # fmt: skip
        return (0.1 * x if case.init == "te" else x).to(dtype)

    batch, hq, hkv, dqk, dv = len(case.lengths_q), case.heads_q, case.heads_kv, case.d_qk, case.d_v
    kwargs: dict = dict(layout=case.layout, return_lse=with_lse)
    geometry: dict = dict(lengths_q=list(case.lengths_q), lengths_kv=list(case.lengths_kv))
    if case.layout == "thd":
        pads_q, pads_kv = case.pads_q or (0,) * batch, case.pads_kv or (0,) * batch
        cu_q = [0, *itertools.accumulate(case.lengths_q)]
        cu_kv = [0, *itertools.accumulate(case.lengths_kv)]
        off_q = [0, *itertools.accumulate(n + p for n, p in zip(case.lengths_q, pads_q))]
        off_kv = [0, *itertools.accumulate(n + p for n, p in zip(case.lengths_kv, pads_kv))]
        tq, tkv = off_q[-1], off_kv[-1]
        if case.te_layout:
            q, k, v = _te_views(case.te_layout, tq, tkv, hq, hkv, dqk, draw)
        else:
            q, k, v = draw((tq, hq, dqk)), draw((tkv, hkv, dqk)), draw((tkv, hkv, dv))

        def t(x):
            return torch.tensor(x, dtype=torch.int32, device=device)

        kwargs.update(cu_seqlens_q=t(cu_q), cu_seqlens_kv=t(cu_kv), max_seqlen_q=case.max_seqlen[0],
                      max_seqlen_kv=case.max_seqlen[1])  # fmt: skip
        if case.pads_q is not None:
            kwargs.update(cu_seqlens_q_padded=t(off_q), cu_seqlens_kv_padded=t(off_kv))
        geometry.update(starts_q=off_q[:-1], starts_kv=off_kv[:-1], tokens_q=tq, tokens_kv=tkv)
    else:
        sq, skv = case.lengths_q[0], case.lengths_kv[0]
        shape = {"bshd": lambda s, h, d: (batch, s, h, d), "sbhd": lambda s, h, d: (s, batch, h, d),
                 "bhsd": lambda s, h, d: (batch, h, s, d)}[case.layout]  # fmt: skip
        q, k, v = draw(shape(sq, hq, dqk)), draw(shape(skv, hkv, dqk)), draw(shape(skv, hkv, dv))
    if case.q_mult != 1.0:
        q = (q.float() * case.q_mult).to(dtype)
    q, k, v = (x.requires_grad_(case.training) for x in (q, k, v))  # leaves (views of buffers needing no grad, too)
    out_shape = (*q.shape[:-1], dv)
    if case.grad == "te":
        dout = 0.001 * torch.randint(0, 200, out_shape, generator=g, device=device)
    else:
        dout = torch.rand(out_shape, generator=g, device=device) if case.grad == "rand" else (
            torch.randn(out_shape, generator=g, device=device))  # fmt: skip
    for name in ("causal", "window", "scale", "softcap"):
        if getattr(case, name) not in (None, False):
            kwargs[name] = getattr(case, name)
    return q, k, v, dout.to(dtype), kwargs, geometry


def call_text(case: Case, q, k, v, kwargs: dict) -> str:
    """The exact call, to reproduce it: shapes and strides, and every argument (boundaries as lists)."""

    def describe(x):
        return f"{tuple(x.shape)}" + ("" if x.is_contiguous() else f" strides {x.stride()}")

    args = [f"q {describe(q)} {case.dtype}", f"k {describe(k)}", f"v {describe(v)}"]
    for name, value in kwargs.items():
        args.append(f"{name}={value.tolist() if isinstance(value, torch.Tensor) else value!r}")
    phase = "forward+backward" if case.training else "forward (no grad)"
    return f"attention({', '.join(args)}) {phase}"


# -- one case: the reference and the judgement -----------------------------------------------------------------------


def _visible(band, n_q: int, n_kv: int, device) -> torch.Tensor | None:
    """The peer's mask of one sequence, True where query i sees key j: a band around the diagonal j = i + shift, shift 0
    (top-left) or n_kv - n_q (bottom-right), from i + shift - left to i + shift + right, None bounds open."""
    if band is None:
        return None
    align, left, right = band
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_kv, device=device)[None, :]
    diagonal = i + (n_kv - n_q if align == "bottom_right" else 0)
    seen = torch.ones(n_q, n_kv, dtype=torch.bool, device=device)
    if right is not None:
        seen &= j <= diagonal + right
    if left is not None:
        seen &= j >= diagonal - left
    return seen


def _attend(q, k, v, dout, seen, scale: float, softcap, dtype, grads: bool) -> dict:
    """Attention of one sequence, q (Sq, Hq, D) over k/v (Skv, Hkv, D), in ``dtype`` (softmax in float32 at least, as
    attnselect.correctness.reference): out (Sq, Hq, Dv), lse (Hq, Sq), and dq, dk, dv for ``dout``."""
    sq, hq, skv = q.shape[0], q.shape[1], k.shape[0]
    group = hq // k.shape[1]
    qq, kk, vv = (x.detach().to(dtype).requires_grad_(grads) for x in (q, k, v))
    if skv == 0:  # no key at all: zero output, lse -inf, zero gradients
        out = q.new_zeros(sq, hq, v.shape[-1], dtype=dtype)
        lse = torch.full((hq, sq), float("-inf"), device=q.device)
        zeros = (torch.zeros_like(qq), torch.zeros_like(kk), torch.zeros_like(vv)) if grads else (None,) * 3
        return dict(zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *zeros)))
    with torch.enable_grad() if grads else torch.no_grad():
        keys, values = kk.repeat_interleave(group, dim=1), vv.repeat_interleave(group, dim=1)
        scores = torch.einsum("shd,thd->hst", qq, keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        empty = None
        if seen is not None:
            scores = scores.masked_fill(~seen, float("-inf"))
            empty = ~seen.any(-1)
            scores = scores.masked_fill(empty[:, None], 0.0)
        wide = torch.float64 if dtype == torch.float64 else torch.float32
        lse = torch.logsumexp(scores.to(wide), dim=-1)
        probs = torch.softmax(scores.to(wide), dim=-1).to(dtype)
        if empty is not None:
            probs = probs.masked_fill(empty[:, None], 0.0)
            lse = lse.masked_fill(empty, float("-inf"))
        out = torch.einsum("hst,thd->shd", probs, values)
        dq = dk = dv = None
        if grads:
            dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), dout.to(dtype))
    return dict(out=out.detach(), lse=lse.detach(), dq=dq, dk=dk, dv=dv)


def _rows(t: torch.Tensor, layout: str, s: int, start: int, length: int) -> torch.Tensor:
    """Sequence s of a q/k/v/out-like tensor as (S, H, D)."""
    if layout == "thd":
        return t[start : start + length]
    if layout == "bshd":
        return t[s]
    if layout == "sbhd":
        return t[:, s]
    return t[s].transpose(0, 1)  # bhsd


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    if not bool(torch.isfinite(a).all()):
        return float("inf")
    return float((a.double() - b.double()).abs().max())


def judge(case: Case, q, k, v, dout, out, lse, grads, geometry) -> dict:
    """Errors and bounds of out, lse (and dq, dk, dv), over every sequence, and the gap tokens' largest values."""
    dtype = q.dtype
    exact_dtype = torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32
    scale = case.scale if case.scale is not None else 1.0 / math.sqrt(case.d_qk)
    names = ("out", "lse", "dq", "dk", "dv") if case.training else ("out", "lse")
    if lse is None:  # the call did not ask for it (--no-lse)
        names = tuple(n for n in names if n != "lse")
    err, naive, rounding = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
    notes, failures_keyless = [], []
    starts_q, starts_kv = geometry.get("starts_q"), geometry.get("starts_kv")
    for s, (n_q, n_kv) in enumerate(zip(geometry["lengths_q"], geometry["lengths_kv"])):
        if n_q == 0 and n_kv == 0:
            continue
        at_q, at_kv = (starts_q[s], starts_kv[s]) if starts_q is not None else (0, 0)
        piece = lambda t, n, at, s=s: _rows(t, case.layout, s, at, n)
        qs, ks, vs = piece(q, n_q, at_q), piece(k, n_kv, at_kv), piece(v, n_kv, at_kv)
        douts = piece(dout, n_q, at_q)
        seen = _visible(case.band, n_q, n_kv, q.device)
        exact = _attend(qs, ks, vs, douts, seen, scale, case.softcap, exact_dtype, case.training)
        plain = _attend(qs, ks, vs, douts, seen, scale, case.softcap, dtype, case.training)
        got = dict(out=piece(out, n_q, at_q))
        if lse is not None:
            got["lse"] = lse[:, at_q : at_q + n_q] if case.layout == "thd" else lse[s]
        if case.training:
            got.update(dq=piece(grads[0], n_q, at_q), dk=piece(grads[1], n_kv, at_kv), dv=piece(grads[2], n_kv, at_kv))
        keyless = torch.isinf(exact["lse"])  # (h, s): rows that see no key
        rows_out = got["out"].transpose(0, 1)[keyless]
        if rows_out.numel() and bool((rows_out != 0).any()):
            failures_keyless.append(f"sequence {s}: out is not 0 on a row that sees no key")
        for name in names:
            value, ref, other = got[name], exact[name], plain[name]
            if name == "lse":
                if bool((value[keyless] != float("-inf")).any()):
                    err[name] = float("inf")
                    notes.append(f"sequence {s}: lse is not -inf on a row that sees no key")
                value, ref, other = value[~keyless], ref[~keyless], other[~keyless]
                rounding[name] = 1e-5
            else:
                wobble = 2 * _max_abs((ref.to(dtype) + 0.3 - 0.3).to(ref.dtype), ref)
                rounding[name] = max(rounding[name], wobble)
            err[name] = max(err[name], _max_abs(value, ref))
            naive[name] = max(naive[name], _max_abs(other, ref))
    bounds = {n: (OUT_FACTOR if n in ("out", "lse") else GRAD_FACTOR) * naive[n] + rounding[n] + 1e-6 for n in names}
    failures = [n for n in names if not err[n] <= bounds[n]] + ["keyless out"] * bool(failures_keyless)
    notes += failures_keyless[:3]
    floored = [n for n in failures if n in naive and naive[n] == 0.0 and rounding[n] == 0.0]
    if floored:  # e.g. rows that see one key: softmax 1, gradients exactly 0, the naive reference exact too
        notes.append(f"{', '.join(floored)}: the bound is the 1e-6 floor (the naive reference is exact here)")
    gaps = {}
    if case.layout == "thd" and case.pads_q is not None:
        of_q = [("out", out)] + ([("dq", grads[0])] if grads else [])
        of_kv = [("dk", grads[1]), ("dv", grads[2])] if grads else []
        sides = (
            (geometry["tokens_q"], starts_q, geometry["lengths_q"], of_q),
            (geometry["tokens_kv"], starts_kv, geometry["lengths_kv"], of_kv),
        )
        for tokens, starts, lengths, tensors in sides:
            inside = torch.zeros(tokens, dtype=torch.bool, device=q.device)
            for at, n in zip(starts, lengths):
                inside[at : at + n] = True
            for name, t in tensors:
                largest = float(t[~inside].abs().max()) if bool((~inside).any()) else 0.0
                gaps[name] = largest
                if largest != 0.0:
                    failures.append(f"gap {name}")
                    notes.append(f"gap tokens' {name} reaches {largest:.3g} (must be 0)")
    return dict(errors=err, bounds=bounds, failures=failures, gaps=gaps, notes=notes)


# -- one case: run and record ----------------------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:400]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_case(case: Case, device: str, before_call=lambda record: None, with_lse: bool = True) -> dict:
    """Build, choose, call, judge; ``before_call(record)`` sees the record (chosen candidate, exact call) just before
    attention() runs, so a process that dies in the call leaves them behind."""
    import attnselect
    from attnselect.errors import InvalidInputError, NoSupportedCandidateError
    from attnselect.self_check import WrongResultError

    started = time.perf_counter()
    record = dict(family=case.family, case=case.name, test=case.test, dtype=case.dtype, layout=case.layout,
                  te_layout=case.te_layout, mask=case.mask, causal=case.causal, window=case.window,
                  phase="training" if case.training else "inference", heads=[case.heads_q, case.heads_kv],
                  head_dims=[case.d_qk, case.d_v], configuration=list(case.configuration),
                  known=case.known, return_lse=with_lse)  # fmt: skip
    status, error, chosen, judgement = "ok", None, None, None
    try:
        q, k, v, dout, kwargs, geometry = build(case, device, with_lse)
    except Exception as exc:  # this script's failure, not attnselect's
        record.update(status="unjudged", error="building the inputs: " + _first_line(exc))
        return record
    record.update(shapes=dict(q=list(q.shape), k=list(k.shape), v=list(v.shape)), call=call_text(case, q, k, v, kwargs))
    if case.layout == "thd":
        record.update(lengths_q=list(case.lengths_q), lengths_kv=list(case.lengths_kv), pads_q=case.pads_q,
                      pads_kv=case.pads_kv)  # fmt: skip
    with torch.enable_grad() if case.training else torch.no_grad():
        try:
            problem = attnselect.AttentionProblem.from_tensors(q, k, v, **kwargs)
            record.update(problem=problem.describe(), signature=json.loads(json.dumps(problem.signature)))
            decision = attnselect.select(problem)
            chosen, record["candidate"] = str(decision.chosen), decision.chosen.to_dict()
        except (InvalidInputError, NoSupportedCandidateError) as exc:
            status, error = "refused", _first_line(exc)
        out = lse = grads = None
        if status == "ok":
            before_call(dict(record, chosen=chosen))
            try:
                result = attnselect.attention(q, k, v, **kwargs)
                out, lse = result if with_lse else (result, None)
                if case.training:
                    grads = torch.autograd.grad(out, (q, k, v), dout)
                _sync(device)
            except WrongResultError as exc:  # attnselect's own first-use self-check caught the chosen kernel
                status, error = "wrong", "self-check: " + _first_line(exc)
            except (InvalidInputError, NoSupportedCandidateError) as exc:
                status, error = "refused", _first_line(exc)
            except Exception as exc:  # whatever the chosen kernel does is the finding
                status, error = "raised", _first_line(exc)
                frames = traceback.extract_tb(exc.__traceback__)[-10:]  # where it was raised, innermost first
                record["where"] = " < ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(frames))
        if status == "ok":
            try:
                judgement = judge(case, q, k, v, dout, out.detach(), lse, grads, geometry)
                _sync(device)
            except Exception as exc:
                status, error = "unjudged", "judging: " + _first_line(exc)
    if judgement is not None:
        record.update(errors=judgement["errors"], bounds=judgement["bounds"], gaps=judgement["gaps"])
        if judgement["failures"]:
            status = "wrong"
            described = ", ".join(
                f"{n} {judgement['errors'][n]:.3g} > {judgement['bounds'][n]:.3g}"
                for n in judgement["failures"]
                if n in judgement["errors"]
            )
            error = "; ".join(filter(None, [described, *judgement["notes"]]))
    record.update(chosen=chosen, status=status, error=error, seconds=round(time.perf_counter() - started, 3))
    record["cuda_error"] = bool(error and any(s in error for s in CUDA_ERRORS))
    return record


# -- the worker and its parent ---------------------------------------------------------------------------------------


def _done(path: str) -> dict:
    found = {}
    if os.path.exists(path):
        for line in open(path):
            try:
                r = json.loads(line)
            except ValueError:  # a line cut short by a killed worker
                continue
            found[f"{r['family']}/{r['case']}"] = r
    return found


def worker(cases: list[Case], device: str, prefix: str, deadline: float | None, with_lse: bool = True) -> int:
    """Run the cases not yet in PREFIX.jsonl; 3 after a CUDA error (the parent starts a fresh process)."""
    os.environ["ATTNSELECT_STRICT"] = "1"
    done = _done(prefix + ".jsonl")
    todo = [c for c in cases if c.id not in done]
    sink = open(prefix + ".jsonl", "a")
    pending = prefix + ".pending.json"
    for index, case in enumerate(todo):
        if deadline is not None and time.time() > deadline:
            print(f"deadline: {len(todo) - index} cases not run", flush=True)
            return 0
        started = time.time()
        json.dump(dict(family=case.family, case=case.name, started=started), open(pending, "w"))
        record = run_case(
            case, device, lambda r, t=started: json.dump(dict(r, started=t), open(pending, "w")), with_lse
        )
        sink.write(json.dumps(record) + "\n")
        sink.flush()
        os.remove(pending)
        line = f"[{len(done) + index + 1}/{len(cases)}] {case.id} -> {record['status']}"
        line += f" ({record['chosen']}) {record['seconds']}s" + (
            f": {record['error'][:200]}" if record["error"] else ""
        )
        print(line, flush=True)
        if record["cuda_error"]:
            return 3
    return 0


def supervise(args, cases: list[Case], deadline: float | None, cache_dir: str) -> None:
    """Start workers until every case has a record, the deadline passes or workers keep dying; a case a worker died
    on is recorded as raised (or unjudged when the deadline stopped it)."""
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--device", args.device, "--out", args.out,
            "--families", ",".join(args.families)] + (["--quick"] if args.quick else [])  # fmt: skip
    argv += ["--no-lse"] if args.no_lse else []
    argv += [f"--max-seqlen={args.max_seqlen}", f"--max-batch={args.max_batch}"]
    argv += [f"--shard={args.shard}"] if args.shard else []
    if deadline is not None:
        argv += ["--deadline-at", str(deadline)]
    env = dict(os.environ, ATTNSELECT_STRICT="1", ATTNSELECT_CACHE_DIR=cache_dir, PYTHONUNBUFFERED="1")
    pending = args.out + ".pending.json"
    for _attempt in range(25):
        proc = subprocess.Popen(argv, env=env)
        try:
            code = proc.wait(timeout=None if deadline is None else max(1.0, deadline + GRACE_S - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            code = "stopped"
        if os.path.exists(pending):
            died = json.load(open(pending))
            os.remove(pending)
            ran = round(time.time() - died["started"], 1)
            stopped = code == "stopped"
            record = dict(died, status="unjudged" if stopped else "raised", seconds=ran, cuda_error=False,
                          error=f"stopped {GRACE_S:.0f} s after the deadline, {ran} s into the case" if stopped else
                          f"the worker process died running it (exit code {code})")  # fmt: skip
            record.pop("started")
            match = next((c for c in cases if c.id == f"{died['family']}/{died['case']}"), None)
            if match is not None and "test" not in record:
                record.update(test=match.test, dtype=match.dtype, layout=match.layout, mask=match.mask,
                              phase="training" if match.training else "inference", known=match.known,
                              configuration=list(match.configuration))  # fmt: skip
            with open(args.out + ".jsonl", "a") as sink:
                sink.write(json.dumps(record) + "\n")
            print(f"{died['family']}/{died['case']} -> {record['status']}: {record['error']}", flush=True)
        if code == 0 or code == "stopped" or (deadline is not None and time.time() > deadline):
            return
        if len(_done(args.out + ".jsonl")) >= len(cases):
            return
        print(f"worker exited with {code}; starting a fresh one", flush=True)


# -- the report ------------------------------------------------------------------------------------------------------

STATUSES = ("ok", "wrong", "raised", "refused", "unjudged")


def meta(device: str, args, seconds: float, cache_dir: str) -> dict:
    from attnselect.choose import settings
    from attnselect.spec.target import target_for_device

    target = target_for_device(torch.device(device))
    name = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else "CPU"
    return dict(device=name, target=target.to_dict(), date=time.strftime("%Y-%m-%d %H:%M"), quick=args.quick,
                families=list(args.families), strict="1", self_check=settings.self_check_mode(), cache_dir=cache_dir,
                seconds=round(seconds, 1), max_seqlen=args.max_seqlen, max_batch=args.max_batch,
                return_lse=not args.no_lse)  # fmt: skip


def report(records: list[dict], cases: list[Case], info: dict) -> str:
    """PREFIX.md: a table by family, the chosen candidates, and every case that is not ok, with its exact call."""
    target = info["target"]
    versions = ", ".join(f"{k.removesuffix('_version')} {v}" for k, v in target.items() if k.endswith("_version") and v)
    label = info["device"] + (f" ({target['name']}, {target['capability']})" if target["capability"] else "")
    lines = [
        "# Peer-like attention calls through attnselect (ATTNSELECT_STRICT=1)",
        "",
        f"{label}; {versions}. {info['date']}, {info['seconds']} s"
        f"{', --quick' if info['quick'] else ''}; self-check mode {info['self_check']}; sizes capped at "
        f"seqlen {info['max_seqlen']}, batch {info['max_batch']} (None: the peers' own). "
        "Written by benchmarks/peer_sweep.py.",
        "",
        "Each case is a call from a peer's test suite (family below; the script names file, test and parameters), "
        f"run on attnselect's choice with return_lse={info['return_lse']} and, in training, a backward; out, lse, dq, "
        "dk, dv judged "
        "against a float32 reference of the rounded inputs built from the peer's own mask: within 2x (out, lse) or "
        "3x (gradients) the naive same-dtype reference's largest error, plus rounding. refused: attnselect raised "
        "InvalidInputError or NoSupportedCandidateError.",
        "",
        "| family | peer tests | cases | configurations | ok | wrong | raised | refused | unjudged | not run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_id = {f"{r['family']}/{r['case']}": r for r in records}
    for family in [*info["families"], "all"]:
        mine = [c for c in cases if family in (c.family, "all")]
        rows = [by_id[c.id] for c in mine if c.id in by_id]
        counts = Counter(r["status"] for r in rows)
        tests = sorted({c.test.split("::")[1] for c in mine}) if family != "all" else []
        lines.append(
            f"| {family} | {', '.join(tests)} | {len(mine)} | {len({c.configuration for c in mine})} | "
            + " | ".join(str(counts.get(s, 0)) for s in STATUSES)
            + f" | {len(mine) - len(rows)} |"
        )
    lines += ["", "## Chosen candidates", "", "| family | chosen | phase | cases |", "|---|---|---|---|"]
    chosen = Counter((r["family"], r.get("chosen"), r.get("phase")) for r in records if r.get("chosen"))
    for (family, choice, phase), n in sorted(chosen.items(), key=lambda kv: (kv[0][0], -kv[1], str(kv[0]))):
        lines.append(f"| {family} | {choice} | {phase} | {n} |")
    bad = [r for r in records if r["status"] != "ok"]
    lines += ["", f"## Cases not ok ({len(bad)})", ""]
    if not bad:
        lines.append("None.")
    for r in bad:
        known = f" Documented: {r['known']}." if r.get("known") else ""
        lines += [
            f"- **{r['status']}** `{r['family']}` {r['case']} ({r.get('test', '').split('::')[-1]}; chosen "
            f"{r.get('chosen')}): {r.get('error')}.{known}",
            f"  - `{r.get('call', '(no call recorded)')}`",
        ]
    return "\n".join(lines) + "\n"


def summary_lines(records: list[dict], cases: list[Case], info: dict) -> list[str]:
    counts = Counter(r["status"] for r in records)
    head = (
        f"peer_sweep: {len(cases)} cases ({len({c.configuration for c in cases})} configurations) on {info['device']}: "
        + ", ".join(f"{counts.get(s, 0)} {s}" for s in STATUSES)
        + f", {len(cases) - len(records)} not run, in {info['seconds']} s"
        + ("" if info["return_lse"] else " (calls without return_lse)")
    )
    lines = [head]
    for family in info["families"]:
        fam = Counter(r["status"] for r in records if r["family"] == family)
        total = sum(1 for c in cases if c.family == family)
        ran = ", ".join(f"{fam.get(s, 0)} {s}" for s in STATUSES)
        lines.append(f"  {family}: {total} cases, {ran}, {total - sum(fam.values())} not run")
    for r in records:
        if r["status"] != "ok":
            lines.append(
                f"  {r['status']}: {r['family']}/{r['case']} ({r.get('chosen')}): {(r.get('error') or '')[:160]}"
            )
    return lines


FAILED = ("wrong", "raised")  # the statuses whose records name a failure of the chosen candidate


def add_signatures(path: str) -> None:
    """Give each failed record of ``path`` that lacks them its problem signature and chosen candidate, rebuilding
    its case at the peers' own sizes, its problem described as on the GPU."""
    import attnselect

    records = [json.loads(line) for line in open(path)]
    cases = {(c.family, c.name): c for c in all_cases(FAMILIES, Fit(None, None), False)}
    for record in records:
        if record["status"] not in FAILED or "signature" in record or not record.get("chosen"):
            continue
        case = cases[(record["family"], record["case"])]
        q, k, v, _, kwargs, _ = build(case, "cpu", record.get("return_lse") in (True, "True"))
        with torch.enable_grad() if case.training else torch.no_grad():
            # as on the GPU: its boundaries are not read where both max_seqlen are given (meta tensors cannot be
            # read either); where they are read, the CPU's problem is the GPU's
            to_meta = lambda x: (
                x.detach().to("meta").requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x
            )  # noqa: E731
            try:
                problem = attnselect.AttentionProblem.from_tensors(
                    *map(to_meta, (q, k, v)), **{name: to_meta(value) for name, value in kwargs.items()}
                )
            except NotImplementedError:  # a read of the boundaries: the values decide, as on the CPU
                problem = attnselect.AttentionProblem.from_tensors(q, k, v, **kwargs)
        backend, _, pad = record["chosen"].partition(" padded to ")
        record.update(
            signature=json.loads(json.dumps(problem.signature)),
            candidate={"backend": backend.removesuffix(" native"), "pad_to": int(pad) if pad else None},
        )
        print(f"{record['family']}/{record['case']}: {record['candidate']} {record['signature']}")
    with open(path, "w") as sink:
        sink.writelines(json.dumps(r) + "\n" for r in records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="PREFIX: writes PREFIX.jsonl and PREFIX.md")
    ap.add_argument("--device", help="cuda or cpu (default: cuda where torch.cuda.is_available())")
    ap.add_argument("--quick", action="store_true", help="a small subset of every family")
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma list of {', '.join(FAMILIES)}")
    ap.add_argument("--deadline", type=float, help="seconds from now: no case starts after it")
    cap = lambda s: None if s == "None" else int(s)
    ap.add_argument("--max-seqlen", type=cap, default=-1, help="scale sequence lengths down to this "
                    "(default: 128 on the CPU, the peers' on a GPU)")  # fmt: skip
    ap.add_argument(
        "--max-batch", type=cap, default=-1, help="cap batches (default: 2 on the CPU, the peers' on a GPU)"
    )
    ap.add_argument("--cache-dir", help="ATTNSELECT_CACHE_DIR for the run (default: a fresh temporary directory)")
    ap.add_argument("--no-lse", action="store_true", help="call without return_lse (judge out and gradients only): "
                    "kernels that return no lse serve then, e.g. SDPA's on the CPU")  # fmt: skip
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument(
        "--add-signatures",
        metavar="JSONL",
        help="add the problem signature and candidate to each failed record of JSONL (written before records held "
        "them), the case rebuilt on the CPU, and exit",
    )
    ap.add_argument("--inline", action="store_true", help="run in this process (no restart after a crash)")
    ap.add_argument("--resume", action="store_true", help="keep PREFIX.jsonl's records and run the rest")
    ap.add_argument("--workers", type=int, default=1, help="processes sharing the device, each a shard of the cases")
    ap.add_argument("--shard", help=argparse.SUPPRESS)  # K/N: a worker's cases, every N-th from the K-th
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--deadline-at", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = [f for f in args.families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; expected some of {FAMILIES}")
    cpu = args.device == "cpu"
    if args.max_seqlen == -1:
        args.max_seqlen = 128 if cpu else None
    if args.max_batch == -1:
        args.max_batch = 2 if cpu else None
    if args.add_signatures:
        add_signatures(args.add_signatures)
        return
    cases = all_cases(args.families, Fit(args.max_seqlen, args.max_batch), args.quick)
    if args.list:
        for c in cases:
            print(f"{c.id}  q{c.lengths_q[:3]}{'...' if len(c.lengths_q) > 3 else ''} kv{c.lengths_kv[:3]} {c.layout}")
        print(f"{len(cases)} cases, {len({c.configuration for c in cases})} configurations")
        return
    if args.worker:
        if args.shard:
            k, n = map(int, args.shard.split("/"))
            cases = cases[k::n]
        sys.exit(worker(cases, args.device, args.out, args.deadline_at, not args.no_lse))
    started = time.time()
    deadline = started + args.deadline if args.deadline else None
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    if not args.resume:
        for suffix in (".jsonl", ".pending.json"):
            if os.path.exists(args.out + suffix):
                os.remove(args.out + suffix)
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="peer-sweep-")
    if args.inline:
        os.environ.update(ATTNSELECT_STRICT="1", ATTNSELECT_CACHE_DIR=cache_dir)
        worker(cases, args.device, args.out, deadline, not args.no_lse)
    elif args.workers > 1:  # shards side by side, each supervised; their records joined into PREFIX.jsonl
        import copy
        import threading

        shards = []
        for k in range(args.workers):
            shard = copy.copy(args)
            shard.out, shard.shard = f"{args.out}.part{k}", f"{k}/{args.workers}"
            for suffix in (".jsonl", ".pending.json"):
                if not args.resume and os.path.exists(shard.out + suffix):
                    os.remove(shard.out + suffix)
            shards.append(shard)
        threads = [threading.Thread(target=supervise, args=(shard, cases[k :: args.workers], deadline, cache_dir))
                   for k, shard in enumerate(shards)]  # fmt: skip
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        with open(args.out + ".jsonl", "a") as sink:
            for shard in shards:
                if os.path.exists(shard.out + ".jsonl"):
                    sink.write(open(shard.out + ".jsonl").read())
                    os.remove(shard.out + ".jsonl")
    else:
        supervise(args, cases, deadline, cache_dir)
    records = list(_done(args.out + ".jsonl").values())
    order = {c.id: i for i, c in enumerate(cases)}
    records.sort(key=lambda r: order.get(f"{r['family']}/{r['case']}", len(order)))
    info = meta(args.device, args, time.time() - started, cache_dir)
    with open(args.out + ".md", "w") as f:
        f.write(report(records, cases, info))
    print("\n".join(summary_lines(records, cases, info)))
    print(f"wrote {args.out}.jsonl and {args.out}.md")


if __name__ == "__main__":
    main()
