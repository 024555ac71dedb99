"""The first-use self-check: a kernel that returns wrong values is caught at its first call of a signature, forced
(the library's error) or chosen (one warning, the call recomputed on the next candidate), forward and gradients."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attnselect
from attnselect import backends, correctness, self_check
from attnselect.backends.reference import Reference
from attnselect.choose import failures
from attnselect.errors import InvalidInputError
from attnselect.self_check import WrongResultError
from attnselect.spec.options import Candidate
from helpers import dense_inputs, rel_err, thd_inputs

ROOT = Path(__file__).resolve().parents[1]


class _WrongGradient(torch.autograd.Function):
    """Identity forward; the backward scales the gradient (a kernel whose backward is wrong)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.5


class Wrong(Reference):
    """The reference with a wrong forward (``forward``), a wrong backward (``backward``), or a backward wrong for one
    (sequence, head) pair only (``patch``: the first batch row's second head, as FA4's 128/64 backward was wrong in
    some pairs only)."""

    def __init__(self, name: str, broken: str):
        self.name, self.broken = name, broken

    def run(self, q, k, v, call):
        if self.broken == "backward":
            q = _WrongGradient.apply(q)
        if self.broken == "patch" and q.dim() == 4 and q.shape[0] > 1 and q.shape[1] > 1:  # (B, H, S, D)
            q = _patched(q)
        out, *rest = super().run(q, k, v, call)
        return (out * 1.01 if self.broken == "forward" else out), *rest


def _patched(q):
    """q with a wrong gradient in batch row 0, head 1 alone."""
    row = torch.cat([q[:1, :1], _WrongGradient.apply(q[:1, 1:2]), q[:1, 2:]], 1)
    return torch.cat([row, q[1:]], 0)


@pytest.fixture
def wrong(request):
    backend = Wrong(f"wrong_{request.param}", request.param)
    backends.register(backend)
    yield backend
    backends.unregister(backend.name)


def _reference(q, k, v, **kwargs):
    exact = [t.detach().double().requires_grad_(t.requires_grad) for t in (q, k, v)]
    return attnselect.attention(*exact, backend="reference", **kwargs), exact


@pytest.mark.parametrize("wrong", ["forward", "backward"], indirect=True)
def test_a_forced_wrong_kernel_raises_naming_the_signature(wrong):
    q, k, v = dense_inputs(dtype=torch.float32, hq=4, hkv=2, dqk=24, dv=16)
    with pytest.raises(WrongResultError, match=r"self-check of wrong_\w+ native at signature bshd 24/16 GQA 2") as e:
        attnselect.attention(q, k, v, causal=True, backend=wrong.name)
    wrong_values = str(e.value).split(": ", 1)[1].split(" wrong (")[0].split(", ")
    assert wrong_values == (["out", "dq", "dk", "dv"] if wrong.broken == "forward" else ["dq"])


@pytest.mark.parametrize("wrong", ["forward", "backward"], indirect=True)
def test_a_chosen_wrong_kernel_is_never_returned(wrong, monkeypatch, caplog):
    from attnselect.choose import rules

    table = rules.TABLES[("cpu", "training")]
    monkeypatch.setitem(rules.TABLES, ("cpu", "training"), ((wrong.name, False), *table))
    q, k, v = dense_inputs(dtype=torch.float32, hq=4, hkv=2, dqk=24, dv=16)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, causal=True)
    assert attnselect.select(problem).chosen.backend == wrong.name
    with caplog.at_level(logging.WARNING, logger="attnselect"):
        out = attnselect.attention(q, k, v, causal=True)
    assert any("WrongResultError" in r.getMessage() for r in caplog.records)
    ref, exact = _reference(q, k, v, causal=True)
    assert rel_err(out, ref) < 1e-5
    out.backward(torch.ones_like(out))
    ref.backward(torch.ones_like(ref))
    assert all(rel_err(a.grad, b.grad) < 1e-5 for a, b in zip((q, k, v), exact))
    # Known for the signature, in this process and in the decision cache: explain says why.
    assert attnselect.select(problem).chosen.backend != wrong.name
    assert "self-check" in attnselect.explain(problem, show_all=True)
    failures._FAILED.clear()
    monkeypatch.setattr(failures, "_RECORDED", None)
    assert "self-check" in attnselect.explain(problem, show_all=True)


