"""torch.compile: attention traces as one custom op (no graph break), forward and backward, dense and thd."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

import attnselect
from attnselect import AttentionProblem, InvalidInputError, ops
from attnselect.choose.candidates import judge
from attnselect.spec.options import Candidate
from helpers import thd_inputs


def _dense(dtype=torch.float64, grad=True):
    g = torch.Generator().manual_seed(0)
    shapes = ((2, 6, 4, 24), (2, 6, 2, 24), (2, 6, 2, 16))
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_(grad) for s in shapes]


def _compiled_graph_ops(fn, *args, compiler="aot_eager"):
    """Run ``fn`` compiled with fullgraph=True (a graph break raises) through AOTAutograd (so the
    fake implementations and the backward op are traced too) and ``compiler``; return its result and
    the ops of its graph."""
    from torch._dynamo.backends.registry import lookup_backend

    seen, compile_graph = [], lookup_backend(compiler)

    def backend(gm, example_inputs):
        seen.extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
        return compile_graph(gm, example_inputs)

    torch._dynamo.reset()
    result = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)(*args)
    return result, seen


def _grads(out, inputs, grad_out):
    return torch.autograd.grad(out, inputs, grad_out)


CALLS = {
    "dense-causal": dict(causal=True),
    "dense-bottom-right-window-lse": dict(causal="bottom_right", window=(3, 0), return_lse=True),
    "dense-forced-padding": dict(pad="always"),
}


@pytest.mark.parametrize("name", CALLS)
def test_dense_compiles_to_one_op_and_matches_eager(name):
    q, k, v = _dense()
    kwargs = CALLS[name]

    def fn(q, k, v):
        return attnselect.attention(q, k, v, **kwargs)

    compiled, graph_ops = _compiled_graph_ops(fn, q, k, v)
    assert "attnselect.attention" in graph_ops
    eager = fn(q, k, v)
    compiled_out, eager_out = (r[0] if isinstance(r, tuple) else r for r in (compiled, eager))
    assert compiled_out.shape == (2, 6, 4, 16)
    torch.testing.assert_close(compiled_out, eager_out)
    if kwargs.get("return_lse"):
        torch.testing.assert_close(compiled[1], eager[1])
    grad_out = torch.randn_like(eager_out)
    for got, want in zip(_grads(compiled_out, (q, k, v), grad_out), _grads(eager_out, (q, k, v), grad_out)):
        torch.testing.assert_close(got, want)


def test_compiled_cpu_graphs_leave_flex_out():
    q, k, v = _dense(grad=False)  # inference with lse: flex would rank above reference in eager calls
    compiled, _ = _compiled_graph_ops(
        lambda q, k, v: attnselect.attention(q, k, v, causal=True, return_lse=True), q, k, v
    )
    torch.testing.assert_close(compiled[0], attnselect.attention(q, k, v, causal=True, backend="reference"))
    assert (
        attnselect.select(AttentionProblem.from_tensors(q, k, v, causal=True, return_lse=True)).chosen.backend == "flex"
    )
    _forced_flex_refuses_to_compile(q, k, v, "CPU")


def _forced_flex_refuses_to_compile(q, k, v, device_name):
    forced = torch.compile(lambda q, k, v: attnselect.attention(q, k, v, backend="flex"), fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=f"cannot run inside a compiled graph on the {device_name}"):
        forced(q, k, v)


def test_thd_compiles_with_max_seqlen_and_matches_eager():
    (q, k, v), cu_q, cu_kv = thd_inputs(
        lengths_q=[0, 1, 5, 3], hq=4, hkv=2, dqk=24, dv=16, dtype=torch.float64, device="cpu"
    )
    for t in (q, k, v):
        t.requires_grad_()

    def fn(q, k, v, cu_q):
        return attnselect.attention(
            q, k, v, layout="thd", cu_seqlens_q=cu_q, causal=True, max_seqlen_q=5, max_seqlen_kv=5, return_lse=True
        )

    (out, lse), graph_ops = _compiled_graph_ops(fn, q, k, v, cu_q)
    assert "attnselect.attention" in graph_ops
    want_out, want_lse = fn(q, k, v, cu_q)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    grad_out = torch.randn_like(out)
    for got, want in zip(_grads(out, (q, k, v), grad_out), _grads(want_out, (q, k, v), grad_out)):
        torch.testing.assert_close(got, want)


def test_thd_under_compile_needs_max_seqlen():
    (q, k, v), cu_q, _ = thd_inputs(lengths_q=[2, 3], hq=2, hkv=2, dqk=8, dv=8, dtype=torch.float32, device="cpu")
    compiled = torch.compile(
        lambda q, k, v, cu: attnselect.attention(q, k, v, layout="thd", cu_seqlens_q=cu), fullgraph=True
    )
    torch._dynamo.reset()
    with pytest.raises(Exception, match="max_seqlen_q/max_seqlen_kv: got None/None"):
        compiled(q, k, v, cu_q)


def test_bad_input_fails_while_tracing_with_the_eager_message():
    q, k, v = _dense(grad=False)
    compiled = torch.compile(lambda q, k, v: attnselect.attention(q, k[..., :8], v, causal=True), fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"k\.shape\[-1\]: got 8, expected q's head dim 24"):
        compiled(q, k, v)
    for option, value in (("return_lse", "no"), ("pad", 1), ("backend", "nope")):  # as eager calls name them
        given = {option: value}
        compiled = torch.compile(lambda q, k, v, g=given: attnselect.attention(q, k, v, **g), backend="aot_eager")
        torch._dynamo.reset()
        with pytest.raises(Exception, match=rf"{option}: got {value!r}"):
            compiled(q, k, v)


def test_a_graph_traced_on_meta_tensors_is_decided_as_on_the_cpu():
    """No kernel runs in a graph traced on meta tensors (the op's fake implementation), so it compiles, as eager
    attention() on meta tensors is refused."""
    q = torch.randn(1, 4, 2, 8, device="meta")
    torch._dynamo.reset()
    out = torch.compile(lambda q: attnselect.attention(q, q, q), backend="aot_eager")(q)
    assert out.device.type == "meta" and out.shape == q.shape
    with pytest.raises(InvalidInputError, match="^q.device: got meta"):
        attnselect.attention(q, q, q)


@pytest.mark.parametrize(
    "refused,message",
    [
        (dict(d=8), r"k\.shape\[-1\]: got 8"),  # the decision's validation
        (dict(softcap=30.0), r"softcap: got 30.0 under torch.compile"),  # what traced calls do not serve yet
        (dict(scale=-1.0), r"scale: got -1.0"),
    ],
)
def test_a_refused_call_is_refused_and_leaves_later_calls_compiled(monkeypatch, refused, message):
    """Every refusal of a traced call is raised while dynamo traces the decision, which dynamo wraps but does not
    take for a reason to skip the function: the refused call is not run eagerly instead (a graph break would run it,
    silently), and the next valid call compiles to the traced op."""
    traced = []
    original = ops.traced_attention
    monkeypatch.setattr(ops, "traced_attention", lambda *a: traced.append(1) or original(*a))
    q, k, v = _dense(grad=False)

    def fn(q, k, v, d=24, softcap=None, scale=None):
        return attnselect.attention(q, k[..., :d], v, causal=True, softcap=softcap, scale=scale)

    compiled = torch.compile(fn, backend="eager")
    torch._dynamo.reset()
    with pytest.raises(Exception, match=message):
        compiled(q, k, v, **refused)
    traced.clear()
    out = compiled(q, k, v)
    assert traced and torch.allclose(out, attnselect.attention(q, k, v, causal=True))


def test_dropout_backward_replays_the_forward_mask():
    q, k, v = _dense(dtype=torch.float32)

    def fn(q, k, v):
        return attnselect.attention(q, k, v, dropout_p=0.5, backend="sdpa_math")

    torch.manual_seed(1)
    compiled, _ = _compiled_graph_ops(fn, q, k, v)
    grad_out = torch.ones_like(compiled)
    got = _grads(compiled, (q, k, v), grad_out)
    torch.manual_seed(1)
    eager = fn(q, k, v)
    torch.testing.assert_close(compiled, eager)  # the same draws from the same RNG state
    for g, want in zip(got, _grads(eager, (q, k, v), grad_out)):
        torch.testing.assert_close(g, want)


def _spec(problem: AttentionProblem, candidate: Candidate) -> str:
    return json.dumps({"problem": problem.to_dict(), "backend": candidate.backend, "pad_to": candidate.pad_to})


# (label, problem kwargs, candidate): every CPU candidate, dense and packed, except flex. Eager flex
# (its CPU path) applies the mask with functorch's vmap, which cannot run under the dispatch modes of
# opcheck's checks ("NYI: querying is_contiguous inside of vmap"), nor inside a compiled graph, so
# compiled CPU graphs leave it out (test_compiled_cpu_graphs_leave_flex_out).
OPCHECK = [
    ("sdpa_flash-padded", dict(mask="causal"), Candidate("sdpa_flash", 24)),
    ("sdpa_math", dict(mask="causal_bottom_right"), Candidate("sdpa_math")),
    ("reference-lse", dict(return_lse=True), Candidate("reference")),
    ("reference-padded-window", dict(mask="sliding_window", window=(2, 1)), Candidate("reference", 24)),
    ("thd-sdpa_math", dict(layout="thd", mask="causal"), Candidate("sdpa_math")),
    ("thd-reference-lse", dict(layout="thd", return_lse=True), Candidate("reference")),
]


@pytest.mark.parametrize("label,fields,candidate", OPCHECK, ids=[c[0] for c in OPCHECK])
def test_opcheck(label, fields, candidate):
    fields = dict(fields)
    training = fields.pop("training", True)
    if fields.get("layout") == "thd":
        (q, k, v), cu, _ = thd_inputs(
            lengths_q=[2, 0, 4], hq=4, hkv=2, dqk=24, dv=16, dtype=torch.float64, device="cpu"
        )
        problem = AttentionProblem(3, 4, 4, 4, 2, 24, 16, dtype=torch.float64, training=training, **fields)
        packing = (cu, cu, cu, cu)
    else:
        q, k, v = _dense(grad=False)
        problem = AttentionProblem(2, 6, 6, 4, 2, 24, 16, dtype=torch.float64, training=training, **fields)
        packing = (None, None, None, None)
    q, k, v = (t.detach().requires_grad_(training) for t in (q, k, v))
    spec = _spec(problem, candidate)
    torch.library.opcheck(torch.ops.attnselect.attention, (q, k, v, *packing, spec, None))
    if training:
        grad_out = torch.randn(*q.shape[:-1], 16, dtype=torch.float64)
        rng = torch.empty(0, dtype=torch.uint8)
        torch.library.opcheck(
            torch.ops.attnselect.attention_backward,
            (grad_out, q.detach(), k.detach(), v.detach(), *packing, rng, spec, 0.3),
        )


def test_fake_output_takes_the_value_head_dim():
    problem = AttentionProblem(2, 6, 6, 4, 2, 24, 16, dtype=torch.float32, layout="bhsd", return_lse=True)
    spec = _spec(problem, Candidate("sdpa_math"))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(2, 4, 6, 24), torch.empty(2, 2, 6, 24)
        v = torch.empty(2, 2, 6, 16)
        out, lse, rng = torch.ops.attnselect.attention(q, k, v, None, None, None, None, spec, None)
    assert out.shape == (2, 4, 6, 16) and lse.shape == (2, 4, 6) and rng.numel() == 0


def test_ops_module_parses_each_spec_once():
    problem = AttentionProblem(1, 2, 2, 1, 1, 8, 8)
    spec = _spec(problem, Candidate("reference"))
    ops._parse.cache_clear()
    assert ops._parse(spec) == (problem, Candidate("reference")) and ops._parse(spec)[0] is ops._parse(spec)[0]


def test_eager_calls_do_not_use_the_ops(monkeypatch):
    monkeypatch.setattr(ops, "traced_attention", lambda *a, **k: pytest.fail("eager call took the traced path"))
    q, k, v = _dense(grad=False)
    attnselect.attention(q, k, v)


def test_the_trace_time_decision_validates_on_meta_tensors():
    with pytest.raises(InvalidInputError, match=r"k\.shape\[-1\]: got 8"):
        ops._decide(
            None,
            ((2, 6, 4, 24), (2, 6, 2, 8), (2, 6, 2, 16)),
            ("torch.float64",) * 3,
            ("cpu",) * 3,
            (None,) * 4,
            True,
            "bshd",
            True,
            None,
            0.0,
            None,
            None,
            False,
            False,
            False,
            None,
            None,
            None,
        )


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_gpu_backends_compile_to_one_op(layout):
    """On the GPU the traced op runs the GPU choice (cuDNN, the packed kernels), forward and backward."""
    from helpers import rel_err

    if layout == "thd":
        (q, k, v), cu, _ = thd_inputs(
            lengths_q=[0, 1, 100, 37, 256], hq=8, hkv=8, dqk=192, dv=128, dtype=torch.bfloat16, device="cuda"
        )
        kwargs = dict(layout="thd", cu_seqlens_q=cu, max_seqlen_q=256, max_seqlen_kv=256, causal=True)
    else:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (
            torch.randn(2, 512, 8, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for d in (192, 192, 128)
        )
        kwargs = dict(causal=True)

    def fn(q, k, v):
        return attnselect.attention(q, k, v, **kwargs)

    compiled, graph_ops = _compiled_graph_ops(fn, q, k, v, compiler="inductor")
    assert "attnselect.attention" in graph_ops
    eager = fn(q, k, v)
    assert rel_err(compiled, eager) < 1e-2
    grad_out = torch.randn_like(eager)
    for got, want in zip(_grads(compiled, (q, k, v), grad_out), _grads(eager, (q, k, v), grad_out)):
        assert rel_err(got, want) < 1e-2


@pytest.mark.gpu
def test_compiled_gpu_graphs_leave_flex_out():
    """FlexAttention's block masks fail under the compiled graph's dispatch mode on the H200 too (torch 2.11)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 256, 8, d, device="cuda", dtype=torch.bfloat16, generator=g) for d in (64, 64, 64))
    problem = AttentionProblem.from_tensors(q, k, v, causal=True)
    flex = [
        v
        for v in judge(dataclasses.replace(problem, compiled_graph=True), attnselect.Target.current())
        if v.candidate.backend == "flex"
    ]
    assert flex and not any(v.supported for v in flex)
    _forced_flex_refuses_to_compile(q, k, v, "CUDA")


