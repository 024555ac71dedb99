"""TransformerEngine's packed-layout attention test, call for call, on attnselect: no valid call refused, each exact.

Source: NVIDIA/TransformerEngine, ``tests/pytorch/attention/test_attention.py``: ``test_dpa_qkv_layout_thd`` runs
every config of ``model_configs_layout_thd`` with every layout of ``qkv_layouts_thd`` (``t3hd``, ``th3d``,
``thd_t2hd``, ``thd_th2d``, ``thd_thd_thd``; the ``3`` layouts are skipped for MQA/GQA and for cross-attention),
once with ``pad_between_seqs=True`` and once with False; ``_run_dot_product_attention`` builds the call and
``ModelConfig`` comes from ``tests/pytorch/utils.py`` (attn_type is "cross" when max_seqlen_kv differs).

======================  =========================================  ===========================  ===========
config                  ModelConfig(b, sq, hq, dqk, ...)           attn_mask_type               window_size
======================  =========================================  ===========================  ===========
layout_0_0 / _1 / _2    (2, 2048, 16, 64) / (2, 2048, 24, 128,     padding                      (-1, -1)
                        num_gqa_groups=1) / (2, 2048, 24, 128,
                        max_seqlen_kv=4096)
layout_1_0 / _1 / _2    the same three                             padding_causal               (-1, 0)
layout_2_0 / _1 / _2    the same three                             padding_causal_bottom_right  (-1, 0)
layout_3_0 / _1 / _2    the same three                             padding                      (4, 4)
layout_4_0 / _1 / _2    the same three                             padding_causal               (4, 0)
layout_5_0 / _1 / _2    the same three                             padding_causal_bottom_right  (4, 0)
======================  =========================================  ===========================  ===========

How TE builds each call, kept here with the sizes scaled down on the CPU (2048 -> 16, 4096 -> 32, 16 -> 4 and
24 -> 6 heads, head dims 64 -> 16 and 128 -> 32; the GPU test runs TE's own sizes):

- ``seqlens_q = randint(1, max_seqlen_q, [b])``; self-attention ``seqlens_kv = seqlens_q``, cross-attention
  ``randint(1, max_seqlen_kv, [b])``. ``cu_seqlens_q`` and ``cu_seqlens_kv`` are two tensors, equal in value for
  self-attention.
- ``pad_len = randint(0, 4, [b])`` with pad_between_seqs, else 0, the same for q and kv: sequence i starts at
  ``cu_seqlens_*_after_pad[i]`` and is followed by pad_len[i] gap tokens. Those offsets are passed as
  ``cu_seqlens_q_padded`` / ``cu_seqlens_kv_padded`` (to its fused and flash backends) in both runs: without
  pad_between_seqs they are clones of the boundaries, equal in value, tensors of their own.
- ``max_seqlen_q`` / ``max_seqlen_kv`` are the config's (2048, 4096), above every real length.
- q, k, v (``0.1 * randn``) are views of packed buffers as the layout says (``t3hd``: one (t, 3, h, d) buffer;
  ``thd_th2d``: q (t, h, d) and one (t_kv, h_kv, 2, d) buffer for k and v; ...), each view a leaf requiring grad;
  training throughout, with TE's output gradient ``0.001 * randint(0, 200)``.
- Windows: TE aligns them top-left for ``padding_causal`` and bottom-right, per sequence, for ``padding`` and
  ``padding_causal_bottom_right`` (``bottom_right_diagonal`` in dot_product_attention.py; ``get_full_mask`` in
  dot_product_attention/utils.py). The reference below follows TE; so does attnselect (``AttentionProblem``):
  ``padding_causal`` with (4, 0) is ``causal=True, window=(4, 0)``, a bottom-right window where every sequence
  has as many queries as keys (self-attention: layout_4_0, layout_4_1; FlashAttention serves it) and
  ``sliding_window_top_left`` where lengths differ (layout_4_2, cross-attention: a mask, flex and the SDPA kernels).

On the GPU both max_seqlen given means the boundaries are not read; ``_as_on_the_gpu`` runs CPU tensors through
that decision (the defect this file was written for: TE's layout_4 calls were refused on CUDA), and the
meta-tensor tests show no host read is made but the one a top-left window needs.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import zlib

import pytest
import torch

import attnselect
from attnselect import memos
from attnselect.spec import validate
from attnselect.spec.options import CallOptions, Packing
from attnselect.spec.problem import describe_call

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
# TE's qkv layouts and (attn_mask_type, window_size) per config family, as the peer sweep holds them
from peer_sweep import TE_LAYOUTS  # noqa: E402
from peer_sweep import TE_THD_MASKS as TE_MASKS  # noqa: E402

CAUSAL = {"padding": False, "padding_causal": True, "padding_causal_bottom_right": "bottom_right"}
# (batch, max_seqlen_q, max_seqlen_kv, heads_q, heads_kv, head_dim): TE's three variants of each family
TE_SIZES = {"0": (2, 2048, 2048, 16, 16, 64), "1": (2, 2048, 2048, 24, 1, 128), "2": (2, 2048, 4096, 24, 24, 128)}
CPU_SIZES = {"0": (2, 16, 16, 4, 4, 16), "1": (2, 16, 16, 6, 1, 32), "2": (2, 16, 32, 6, 6, 32)}


def te_cases():
    """(config, qkv_layout) pairs test_dpa_qkv_layout_thd runs: no ``3`` layout for MQA/GQA or cross-attention."""
    for family in TE_MASKS:
        for variant, (_, sq, skv, hq, hkv, _) in TE_SIZES.items():
            for layout in TE_LAYOUTS:
                if "3" in layout and (hq != hkv or sq != skv):
                    continue
                yield f"{family}_{variant}", layout


CASES = list(te_cases())


def te_call(config: str, layout: str, pad_between_seqs: bool, sizes: dict, dtype, device):
    """The call TE's _run_dot_product_attention makes: (q, k, v) and attention()'s keyword arguments, plus what the
    reference needs (the lengths and the offsets, as lists)."""
    family, variant = config.rsplit("_", 1)
    b, max_q, max_kv, hq, hkv, d = sizes[variant]
    mask_type, window = TE_MASKS[family]
    g = torch.Generator().manual_seed(zlib.crc32(f"{config}/{layout}/{pad_between_seqs}".encode()))
    seqlens_q = torch.randint(1, max_q, [b], generator=g, dtype=torch.int32)
    seqlens_kv = seqlens_q if max_q == max_kv else torch.randint(1, max_kv, [b], generator=g, dtype=torch.int32)
    cu_q, cu_kv = torch.zeros(b + 1, dtype=torch.int32), torch.zeros(b + 1, dtype=torch.int32)  # two tensors
    cu_q[1:], cu_kv[1:] = torch.cumsum(seqlens_q, 0), torch.cumsum(seqlens_kv, 0)
    pad_len = torch.randint(0, 4, [b], generator=g, dtype=torch.int32) * pad_between_seqs  # 0 without gaps
    after_pad_q, after_pad_kv = cu_q.clone(), cu_kv.clone()  # cu_seqlens_*_padded: clones even without gaps
    after_pad_q[1:], after_pad_kv[1:] = torch.cumsum(seqlens_q + pad_len, 0), torch.cumsum(seqlens_kv + pad_len, 0)
    tq, tkv = int(after_pad_q[-1]), int(after_pad_kv[-1])
    tensors = []
    for i, part in enumerate(layout.split("_")):
        t, h = (tq, hq) if i == 0 else (tkv, hkv)
        shape = {"t3hd": (t, 3, h, d), "th3d": (t, h, 3, d), "t2hd": (t, 2, h, d), "th2d": (t, h, 2, d)}
        shape = shape.get(part, (t, h, d))
        # TE zeroes the gap tokens; random values there show that they are ignored
        buffer = (0.1 * torch.randn(shape, generator=g, dtype=torch.float64)).to(device=device, dtype=dtype)
        split = next((j for j, c in enumerate(part[1:]) if c.isdigit()), None)  # 3hd -> 1, h2d -> 2
        tensors += [buffer] if split is None else [x.squeeze(split + 1) for x in buffer.split(1, split + 1)]
    for t in tensors:
        t.requires_grad_(True)  # views of a buffer that needs no grad: leaves, as TE's
    kwargs = dict(
        layout="thd",
        causal=CAUSAL[mask_type],
        window=window,
        cu_seqlens_q=cu_q.to(device),
        cu_seqlens_kv=cu_kv.to(device),
        cu_seqlens_q_padded=after_pad_q.to(device),
        cu_seqlens_kv_padded=after_pad_kv.to(device),
        max_seqlen_q=max_q,
        max_seqlen_kv=max_kv,
    )
    geometry = dict(
        mask_type=mask_type,
        window=window,
        lengths_q=seqlens_q.tolist(),
        lengths_kv=seqlens_kv.tolist(),
        starts_q=after_pad_q[:-1].tolist(),
        starts_kv=after_pad_kv[:-1].tolist(),
        gaps=bool(pad_len.any()),
    )
    return tensors, kwargs, geometry


def te_visible(mask_type: str, window, n_q: int, n_kv: int, device) -> torch.Tensor:
    """TE's mask of one sequence, True where query i sees key j (get_full_mask): a window (left, right), -1
    unbounded, around the diagonal j = i + shift, top-left (shift 0) for padding_causal, bottom-right
    (shift n_kv - n_q) for padding and padding_causal_bottom_right; the causal masks have right = 0."""
    i = torch.arange(n_q, device=device)[:, None]
    j = torch.arange(n_kv, device=device)[None, :]
    shift = 0 if mask_type == "padding_causal" else n_kv - n_q
    left, right = window if window is not None else (-1, -1)
    if "causal" in mask_type:
        right = 0
    seen = torch.ones(n_q, n_kv, dtype=torch.bool, device=device)
    if left >= 0:
        seen &= j >= i + shift - left
    if right >= 0:
        seen &= j <= i + shift + right
    return seen


def reference(q, k, v, geometry, scale):
    """float64 attention sequence by sequence with plain torch math: softmax(q k^T * scale + mask) v, zero for
    queries that see no key and for the gap tokens."""
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    pieces = []
    for s_q, s_kv, n_q, n_kv in zip(
        geometry["starts_q"], geometry["starts_kv"], geometry["lengths_q"], geometry["lengths_kv"]
    ):
        qs = q[s_q : s_q + n_q]
        ks = k[s_kv : s_kv + n_kv].repeat_interleave(groups, dim=1)
        vs = v[s_kv : s_kv + n_kv].repeat_interleave(groups, dim=1)
        seen = te_visible(geometry["mask_type"], geometry["window"], n_q, n_kv, q.device)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        scores = scores.masked_fill(~seen, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row without keys: all -inf, output 0
        pieces.append((s_q, n_q, torch.einsum("hqk,khd->qhd", weights, vs)))
    for s_q, n_q, o in pieces:  # index_put keeps autograd through every piece
        out = out.index_put((torch.arange(s_q, s_q + n_q, device=q.device),), o)
    return out


def gap_rows(geometry, total: int, side: str = "q") -> torch.Tensor:
    """True for the tokens outside every sequence (the gaps, and the tail)."""
    inside = torch.zeros(total, dtype=torch.bool)
    for s, n in zip(geometry[f"starts_{side}"], geometry[f"lengths_{side}"]):
        inside[s : s + n] = True
    return ~inside


def _as_on_the_gpu(monkeypatch):
    """CPU tensors through the GPU's decision: with both max_seqlen given the boundaries are not read, and two
    boundary tensors are compared by value where _comparable allows it (CUDA tensors, there; these, here). The
    kernels run as they do on the CPU."""
    unread = lambda cu_q, max_q, max_kv: max_q is not None and max_kv is not None  # noqa: E731
    monkeypatch.setattr(validate, "_lengths_unread", unread)
    monkeypatch.setattr(
        validate, "_comparable", lambda cu_q, cu_kv, capturing: not capturing and not cu_q.is_inference()
    )


def check_te_call(config, layout, pad_between_seqs, dtype, device, sizes, tolerance, **controls):
    """Run TE's call through attention() forward and backward; compare with the float64 reference (outputs and
    gradients) and check that gap tokens get zero output and zero gradient. Returns (problem, geometry)."""
    (q, k, v), kwargs, geometry = te_call(config, layout, pad_between_seqs, sizes, dtype, device)
    problem, _ = describe_call(q, k, v, CallOptions(**kwargs))
    out = attnselect.attention(q, k, v, **kwargs, **controls)
    g = torch.Generator().manual_seed(1)  # TE's out_grad, 0.001 * randint(0, 200), gap rows too (TE zeroes those)
    grad_out = (0.001 * torch.randint(0, 200, out.shape, generator=g, dtype=torch.float64)).to(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    q64, k64, v64 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    expected = reference(q64, k64, v64, geometry, q.shape[-1] ** -0.5)
    expected_grads = torch.autograd.grad(expected, (q64, k64, v64), grad_out.double())
    torch.testing.assert_close(out.double(), expected, **tolerance)
    for name, got, want in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(got.double(), want, **tolerance, msg=lambda m, name=name: f"d{name}: {m}")
    gaps_q, gaps_kv = gap_rows(geometry, q.shape[0], "q").to(device), gap_rows(geometry, k.shape[0], "kv").to(device)
    assert pad_between_seqs or not (gaps_q.any() or gaps_kv.any())
    assert torch.equal(out[gaps_q], torch.zeros_like(out[gaps_q])), "gap tokens must get a zero output"
    assert not grads[0][gaps_q].any() and not grads[1][gaps_kv].any() and not grads[2][gaps_kv].any()
    return problem, geometry


CPU_RUNS = [
    pytest.param(torch.float64, False, id="float64"),
    pytest.param(torch.float64, True, id="float64-unread-as-on-gpu"),
    pytest.param(torch.float32, False, id="float32"),
]
TOLERANCE = {torch.float64: dict(atol=1e-10, rtol=1e-9), torch.float32: dict(atol=2e-5, rtol=2e-4)}


@pytest.mark.parametrize("config,layout", CASES, ids=[f"{c}-{lay}" for c, lay in CASES])
@pytest.mark.parametrize("dtype,unread", CPU_RUNS)
def test_te_dpa_qkv_layout_thd_on_the_cpu(config, layout, dtype, unread, monkeypatch):
    """Every call of test_dpa_qkv_layout_thd, scaled down, with pad_between_seqs True then False as TE runs them:
    every one served exactly. ``unread``: the boundaries stay unread as on the GPU."""
    if unread:
        _as_on_the_gpu(monkeypatch)
    for pad_between_seqs in (True, False):
        problem, geometry = check_te_call(config, layout, pad_between_seqs, dtype, "cpu", CPU_SIZES, TOLERANCE[dtype])
        windowed = config.startswith(("layout_3", "layout_4", "layout_5"))
        cross_top_left = config.startswith("layout_4") and config.endswith("_2")  # lengths differ: anchored top-left
        expected = "sliding_window_top_left" if cross_top_left else "sliding_window" if windowed else None
        assert expected is None or problem.mask == expected, (config, problem.mask)
        if config.rsplit("_", 1)[1] != "2":  # self-attention: recognised as such
            if unread:  # unread offsets count as gaps; q/kv lengths are compared only where a top-left window needs it
                assert problem.varlen_gaps
                assert problem.varlen_seqlens_match == config.startswith("layout_4")
            else:
                assert problem.varlen_seqlens_match and problem.varlen_gaps == geometry["gaps"]


@pytest.mark.parametrize("family", list(TE_MASKS))
@pytest.mark.parametrize("variant", ["0", "2"])
@pytest.mark.parametrize("unread", [False, True], ids=["read", "unread-as-on-gpu"])
def test_te_calls_on_every_supported_cpu_candidate(family, variant, unread, monkeypatch):
    """The automatic choice is one kernel; each supported candidate, forced, must be exact on TE's calls too."""
    if unread:
        _as_on_the_gpu(monkeypatch)
    config = f"{family}_{variant}"
    for pad_between_seqs in (True, False):
        (q, k, v), kwargs, geometry = te_call(config, "thd_thd_thd", pad_between_seqs, CPU_SIZES, torch.float64, "cpu")
        problem, _ = describe_call(q, k, v, CallOptions(**kwargs))
        supported = [c.candidate.backend for c in attnselect.select(problem).verdicts if c.supported]
        assert supported, f"nothing serves {problem.describe()}"
        for backend in supported:
            check_te_call(config, "thd_thd_thd", pad_between_seqs, torch.float64, "cpu", CPU_SIZES,
                          TOLERANCE[torch.float64], backend=backend)  # fmt: skip