@pytest.mark.parametrize("wrong", ["forward"], indirect=True)
def test_packed_sequences_with_gaps_are_checked_at_their_offsets(wrong):
    (q, k, v), cu, _ = thd_inputs([5, 9, 3], dtype=torch.float32, hq=4, hkv=2)
    padded = torch.tensor([0, 7, 18, 24], dtype=torch.int32)
    wide = [torch.zeros(24, t.shape[1], t.shape[2]) for t in (q, k, v)]
    for w, t in zip(wide, (q, k, v)):
        for i, start in enumerate(padded[:-1].tolist()):
            w[start : start + int(cu[i + 1] - cu[i])] = t.detach()[int(cu[i]) : int(cu[i + 1])]
    with pytest.raises(WrongResultError, match="thd with gaps"):
        attnselect.attention(*wide, layout="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=padded, backend=wrong.name)


@pytest.mark.parametrize("wrong", ["forward"], indirect=True)
def test_the_check_runs_once_per_signature_and_process(wrong, monkeypatch):
    checked = []
    judge = self_check.judge
    monkeypatch.setattr(self_check, "judge", lambda *a, **kw: checked.append(1) or judge(*a, **kw))
    q, k, v = dense_inputs(dtype=torch.float32, requires_grad=False)
    attnselect.attention(q, k, v)  # sdpa_flash (padded) on the CPU: checked once
    attnselect.attention(q, k, v)
    attnselect.attention(q[:, :30], k[:, :30], v[:, :30])  # a new shape, the same size class: not again
    assert len(checked) == 1
    monkeypatch.setenv("ATTNSELECT_SELF_CHECK", "0")
    with pytest.raises(AssertionError):  # nothing checks it: the wrong values come back
        torch.testing.assert_close(attnselect.attention(q, k, v, backend=wrong.name), attnselect.attention(q, k, v))
    monkeypatch.setenv("ATTNSELECT_SELF_CHECK", "junk")
    with pytest.raises(InvalidInputError, match="ATTNSELECT_SELF_CHECK: got 'junk'"):
        attnselect.attention(q, k, v)


def test_all_checks_signatures_the_grid_covered(monkeypatch):
    from attnselect.backends import evidence

    monkeypatch.setattr(evidence, "covers", lambda *a: True)
    q, k, v = dense_inputs(dtype=torch.float32, requires_grad=False)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v)
    decision = attnselect.select(problem)
    assert not self_check.needed(problem, decision.chosen, decision.target)
    monkeypatch.setenv("ATTNSELECT_SELF_CHECK", "all")
    assert self_check.needed(problem, decision.chosen, decision.target)


def test_a_reference_that_cannot_run_skips_the_check_with_a_warning(monkeypatch, caplog):

    monkeypatch.setattr(correctness, "compare_batch", lambda *a, **kw: (_ for _ in ()).throw(MemoryError("no room")))
    q, k, v = dense_inputs(dtype=torch.float32, requires_grad=False)
    with caplog.at_level(logging.WARNING, logger="attnselect"):
        out = attnselect.attention(q, k, v)
    assert any("could not run" in r.getMessage() for r in caplog.records)
    assert torch.isfinite(out).all()


