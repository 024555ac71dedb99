"""Bad input raises InvalidInputError (a ValueError) naming the argument, before any kernel runs."""

from __future__ import annotations

import pytest
import torch

import attnselect
from attnselect import InvalidInputError
from attnselect.errors import AttnSelectError
from attnselect.spec import validate
from attnselect.spec.options import CallOptions
from attnselect.spec.validate import packing_facts

q = torch.randn(2, 8, 4, 24)
k = torch.randn(2, 8, 2, 24)
v = torch.randn(2, 8, 2, 16)
cu = torch.tensor([0, 3, 8], dtype=torch.int32)
tq, tk, tv = torch.randn(8, 4, 24), torch.randn(8, 2, 24), torch.randn(8, 2, 16)

CASES = [
    ("rank", (q[0], k, v), {}, r"q\.shape: got \(8, 4, 24\), expected 4 dims \(B, S, H, D\)"),
    ("qk head dim", (q, k[..., :16], v), {}, r"k\.shape\[-1\]: got 16, expected q's head dim 24"),
    ("heads not divisible", (q[:, :, :3], k, v), {}, r"q heads: got 3, expected a multiple of the k/v head count 2"),
    ("v heads", (q, k, v[:, :, :1]), {}, r"v heads: got 1, expected k's head count 2"),
    ("batch", (q, k[:1], v[:1]), {}, r"k/v batch size"),
    ("kv length", (q, k, v[:, :5]), {}, r"v\.shape: .* expected as many key positions as k \(8\)"),
    ("mixed dtypes", (q, k.double(), v), {}, r"k\.dtype/v\.dtype"),
    ("int dtype", (q.long(), k, v), {}, r"q\.dtype: got torch\.int64"),
    ("layout", (q, k, v), {"layout": "bsh"}, r"layout: got 'bsh', expected one of"),
    ("meta tensors", tuple(t.to("meta") for t in (q, k, v)), {}, r"q.device: got meta, expected tensors with data"),
    (
        "pad as a number where True was decided",  # 1 == True: the memo must not answer for it
        (q, k, v),
        {"__first__": {"pad": True}, "pad": 1},
        r"pad: got 1",
    ),
    ("dropout", (q, k, v), {"dropout_p": 1.0}, r"dropout_p: got 1\.0, expected a number in \[0, 1\)"),
    ("dropout as a bool", (q, k, v), {"dropout_p": False}, r"dropout_p: got False, expected a number in \[0, 1\)"),
    ("causal value", (q, k, v), {"causal": "left"}, r"causal: got 'left'"),
    ("window shape", (q, k, v), {"window": (3,)}, r"window: got \(3,\)"),
    ("negative window", (q, k, v), {"window": (-2, 0)}, r"window: got \(-2, 0\)"),
    ("window past int32", (q, k, v), {"window": (2**31, 0)}, r"window: got \(2147483648, 0\), .* 2\*\*31 - 1"),
    ("window past a float", (q, k, v), {"window": (10**30, 0)}, r"window: got \(10{30}, 0\)"),
    ("scale past a float", (q, k, v), {"scale": 10**400}, r"scale: got 10{400}, expected None or a finite"),
    ("causal window looks ahead", (q, k, v), {"window": (4, 2), "causal": True}, r"right = 0 or -1"),
    ("cu_seqlens on dense", (q, k, v), {"cu_seqlens_q": cu}, r"cu_seqlens_q: .* belong to layout='thd'"),
    ("max_seqlen on dense", (q, k, v), {"max_seqlen_q": "abc"}, r"max_seqlen_q: got 'abc', expected None for layout"),
    ("max_seqlen_kv on dense", (q, k, v), {"max_seqlen_kv": 8}, r"max_seqlen_kv: got 8, .* belongs to layout='thd'"),
    ("thd without cu_seqlens", (tq, tk, tv), {"layout": "thd"}, r"cu_seqlens_q: got None"),
    (
        "thd int64 cu_seqlens",
        (tq, tk, tv),
        {"layout": "thd", "cu_seqlens_q": cu.long()},
        r"cu_seqlens_q: got tensor\(dtype=torch\.int64",
    ),
    (
        "thd empty cu_seqlens",
        (tq, tk, tv),
        {"layout": "thd", "cu_seqlens_q": cu[:0]},
        r"cu_seqlens_q: got tensor\(dtype=torch\.int32, shape=\(0,\)\), expected a 1-D torch\.int32 tensor",
    ),
    (
        "thd decreasing",
        (tq, tk, tv),
        {"layout": "thd", "cu_seqlens_q": torch.tensor([0, 5, 3, 8], dtype=torch.int32)},
        r"cu_seqlens_q: .* non-decreasing",
    ),
    (
        "thd not ending at T",
        (tq, tk, tv),
        {"layout": "thd", "cu_seqlens_q": torch.tensor([0, 3, 7], dtype=torch.int32)},
        r"cu_seqlens_q: got last entry 7, expected the token count 8",
    ),
    (
        "thd not starting at 0",
        (tq, tk, tv),
        {"layout": "thd", "cu_seqlens_q": torch.tensor([1, 3, 8], dtype=torch.int32)},
        r"cu_seqlens_q: .* first entry of 0",
    ),
    (
        "thd max_seqlen too small",
        (tq, tk, tv),
        {"layout": "thd", "cu_seqlens_q": cu, "max_seqlen_q": 3, "max_seqlen_kv": 5},
        r"max_seqlen_q: got 3, expected >= the longest sequence \(5\)",
    ),
    ("forced pad value", (q, k, v), {"pad": "maybe"}, r"pad: got 'maybe'"),
    ("scale text", (q, k, v), {"scale": "abc"}, r"scale: got 'abc', expected None or a finite number > 0"),
    ("scale nan", (q, k, v), {"scale": float("nan")}, r"scale: got nan"),
    ("scale negative", (q, k, v), {"scale": -1.0}, r"scale: got -1\.0"),
    (
        "max_seqlen type",
        (tq, tk, tv),
        {"layout": "thd", "cu_seqlens_q": cu, "max_seqlen_q": 5.0},
        r"max_seqlen_q: got 5\.0, expected an integer >= 0",
    ),
    (
        "max_seqlen negative",
        (tq, tk, tv),
        {"layout": "thd", "cu_seqlens_q": cu, "max_seqlen_kv": -1},
        r"max_seqlen_kv: got -1, expected an integer >= 0",
    ),
    (
        "max_seqlen_kv too small",
        (tq, tk, tv),
        {"layout": "thd", "cu_seqlens_q": cu, "max_seqlen_kv": 4},
        r"max_seqlen_kv: got 4, expected >= the longest sequence \(5\)",
    ),
    ("q not a tensor", (q.tolist(), k, v), {}, r"q: got list, expected a torch\.Tensor"),
    ("mixed devices", (q, k.to("meta"), v), {}, r"k\.device/v\.device: got q cpu, k meta, v cpu"),
    (
        "thd rank",
        (q, k, v),
        {"layout": "thd", "cu_seqlens_q": cu},
        r"q\.shape: got \(2, 8, 4, 24\), expected 3 dims \(T, H, D\)",
    ),
    (
        "bhsd heads",
        (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)[:, :1]),
        {"layout": "bhsd"},
        r"v heads: got 1, expected k's head count 2",
    ),
    (
        "cu_seqlens device",
        (tq, tk, tv),
        {"layout": "thd", "cu_seqlens_q": cu.to("meta")},
        r"cu_seqlens_q\.device: got meta, expected q's device cpu",
    ),
    (
        "cu_seqlens 2-D",
        (tq, tk, tv),
        {"layout": "thd", "cu_seqlens_q": cu.view(1, 3)},
        r"cu_seqlens_q: got tensor\(dtype=torch\.int32, shape=\(1, 3\)\), expected a 1-D torch\.int32 tensor",
    ),
    (
        "cu_seqlens_kv entries",
        (tq, tk, tv),
        {"layout": "thd", "cu_seqlens_q": cu, "cu_seqlens_kv": torch.tensor([0, 2, 4, 8], dtype=torch.int32)},
        r"cu_seqlens_kv: got 4 entries, expected as many as cu_seqlens_q \(3\)",
    ),
    (
        "cu_seqlens_kv not ending at Tk",
        (tq, tk[:6], tv[:6]),
        {"layout": "thd", "cu_seqlens_q": cu, "cu_seqlens_kv": cu.clone()},
        r"cu_seqlens_kv: got last entry 8, expected the token count 6",
    ),
    (
        "Tq != Tk with shared cu_seqlens",
        (tq, tk[:6], tv[:6]),
        {"layout": "thd", "cu_seqlens_q": cu},
        r"k\.shape\[0\]: got 6, expected q's token count 8",
    ),
    (
        "padded offsets end",
        (tq, tk, tv),
        {
            "layout": "thd",
            "cu_seqlens_q": torch.tensor([0, 3, 7], dtype=torch.int32),
            "cu_seqlens_q_padded": torch.tensor([0, 4, 9], dtype=torch.int32),
        },
        r"cu_seqlens_q_padded: got first 0, last 9, expected 0 and the token count 8",
    ),
    (
        "padded offsets too tight",
        (tq, tk, tv),
        {
            "layout": "thd",
            "cu_seqlens_q": torch.tensor([0, 3, 7], dtype=torch.int32),
            "cu_seqlens_q_padded": torch.tensor([0, 2, 8], dtype=torch.int32),
        },
        r"cu_seqlens_q_padded: got room 2 for sequence 0, expected >= its length 3",
    ),
    ("scale zero", (q, k, v), {"scale": 0.0}, r"scale: got 0\.0, expected None or a finite number > 0"),
    ("scale inf", (q, k, v), {"scale": float("inf")}, r"scale: got inf"),
    ("scale bool", (q, k, v), {"scale": True}, r"scale: got True"),
    ("dropout negative", (q, k, v), {"dropout_p": -0.1}, r"dropout_p: got -0\.1, expected a number in \[0, 1\)"),
    ("dropout text", (q, k, v), {"dropout_p": "0.1"}, r"dropout_p: got '0\.1', expected a number in \[0, 1\)"),
    ("window not integers", (q, k, v), {"window": (1.5, 0)}, r"window: got \(1\.5, 0\)"),
    (
        "forced backend unknown",
        (q, k, v),
        {"backend": "flash9"},
        r"backend: got 'flash9', expected one of \[.*'sdpa_flash'.*\]",
    ),
    (
        "forced backend cannot serve",
        (q, k, v),
        {"backend": "sdpa_flash", "pad": "never"},
        r"sdpa_flash.*needs equal head dims, got d_qk=24 and d_v=16",
    ),
    (
        "disable unknown",
        (q, k, v),
        {"disable": ["sdpa_flash", "nope"]},
        r"disable: got unknown backend\(s\) \['nope'\]",
    ),
    ("disable not names", (q, k, v), {"disable": [1]}, r"disable: got \[1\], expected a list of backend names"),
    (
        "policy unknown",
        (q, k, v),
        {"backend": None, "pad": "auto", "disable": None, "__env__": {"ATTNSELECT_POLICY": "fast"}},
        r"ATTNSELECT_POLICY: got 'fast', expected one of \('rules', 'measure'\)",
    ),
    ("env pad", (q, k, v), {"__env__": {"ATTNSELECT_PAD": "sometimes"}}, r"ATTNSELECT_PAD: got 'sometimes'"),
    (
        "env backend",
        (q, k, v),
        {"__env__": {"ATTNSELECT_BACKEND": "nope"}},
        r"ATTNSELECT_BACKEND: got 'nope', expected one of",
    ),
    (
        "env disable",
        (q, k, v),
        {"__env__": {"ATTNSELECT_DISABLE": "flex,nope"}},
        r"ATTNSELECT_DISABLE: got unknown backend\(s\) \['nope'\]",
    ),
    (
        "env strict",
        (q, k, v),
        {"__env__": {"ATTNSELECT_STRICT": "yes"}},
        r"ATTNSELECT_STRICT: got 'yes', expected '0' or '1'",
    ),
    (
        "env debug level",
        (q, k, v),
        {"__env__": {"ATTNSELECT_DEBUG": "1", "ATTNSELECT_DEBUG_LEVEL": "3"}},
        r"ATTNSELECT_DEBUG_LEVEL: got '3'",
    ),
]