# -- the GPU's decision, on meta tensors: a host read would fail there, so any read shows ------------------------


def _meta_te_tensors(t=12, heads=2, d=16, b=2):
    meta = torch.device("meta")
    q, k, v = (torch.empty(t, heads, d, device=meta) for _ in range(3))
    cu_q, cu_kv, padded_q, padded_kv = (torch.empty(b + 1, dtype=torch.int32, device=meta) for _ in range(4))
    return (q, k, v), dict(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, cu_seqlens_q_padded=padded_q,
                           cu_seqlens_kv_padded=padded_kv, max_seqlen_q=2048, max_seqlen_kv=2048)  # fmt: skip


def _count_comparisons(monkeypatch, answer: bool) -> list:
    compared = []

    def equal(a, b):
        compared.append((a, b))
        return answer

    monkeypatch.setattr(torch, "equal", equal)
    monkeypatch.setattr(validate, "_comparable", lambda cu_q, cu_kv, capturing: not capturing)
    return compared


@pytest.mark.parametrize("family", list(TE_MASKS))
def test_te_calls_make_no_host_read_but_for_a_top_left_window(family, monkeypatch):
    """TE's self-attention calls on the GPU (separate cu_seqlens_kv and padded offsets, both max_seqlen): only a
    window with top-left causal needs to know that the lengths match, and asks once per pair of tensors, for every
    layer of the step."""
    compared = _count_comparisons(monkeypatch, answer=True)
    mask_type, window = TE_MASKS[family]
    (q, k, v), call = _meta_te_tensors()
    for _ in range(4):  # four layers, one pair of boundary tensors
        problem, packing = describe_call(q, k, v, CallOptions(causal=CAUSAL[mask_type], window=window, **call))
    top_left_window = family == "layout_4"
    assert len(compared) == (1 if top_left_window else 0)
    assert problem.varlen_gaps and packing.offsets_q is call["cu_seqlens_q_padded"]
    assert packing.offsets_kv is call["cu_seqlens_kv_padded"]  # the offsets stay as given
    assert problem.varlen_seqlens_match == top_left_window
    assert (packing.cu_seqlens_kv is call["cu_seqlens_q"]) == top_left_window


