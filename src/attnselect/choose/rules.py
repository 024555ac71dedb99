"""The rules policy: rank supported candidates by their predicted time where a calibration holds, else by a
preference table per arch family and phase.

Where a calibration of this GPU and these library versions holds (:mod:`attnselect.choose.calibration`), the
supported candidates go by their predicted time for the call (:mod:`attnselect.choose.predict`), the table breaking
ties and the backends the calibration skips last (packed: the candidates that run sequence by sequence too). A
packed candidate's calibrated host time includes what it rebuilds for a new packing, so the demotion below and the
refinements for small packs are the table's, where no calibration holds. Elsewhere the table
orders them, as follows.

A table lists candidates fastest first ("name" = native, "name+pad" = padded). Padding wins
only where a padded entry ranks above every supported native one. Supported candidates the
table does not list rank last, in registry order. On packed (thd) input a candidate whose backend
builds something for every new packing (:class:`~attnselect.backends.shape_cache.ShapeCache`,
``rebuilds_per_packing``) then moves down to just after the last candidate on its path (one packed call,
or sequence by sequence) that does not, since a training loop packs anew every step: on the H200 loop
(results/h200_training_loop.md) no such candidate was faster with its rebuild than those without one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch

from attnselect.backends.base import all_backends
from attnselect.backends.base import get as backend_named
from attnselect.choose import calibration
from attnselect.choose.predict import Curve, Prediction, curve, rest_lengths
from attnselect.spec.options import Candidate, Verdict
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target

_SLOW_TAIL = ("sdpa_efficient", "sdpa_efficient+pad", "sdpa_math", "sdpa_math+pad", "reference", "reference+pad")

PREFERENCES: dict[tuple[str, str], tuple[str, ...]] = {
    # H200, torch 2.11, cuDNN 9.19 (docs/sources/h200-measurements.md), fwd+bwd TFLOP/s, 192/128:
    # cuDNN 392 (frontend 399) > cuDNN padded 275 > FA2 padded 189 > flex 154 > efficient 45 > padded 36;
    # 128/128: cuDNN 425 > flex 327 > FA2 236 > efficient 117. TransformerEngine (utils.py) drops
    # FlashAttention when fused attention also serves on sm90+, so FA3 follows cuDNN. FA4 (flash-attn-4 4.0.0b36)
    # led cuDNN on every dense problem measured on the same H200 (docs/sources/h200-measurements-2026-12.md,
    # fwd+bwd TFLOP/s, causal bf16: B2 S4k H16 192/128 455 against 414; B1 S8k H128 493/478; B1 S16k H16 502/493;
    # 128/128 542/481; 192/192 523/372; forward 629/507 to 701/570).
    ("sm90", "training"): (
        "flash_attn4",
        "sdpa_cudnn",
        "cudnn_frontend",
        "flash_attn3",
        "flash_attn4+pad",
        "sdpa_cudnn+pad",
        "cudnn_frontend+pad",
        "flash_attn3+pad",
        "flash_attn2+pad",
        "sdpa_flash+pad",
        "flex",
        "flash_attn2",
        "sdpa_flash",
        "flex+pad",
        *_SLOW_TAIL,
    ),
    # Same machine, forward TFLOP/s, 192/128: cuDNN 500 (frontend 514) > cuDNN padded 473 > flex 273 >
    # FA2 padded 222 > efficient 135 > padded 100; 128/128: cuDNN 514 > flex 335 > FA2 269 > efficient 150.
    ("sm90", "inference"): (
        "flash_attn4",
        "sdpa_cudnn",
        "cudnn_frontend",
        "flash_attn3",
        "flash_attn4+pad",
        "sdpa_cudnn+pad",
        "cudnn_frontend+pad",
        "flash_attn3+pad",
        "flex",
        "flash_attn2",
        "sdpa_flash",
        "flash_attn2+pad",
        "sdpa_flash+pad",
        "flex+pad",
        *_SLOW_TAIL,
    ),
    # A100: no fused cuDNN kernel above head dim 128 (TE fused_attn.cpp); Megatron-LM #6241 measured
    # padded FA2 0.96 ms against 113.7 ms for the native fallback. TE prefers FlashAttention below sm90.
    ("sm80", "training"): (
        "flash_attn2",
        "sdpa_flash",
        "flash_attn2+pad",
        "sdpa_flash+pad",
        "sdpa_cudnn",
        "cudnn_frontend",
        "sdpa_cudnn+pad",
        "cudnn_frontend+pad",
        "flex",
        "flex+pad",
        *_SLOW_TAIL,
    ),
    # Blackwell: Megatron-LM #6241 on sm103, core attention 0.35 ms native against 0.45 ms padded;
    # padded 192/192 has no cuDNN backward (sdpa_cudnn rules). TE prefers fused attention on sm90+; the cuDNN
    # frontend's GB200 DSv3 results (dsv3_20260724_041401.csv, causal 8k) put cuDNN ahead of FA4 too (fwd 1646
    # against 1576, bwd 1257 against 1101 TFLOP/s), so FA4 follows cuDNN there. FA4 serves MLA's 192/128 natively on
    # sm100, forward and backward (flash_attn/cute/interface.py _validate_head_dims; the backward: flash-attention
    # PR #2270), so flash_attn4 ranks above every padded candidate.
    ("sm100", "training"): (
        "sdpa_cudnn",
        "cudnn_frontend",
        "flash_attn4",
        "sdpa_cudnn+pad",
        "cudnn_frontend+pad",
        "flash_attn4+pad",
        "flash_attn2",
        "sdpa_flash",
        "flash_attn2+pad",
        "sdpa_flash+pad",
        "flex",
        "flex+pad",
        *_SLOW_TAIL,
    ),
    # CPU: SDPA's C++ flash kernel is the fused path; math and reference materialise the scores and
    # eager flex is an unfused fallback.
    ("cpu", "training"): (
        "sdpa_flash",
        "sdpa_flash+pad",
        "sdpa_math",
        "sdpa_math+pad",
        "flex",
        "flex+pad",
        "reference",
        "reference+pad",
    ),
}
# Packed (thd) input. Backends without a packed kernel run sequence by sequence and rank after the
# packed ones ("per-sequence" below). H200, 32k tokens in 18 sequences, 192/128 causal bf16
# (docs/sources/h200-measurements.md), fwd+bwd TFLOP/s: cuDNN frontend THD 357 > padded 233 >
# varlen_attn V padded 186 > flex document mask 147 > per-sequence SDPA 87; forward: 471 > 376 >
# flex 266 > varlen padded 215 > per-sequence 199. FA4's varlen kernel, same GPU (h200-measurements-2026-12.md):
# 570 / 435 against the frontend's 461 / 390 on that packing, and 5.2 against 7.6 ms a step in a loop that packs
# anew (long-tailed documents; 1.6 against 2.0 ms on short chat turns).
_PER_SEQUENCE = (
    "sdpa_cudnn",
    "flash_attn3",
    "sdpa_cudnn+pad",
    "flash_attn2",
    "sdpa_flash",
    "flash_attn2+pad",
    "sdpa_flash+pad",
    *_SLOW_TAIL,
)
PREFERENCES.update(
    {
        ("sm90", "training", "thd"): (
            "flash_attn4",
            "cudnn_frontend",
            "flash_attn4+pad",
            "cudnn_frontend+pad",
            "varlen_fa2+pad",
            "flex",
            "varlen_fa2",
            "flex+pad",
            *_PER_SEQUENCE,
        ),
        ("sm90", "inference", "thd"): (
            "flash_attn4",
            "cudnn_frontend",
            "flash_attn4+pad",
            "cudnn_frontend+pad",
            "flex",
            "varlen_fa2+pad",
            "varlen_fa2",
            "flex+pad",
            *_PER_SEQUENCE,
        ),
        # A100: FA2 first as for dense input; Blackwell: cuDNN first (padded 192/192 cannot train there).
        ("sm80", "training", "thd"): (
            "varlen_fa2",
            "varlen_fa2+pad",
            "cudnn_frontend",
            "cudnn_frontend+pad",
            "flex",
            "flex+pad",
            *_PER_SEQUENCE,
        ),
        ("sm100", "training", "thd"): (
            "cudnn_frontend",
            "cudnn_frontend+pad",
            "flash_attn4",
            "flash_attn4+pad",
            "varlen_fa2",
            "varlen_fa2+pad",
            "flex",
            "flex+pad",
            *_PER_SEQUENCE,
        ),
        # CPU: eager flex would materialise a T x T score matrix for the whole pack; per sequence is smaller.
        ("cpu", "training", "thd"): (
            "sdpa_flash",
            "sdpa_flash+pad",
            "sdpa_math",
            "sdpa_math+pad",
            "flex",
            "flex+pad",
            "reference",
            "reference+pad",
        ),
    }
)
# Refinements, keyed by the base key plus a name, for problems where the measured order differs.
# "small training pack" (thd, sm90 training, little work in the whole pack): the cuDNN frontend's torch op spends
# about 2 ms of host time per forward+backward call, so when the pack's GPU work is smaller than that, varlen_attn
# with V padded is faster (192/128, 16 heads, fwd+bwd ms queued: results/h200_thd_bench.md, 16k tokens of
# 128..512-token documents, 1.40 against 2.02; results/h200_thd_crossover.md, equal documents of 128 / 256 / 512
# tokens, 1.02 / 1.42 / 1.44 against 2.04 / 2.00 / 2.25, at 1024 (work 8.6e10) they trade places between runs, and
# with more work, 16k of 2048-token documents or 32k of 256..1024, cuDNN leads, 2.16 against 3.36 and 2.26 against
# 3.50). The work bound is H * (d_qk + d_v) * sequences * max_seqlen^2 (the forward's FLOPs with every sequence as
# long as the longest): 6.7e10 for the 16k pack of 128..512 (51 sequences), 1.7e11 for 2048-token documents. Long
# documents in a small pack are below it too: 1024 tokens in 1 to 8 documents (up to 1000 tokens long), 128/128,
# training without FA4 on an H100, attention() took 1660.2 us a call where the frontend served 92 of the 150
# packings (those with a document over 512 tokens, before this table took them) against varlen_attn's 609.5
# (results/h100_new_packing_parts_training_e58eab5_nofa4.md), and the H200's calibration, host times included,
# ranks varlen_fa2 first on all 150.
# Forward only, the order stays: uncontended, cuDNN led that pack (0.24 ms against 0.39 for flex and varlen); the
# crossover run, beside another GPU's test suite, had flex ahead on equal short documents, which is unsettled.
# The "small pack" table below, tested first, takes the causal packs of even less work, FA4's host time in mind.
SMALL_TRAINING_PACK_WORK = 8e10
PREFERENCES[("sm90", "training", "thd", "small training pack")] = (
    "flash_attn4",
    "flash_attn4+pad",
    "varlen_fa2",
    "varlen_fa2+pad",
    "cudnn_frontend",
    "cudnn_frontend+pad",
    "flex",
    "flex+pad",
    *_PER_SEQUENCE,
)
# "small pack" (thd, sm90 outside CUDA graph capture, pack work <= SMALL_PACK_WORK; only what was measured:
# as many queries as keys in every sequence, causal, no grouped heads, head dims up to 192): the cuDNN frontend's and
# FA4's packed forwards are host-bound there, so torch's packed FlashAttention-2 (varlen_fa2) serves the loop faster.
# results/h200_thd_inference.md (no FA4) and _fa4.md, measured through varlen_attn, 16 heads, a new packing every
# step, 8 calls a step, on the configurations below the bound counted as every sequence at the longest (1k-4k
# tokens), wall us a call: the frontend 241-574
# and FA4 162-317 while their GPU time is 15-65, varlen_attn 128-335 (native on 128/128, V padded on 192/128;
# 1.6-2.6x the frontend's speed in the run without FA4). FA4 native matches varlen padded on 192/128 (286-317 against
# 296-322) and trails varlen native on 128/128 (162-181 against 125-140). The frontend leads from 16k tokens on
# 192/128 and from 32k on 128/128. Below the bound so counted the GPU time given up for varlen is at most 32 us a
# call (128/128 at 1k tokens: 47 against FA4's 16); the bound counts heads, so a 128-head model meets it with an
# eighth of the tokens. results/h200_thd_inference_aten.md, varlen_fa2 on the op under varlen_attn: on the packs
# where the default chose it alone (1k-4k tokens of 32..256-token documents, 1k of 128..1024) it takes 82-143 us a
# call against the frontend's 287-466 in the same run. Under capture a graph replays without host time: the general
# order (FA4 where installed, which then compiles on its first call inside the capture if the eager warm-up ran
# varlen_fa2).
# In training, the same bound: FA4's packed forward+backward spends about 290 us of host time a call. 1024 tokens in 1
# to 8 documents, 128/128, a new packing a call, on an H100: FA4's flash_attn_varlen_func 290.2 us a call against
# aten._flash_attention_forward's and backward's 116.4, and attention() 362.8 on FA4 against 156.5 on varlen_fa2
# without FA4 (results/h100_new_packing_parts_training_dd924d0_{fa4,nofa4}.md). On 192/128, V padded for varlen_fa2
# first too: on the H200 ladder's 2048-token packings it took 0.777 ms a call (0.544 in a stack of 8 layers), FA4
# called directly 0.777 (0.715) and FA4 through attnselect 0.981 (0.851) (results/h200_ladder_packed_9c10af6_fa4.md).
# The H200's calibration (attnselect/data/calibration_sm90_nvidia-h200.json, 16 heads, causal, 4 equal documents,
# host times on new packings) has varlen_fa2 native ahead of FA4 up to a work of 1.86e10 (64/64 and 128/128) and
# varlen_fa2 padded up to 1.01e10 (192/128), within the rules' 15% tie band of it up to 1.43e10, FA4 20% ahead at
# the bound: the one bound for both phases sits between (tests/choose/test_rules.py).
# A pack of up to SMALL_PACK_HEAD_TOKENS query rows x heads (8k tokens at 16 heads) has its work counted as a
# prediction estimates it (:func:`_pack_estimate`), not as every sequence at the longest: a few long documents and
# many short ones are not taken for many long ones. Replayed through the rules, the estimate moves 9 of the
# configurations of results/h200_thd_inference*.json (2k-8k tokens) to varlen_fa2, each faster there by wall time,
# the GPU time given up up to 76 us a call; the size ladder's 2048-token packs too, where on an H100 with FA4 the
# rungs ran 1.25-1.76x faster once on varlen_fa2 (results/h100_ladder_packed2048_44aaf95_fa4.md against
# results/h100_ladder_packed_e8d4192_fa4.md, one machine). At 16k tokens of 32..256-token documents it would move
# those too, and there varlen_fa2 with V padded took 0.86x the frontend's speed (192/128, no FA4; native on 128/128
# it was 1.33x): larger packs keep the count above (tests/choose/test_rules.py replays both).
SMALL_PACK_WORK = 1.5e10
SMALL_PACK_HEAD_TOKENS = 8192 * 16
PREFERENCES[("sm90", "inference", "thd", "small pack")] = (
    "varlen_fa2",
    "flash_attn4",
    "varlen_fa2+pad",
    "flash_attn4+pad",
    "cudnn_frontend",
    "cudnn_frontend+pad",
    "flex",
    "flex+pad",
    *_PER_SEQUENCE,
)
PREFERENCES[("sm90", "training", "thd", "small pack")] = (
    "varlen_fa2",
    "varlen_fa2+pad",
    "flash_attn4",
    "flash_attn4+pad",
    "cudnn_frontend",
    "cudnn_frontend+pad",
    "flex",
    "flex+pad",
    *_PER_SEQUENCE,
)
# "medium equal-dims pack" (thd, sm90 outside CUDA graph capture, as many queries as keys in every sequence, causal,
# no dropout, no grouped heads, d_qk == d_v <= 128, the pack's work estimated as the "small pack" test estimates it,
# at any size: one sequence at the longest, the rest of q's rows shared evenly): with equal head dims varlen_fa2 runs
# unpadded, and until the pack's GPU work hides the cuDNN
# frontend's host time it is the faster. results/h100_pack_crossover_21436be.md (an H100, 128/128, 16 heads, the size
# ladder's packings of 4k to 24k tokens and packs of equal documents, each kernel forced, packing by packing): of the
# three counts of a pack's work the host knows or could know, the estimate parts the two kernels best, nearly as well
# as the exact work; its bound that loses least over both ways (a stack of 8 layers and a call alone) is 8.12e10 in
# training and 5.03e10 in inference. Against each packing's faster kernel, in a stack and alone, the tables lost 1.5%
# and 12.3% in training and 2.6% and 9.3% in inference with the small-pack refinements alone, and lose 1.2% and 2.6%,
# 0.7% and 3.7% with this one (its bounds rounded: 8e10, 5e10). On another H100
# (results/h100_pack_crossover_128_52052c5.md) the small-pack refinements alone lost 2.0% and 13.3%, 10.7% and 15.7%,
# this one 1.5% and 2.7%, 4.0% and 9.0%; at 64/64 there (results/h100_pack_crossover_64_52052c5.md) 5.8% and 36.2%,
# 2.5% and 18.7% against 2.0% and 6.0%, 4.1% and 5.2% (the bounds were fitted on those packings: the later runs drew
# the same seeds, so they test the machine and the head dim, not the packings). On packings drawn apart (seeds from 101,
# results/h100_pack_crossover_128_seeds101_cc0895f.md) this one lost 0.7% and 9.3%, 1.3% and 10.7%: alone, more than
# fitted, and still under a third of the small-pack refinements' loss. The size ladder agrees where
# the two kernels are far apart: at 8192 tokens, training, varlen_fa2 took 1.1548 ms a call alone and 0.9731 in a stack
# against the frontend's 1.9831 and 1.5795 (results/h100_ladder_packed_128_training_50926a7_fa4.md). FA4 stays first
# (it led those rungs where installed); under capture a graph replays without host time, and the general order stands.
MEDIUM_EQUAL_PACK_WORK = {True: 8e10, False: 5e10}  # keyed by AttentionProblem.training
for _phase in ("training", "inference"):
    PREFERENCES[("sm90", _phase, "thd", "medium equal-dims pack")] = PREFERENCES[
        ("sm90", "training", "thd", "small training pack")
    ]
# "wide heads" (a head dim above 256: absorbed MLA, 576/512 with one key/value head), sm90 prefill (as many queries as
# keys, >= 1024 of them): results/h200_bench.md, B*S = 16k, 128 query heads, causal: sdpa_efficient 21.5 / 71.7 / 301
# ms at 1k / 4k / 16k against the cuDNN frontend's 28.7 / 105 / 427 ms (2026-11-30). Decode (one query against a long
# cache) is not measured and keeps the general order.
WIDE_PREFILL = 1024
PREFERENCES[("sm90", "inference", "wide heads")] = (
    "sdpa_efficient",
    "cudnn_frontend",
    "sdpa_efficient+pad",
    "cudnn_frontend+pad",
    "sdpa_math",
    "sdpa_math+pad",
    "reference",
    "reference+pad",
)
# "tiny call", "small call" and "medium call" (dense, sm90, as many queries as keys, 16-bit, causal (tiny calls also
# without a mask: below), as many query as K/V heads, head dims multiples of 8 from 64 to 192, outside CUDA graph
# capture; call work up to TINY_CALL_WORK, SMALL_CALL_WORK, MEDIUM_CALL_WORK):
# FA4's and the cuDNN frontend's Python interfaces cost 100-190 us of host time a call against 25-35 for the SDPA
# kernels, more than the GPU time they save on these calls. Size ladders, 16 heads, causal bf16, 192/128 and 128/128,
# inference and training, every forced row timed alone (latency) and in a stack of 8 layers: three on the H200
# (results/h200_ladder_20c9c6a_fa4.md, results/h200_ladder_small_d7b14ce_fa4.md,
# results/h200_ladder_b1s1k_40a2f27_fa4.md) and one on an H100 (results/h100_ladder_small_fa4.md). Below
# MEDIUM_CALL_WORK (B1 S256 to B8 S1k, work 2.7e8 to 4.3e10) forced FA4 took 0.92-4.8x the time of these tables'
# choice (below 1x only in B8 S1k stacks, 0.92-0.99x) and the frontend 1.05-3.8x; from B1 S4k (6.9e10) on FA4 led
# the H200's stacks (0.73-0.94x) and from S8k both ways.
# Among the SDPA kernels: at B1 S256 sdpa_efficient led sdpa_cudnn on every rung-way (1.2-2.0x) and led or matched
# sdpa_flash; at B1 S1k 128/128 (4.3e9) sdpa_flash led sdpa_cudnn in training on every run (1.4-2.5x) and about
# matched it in inference, where sdpa_efficient mostly trailed both; at B8 S1k 128/128 (3.4e10) sdpa_cudnn led
# sdpa_flash on every H200 rung-way (1.2-1.8x). FlashAttention 2 and 3 were not installed there: these tables put them
# after the three SDPA kernels, unmeasured (the general tables have FA3 above sdpa_flash). Where a calibration holds,
# the predicted times order these calls and these tables only break exact ties.
# Without a mask, measured at B1 S256 192/128 only, host time with the sync, inference and fwd+bwd: FA4 158.5 and 777.5
# us a call on an H100 (results/h100_hot_path_529f551_fa4.md) against 19.2 and 198.5 for sdpa_efficient on the H200
# (results/h200_hot_path_after_35aaaad_nofa4.md): the "tiny call" table takes such calls, where a non-causal call's
# twice the GPU time is still a few microseconds.
TINY_CALL_WORK, SMALL_CALL_WORK, MEDIUM_CALL_WORK = 1e9, 1e10, 5e10
TINY_CALL_MASKS = ("causal", "causal_bottom_right", "none")
# after every SDPA and FlashAttention 2/3 kernel: FA4 and the frontend for their host time, flex (compiled per shape,
# not forced on the ladders) where the general table has it, after them
_HOST_BOUND_LAST = ("flash_attn4", "cudnn_frontend", "flex")
_SDPA_FIRST = {
    "tiny call": ("sdpa_efficient", "sdpa_flash", "sdpa_cudnn"),
    "small call": ("sdpa_flash", "sdpa_cudnn", "sdpa_efficient"),
    "medium call": ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient"),
}
for _size, _first in _SDPA_FIRST.items():
    _native = (*_first, "flash_attn3", "flash_attn2", *_HOST_BOUND_LAST)
    for _phase in ("training", "inference"):
        PREFERENCES[("sm90", _phase, _size)] = (
            *_native,
            *(name + "+pad" for name in _native),
            "sdpa_math",
            "sdpa_math+pad",
            "reference",
            "reference+pad",
        )
for _family in ("sm80", "sm100", "sm120", "cpu"):
    PREFERENCES[(_family, "inference", "thd")] = PREFERENCES[
        ("sm100" if _family == "sm120" else _family, "training", "thd")
    ]
PREFERENCES[("sm120", "training", "thd")] = PREFERENCES[("sm100", "training", "thd")]
PREFERENCES[("sm80", "inference")] = PREFERENCES[("sm80", "training")]
PREFERENCES[("sm100", "inference")] = PREFERENCES[("sm100", "training")]
# sm120 (RTX PRO 6000): TE keeps fused attention first on sm90+; its cuDNN rules refuse > 128.
PREFERENCES[("sm120", "training")] = PREFERENCES[("sm100", "training")]
PREFERENCES[("sm120", "inference")] = PREFERENCES[("sm100", "inference")]
PREFERENCES[("cpu", "inference")] = PREFERENCES[("cpu", "training")]


def parse_table(key: tuple, names: tuple[str, ...]) -> tuple[tuple[str, bool], ...]:
    """A table's "name" / "name+pad" strings as (backend, padded) entries, checked against the registry: a misspelt
    or repeated entry raises here, at import, instead of silently ranking last."""
    known = {b.name for b in all_backends()}
    entries = []
    for name in names:
        backend, plus, pad = name.partition("+")
        if backend not in known or (plus and pad != "pad"):
            raise ValueError(f"rules table {key}: got entry {name!r}, expected 'name' or 'name+pad' of a registered "
                             f"backend ({', '.join(sorted(known))})")  # fmt: skip
        entries.append((backend, bool(plus)))
    if len(set(entries)) != len(entries):
        raise ValueError(f"rules table {key}: got an entry twice, expected each candidate once")
    return tuple(entries)


TABLES = {key: parse_table(key, names) for key, names in PREFERENCES.items()}


_ARCH_FAMILIES = {8: "sm80", 9: "sm90", 10: "sm100", 11: "sm100", 12: "sm120"}


def arch_family(target: Target) -> str:
    if not target.is_cuda:
        return "cpu"
    major = target.capability[0]
    return _ARCH_FAMILIES.get(major, "sm80" if major < 8 else "sm120")


def table_for(problem: AttentionProblem, target: Target) -> tuple[tuple[str, ...], tuple[tuple[str, bool], ...]]:
    """The key of the table that ranks ``problem`` on ``target`` and its (backend, padded) entries, best first: the
    first refinement (in :data:`_REFINEMENTS`' order) that has a table for this family and phase and applies."""
    key = _base_key(problem, target)
    for refined, fits, fits_at in _REFINED.get(key, ()):  # each test run only where its table exists
        if fits(problem) and fits_at(problem)(problem.batch, problem.seqlen_q, problem.seqlen_kv, problem.tokens):
            return refined, TABLES[refined]
    return key, TABLES[key]


def table_chooser(
    problem: AttentionProblem, target: Target
) -> Callable[[int, int, int, int], tuple[tuple[str, ...], tuple[tuple[str, bool], ...]]]:
    """``table_at(sequences, seqlen_q, seqlen_kv, tokens)``: :func:`table_for` of the problem that differs from
    ``problem`` in those sizes alone (batch, sequence lengths, q's rows: a packed loop's new packings), on ``target``:
    the refinements' tests that read no size run once, here, and their size tests read the problem's other fields
    here too."""
    key = _base_key(problem, target)
    sized = tuple((refined, TABLES[refined], fits_at(problem)) for refined, fits, fits_at in _REFINED.get(key, ())
                  if fits(problem))  # fmt: skip
    unrefined = key, TABLES[key]

    def table_at(sequences: int, seqlen_q: int, seqlen_kv: int, tokens: int):
        for refined, entries, within in sized:
            if within(sequences, seqlen_q, seqlen_kv, tokens):
                return refined, entries
        return unrefined

    return table_at


def _base_key(problem: AttentionProblem, target: Target) -> tuple[str, ...]:
    key = (arch_family(target), "training" if problem.training else "inference")
    return key + ("thd",) if problem.layout == "thd" else key


def _work(problem: AttentionProblem) -> int:
    """:func:`pack_work`; a packed call of as many queries as keys in every sequence whose q holds T tokens (rows)
    does at most one T-token sequence's work (the sum of squared lengths is at most their sum squared), so its
    work is capped there: a pack of one long document and a few short ones is not taken for several long ones (1024
    tokens in 5 documents, the longest 856, counted 3.5x a 1024-token sequence's work without the cap)."""
    return _work_counter(problem)(problem.batch, problem.seqlen_q, problem.seqlen_kv, problem.tokens)


def _work_counter(p: AttentionProblem) -> Callable[[int, int, int, int], int]:
    """``work_at(sequences, seqlen_q, seqlen_kv, tokens)``: :func:`_work` of ``p`` at these sizes, its other fields
    (H * (d_qk + d_v), :func:`pack_work`'s factor, and whether q's rows cap the work) read once here."""
    per_pair = pack_work(p.heads_q, p.head_dim_qk, p.head_dim_v, 1, 1, 1)
    capped = _capped_at_tokens(p)

    def work_at(sequences: int, seqlen_q: int, seqlen_kv: int, tokens: int) -> int:
        work = per_pair * sequences * seqlen_q * seqlen_kv
        if capped and tokens:
            return min(work, per_pair * tokens * tokens)
        return work

    return work_at


def _capped_at_tokens(p: AttentionProblem) -> bool:
    """A packed call whose every sequence has as many queries as keys (a field of a packed problem, not a size): its
    work is capped at its q rows' (:func:`_work`), where it knows them."""
    return p.layout == "thd" and p.varlen_seqlens_match


def _pack_estimate(problem: AttentionProblem, head_tokens: int | None = SMALL_PACK_HEAD_TOKENS) -> int:
    """The "small pack" test's work: for a pack of at most ``head_tokens`` query rows x heads, the least
    of :func:`_work` and the count a prediction estimates (:func:`attnselect.choose.predict.rest_lengths`: one
    sequence at the longest lengths, the others sharing the rest of q's rows evenly; a causal pack's exact work is
    1.0-1.9x that over the size ladder's and the calibration's seeded packings, results/cpu_packed_work_estimates.md);
    else, and where q's rows are not known, :func:`_work` (the "medium equal-dims pack" test's: any pack estimated)."""
    return _pack_estimator(problem, head_tokens)(problem.batch, problem.seqlen_q, problem.seqlen_kv, problem.tokens)


def _pack_estimator(
    p: AttentionProblem, head_tokens: int | None = SMALL_PACK_HEAD_TOKENS
) -> Callable[[int, int, int, int], int]:
    """``estimate_at(sequences, seqlen_q, seqlen_kv, tokens)``: :func:`_pack_estimate` of ``p`` at these sizes, its
    other fields read once here; ``head_tokens``: the most query rows x heads a pack is estimated at (None: any)."""
    work_at = _work_counter(p)
    per_pair, heads = pack_work(p.heads_q, p.head_dim_qk, p.head_dim_v, 1, 1, 1), p.heads_q

    def estimate_at(sequences: int, seqlen_q: int, seqlen_kv: int, tokens: int) -> int:
        work = work_at(sequences, seqlen_q, seqlen_kv, tokens)
        others = _estimated_lengths_at(heads, sequences, seqlen_q, seqlen_kv, tokens, head_tokens)
        if others is None:
            return work
        return min(work, per_pair * (seqlen_q * seqlen_kv + (sequences - 1) * others[0] * others[1]))

    return estimate_at


def _estimated_lengths(
    problem: AttentionProblem, head_tokens: int | None = SMALL_PACK_HEAD_TOKENS
) -> tuple[int, int] | None:
    """:func:`attnselect.choose.predict.rest_lengths` for a pack :func:`_pack_estimator` estimates, else None."""
    p = problem
    return _estimated_lengths_at(p.heads_q, p.batch, p.seqlen_q, p.seqlen_kv, p.tokens, head_tokens)


def _estimated_lengths_at(
    heads: int, sequences: int, seqlen_q: int, seqlen_kv: int, tokens: int, head_tokens: int | None
) -> tuple[int, int] | None:
    """:func:`_estimated_lengths` of a pack of ``heads`` query heads at these sizes."""
    if head_tokens is not None and tokens * heads > head_tokens:
        return None
    return rest_lengths(sequences, seqlen_q, seqlen_kv, tokens)


def _small_dense_call(p: AttentionProblem, masks: tuple[str, ...] = ("causal", "causal_bottom_right")) -> bool:
    """What the "tiny call", "small call" and "medium call" tables were measured on, their sizes aside
    (:func:`_prefill_within`)."""
    return (
        p.layout != "thd"
        and not p.cuda_graph_capture
        and p.dtype in (torch.bfloat16, torch.float16)
        and p.mask in masks
        and p.heads_q == p.heads_kv
        and all(64 <= d <= 192 and d % 8 == 0 for d in (p.head_dim_qk, p.head_dim_v))
    )


def _prefill_within(p: AttentionProblem, bound: float) -> Callable[[int, int, int, int], bool]:
    """``within(sequences, seqlen_q, seqlen_kv, tokens)``: a dense call of ``p`` at these sizes has as many queries as
    keys (prefill; decode against a long cache is bound by its memory) and at most ``bound`` work."""
    work_at = _work_counter(p)
    return lambda sequences, seqlen_q, seqlen_kv, tokens: (
        seqlen_q == seqlen_kv and work_at(sequences, seqlen_q, seqlen_kv, tokens) <= bound
    )


def _at_most(count: Callable[[int, int, int, int], int], bound: float) -> Callable[[int, int, int, int], bool]:
    """``within(sequences, seqlen_q, seqlen_kv, tokens)``: ``count`` at these sizes is at most ``bound``."""
    return lambda sequences, seqlen_q, seqlen_kv, tokens: count(sequences, seqlen_q, seqlen_kv, tokens) <= bound


# The refinements whose bound compares a pack's estimated work (:func:`_pack_estimate`), with the most query rows x
# heads they estimate a pack at (None: any)
_ESTIMATED_UP_TO = {"small pack": SMALL_PACK_HEAD_TOKENS, "medium equal-dims pack": None}


# Each refinement: (its name, a test that reads no size of the problem, and ``fits_at(problem)``: the test of the
# problem at sizes given apart, ``within(sequences, seqlen_q, seqlen_kv, tokens)``, reading none of the problem's own
# sizes), so a packed loop's family runs the first and makes the second once, then runs it on each packing's sizes
# alone (:func:`table_chooser`).
_REFINEMENTS = (
    (
        "small pack",
        lambda p: (
            p.layout == "thd"
            and not p.cuda_graph_capture
            and p.square  # packed: whether every sequence has as many keys (a field, not a size)
            and p.mask in ("causal", "causal_bottom_right")
            and p.heads_q == p.heads_kv
            and max(p.head_dim_qk, p.head_dim_v) <= 192
        ),
        lambda p: _at_most(_pack_estimator(p, _ESTIMATED_UP_TO["small pack"]), SMALL_PACK_WORK),
    ),
    (
        "small training pack",
        lambda p: p.layout == "thd",
        lambda p: _at_most(_work_counter(p), SMALL_TRAINING_PACK_WORK),
    ),
    (
        "medium equal-dims pack",
        lambda p: (
            p.layout == "thd"
            and not p.cuda_graph_capture
            and p.square  # packed: every sequence has as many keys as queries (decode and chunked prefill: unmeasured)
            and p.dropout_p == 0.0
            and p.mask in ("causal", "causal_bottom_right")
            and p.heads_q == p.heads_kv
            and p.head_dim_qk == p.head_dim_v <= 128
        ),
        lambda p: _at_most(
            _pack_estimator(p, _ESTIMATED_UP_TO["medium equal-dims pack"]), MEDIUM_EQUAL_PACK_WORK[p.training]
        ),
    ),
    (
        "wide heads",
        lambda p: max(p.head_dim_qk, p.head_dim_v) > 256,
        lambda p: lambda sequences, seqlen_q, seqlen_kv, tokens: seqlen_q == seqlen_kv >= WIDE_PREFILL,
    ),
    (
        "tiny call",
        lambda p: _small_dense_call(p, TINY_CALL_MASKS),
        lambda p: _prefill_within(p, TINY_CALL_WORK),
    ),
    ("small call", _small_dense_call, lambda p: _prefill_within(p, SMALL_CALL_WORK)),
    ("medium call", _small_dense_call, lambda p: _prefill_within(p, MEDIUM_CALL_WORK)),
)


_HOST_BOUND = "the host time of FA4's and the cuDNN frontend's Python interfaces outweighs the GPU time they save"
# Why each refinement's table ranks the calls it takes, for a decision's why: (its bound, or None, and the reason)
_REFINEMENT_REASONS = {
    "small training pack": (SMALL_TRAINING_PACK_WORK, "the cuDNN frontend's host time outweighs the pack's GPU work"),
    "small pack": (SMALL_PACK_WORK, _HOST_BOUND),
    "medium equal-dims pack": (
        MEDIUM_EQUAL_PACK_WORK,
        "with equal head dims varlen_fa2 runs unpadded, and the pack's GPU work does not yet hide the cuDNN frontend's "
        "host time",
    ),
    "wide heads": (None, "head dims above 256 in prefill, where sdpa_efficient measured fastest"),
    "tiny call": (TINY_CALL_WORK, _HOST_BOUND),
    "small call": (SMALL_CALL_WORK, _HOST_BOUND),
    "medium call": (MEDIUM_CALL_WORK, _HOST_BOUND),
}


def refinement_reason(key: tuple[str, ...], problem: AttentionProblem) -> str:
    """Why the refined table ``key`` (:func:`table_for`'s) ranks ``problem``, with the work its bound compares; empty
    for a table without a refinement."""
    bound, reason = _REFINEMENT_REASONS.get(key[-1], (None, ""))
    if bound is None:
        return reason
    if isinstance(bound, dict):  # a bound per phase
        bound = bound[problem.training]
    head_tokens = _ESTIMATED_UP_TO.get(key[-1])
    if key[-1] in _ESTIMATED_UP_TO and _estimated_lengths(problem, head_tokens) is not None:
        counted = "min(B*S_q*S_kv, T^2, S_q*S_kv + (B-1)*r_q*r_kv: r the rest of T shared)"
        work = _pack_estimate(problem, head_tokens)
    else:
        counted = "min(B*S_q*S_kv, T^2)" if _capped_at_tokens(problem) and problem.tokens else "B*S_q*S_kv"
        work = _work(problem)
    return f"work H*(d_qk+d_v)*{counted} {work:.2g} <= {bound:.2g}: {reason}"


# Per table key without a refinement: the refined tables it has, with their tests, in _REFINEMENTS' order
_REFINED = {
    base: tuple((base + (name,), fits, fits_at) for name, fits, fits_at in _REFINEMENTS if base + (name,) in TABLES)
    for base in {key[:-1] for key in TABLES if key[-1] in {name for name, *_ in _REFINEMENTS}}
}


def pack_work(heads_q: int, head_dim_qk: int, head_dim_v: int, sequences: int, seqlen_q: int, seqlen_kv: int) -> int:
    """``H * (d_qk + d_v) * sequences * seqlen_q * seqlen_kv``: the forward's FLOPs, up to a constant, of ``sequences``
    sequences of these lengths (what the refinements' thresholds compare: :func:`_work`, :func:`_pack_estimate`)."""
    return heads_q * (head_dim_qk + head_dim_v) * sequences * seqlen_q * seqlen_kv


def entry(c: Candidate) -> tuple[str, bool]:
    """A candidate as the parsed tables hold it: (backend, padded)."""
    return c.backend, c.padded


def predictions(
    verdicts: tuple[Verdict, ...], problem: AttentionProblem, target: Target
) -> tuple[dict[Candidate, Prediction | None] | None, str, dict]:
    """Each supported candidate's predicted time (None for backends the calibration skips on purpose: they rank
    after the others), the calibration's source and the calibration itself (its first calls' costs:
    :mod:`attnselect.choose.first_calls`); (None, why not,
    {}) where no calibration holds on ``target``, the
    call is not one calibrations measure (:func:`attnselect.choose.calibration.outside`: the table ranks it), or a
    candidate the calibration did not skip has no curve for it or another version of its package (a partial
    calibration orders nothing)."""
    found, source = calibration.for_target(target)
    if found is None:
        return None, source, {}
    outside = calibration.outside(problem)
    if outside:
        return None, f"calibration {source} covers {outside}", {}
    predicted: dict[Candidate, Prediction | None] = {}
    for verdict in verdicts:
        if verdict.supported:
            predicted[verdict.candidate], unranked = prediction(verdict.candidate, problem, target, found)
            if unranked:
                return None, f"calibration {source} {unranked}", {}
    if not any(predicted.values()):
        return None, f"calibration {source} has no curve for this call's candidates", {}
    return predicted, source, found


def prediction(
    c: Candidate, problem: AttentionProblem, target: Target, found: dict
) -> tuple[Prediction | None, str | None]:
    """A supported candidate's predicted time under the calibration ``found`` (None where the calibration leaves it
    out on purpose) and, where the calibration cannot rank a call this candidate serves, why (None otherwise). Neither
    depends on the call's sizes, only the predicted time does (:func:`prediction_curve`)."""
    curve, why = prediction_curve(c, problem, target, found)
    return (curve.at(problem) if curve is not None else None), why


def prediction_curve(
    c: Candidate, problem: AttentionProblem, target: Target, found: dict
) -> tuple[Curve | None, str | None]:
    """:func:`prediction` before the call's sizes: the curve that predicts it at any size, or None as there."""
    backend = backend_named(c.backend)
    # Packed, a candidate that runs sequence by sequence is not calibrated (it reads the boundaries on the host:
    # attnselect.bench.calibrate) and ranks after the packed ones, as a skipped backend does.
    if c.backend in found["skipped"] or (problem.layout == "thd" and not backend.packs_thd(target)):
        return None, None
    changed = backend.package and calibration.package_changed(found, backend.package.distribution, target)
    if changed:
        return None, f"does not hold for {c.backend}: {changed}"
    found_curve = curve(c, problem, found, calls_before_replay=backend.replay_start_calls(problem))
    return found_curve, None if found_curve is not None else f"has no curve for {c} at this call"


def rank(
    verdicts: tuple[Verdict, ...],
    problem: AttentionProblem,
    target: Target,
    predicted: dict[Candidate, Prediction | None] | None = None,
) -> tuple[Candidate, ...]:
    """Supported candidates, best first: by ``predicted`` time (:func:`predictions`) where given, else by the
    table."""
    supported = [v.candidate for v in verdicts if v.supported]
    ordered = list(settled(sorted(supported, key=order(problem, target, predicted, supported)), predicted))
    # Predicted, a packed candidate's GPU curve was timed with a new packing every call (attnselect.bench.calibrate):
    # what it rebuilds per packing on the GPU is in its prediction.
    return tuple(_stable_across_packings(ordered, target) if problem.layout == "thd" and predicted is None else ordered)


def order(
    problem: AttentionProblem, target: Target, predicted: dict | None, candidates, places: dict | None = None
) -> Callable:
    """The sort key of :func:`rank`: by ``predicted`` time where given (those without a prediction last), then the
    table, then the order of ``candidates`` (the registry's); ``places``: their :func:`table_places`, where known."""
    places = places if places is not None else table_places(problem, target, candidates)

    def key(c: Candidate) -> tuple:
        in_table = places[c]
        if predicted is None:
            return in_table
        time = predicted.get(c)
        return (time is None, time.total_us if time is not None else 0.0, *in_table)

    return key


# Predicted times within this fraction of the least are a tie, settled by the call's time alone (predict.Prediction
# .alone_us: host + GPU, less in training what the forward's GPU time hides of the backward's host time): a stack of
# layers overlaps the host's work with the GPU's (the time candidates rank by), a call alone waits for both. On the
# H200 size ladders' dense rungs, thirteen runs pooled (benchmarks/ladder_rules.py: results/cpu_ladder_rules_hidden.md,
# 160 rungs), the picks' speed in a rung's worse way had a geometric mean of 0.974 with the band, 133 rungs within 3%
# of the fastest in both ways, against 0.970 and 131 without it and 0.970 and 125 settling by host + GPU (its 8 rungs
# of difference: B1 S8k and S16k 192/128 training, where FA4 led sdpa_cudnn both ways by 3-12%); one choice in
# hindsight: 0.984 and 139.
TIE_BAND = 0.15


def settled(ordered: Iterable[Candidate], predicted: dict | None, serves=None) -> Iterator[Candidate]:
    """``ordered`` (candidates sorted by :func:`order`) with its lead settled: the candidates predicted within
    :data:`TIE_BAND` of the first's time go by their time alone (the table's order among equals), then the rest as
    they come. ``serves``: a predicate that keeps the supported ones, asked lazily, only of the candidates drawn: one
    predicted beyond the band cannot tie, so it is not judged to settle the lead."""
    items, keep = iter(ordered), serves or _any
    first = next((c for c in items if keep(c)), None)
    if first is None:
        return
    best = predicted.get(first) if predicted else None
    if best is None:
        yield first
        yield from (c for c in items if keep(c))
        return
    lead, beyond = [first], None
    for c in items:
        time = predicted.get(c)
        if time is None or time.total_us > best.total_us * (1 + TIE_BAND):  # sorted: the rest are beyond too
            beyond = c
            break
        if keep(c):
            lead.append(c)
    yield from sorted(lead, key=lambda c: predicted[c].alone_us)
    if beyond is not None:
        if keep(beyond):
            yield beyond
        yield from (c for c in items if keep(c))


def _any(candidate: Candidate) -> bool:
    return True


def tied(chosen: Candidate, served: Iterable[Candidate], predicted: dict | None) -> bool:
    """Whether another of ``served`` was predicted within :data:`TIE_BAND` of ``chosen``'s lead (the choice read the
    predicted times, not only their order)."""
    if not predicted or predicted.get(chosen) is None:
        return False
    served = tuple(served)
    least = min(predicted[c].total_us for c in served if predicted.get(c) is not None)
    return any(c != chosen and predicted.get(c) is not None and predicted[c].total_us <= least * (1 + TIE_BAND)
               for c in served)  # fmt: skip


def table_places(problem: AttentionProblem, target: Target, candidates) -> dict[Candidate, tuple[int, int]]:
    """Each of ``candidates``' place by the table that ranks ``problem`` (those it leaves out after it), then by
    their order: what :func:`order` sorts by after the predicted time, the same for every call the table ranks."""
    _, table = table_for(problem, target)
    # a name of its own, not `entry`: Python 3.12 inlines comprehensions, and 3.12.3 reads entry(c) below as this
    # comprehension's variable (UnboundLocalError)
    position = {name: i for i, name in enumerate(table)}
    return {c: (position.get(entry(c), len(table)), i) for i, c in enumerate(candidates)}


def _stable_across_packings(ordered: list[Candidate], target: Target) -> list[Candidate]:
    """``ordered`` with each candidate that rebuilds per new packing moved to just after the last candidate on
    its path (packed, or per sequence) that does not."""
    rebuilds, packed = {}, {}
    for c in ordered:
        backend = backend_named(c.backend)
        rebuilds[c] = backend.shape_cache is not None and backend.shape_cache.rebuilds_per_packing
        packed[c] = backend.packs_thd(target)
    result = [c for c in ordered if not rebuilds[c]]
    place = {c: i for i, c in enumerate(ordered)}
    for c in (c for c in ordered if rebuilds[c]):
        after = [i for i, other in enumerate(result) if packed[other] == packed[c]]
        if not any(not rebuilds[result[i]] for i in after):  # nothing on its path is stable: it keeps its place
            after = [i for i, other in enumerate(result) if place[other] < place[c]]
        result.insert(after[-1] + 1 if after else 0, c)
    return result