def test_a_check_that_cannot_run_keeps_no_tensor_of_the_call_alive():
    """Without the garbage collector (CUDA memory does not prompt it): what a failed reference raised does not keep
    the check's tensors in a cycle of frames."""
    import gc
    import weakref

    held = []

    def failing(*args, **kwargs):
        held.append(weakref.ref(args[0]))  # a tensor of the check's (the sliced queries)
        raise MemoryError("no room")

    q, k, v = dense_inputs(dtype=torch.float32, requires_grad=False)
    gc.collect()
    gc.disable()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(correctness, "compare_batch", failing)
            attnselect.attention(q, k, v, causal=True)
        assert held and all(ref() is None for ref in held)
    finally:
        gc.enable()


def _bytes_kept_by_checked_steps(**options) -> int:
    """Tensor bytes still alive after three more training steps whose call is self-checked each time (the first
    step's, which may hold a lasting memo, not counted)."""
    import gc

    def live() -> int:
        gc.collect()
        return sum(o.untyped_storage().nbytes() for o in gc.get_objects() if type(o) is torch.Tensor)

    q, k, v = dense_inputs(dtype=torch.float32, b=1, sq=256, skv=256, hq=8, hkv=8)

    def checked_step():
        self_check._PASSED.clear()
        attnselect.clear_cache()  # decided again: checked again
        result = attnselect.attention(q, k, v, causal=True, **options)
        (result[0] if options.get("return_lse") else result).sum().backward()
        q.grad = k.grad = v.grad = None

    checked_step()
    before = live()
    for _ in range(3):
        checked_step()
    return live() - before


def test_a_training_check_leaves_no_graph_alive(monkeypatch):
    """The check's graphs go with it, the reference's lse (judged, never differentiated) included: a saved output
    held by its own graph is a cycle the collector cannot break (it held 8.5 GiB a check at 8k tokens)."""
    monkeypatch.setenv("ATTNSELECT_SELF_CHECK", "all")
    assert _bytes_kept_by_checked_steps() < 2**20


class _Registered(Reference):
    """The reference under another name (the self-check skips the reference itself)."""

    def __init__(self, name: str):
        self.name = name


def test_a_kernels_lse_left_without_a_gradient_keeps_no_graph(monkeypatch):
    """The check's rerun differentiates the output alone: the kernel's lse graph (its logsumexp saves its own result)
    must go with the check too, which packing saved tensors as themselves prevented."""
    monkeypatch.setenv("ATTNSELECT_SELF_CHECK", "all")
    backend = _Registered("registered_reference")
    backends.register(backend)
    try:
        assert _bytes_kept_by_checked_steps(return_lse=True, backend=backend.name) < 2**20
    finally:
        backends.unregister(backend.name)


# -- on the GPU ---------------------------------------------------------------------------------------------------

WORKER = """
import json, os, sys, torch
import attnselect
from attnselect.self_check import WrongResultError
torch.manual_seed(int(sys.argv[1]))
shape = dict(B=32, S=640, H=16)
make = lambda d: torch.randn(shape["B"], shape["S"], shape["H"], d, device="cuda", dtype=torch.bfloat16)
q, k, v, dout = make(128), make(128), make(64), make(64)

def grads(run):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = run(*leaves)
    return torch.autograd.grad(out, leaves, dout)

def ref(q, k, v):
    s = torch.einsum("bshd,bthd->bhst", q.float(), k.float()) / 128 ** 0.5
    return torch.einsum("bhst,bthd->bshd", s.softmax(-1), v.float())

exact = grads(ref)
err = lambda gs: max(((g.float() - e).norm() / e.norm()).item() for g, e in zip(gs, exact))
from flash_attn.cute import flash_attn_func
got = grads(lambda q, k, v: flash_attn_func(q, k, v)[0])
direct = err(got)
# where FA4's gradients are wrong: the (batch row, head) pairs whose dq max error is over 100x the median pair's
pair = (got[0].float() - exact[0]).abs().amax(dim=(1, 3))  # (B, H)
bad = (pair > 100 * pair.median()).nonzero().tolist()
try:
    forced, raised = err(grads(lambda q, k, v: attnselect.attention(q, k, v, backend="flash_attn4"))), None
except WrongResultError as exc:
    forced, raised = None, str(exc)
chosen = err(grads(lambda q, k, v: attnselect.attention(q, k, v)))
print(json.dumps(dict(direct=direct, forced=forced, raised=raised, chosen=chosen, wrong_pairs=len(bad), some=bad[:8])))
"""