def test_te_cross_attention_top_left_window_keeps_its_anchor_on_the_gpu_when_lengths_differ(monkeypatch):
    """layout_4_2: the boundaries differ (one comparison), so top-left causal with a window stays anchored top-left,
    a mask of its own that the bottom-right-window kernels refuse with the reason; also when max_seqlen differ
    (bounds do not tell lengths apart)."""
    compared = _count_comparisons(monkeypatch, answer=False)
    (q, k, v), call = _meta_te_tensors()
    for max_kv in (2048, 4096):
        cu_kv = torch.empty(3, dtype=torch.int32, device="meta")
        options = CallOptions(causal=True, window=(4, 0), **dict(call, cu_seqlens_kv=cu_kv, max_seqlen_kv=max_kv))
        problem, _ = describe_call(q, k, v, options)
        assert problem.mask == "sliding_window_top_left" and problem.window == (4, 0)
    assert len(compared) == 2
    h200 = attnselect.Target.preset("h200", packages={"flash-attn-4": "4.0.0b36", "nvidia-cudnn-frontend": "1.32.0"})
    for name in ("varlen_fa2", "flash_attn4"):
        reasons = attnselect.backends.get(name).not_supported_reasons(problem, h200)
        assert any("window is anchored bottom-right" in r for r in reasons), (name, reasons)
    reasons = attnselect.backends.get("cudnn_frontend").not_supported_reasons(problem, h200)
    assert any("'sliding_window_top_left' is not supported" in r for r in reasons), reasons
    problem = dataclasses.replace(problem, varlen_gaps=False)  # flex serves the mask, gaps or not
    assert attnselect.select(problem, target=h200).chosen.backend == "flex"