@pytest.mark.parametrize("args,kwargs,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_names_the_argument(args, kwargs, message, monkeypatch):
    def no_kernel(*a, **kw):
        raise AssertionError("a kernel ran before validation failed")

    for backend in attnselect.backends.all_backends():
        for method in ("run", "run_packed"):
            monkeypatch.setattr(type(backend), method, no_kernel)
    kwargs = dict(kwargs)
    for name, value in kwargs.pop("__env__", {}).items():
        monkeypatch.setenv(name, value)
    first = kwargs.pop("__first__", None)
    if first is not None:  # a valid call before, memoized
        monkeypatch.undo()
        attnselect.attention(*args, **first)
        for backend in attnselect.backends.all_backends():
            for method in ("run", "run_packed"):
                monkeypatch.setattr(type(backend), method, no_kernel)
    with pytest.raises(AttnSelectError, match=message) as err:
        attnselect.attention(*args, **kwargs)
    assert isinstance(err.value, ValueError)  # InvalidInputError or ForcedChoiceError


def test_the_catalogue_is_large():
    assert len(CASES) >= 40


def test_views_and_gqa_are_valid_input():
    out = attnselect.attention(q, k, v, causal=True)
    assert out.shape == (2, 8, 4, 16)


def test_thd_reads_boundaries_on_the_host_only_without_max_seqlen():
    # Meta tensors stand in for GPU tensors: reading their values fails, so a host read would show.
    meta = torch.device("meta")
    q, k, v = (torch.empty(8, 2, d, device=meta) for d in (24, 24, 16))
    cu = torch.empty(3, dtype=torch.int32, device=meta)
    problem = attnselect.AttentionProblem.from_tensors(
        q, k, v, layout="thd", cu_seqlens_q=cu, max_seqlen_q=5, max_seqlen_kv=5
    )
    assert (problem.batch, problem.seqlen_q, problem.varlen_seqlens_match) == (2, 5, True)
    with pytest.raises(Exception, match="meta"):
        attnselect.AttentionProblem.from_tensors(q, k, v, layout="thd", cu_seqlens_q=cu)
    with pytest.raises(InvalidInputError, match=r"k\.shape\[0\]: got 6, expected q's token count 8"):
        attnselect.AttentionProblem.from_tensors(
            q, k[:6], v[:6], layout="thd", cu_seqlens_q=cu, max_seqlen_q=5, max_seqlen_kv=5
        )  # Tq != Tk under shared boundaries, no read


def test_thd_facts_are_exact_from_lengths_and_conservative_without():
    assert packing_facts("causal", None, None, None, shared_boundaries=True) == {
        "varlen_seqlens_match": True,
        "varlen_single_key": True,
        "varlen_rows_without_keys": False,
    }
    assert packing_facts("causal", None, None, None)["varlen_rows_without_keys"]
    assert not packing_facts("causal_bottom_right", None, [2, 0, 3], [2, 0, 5])["varlen_rows_without_keys"]
    assert packing_facts("none", None, [2, 1], [2, 0])["varlen_rows_without_keys"]


def test_equal_boundaries_in_tensors_of_their_own_are_recognised_once_per_pair(monkeypatch):
    """Collators, TE and Megatron pass cu_seqlens_kv as a copy of cu_seqlens_q: self-attention, not keyless rows."""
    meta = torch.device("meta")  # stands in for the GPU: no value can be read by accident
    q, k, v = (torch.empty(8, 2, d, device=meta) for d in (24, 24, 16))
    cu_q, cu_kv = (torch.empty(3, dtype=torch.int32, device=meta) for _ in range(2))
    compared = []

    def equal(a, b):
        compared.append((a, b))
        return answer

    monkeypatch.setattr(torch, "equal", equal)

    monkeypatch.setattr(validate, "_comparable", lambda cu_q, cu_kv, capturing: True)
    answer = True
    call = dict(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, max_seqlen_q=5, max_seqlen_kv=5)
    for _ in range(3):  # every layer of a step: one comparison
        problem = attnselect.AttentionProblem.from_tensors(q, k, v, causal=True, window=(4, 0), **call)
    assert len(compared) == 1 and problem.varlen_seqlens_match and not problem.varlen_rows_without_keys
    assert problem.mask == "sliding_window"
    answer = False
    other = torch.empty(3, dtype=torch.int32, device=meta)
    # different boundaries: top-left with a window stays anchored top-left
    problem = attnselect.AttentionProblem.from_tensors(
        q, k, v, causal=True, window=(4, 0), **dict(call, cu_seqlens_kv=other)
    )
    assert len(compared) == 2 and problem.mask == "sliding_window_top_left"
    unequal_max = attnselect.AttentionProblem.from_tensors(q, k, v, **dict(call, cu_seqlens_kv=other, max_seqlen_kv=6))
    assert len(compared) == 2 and unequal_max.varlen_rows_without_keys  # told apart without a read


def test_equal_boundaries_read_on_the_host_are_shared():
    q = torch.randn(9, 2, 16)
    cu_q, cu_kv = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    from attnselect.spec.problem import describe_call

    problem, packing = describe_call(
        q, q, q, CallOptions(layout="thd", cu_seqlens_q=cu_q, cu_seqlens_kv=cu_kv, causal=True, window=(2, 0))
    )
    assert problem.varlen_seqlens_match and packing.cu_seqlens_kv is cu_q and not packing.has_gaps


def test_boundaries_are_compared_by_value_only_where_a_read_is_allowed_and_remembered():
    from attnselect.spec.validate import _comparable

    meta = torch.empty(3, dtype=torch.int32, device="meta")  # a traced call's tensors: no values to read
    assert not _comparable(meta, meta.clone(), capturing=False)
    with torch.inference_mode():
        frozen = torch.zeros(3, dtype=torch.int32)
    for cu in (frozen, torch.zeros(3, dtype=torch.int32)):  # inference tensors (no version), and the CPU
        assert not _comparable(cu, cu.clone(), capturing=False)
    assert not _comparable(meta, meta, capturing=True)


def test_a_copy_of_cu_seqlens_q_compiles_as_before():
    """Under torch.compile validation runs on meta tensors: a copied cu_seqlens_kv must not be read there."""
    (q, k, v), cu, _ = __import__("helpers").thd_inputs([3, 5], hq=2, hkv=2, dqk=16, dv=8)
    copy = cu.clone()

    def fn(q, k, v):
        return attnselect.attention(
            q,
            k,
            v,
            layout="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=copy,
            max_seqlen_q=5,
            max_seqlen_kv=5,
            causal="bottom_right",
            backend="reference",
        )

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v)
    assert torch.allclose(out, fn(q, k, v))


