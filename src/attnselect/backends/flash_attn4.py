"""``flash_attn4``: FlashAttention-4 (CuTe DSL), module flash_attn.cute, when it is installed.

Dense ``flash_attn_func`` and packed ``flash_attn_varlen_func`` (cu_seqlens, max_seqlen), forward and
backward, GQA, bottom-right causal and (left, right) windows, lse, deterministic backward. FA4 compiles
each configuration on first use; attnselect switches on its on-disk cache of compiled kernels under
attnselect's cache directory unless the caller set FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED /
FLASH_ATTENTION_CUTE_DSL_CACHE_DIR (read when flash_attn.cute is first imported).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys

import torch

from attnselect.backends import flash_attn4_replay
from attnselect.backends._flash_attn import FlashAttnPackageBackend
from attnselect.backends.base import HALF, Surface
from attnselect.backends.shape_cache import ShapeCache
from attnselect.memos import cache_dir
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Package

log = logging.getLogger("attnselect")

SM90_BACKWARD_HEAD_DIMS = frozenset({24, 32, 56, 64, 96, 128, 192, 256})  # measured correct (extra_reasons)
CACHE_ENABLED, CACHE_DIR = "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"


class FlashAttn4(FlashAttnPackageBackend):
    name = "flash_attn4"
    summary = "FlashAttention-4 (flash_attn.cute): dense and packed thd, sm90-sm11x, 192/128 natively, fwd+bwd"
    package = Package("flash-attn-4", "flash_attn.cute", shared_module=True)
    module = "flash_attn.cute"
    unbounded = None
    lse_argument = "return_lse"  # always returns (out, lse)
    calls_before_replay = flash_attn4_replay.CALLS_BEFORE_REPLAY  # runner(), packed_runner()
    # its lse is float32 and -inf on rows that see no key, as ours (flash_attn/cute/softmax.py Softmax.finalize,
    # which flash_fwd.py and flash_fwd_sm90.py call, and flash_fwd_sm100.py's correction epilogue: row_sum == 0 or
    # NaN gives -inf)
    keyless_lse_posinf = False
    # Source: Dao-AILab/flash-attention flash_attn/cute/interface.py: fp16/bf16; forward arch 8.x-12.x
    # (_flash_attn_fwd), backward 9.x-12.x (_flash_attn_bwd); head dims multiples of 16 bytes (8 in 16 bit);
    # no dropout argument; flash_attn_varlen_func takes cu_seqlens_q/k and max_seqlen_q/k, whose sequences
    # sit back to back (no separate padded offsets, so no gaps); deterministic backward except on sm120.
    # Captured into CUDA graphs and inside torch.compile(fullgraph=True), dense and packed, it matched float64 on
    # the H200 (results/h200_gpu_tests_fa4.txt, 4.0.0b36), bit-identical gradients under deterministic mode too.
    surfaces = {
        "cuda": Surface(
            dtypes=HALF,
            min_capability=(9, 0),
            max_capability=(11, 9),
            head_dim_multiple=8,
            max_head_dim=512,
            dropout=False,
            causal_is_bottom_right=True,
            packed=True,
            # flash_attn/cute/interface.py: softcap= becomes a score_mod with its backward (SM90+); the returned
            # lse takes a gradient (dlse in the backward when return_lse=True).
            softcap=True,
            lse_gradient=True,
        )
    }
    # interface.py _flash_attn_fwd: cute.compile once per compile_key (dtype, head dims, GQA ratio, causal,
    # window, varlen, lse, tile sizes and split choices derived from the lengths), not per length. A process's
    # first forward+backward of a 192/128 configuration took 13 s (dense) and 19 s (packed) with an empty disk
    # cache, 6.5 and 10 s with a filled one, on the H200 (results/h200_fa4_compile.md).
    evidence_required = frozenset({"cuda"})  # a young kernel: served where the correctness grid passed
    shape_cache = ShapeCache(
        builds="compiled CuTe DSL kernels",
        keyed_on="dtype, head dims, GQA ratio, causal, window, varlen and the tile sizes "
        "chosen from the lengths, not the lengths themselves",
        source="flash-attention flash_attn/cute/interface.py (compile_key)",
        new_key_ms=13000.0,
    )

    extra_reasons_read_sizes = False  # the head dims, the GPU, the phase and the K/V grouping

    def extra_reasons(self, p, t):
        r = []
        dqk, dv = p.head_dim_qk, p.head_dim_v
        # interface.py _validate_head_dims: SM90 any pair in 8..256; SM100/110 both <= 128, 192/128 (its
        # backward: flash-attention PR #2270), (64 or dv)/512 and 256/256 (the lower bound of 8: the surface's
        # head_dim_multiple).
        if t.capability[0] == 9:
            ok = max(dqk, dv) <= 256
        else:
            ok = max(dqk, dv) <= 128 or (dqk, dv) in ((192, 128), (256, 256)) or (dv == 512 and dqk in (64, 512))
        if not ok:
            r.append(
                f"head dims {dqk}/{dv} are not served on {t.arch} (sm90: both in 8..256; sm100: both <= 128, "
                "192/128, 256/256 or 64/512)"
            )
        # 4.0.0b36 on the H200 (results/h200_rules_grid.md, its FA4 rows): the sm90 backward returned wrong
        # gradients (relative error 0.75 to 0.89) for head dims 8, 16, 40, 48, 80 and 112, and matched float64 for
        # the others measured, so training is served for those only.
        if p.training and t.capability[0] == 9 and not {dqk, dv} <= SM90_BACKWARD_HEAD_DIMS:
            r.append(
                f"its sm90 backward gave correct gradients on the H200 only for head dims "
                f"{', '.join(map(str, sorted(SM90_BACKWARD_HEAD_DIMS)))}; got {dqk}/{dv}"
            )
        # 4.0.0b36 on the H200 (results/h200_gpu_tests_fa4.txt): the sm90 backward raises "GQA backward requires
        # head_dim == head_dim_v" for grouped K/V heads with d_qk != d_v; its padded candidate serves them.
        if p.training and t.capability[0] == 9 and p.heads_q != p.heads_kv and dqk != dv:
            r.append(
                f"its sm90 backward needs d_qk == d_v with grouped K/V heads (GQA), got {dqk}/{dv} with "
                f"{p.heads_q}/{p.heads_kv} heads"
                + (f"; padding to {p.pad_target} serves it" if p.pad_target in SM90_BACKWARD_HEAD_DIMS else "")
            )
        return r

    def replay_start_calls(self, problem: AttentionProblem) -> int:
        # runner(): a dense window's edges read the lengths, and softcap becomes a score_mod: FA4's own call each time
        dense_window = problem.layout != "thd" and problem.mask == "sliding_window"
        return 0 if dense_window or problem.softcap else self.calls_before_replay

    def runner(self, call, *, repeated: bool = False, like: tuple | None = None):
        """FA4's ``flash_attn_func`` with ``call`` bound; where the runner serves repeated calls (attnselect.attention's
        memoized ones), a call that needs no gradient replays the compiled forward a call of its shapes ran before
        (attnselect.backends.flash_attn4_replay: FA4's Python interface costs more host time than its kernel at small
        sizes)."""
        run = super().runner(call, repeated=repeated, like=like)
        # a one-off runner (a call under torch.compile, the self-check's) never calls again; a window's edges read
        # the lengths: the base runner's own call
        if not repeated or call.mask == "sliding_window":
            return run
        # with ``like``, every call is like the first (attention()'s memo checked it): no key to work out again
        return self._replayed(call, run, "flash_attn_func", fixed=like is not None) or run

    def packed_runner(self, call, *, repeated: bool = False):
        """:meth:`runner`'s counterpart for packed calls (``flash_attn_varlen_func``)."""
        run = super().packed_runner(call, repeated=repeated)
        return (self._replayed(call, run, "flash_attn_varlen_func") or run) if repeated else run

    def _replayed(self, call, run, function: str, *, fixed: bool = False):
        """``run``, replaying FA4's forward where the call needs no gradient, or None where FA4's forward is not
        replayed (softcap becomes a score_mod; another FA4 version)."""
        if call.softcap:
            return None
        module = self._module()
        replays = flash_attn4_replay.replays(module, getattr(module, function), self._options(call, 1, 1), fixed=fixed)
        if replays is None:
            return None
        lse, grad_enabled, forward_ad = self._lse, torch.is_grad_enabled, torch.autograd.forward_ad

        def replayed(q, k, v, *packing):
            # a gradient, or a forward-mode tangent (dual tensors: FA4's autograd Function refuses them), needs FA4's
            # own call
            if (grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)) or (
                forward_ad._current_level >= 0
            ):
                return run(q, k, v, *packing)
            return lse(call, replays(q, k, v, *packing))

        return replayed

    def _module(self):
        if self.module not in sys.modules:
            _enable_compile_cache()
        return importlib.import_module(self.module)


def _enable_compile_cache() -> None:
    """FA4's on-disk cache of compiled kernels under attnselect's cache directory, unless the caller chose."""
    if CACHE_ENABLED in os.environ or CACHE_DIR in os.environ:
        return
    directory = cache_dir() / "flash_attn_cute"
    os.environ[CACHE_ENABLED], os.environ[CACHE_DIR] = "1", str(directory)
    log.info(
        "attnselect: FlashAttention-4 keeps its compiled kernels in %s (set %s=0 to switch that off)",
        directory,
        CACHE_ENABLED,
    )