@pytest.mark.parametrize("unread", [False, True], ids=["read", "unread-as-on-gpu"])
def test_equal_lengths_take_a_top_left_window_whatever_the_max_seqlen_bounds(unread, monkeypatch):
    """max_seqlen are bounds: TE's layout_4_0 call with max_seqlen_kv above max_seqlen_q is still self-attention."""
    if unread:
        _as_on_the_gpu(monkeypatch)
    (q, k, v), kwargs, geometry = te_call("layout_4_0", "thd_thd_thd", True, CPU_SIZES, torch.float64, "cpu")
    out = attnselect.attention(q, k, v, **dict(kwargs, max_seqlen_kv=2 * kwargs["max_seqlen_q"]))
    expected = reference(q.detach(), k.detach(), v.detach(), geometry, q.shape[-1] ** -0.5)
    torch.testing.assert_close(out.detach(), expected, **TOLERANCE[torch.float64])


def test_unpadded_calls_with_other_token_totals_are_told_apart_without_a_read(monkeypatch):
    compared = _count_comparisons(monkeypatch, answer=True)
    (q, k, v), call = _meta_te_tensors()
    call = dict(call, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None)
    problem, _ = describe_call(q, k[:10], v[:10], CallOptions(causal=True, window=(4, 0), **call))
    assert problem.mask == "sliding_window_top_left"
    assert not compared