class _MLABlock(torch.nn.Module):
    """Projections around attention with d_qk=24, d_v=16, as an MLA layer has them."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = torch.nn.Linear(32, 4 * 24), torch.nn.Linear(32, 2 * 24), torch.nn.Linear(32, 2 * 16)
        self.out = torch.nn.Linear(4 * 16, 32)

    def forward(self, x):
        b, s, _ = x.shape
        o = attnselect.attention(
            self.q(x).view(b, s, 4, 24), self.k(x).view(b, s, 2, 24), self.v(x).view(b, s, 2, 16), causal=True
        )
        return self.out(o.reshape(b, s, 64))


def test_a_module_compiles_fullgraph_and_trains_like_eager():
    torch.manual_seed(0)
    module = _MLABlock().double()
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    compiled, graph_ops = _compiled_graph_ops(module, x)
    assert "attnselect.attention" in graph_ops
    compiled.sum().backward()
    got = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    eager = module(x)
    eager.sum().backward()
    torch.testing.assert_close(compiled, eager)
    for g, p in zip(got, module.parameters()):
        torch.testing.assert_close(g, p.grad)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_every_new_shape_compiles_a_static_fullgraph_with_its_own_decision(device, monkeypatch):
    """The decision is per shape: under dynamic=False, the default torch.compile (which makes a second size
    dynamic) and dynamic=True alike, fullgraph=True compiles each new shape whole, specialized, with no graph
    break, forward and backward; dense and packed with a token total that changes every step."""
    from torch._dynamo.utils import counters

    from helpers import rel_err

    dtype = torch.float64 if device == "cpu" else torch.bfloat16

    def dense(q, k, v):
        return attnselect.attention(q, k, v, causal=True, window=(3, 0), scale=0.3)

    def packed(q, k, v, cu):
        return attnselect.attention(
            q,
            k,
            v,
            layout="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=64,
            max_seqlen_kv=64,
            causal=True,
            dropout_p=0.0,
        )

    def close(got, want):
        if device == "cpu":
            torch.testing.assert_close(got, want)
        else:
            assert rel_err(got, want) < 1e-2

    decided = []
    real_decide = ops._decide

    @torch.compiler.assume_constant_result
    def spy(*args):
        spec = real_decide(*args)
        problem = json.loads(spec)["problem"]
        decided.append((problem["layout"], problem["batch"], problem["seqlen_q"]))
        return spec

    monkeypatch.setattr(ops, "_decide", spy)

    for dynamic in (False, None, True):
        torch._dynamo.reset()  # each setting compiles from scratch
        counters.clear()
        decided.clear()
        compiled_dense = torch.compile(lambda *a: dense(*a), dynamic=dynamic, fullgraph=True)
        compiled_packed = torch.compile(lambda *a: packed(*a), dynamic=dynamic, fullgraph=True)
        for s in (6, 9, 13):
            q, k, v = (
                torch.randn(2, s * 8, 2, d, dtype=dtype, device=device, requires_grad=True) for d in (192, 192, 128)
            )
            out = compiled_dense(q, k, v)
            close(out, dense(q, k, v))
            grad_out = torch.randn_like(out)
            for got, want in zip(_grads(out, (q, k, v), grad_out), _grads(dense(q, k, v), (q, k, v), grad_out)):
                close(got, want)
            lengths = [s - 5, 64, 3][: 2 + s % 2]  # totals and sequence counts change
            cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
            tq, tk, tv = (torch.randn(sum(lengths), 2, d, dtype=dtype, device=device) for d in (192, 192, 128))
            close(compiled_packed(tq, tk, tv, cu), packed(tq, tk, tv, cu))
        assert not counters["graph_break"], (dynamic, dict(counters["graph_break"]))
        assert counters["stats"]["unique_graphs"] == 6, dynamic  # one static graph per shape, not one dynamic
        assert set(decided) == {("bshd", 2, 48), ("bshd", 2, 72), ("bshd", 2, 104), ("thd", 2, 64), ("thd", 3, 64)}


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    "option, value",
    [
        ("window", (1.5, 0)),
        ("window", (True, 0)),
        ("dropout_p", 1.5),
        ("dropout_p", "0.1"),
        ("max_seqlen_q", 2.5),
        ("max_seqlen_q", -1),
        ("scale", -1.0),
        ("scale", True),
    ],
)
def test_bad_options_fail_under_compile_with_the_eager_message(dynamic, option, value):
    """Options are made plain numbers before the decision (dynamic=True keeps them symbolic), and bad ones still
    reach validation, which names them."""
    q, k, v = (torch.randn(7, 2, d) for d in (24, 24, 16))
    kwargs = dict(
        layout="thd",
        cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32),
        max_seqlen_q=4,
        max_seqlen_kv=4,
        causal=True,
    ) | {option: value}
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attnselect.attention(q, k, v, **kwargs), dynamic=dynamic, fullgraph=True)
    with pytest.raises(InvalidInputError, match=option):
        attnselect.attention(q, k, v, **kwargs)
    with pytest.raises(Exception, match=rf"InvalidInputError\W+{option}: got"):  # dynamo wraps it, message and all
        compiled(q, k, v)


@pytest.mark.parametrize("dynamic", [None, True])
def test_options_that_change_or_come_from_sizes_compile(dynamic):
    """A scale that changes between calls, and causal and return_lse computed from sizes, stay out of the decision's
    way: dynamo keeps such numbers and bools symbolic; they are specialized like sizes."""

    def fn(q, k, v, scale):
        return attnselect.attention(q, k, v, scale=scale, causal=q.shape[1] > 1, return_lse=q.shape[1] > 1)

    torch._dynamo.reset()
    compiled = torch.compile(fn, dynamic=dynamic, fullgraph=True)
    for s, scale in ((6, 0.3), (6, 0.5), (9, 2), (1, 0.5)):
        q, k, v = (torch.randn(2, s, 2, d, dtype=torch.float64) for d in (24, 24, 16))
        got, want = compiled(q, k, v, scale), fn(q, k, v, scale)
        if s == 1:
            torch.testing.assert_close(got, want)
        else:
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)


def test_a_size_marked_dynamic_cannot_be_specialized():
    """A size the caller marks dynamic on purpose cannot take a per-shape decision: dynamo says so (README)."""
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: attnselect.attention(q, k, v, causal=True), fullgraph=True)
    q, k, v = (torch.randn(2, 6, 2, d) for d in (24, 24, 16))
    torch._dynamo.mark_dynamic(q, 1)
    with pytest.raises(Exception, match="Constraints violated"):
        compiled(q, k, v)


def test_shared_boundaries_with_gaps_place_keys_as_eager():
    """Regression: cu_seqlens_kv passed as the very cu_seqlens_q tensor shares the queries' padded offsets."""
    g = torch.Generator().manual_seed(7)
    q, k = (torch.randn(9, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(9, 2, 8, generator=g, dtype=torch.float64)
    cu, padded = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)

    def fn(q, k, v):
        return attnselect.attention(
            q,
            k,
            v,
            layout="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            cu_seqlens_q_padded=padded,
            max_seqlen_q=4,
            max_seqlen_kv=4,
            causal=True,
        )

    compiled, _ = _compiled_graph_ops(fn, q, k, v)
    torch.testing.assert_close(compiled, fn(q, k, v))


def test_compiled_lse_is_detached_and_scale_is_checked():
    q, k, v = _dense()
    (_, lse), _ = _compiled_graph_ops(lambda q, k, v: attnselect.attention(q, k, v, return_lse=True), q, k, v)
    assert not lse.requires_grad  # as eager calls return it
    bad = torch.compile(lambda q, k, v: attnselect.attention(q, k, v, scale=-1.0), fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"scale: got -1\.0"):
        bad(q, k, v)


def test_inductor_compiles_the_op_with_matching_strides():
    q, k, v = _dense(dtype=torch.float32)
    (out, lse), graph_ops = _compiled_graph_ops(
        lambda q, k, v: attnselect.attention(q, k, v, causal=True, return_lse=True), q, k, v, compiler="inductor"
    )
    want_out, want_lse = attnselect.attention(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    grad_out = torch.randn_like(out)
    for got, want in zip(_grads(out, (q, k, v), grad_out), _grads(want_out, (q, k, v), grad_out)):
        torch.testing.assert_close(got, want)