@pytest.mark.gpu
def test_fa4_wrong_gradients_at_128_64_are_caught_in_every_process(tmp_path):
    """FA4 4.0.0b36's sm90 backward at d_qk=128, d_v=64 (PyTorch's test_cudnn_attention_different_dk_dv shape) was
    wrong in three processes of four (docs/sources/h200-measurements-2026-12-02.md). With the allowlist off, in
    every process: a forced FA4 either raises WrongResultError or gives right gradients, and the chosen kernel's
    gradients are right."""
    from attnselect.spec.target import Target

    if Target.current().version("flash-attn-4") is None:
        pytest.skip("flash-attn-4 is not installed here")
    results = []
    for seed in range(4):
        env = dict(os.environ, ATTNSELECT_ALLOWLIST="0", ATTNSELECT_CACHE_DIR=str(tmp_path / str(seed)))
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
        done = subprocess.run([sys.executable, "-c", WORKER, str(seed)], env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print("FA4 128/64 per process:", results)
    for r in results:
        assert r["chosen"] < 2e-2
        assert r["raised"] is not None or r["forced"] < 2e-2
        if r["direct"] >= 2e-2:  # FA4 called directly was wrong in this process: the self-check caught it there
            assert r["raised"] is not None, r
    if all(r["direct"] < 2e-2 for r in results):
        pytest.skip("FA4's 128/64 gradients were right in all four processes here: there was nothing to catch")


@pytest.mark.parametrize("name", ["ATTNSELECT_SELF_CHECK", "ATTNSELECT_DEBUG", "ATTNSELECT_ALLOWLIST"])
def test_a_bad_setting_fails_every_call_the_same_way(name, monkeypatch):
    q, k, v = dense_inputs(dtype=torch.float32, requires_grad=False)
    monkeypatch.setenv(name, "maybe")
    for _ in range(2):
        with pytest.raises(InvalidInputError, match=f"{name}: got 'maybe'"):
            attnselect.attention(q, k, v)


@pytest.mark.parametrize("wrong", ["forward"], indirect=True)
def test_a_kernel_caught_eagerly_is_refused_in_compiled_graphs_and_under_capture(wrong):
    import dataclasses

    q, k, v = dense_inputs(dtype=torch.float32, requires_grad=False)
    with pytest.raises(WrongResultError):
        attnselect.attention(q, k, v, backend=wrong.name)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v)
    for traced in (dict(compiled_graph=True), dict(cuda_graph_capture=True)):
        assert Candidate(wrong.name) in failures.failures(dataclasses.replace(problem, **traced), problem_target())


def problem_target():
    return attnselect.Target.current()


def test_activation_checkpointing_trains_through_a_checked_call(monkeypatch):
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setenv("ATTNSELECT_STRICT", "1")
    linear = torch.nn.Linear(16, 48).double()
    x = torch.randn(2, 12, 2, 16, dtype=torch.float64, requires_grad=True)

    def layer(x):
        q, k, v = linear(x).chunk(3, -1)
        return attnselect.attention(q, k, v, causal=True)

    for reentrant in (False, True):
        attnselect.clear_cache()
        self_check._PASSED.clear()
        x.grad = None
        checkpoint(layer, x, use_reentrant=reentrant).sum().backward()
        expected = torch.autograd.grad(layer(x).sum(), x)[0]
        torch.testing.assert_close(x.grad, expected)