def test_a_copy_that_cannot_be_compared_keeps_the_top_left_anchor(monkeypatch, caplog):
    """Where no read may be made (CUDA graph capture, torch.compile's meta tensors, inference tensors), a separate
    cu_seqlens_kv may hold other boundaries: the window stays anchored top-left (right either way); with
    cu_seqlens_kv=None it is self-attention, the bottom-right window the fast kernels take."""
    (q, k, v), call = _meta_te_tensors()
    monkeypatch.setattr(memos, "_WARNED", set())
    for _ in range(2):  # one warning, with the way out
        problem, _ = describe_call(q, k, v, CallOptions(causal=True, window=(4, 0), **call))  # meta: never comparable
    assert problem.mask == "sliding_window_top_left"
    warned = [r.getMessage() for r in caplog.records if "could not be compared" in r.getMessage()]
    assert len(warned) == 1 and "pass cu_seqlens_kv=None" in warned[0]
    problem, _ = describe_call(q, k, v, CallOptions(causal=True, window=(4, 0), **dict(call, cu_seqlens_kv=None)))
    assert problem.varlen_seqlens_match and problem.varlen_gaps and problem.mask == "sliding_window"


def test_shared_after_all_takes_equal_boundaries_as_self_attention(monkeypatch):
    """The decision as a plain function of CPU tensors: equal values share cu_seqlens_q and keep the offsets;
    different values, or token totals that differ without gaps, change nothing."""
    monkeypatch.setattr(validate, "_comparable", lambda cu_q, cu_kv, capturing: not capturing)
    q = torch.zeros(14, 1, 8)
    cu_q, cu_kv = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 3, 8], dtype=torch.int32)
    padded_q, padded_kv = torch.tensor([0, 5, 14], dtype=torch.int32), torch.tensor([0, 5, 14], dtype=torch.int32)
    unread = (None, None, False)
    packing, lengths = validate._shared_after_all(Packing(cu_q, cu_kv, 9, 9, padded_q, padded_kv), unread, q, q, False)
    assert lengths == (None, None, True) and packing.cu_seqlens_kv is cu_q
    assert packing.offsets_q is padded_q and packing.offsets_kv is padded_kv and packing.has_gaps
    packing, lengths = validate._shared_after_all(Packing(cu_q, cu_kv, 9, 9, cu_q, cu_kv), unread, q[:8], q[:8], False)
    assert lengths == (None, None, True) and packing.cu_seqlens_kv is cu_q and not packing.has_gaps
    other = torch.tensor([0, 4, 8], dtype=torch.int32)
    given = Packing(cu_q, other, 9, 9, padded_q, padded_kv)
    assert validate._shared_after_all(given, unread, q, q, False)[0] is given
    given = Packing(cu_q, other, 9, 9, cu_q, other)
    monkeypatch.setattr(torch, "equal", lambda a, b: pytest.fail("no read expected"))
    assert validate._shared_after_all(given, unread, q[:8], q[:7], False)[0] is given  # totals differ: no read
    assert validate._shared_after_all(given, unread, q[:8], q[:8], True)[0] is given  # under capture: no read