def test_a_generous_max_seqlen_does_not_make_the_problem_bigger_where_the_lengths_are_read():
    """On the CPU the boundaries are read anyway: the problem is the real one (the measure policy times its size),
    while the kernels keep the caller's bound."""
    from attnselect.spec.options import CallOptions
    from attnselect.spec.problem import describe_call

    q = torch.randn(20, 2, 16)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    options = CallOptions(layout="thd", cu_seqlens_q=cu, max_seqlen_q=4096, max_seqlen_kv=4096)
    problem, packing = describe_call(q, q, q, options)
    assert (problem.seqlen_q, problem.seqlen_kv) == (13, 13)
    assert (packing.max_seqlen_q, packing.max_seqlen_kv) == (4096, 4096)


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_a_top_left_window_keeps_its_anchor_where_lengths_differ(layout):
    """causal=True with a window is anchored top-left (TransformerEngine's padding_causal with window_size): where a
    sequence has more keys than queries, query i sees keys i - left .. i, on every candidate that serves it."""
    g = torch.Generator().manual_seed(3)
    lengths_q, lengths_kv = [5, 3], [9, 3]
    q = torch.randn(sum(lengths_q), 2, 8, generator=g, dtype=torch.float64)
    k = torch.randn(sum(lengths_kv), 2, 8, generator=g, dtype=torch.float64)
    v = torch.randn(sum(lengths_kv), 2, 4, generator=g, dtype=torch.float64)
    expected = []
    for s_q, s_kv, (a, b) in zip(lengths_q, lengths_kv, [(0, 0), (5, 9)]):
        i, j = torch.arange(s_q)[:, None], torch.arange(s_kv)[None]
        scores = torch.einsum("qhd,khd->hqk", q[a : a + s_q], k[b : b + s_kv]) / 8**0.5
        scores = scores.masked_fill(~((j <= i) & (j >= i - 2)), float("-inf"))
        expected.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[b : b + s_kv]))
    if layout == "thd":
        cu = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
        args, call = (q, k, v), dict(layout="thd", cu_seqlens_q=cu(lengths_q), cu_seqlens_kv=cu(lengths_kv))
        expected = torch.cat(expected)
    else:  # the first sequence as a batch of one
        args, call, expected = (q[None, :5], k[None, :9], v[None, :9]), {}, expected[0][None]
    problem = attnselect.AttentionProblem.from_tensors(*args, causal=True, window=(2, 0), **call)
    assert problem.mask == "sliding_window_top_left" and problem.window == (2, 0)
    served = [x.candidate.backend for x in attnselect.select(problem).verdicts if x.supported]
    assert served
    for backend in served:
        out = attnselect.attention(*args, causal=True, window=(2, 0), backend=backend, **call)
        torch.testing.assert_close(out, expected, msg=lambda m, b=backend: f"{b}: {m}")
    square = attnselect.AttentionProblem.from_tensors(q[None, :5], k[None, :5], v[None, :5], causal=True, window=(2, 0))
    assert square.mask == "sliding_window"  # the same mask where the anchors coincide