def test_an_empty_call_is_not_checked_and_not_failed():
    q = torch.randn(0, 5, 4, 32)
    assert attnselect.attention(q, q, q, backend="sdpa_math").shape == (0, 5, 4, 32)
    assert not failures._FAILED


def test_a_check_out_of_memory_is_no_verdict_on_the_kernel(monkeypatch, caplog):
    def rerun_out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

    q, k, v = dense_inputs(dtype=torch.float32)
    monkeypatch.setattr(self_check, "_output_gradient", rerun_out_of_memory)
    with caplog.at_level(logging.WARNING, logger="attnselect"):
        attnselect.attention(q, k, v, causal=True)
    assert "ran out of memory" in caplog.text and not failures._FAILED


def test_right_kernels_on_packed_sequences_with_gaps_pass(monkeypatch):
    monkeypatch.setenv("ATTNSELECT_STRICT", "1")
    monkeypatch.setenv("ATTNSELECT_SELF_CHECK", "all")
    (q, k, v), cu, _ = thd_inputs([5, 9, 3], dtype=torch.float32, hq=4, hkv=2)
    padded = torch.tensor([0, 7, 18, 24], dtype=torch.int32)
    wide = [torch.randn(24, t.shape[1], t.shape[2]).requires_grad_() for t in (q, k, v)]
    for backend in ("sdpa_flash", "sdpa_math", "reference"):
        out = attnselect.attention(*wide, layout="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=padded, backend=backend,
                                   pad=backend == "sdpa_flash")  # fmt: skip
        assert torch.isfinite(out).all()


class DetachedLse(Reference):
    """The reference whose lse carries no gradient: with sinks, the caller's gradients go wrong through it."""

    name = "detached_lse"

    def run(self, q, k, v, call):
        out, lse, *rest = super().run(q, k, v, call)
        return out, (lse.detach() if lse is not None else None), *rest


def test_the_gradient_through_the_lse_is_checked_where_sinks_need_it(monkeypatch):
    backends.register(DetachedLse())
    try:
        q, k, v = dense_inputs(dtype=torch.float32)
        sinks = torch.randn(4, requires_grad=True)
        with pytest.raises(WrongResultError, match=r": dq, dk wrong|: dq, dk, dv wrong|: dq wrong"):
            attnselect.attention(q, k, v, causal=True, sinks=sinks, backend="detached_lse")
        monkeypatch.setenv("ATTNSELECT_STRICT", "1")
        attnselect.attention(q, k, v, causal=True, sinks=sinks, backend="reference")  # a right one passes
    finally:
        backends.unregister("detached_lse")


@pytest.mark.parametrize("wrong", ["patch"], indirect=True)
def test_a_backward_wrong_in_one_sequence_and_head_is_caught(wrong):
    """The check spreads its slices over every sequence and K/V head: a backward wrong only in batch row 0, head 1
    (neither the last row nor the last head) is caught, forced."""
    q, k, v = dense_inputs(b=4, sq=12, skv=12, hq=4, hkv=4, dqk=16, dv=8, dtype=torch.float32)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v)
    pieces = self_check.check_slices(problem, None)
    assert {(p.sequence, p.kv_head) for p in pieces} == {(b, h) for b in range(4) for h in range(4)}
    with pytest.raises(WrongResultError, match="dq"):
        attnselect.attention(q, k, v, backend=wrong.name)


def test_check_slices_cover_every_sequence_and_kv_head_within_the_budget(monkeypatch):
    big = attnselect.AttentionProblem(32, 640, 640, 16, 16, 128, 64, training=True)
    pieces = self_check.check_slices(big, None)
    assert len(pieces) == self_check.CHECK_SLICES and len(set(pieces)) == len(pieces)
    assert {p.sequence for p in pieces} == set(range(32)) and {p.kv_head for p in pieces} == set(range(16))
    assert pieces[0].sequence == 31 and pieces[0].kv_head == 15  # the last first
    monkeypatch.setattr(self_check, "CHECK_ELEMENTS", 3 * 640 * 640)
    assert len(self_check.check_slices(big, None)) == 3
    huge = attnselect.AttentionProblem(1, 65536, 65536, 16, 16, 192, 128, training=True)
    assert len(self_check.check_slices(huge, None)) == 1  # over the budget: the one slice still