# -- the GPU: TE's own sizes, bf16 ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(TE_MASKS))
def test_te_dpa_qkv_layout_thd_on_the_gpu(family):
    """Every call of test_dpa_qkv_layout_thd for one mask family at TE's sizes (max_seqlen 2048/4096, 16-24 heads,
    head dims 64/128) in bf16 on CUDA, forward and backward, against the float64 reference with TE's bf16
    tolerance (atol = rtol = 1.5e-2); every call served."""
    tolerance = dict(atol=1.5e-2, rtol=1.5e-2)
    chosen = set()
    for config, layout in CASES:
        if not config.startswith(family + "_"):
            continue
        for pad_between_seqs in (True, False):
            problem, _ = check_te_call(config, layout, pad_between_seqs, torch.bfloat16, "cuda", TE_SIZES, tolerance)
            chosen.add(str(attnselect.select(problem).chosen))
    print(family, sorted(chosen))


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(TE_MASKS))
def test_te_calls_on_every_supported_gpu_candidate(family):
    """Each candidate the H200 calls supported, forced, on TE's thd_thd_thd call of each variant of the family with
    gaps between sequences, at TE's sizes in bf16."""
    tolerance = dict(atol=1.5e-2, rtol=1.5e-2)
    for config in (f"{family}_{variant}" for variant in TE_SIZES):
        (q, k, v), kwargs, geometry = te_call(config, "thd_thd_thd", True, TE_SIZES, torch.bfloat16, "cuda")
        problem, _ = describe_call(q, k, v, CallOptions(**kwargs))
        supported = [c.candidate.backend for c in attnselect.select(problem).verdicts if c.supported]
        print(config, supported)
        for backend in supported:
            check_te_call(config, "thd_thd_thd", True, torch.bfloat16, "cuda", TE_SIZES, tolerance, backend=backend)