@pytest.mark.parametrize("wrong", ["forward"], indirect=True)
def test_a_slice_whose_reference_overflows_leaves_the_others_to_judge(wrong):
    """fp16 logits past 65504 in batch row 0 make that slice's naive reference overflow (no verdict there); row 1
    still judges the kernel, and it is wrong."""
    q, k, v = dense_inputs(b=2, sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, dtype=torch.float16, requires_grad=False)
    q[0] *= 300
    k[0] *= 300
    with pytest.raises(WrongResultError, match="out"):
        attnselect.attention(q, k, v, backend=wrong.name)


def test_the_walk_passes_over_long_and_empty_sequences(monkeypatch):
    """A sequence too long for what is left of the budget, or with no query, is passed over, not the end of the
    walk."""
    from attnselect.spec.options import Packing

    def packing(lengths):
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        return Packing(cu, cu, max(lengths), max(lengths), cu, cu)

    problem = attnselect.AttentionProblem(8, 12000, 12000, 32, 8, 64, 64, layout="thd", training=True)
    monkeypatch.setattr(self_check, "CHECK_ELEMENTS", 4 * 12000 * 12000 + 4 * 100 * 100 * 40)
    pieces = self_check.check_slices(problem, packing([12000] + [100] * 7))
    assert pieces[0].sequence == 0 and len(pieces) > 8  # the long one first, then the short ones
    assert {p.sequence for p in pieces} == set(range(8)) and {p.kv_head for p in pieces} == set(range(8))
    problem = attnselect.AttentionProblem(64, 100, 100, 4, 4, 64, 64, layout="thd")
    pieces = self_check.check_slices(problem, packing([0] * 40 + [100] * 24))
    assert all(p.length_q for p in pieces) and len(pieces) == self_check.CHECK_SLICES


def test_slices_of_equal_lengths_share_one_reference(monkeypatch):
    """The check runs the exact and the naive reference once for a dense call's slices (one batch), not per slice
    (float32 inputs: no read-back reference)."""
    q, k, v = dense_inputs(b=4, sq=12, skv=12, hq=4, hkv=4, dqk=16, dv=8, dtype=torch.float32)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v)
    assert len(self_check.check_slices(problem, None)) == 16
    calls = []
    real = correctness.reference
    monkeypatch.setattr(correctness, "reference", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    monkeypatch.setenv("ATTNSELECT_SELF_CHECK", "all")
    attnselect.attention(q, k, v)
    assert [shape[0] for shape in calls] == [16, 16]


@pytest.mark.parametrize("wrong", ["backward"], indirect=True)
def test_a_batch_out_of_memory_is_judged_slice_by_slice(wrong, monkeypatch):
    """Where the batch of slices does not fit, each slice is judged alone: the wrong kernel is still caught."""
    real = correctness.judge_slices

    def tight(layout, pieces, *args, **kwargs):
        if len(pieces) > 1:
            raise torch.OutOfMemoryError("out of memory: the batch")
        return real(layout, pieces, *args, **kwargs)

    monkeypatch.setattr(correctness, "judge_slices", tight)
    q, k, v = dense_inputs(b=4, sq=12, skv=12, hq=4, hkv=4, dqk=16, dv=8, dtype=torch.float32)
    with pytest.raises(WrongResultError, match="dq"):
        attnselect.attention(q, k, v, backend=wrong.name)


def test_the_read_back_reads_the_output_of_the_run_that_gave_the_gradients(monkeypatch):
    """The gradients come from a second run of the call, whose backward read that run's output: the read-back
    reference reads it (attnselect.correctness criterion 3), whatever the first run returned."""
    from attnselect.execution import kernel_call

    q = torch.randn(1, 8, 4, 16, dtype=torch.bfloat16, requires_grad=True)  # grouped heads: the slice's query heads
    k, v = (torch.randn(1, 8, 2, 16, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, causal=True)

    def run(q, k, v):
        bhsd = (t.transpose(1, 2) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(*bhsd, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2), None

    seen = []
    real = correctness._read_back_reference
    monkeypatch.setattr(
        correctness, "_read_back_reference", lambda *a, **kw: seen.append(kw["returned"]) or real(*a, **kw)
    )
    first = (run(q, k, v)[0].detach() + 0.5, None)  # a first run's output unlike the second's
    slices = self_check.check_slices(problem, None)
    judged = self_check.judge(problem, kernel_call(problem), first, q, k, v, None, slices, run)
    assert judged.failures == ["out"] and len(seen) == 1
    again = run(q, k, v)[0].detach()
    piece = slices[0]
    assert torch.equal(seen[0][0], correctness.rows(again, "bshd", piece, piece.q_heads))


@pytest.mark.parametrize("excess, lasting", [(1.5, False), (self_check.CLEARLY_WRONG, True)])
def test_a_result_just_past_its_bound_is_refused_in_this_process_only(excess, lasting, monkeypatch, caplog):
    """A result wrong by less than CLEARLY_WRONG times its bound (as right kernels were under a bound drawn too tight)
    is refused in this process and recomputed on the next candidate, but not recorded for later processes; one wrong
    by more is recorded."""
    q, k, v = dense_inputs(dtype=torch.float32, requires_grad=False)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v)
    first = attnselect.select(problem).chosen
    judge = self_check.judge

    def judged(p, call, result, *args):  # the first candidate's result just past its bound, the others as they are
        if result is not None and first_run and first_run.pop():
            return correctness.Judgement({"out": excess * 1e-3}, {"out": 1e-3})
        return judge(p, call, result, *args)

    first_run = [True]
    monkeypatch.setattr(self_check, "judge", judged)
    monkeypatch.setenv("ATTNSELECT_SELF_CHECK", "all")
    with caplog.at_level(logging.WARNING, logger="attnselect"):
        out = attnselect.attention(q, k, v)
    torch.testing.assert_close(out, _reference(q, k, v)[0].float(), atol=1e-5, rtol=1e-5)
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "WrongResultError" in said and ("a later process checks it again" in said) is not lasting
    assert attnselect.select(problem).chosen != first  # refused in this process
    failures._FAILED.clear()
    monkeypatch.setattr(failures, "_RECORDED", None)  # a later process: what the decision cache holds
    attnselect.clear_cache()
    assert (attnselect.select(problem).chosen != first) is lasting


def test_a_slice_just_past_its_bound_does_not_stop_the_check_before_a_clearly_wrong_one(monkeypatch):
    """How wrong a result is (whether it is recorded for later processes) is judged over every slice where the first
    failures are just past their bound: a slice further on may be clearly wrong (FA4's 128/64 gradients were wrong in
    one pair of a call)."""
    q, k, v = dense_inputs(dtype=torch.float32, requires_grad=False)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v)
    by_length = [correctness.slice_of(4, 4, 0, lengths=(n, n)) for n in (5, 6, 7)]  # three batches: unequal lengths
    found = iter([1.2, 300.0, 0.5])
    monkeypatch.setattr(correctness, "judge_slices",
                        lambda layout, batch, *a, **kw: [correctness.Judgement({"dq": next(found) * 1e-3}, {"dq": 1e-3})
                                                         for _ in batch])  # fmt: skip
    judgement = self_check._judge_slices(problem, None, (None, None), q, k, v, None, {}, by_length, None)
    assert judgement.excess == pytest.approx(300.0) and next(found) == 0.5  # the third was not judged: no need
