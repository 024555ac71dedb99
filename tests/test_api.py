"""attention(): the memoized fast path for repeated dense calls stays correct and controllable."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnselect
from attnselect import api, dispatch, memos
from attnselect.api import call_arguments
from attnselect.spec.options import CallOptions


def _inputs(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 9, 2, d, generator=g, dtype=dtype) for d in (24, 24, 16)]


def test_repeated_call_takes_the_fast_path_with_the_same_result():
    q, k, v = _inputs()
    first = attnselect.attention(q, k, v, causal=True)
    assert len(dispatch.known_calls()) == 1
    assert torch.equal(attnselect.attention(q, k, v, causal=True), first)
    assert len(dispatch.known_calls()) == 1


def test_fast_path_follows_environment_and_clear_cache(monkeypatch):
    q, k, v = _inputs()
    attnselect.attention(q, k, v)
    problem, chosen, *_ = dispatch.known_calls()[0]
    assert chosen.backend == "sdpa_flash"
    monkeypatch.setenv("ATTNSELECT_BACKEND", "reference")
    attnselect.attention(q, k, v)
    assert {known.chosen.backend for known in dispatch.known_calls()} == {"sdpa_flash", "reference"}
    attnselect.clear_cache()
    assert not dispatch.known_calls()


def test_fast_path_still_validates_what_changed():
    q, k, v = _inputs()
    attnselect.attention(q, k, v)
    with pytest.raises(attnselect.InvalidInputError, match="scale"):
        attnselect.attention(q, k, v, scale=float("inf"))
    with pytest.raises(attnselect.InvalidInputError, match="k.dtype/v.dtype"):
        attnselect.attention(q, k.float(), v)
    custom = attnselect.attention(q, k, v, scale=0.5)
    reference = attnselect.attention(q, k, v, scale=0.5, backend="reference")
    assert torch.allclose(custom, reference, atol=1e-12)


def test_iterators_and_lists_bypass_the_fast_path_without_being_consumed():
    q, k, v = _inputs()
    out = attnselect.attention(q, k, v, disable=iter(["sdpa_flash"]), window=[3, 0])
    assert not dispatch.known_calls()
    assert torch.allclose(out, attnselect.attention(q, k, v, window=(3, 0), backend="reference"), atol=1e-12)


class _Broken(RuntimeError):
    pass


def _break_sdpa_flash(monkeypatch):
    from attnselect.backends.sdpa_flash import SdpaFlash

    def runner(self, call, *, repeated=False, like=None):  # what attnselect.attention runs
        def run(q, k, v):
            raise _Broken("workspace allocation failed")

        return run

    monkeypatch.setattr(SdpaFlash, "runner", runner)
    from attnselect.choose import failures

    monkeypatch.setattr(failures, "_FAILED", {})


def test_a_failing_chosen_kernel_falls_back_once_with_a_warning(monkeypatch, caplog):
    _break_sdpa_flash(monkeypatch)
    q, k, v = _inputs()
    with caplog.at_level("WARNING", logger="attnselect"):
        out = attnselect.attention(q, k, v, causal=True)
        again = attnselect.attention(q, k, v, causal=True)
    assert torch.allclose(out, attnselect.attention(q, k, v, causal=True, backend="reference"), atol=1e-12)
    assert torch.equal(out, again)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "sdpa_flash padded to 24 failed" in warnings[0] and "workspace" in warnings[0]
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, causal=True)
    verdict = next(
        v for v in attnselect.select(problem).verdicts if v.candidate == attnselect.Candidate("sdpa_flash", 24)
    )
    assert verdict.reasons[0].startswith("failed at run time on this target: _Broken: workspace")


def _as_a_new_process(monkeypatch):
    """Forget what this process knows of failures and decisions: only the decision cache file remembers."""
    from attnselect.choose import failures

    failures._FAILED.clear()
    monkeypatch.setattr(failures, "_RECORDED", None)
    monkeypatch.setattr(memos, "_WARNED", set())
    attnselect.clear_cache()


def test_a_run_time_failure_is_remembered_by_later_processes_on_the_same_target(monkeypatch, caplog):
    _break_sdpa_flash(monkeypatch)
    q, k, v = _inputs()
    attnselect.attention(q, k, v, causal=True)  # fails over, and writes the failure to the cache
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, causal=True)
    broken = attnselect.Candidate("sdpa_flash", 24)
    _as_a_new_process(monkeypatch)
    caplog.clear()
    with caplog.at_level("WARNING", logger="attnselect"):
        attnselect.attention(q, k, v, causal=True)
        attnselect.attention(q, k, v, causal=True)
    # not tried again, and not skipped silently: one warning, naming what failed, why and where it is recorded
    (record,) = caplog.records
    assert record.getMessage().startswith(f"attnselect: skipping {broken} for {problem.describe()}: _Broken: ")
    assert "in an earlier process" in record.getMessage() and "decisions.json" in record.getMessage()
    verdict = next(v for v in attnselect.select(problem).verdicts if v.candidate == broken)
    assert verdict.reasons[0].startswith("failed at run time on this target: _Broken: workspace")
    _as_a_new_process(monkeypatch)  # another library version: the entry does not apply
    newer = dataclasses.replace(attnselect.Target.current(), torch_version="99.0")
    assert broken in {v.candidate for v in attnselect.select(problem, target=newer).verdicts if v.supported}


def test_out_of_memory_is_not_recorded_for_later_processes(monkeypatch, caplog):
    from attnselect.backends.sdpa_flash import SdpaFlash

    def runner(self, call, *, repeated=False, like=None):
        def run(q, k, v):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64.00 GiB")

        return run

    monkeypatch.setattr(SdpaFlash, "runner", runner)
    q, k, v = _inputs()
    with caplog.at_level("WARNING", logger="attnselect"):
        attnselect.attention(q, k, v, causal=True)
    assert "for this process only: it may pass" in caplog.text
    _as_a_new_process(monkeypatch)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, causal=True)
    assert attnselect.select(problem).chosen == attnselect.Candidate("sdpa_flash", 24)  # tried again


def test_an_error_of_a_capture_broken_before_is_raised_and_not_recorded(monkeypatch, caplog):
    """CUDA fails every operation of a graph capture after an earlier error there ("operation failed due to a previous
    error during capture"): the candidate that meets it did not fail, so nothing is recorded, and no fallback is
    tried (each would fail alike); the error goes to the caller with a note saying so."""
    from attnselect.backends.sdpa_flash import SdpaFlash
    from attnselect.choose import failures

    def runner(self, call, *, repeated=False, like=None):
        def run(q, k, v):
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

        return run

    monkeypatch.setattr(SdpaFlash, "runner", runner)
    monkeypatch.setattr(failures, "_FAILED", {})
    q, k, v = _inputs()
    with caplog.at_level("WARNING", logger="attnselect"), pytest.raises(RuntimeError, match="previous error") as info:
        attnselect.attention(q, k, v, causal=True)
    (record,) = caplog.records  # the note, and no "falling back" warning
    assert "did not fail on" in record.getMessage() and "an earlier error invalidated this CUDA graph capture" in (
        record.getMessage()
    )
    assert getattr(info.value, "__notes__", [record.getMessage()]) == [record.getMessage()]  # Python 3.11 on
    assert failures._FAILED == {}
    _as_a_new_process(monkeypatch)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, causal=True)
    assert attnselect.select(problem).chosen == attnselect.Candidate("sdpa_flash", 24)


def test_failures_of_several_processes_on_one_problem_add_up(monkeypatch):
    from attnselect.choose import failures

    problem = attnselect.AttentionProblem.from_tensors(*_inputs(), causal=True)
    target = attnselect.Target.current()
    first, second = attnselect.Candidate("sdpa_flash", 24), attnselect.Candidate("sdpa_math")
    failures.mark_failed(problem, target, first, RuntimeError("no kernel image"))
    _as_a_new_process(monkeypatch)  # the second process has not seen the first's failure
    failures.mark_failed(problem, target, second, RuntimeError("illegal instruction"))
    _as_a_new_process(monkeypatch)
    assert set(failures.failures(problem, target)) == {first, second}


def test_a_failing_packed_call_falls_back_too(monkeypatch, caplog):
    _break_sdpa_flash(monkeypatch)  # the CPU rules' first choice for this pack, run sequence by sequence
    g = torch.Generator().manual_seed(3)
    q, k = (torch.randn(10, 2, 24, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(10, 2, 16, generator=g, dtype=torch.float64)
    packing = dict(layout="thd", cu_seqlens_q=torch.tensor([0, 3, 3, 10], dtype=torch.int32), causal=True)
    with caplog.at_level("WARNING", logger="attnselect"):
        out = attnselect.attention(q, k, v, **packing)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "sdpa_flash padded to 24 failed on thd" in warnings[0]
    torch.testing.assert_close(out, attnselect.attention(q, k, v, backend="reference", **packing))


def test_a_failing_kernel_inside_a_compiled_graph_raises(monkeypatch):
    """No fallback inside a compiled graph (the decision is part of the graph): the error surfaces."""
    _break_sdpa_flash(monkeypatch)
    q, k, v = _inputs()

    def fn(q, k, v):
        return attnselect.attention(q, k, v, causal=True)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="workspace allocation failed"):
        torch.compile(fn, fullgraph=True, dynamic=False)(q, k, v)


def test_forced_or_strict_failures_raise(monkeypatch):
    _break_sdpa_flash(monkeypatch)
    q, k, v = _inputs()
    with pytest.raises(_Broken):
        attnselect.attention(q, k, v, backend="sdpa_flash", pad=True)
    monkeypatch.setenv("ATTNSELECT_STRICT", "1")
    with pytest.raises(_Broken):
        attnselect.attention(q, k, v)
    monkeypatch.setenv("ATTNSELECT_STRICT", "yes")
    with pytest.raises(attnselect.InvalidInputError, match="ATTNSELECT_STRICT"):
        attnselect.attention(q, k, v)
    monkeypatch.setenv("ATTNSELECT_STRICT", "0")
    attnselect.attention(q, k, v, backend="reference")  # a memoized decision...
    monkeypatch.setenv("ATTNSELECT_STRICT", "maybe")  # ...is not reused past a bad value: it is checked
    with pytest.raises(attnselect.InvalidInputError, match="ATTNSELECT_STRICT: got 'maybe'"):
        attnselect.attention(q, k, v, backend="reference")


def _capture_inputs(layout):
    """Static buffers (fixed cu_seqlens for thd) of an MLA-shaped call, with the call's keyword arguments."""
    if layout == "thd":
        cu = torch.tensor([0, 3, 103, 103, 160], dtype=torch.int32, device="cuda")
        shapes = ((160, 8, 192), (160, 8, 192), (160, 8, 128))
        kwargs = dict(layout="thd", cu_seqlens_q=cu, max_seqlen_q=100, max_seqlen_kv=100, causal=True)
    else:
        shapes = ((2, 256, 8, 192), (2, 256, 8, 192), (2, 256, 8, 128))
        kwargs = dict(causal=True)
    return [torch.empty(s, device="cuda", dtype=torch.bfloat16) for s in shapes], kwargs


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout,backend",
    [
        ("bshd", None),
        ("bshd", "sdpa_cudnn"),
        ("bshd", "sdpa_flash"),
        ("bshd", "sdpa_efficient"),
        ("bshd", "sdpa_math"),
        ("bshd", "reference"),
        ("thd", None),
        ("thd", "varlen_fa2"),
    ],
)
def test_a_captured_cuda_graph_replays_like_a_float64_reference(layout, backend):
    """Warm-up on a side stream, capture, new data in the static buffers, replay: the automatic choice and every
    backend that allows capture (thd: the packed kernels; the per-sequence path reads boundaries on the host)."""
    from helpers import rel_err

    g = torch.Generator(device="cuda").manual_seed(0)
    (q, k, v), kwargs = _capture_inputs(layout)
    for t in (q, k, v):
        t.normal_(generator=g)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            attnselect.attention(q, k, v, backend=backend, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attnselect.attention(q, k, v, backend=backend, **kwargs)
    for _ in range(2):
        for t in (q, k, v):
            t.normal_(generator=g)
        graph.replay()
        reference = attnselect.attention(q.double(), k.double(), v.double(), backend="reference", **kwargs)
        assert rel_err(out, reference) < 2e-2


@pytest.mark.gpu
def test_warmup_of_a_captured_problem_makes_the_graph_run_the_capture_s_first_candidate():
    """warmup() of the captured call runs the candidate its capture ranks first eagerly (its build outside the
    capture: sdpa_cudnn's build inside one failed on an H100), so the graph runs it and replays like a float64
    reference; a job's eager warm-up alone would leave the graph on the eager choice."""
    from helpers import rel_err

    g = torch.Generator(device="cuda").manual_seed(0)
    (q, k, v), kwargs = _capture_inputs("bshd")
    for t in (q, k, v):
        t.normal_(generator=g)
    captured = dataclasses.replace(attnselect.AttentionProblem.from_tensors(q, k, v, **kwargs), cuda_graph_capture=True)
    (warmed,) = attnselect.warmup([captured])
    first = attnselect.select(captured).first_ranked
    assert warmed.error is None and warmed.chosen == str(first) == str(attnselect.select(captured).chosen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attnselect.attention(q, k, v, **kwargs)  # the job's own eager warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attnselect.attention(q, k, v, **kwargs)
    assert dispatch.known_calls()[-1].chosen == first
    for t in (q, k, v):
        t.normal_(generator=g)
    graph.replay()
    reference = attnselect.attention(q.double(), k.double(), v.double(), backend="reference", **kwargs)
    assert rel_err(out, reference) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize(
    "layout,backend",
    [("bshd", "flex"), ("bshd", "cudnn_frontend"), ("thd", "cudnn_frontend"), ("thd", "flex"), ("thd", "sdpa_cudnn")],
)
def test_capture_refuses_a_backend_it_has_not_verified(layout, backend):
    (q, k, v), kwargs = _capture_inputs(layout)
    for t in (q, k, v):
        t.normal_()
    attnselect.attention(q, k, v, backend="reference", **kwargs)  # CUDA initialised before capture
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(attnselect.ForcedChoiceError, match="graph capture"):
        with torch.cuda.graph(graph):
            attnselect.attention(q, k, v, backend=backend, **kwargs)


def _packed_key(cu_kv="same", max_q=7, max_kv=7, device="meta", padded=None):
    q = torch.empty(12, 2, 16, device=device)
    cu = torch.empty(3, dtype=torch.int32, device=device)
    cu_kv = cu if cu_kv == "same" else cu_kv
    options = CallOptions("thd", True, cu_seqlens_q=cu, cu_seqlens_kv=cu_kv, max_seqlen_q=max_q, max_seqlen_kv=max_kv,
                          cu_seqlens_q_padded=padded)  # fmt: skip
    unknown = dispatch.recall(q, q, q, options)
    return None if unknown is None else (unknown.key, unknown.sizes)  # its family's key, and its sizes in it


def test_a_packed_call_keys_the_fast_path_only_where_its_problem_follows_from_the_key():
    assert _packed_key() is not None and _packed_key(cu_kv=None) == _packed_key()
    assert _packed_key(max_q=8) != _packed_key()  # the max_seqlen are part of the problem: its sizes
    assert _packed_key(max_q=8)[0] == _packed_key()[0]  # of one family
    assert _packed_key(cu_kv=torch.empty(3, dtype=torch.int32, device="meta")) is None  # equal values? read once
    assert _packed_key(max_q=None) is None and _packed_key(max_kv=7.0) is None  # read from cu_seqlens
    assert _packed_key(padded=torch.empty(3, dtype=torch.int32, device="meta")) is None  # gaps
    assert _packed_key(device="cpu") is None  # the CPU path reads and checks the boundaries of every call


@pytest.mark.gpu
def test_a_new_packing_of_other_sizes_skips_validation_and_gives_the_slow_path_s_result(monkeypatch):
    from attnselect import api

    cu = torch.tensor([0, 3, 103, 103, 160], dtype=torch.int32, device="cuda")
    q, k = (torch.randn(160, 8, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(160, 8, 128, device="cuda", dtype=torch.bfloat16)
    kwargs = dict(layout="thd", cu_seqlens_q=cu, max_seqlen_q=100, max_seqlen_kv=100, causal=True)
    attnselect.clear_cache()
    attnselect.attention(q, k, v, **kwargs)
    other = dict(kwargs, cu_seqlens_q=torch.tensor([0, 60, 100, 160], dtype=torch.int32, device="cuda"),
                 max_seqlen_q=60, max_seqlen_kv=60)  # fmt: skip
    with monkeypatch.context() as m:
        m.setattr(api, "describe_call", lambda *a, **kw: pytest.fail("validated again"))
        fast = attnselect.attention(q, k, v, **other)
    slow = attnselect.attention(q, k, v, **other, cu_seqlens_kv=other["cu_seqlens_q"].clone())  # read: slow path
    assert torch.equal(fast, slow)
    # the first call and its sibling at the new sizes (a call with its own cu_seqlens_kv tensor is not memoized)
    assert [c.problem.batch for c in dispatch.known_calls()] == [4, 3]


@pytest.mark.gpu
def test_a_new_packing_on_its_sibling_s_choice_runs_its_kernel_and_takes_its_self_check_answer(monkeypatch):
    """A new packing whose decision is its sibling's choice at the same signature (the size class) runs the sibling's
    packed runner (made once for the call's options) and, where the sibling needed no self-check, needs none."""
    from attnselect import api

    monkeypatch.setenv("ATTNSELECT_SELF_CHECK", "0")
    q, k, v = (torch.randn(160, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kwargs = dict(layout="thd", causal=True, backend="varlen_fa2")  # forced: no rental wraps its runner
    attnselect.clear_cache()
    first = torch.tensor([0, 3, 103, 103, 160], dtype=torch.int32, device="cuda")
    attnselect.attention(q, k, v, cu_seqlens_q=first, max_seqlen_q=100, max_seqlen_kv=100, **kwargs)
    other = torch.tensor([0, 99, 100, 150, 160], dtype=torch.int32, device="cuda")  # 4 sequences, the longest 99
    with monkeypatch.context() as m:
        m.setattr(api.self_check, "needed", lambda *a: pytest.fail("asked again"))
        fast = attnselect.attention(q, k, v, cu_seqlens_q=other, max_seqlen_q=99, max_seqlen_kv=99, **kwargs)
    sibling, known = dispatch.known_calls()
    assert known.problem.signature == sibling.problem.signature and known.chosen == sibling.chosen
    assert known.runner is sibling.runner
    slow = attnselect.attention(q, k, v, cu_seqlens_q=other, cu_seqlens_kv=other.clone(), max_seqlen_q=99,
                                max_seqlen_kv=99, **kwargs)  # fmt: skip
    assert torch.equal(fast, slow)


@pytest.mark.gpu
def test_a_repeated_packed_call_takes_the_fast_path_with_the_same_result():
    cu = torch.tensor([0, 3, 103, 103, 160], dtype=torch.int32, device="cuda")
    q, k = (torch.randn(160, 8, 192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(160, 8, 128, device="cuda", dtype=torch.bfloat16)
    kwargs = dict(layout="thd", cu_seqlens_q=cu, max_seqlen_q=100, max_seqlen_kv=100, causal=True)
    attnselect.clear_cache()
    first = attnselect.attention(q, k, v, **kwargs)
    assert len(dispatch.known_calls()) == 1
    other = torch.tensor([0, 60, 160, 160, 160], dtype=torch.int32, device="cuda")  # a new packing, same key
    again = attnselect.attention(q, k, v, **{**kwargs, "cu_seqlens_q": other})
    assert len(dispatch.known_calls()) == 1
    slow = attnselect.attention(q, k, v, **{**kwargs, "cu_seqlens_q": other, "cu_seqlens_kv": other.clone()})
    assert torch.equal(attnselect.attention(q, k, v, **kwargs), first) and torch.equal(again, slow)


def test_a_call_with_its_own_scale_is_memoized_and_a_boolean_scale_is_still_refused():
    q, k, v = _inputs()
    attnselect.clear_cache()
    first = attnselect.attention(q, k, v, scale=1.0)
    assert len(dispatch.known_calls()) == 1 and torch.equal(attnselect.attention(q, k, v, scale=1.0), first)
    assert len(dispatch.known_calls()) == 1
    assert torch.equal(attnselect.attention(q, k, v, scale=1), first)  # the same number
    with pytest.raises(attnselect.InvalidInputError, match="scale: got True"):
        attnselect.attention(q, k, v, scale=True)
    other = attnselect.attention(q, k, v, scale=0.5)
    reference = attnselect.attention(q, k, v, scale=0.5, backend="reference")
    assert len(dispatch.known_calls()) == 3 and torch.allclose(other, reference, atol=1e-5)


def test_attention_hands_each_option_to_its_own_field(monkeypatch):
    """Every keyword reaches the CallOptions field of its name (attention() builds the object from a tuple)."""
    from attnselect import api

    seen = []
    monkeypatch.setattr(api, "recall", lambda q, k, v, options: seen.append(options) or None)
    monkeypatch.setattr(api, "describe_call", lambda *a: (_ for _ in ()).throw(RuntimeError("stop")))
    sentinels = {name: object() for name in CallOptions._fields if name != "cp_group"}
    q = torch.randn(1, 2, 2, 8)
    with pytest.raises(RuntimeError, match="stop"):
        attnselect.attention(q, q, q, **sentinels)
    assert CallOptions._make(seen[0]) == CallOptions(**sentinels)


def test_warmup_makes_each_problem_s_first_call_and_says_what_it_ran_on():
    from attnselect import dispatch

    problems = [
        attnselect.AttentionProblem(2, 16, 16, 4, 2, 24, 16, torch.float32, mask="causal", training=True),
        attnselect.AttentionProblem(3, 12, 12, 2, 2, 16, 16, torch.float32, layout="thd", mask="sliding_window",
                                    window=(3, 0), return_lse=True, softcap=True),
        attnselect.AttentionProblem(1, 8, 8, 2, 2, 16, 16, torch.float32, layout="bhsd", sinks=True, dropout_p=0.1),
    ]  # fmt: skip
    attnselect.clear_cache()
    seen = []
    warmed = attnselect.warmup(problems, device="cpu", progress=lambda done, total, text: seen.append((done, total)))
    assert [w.problem for w in warmed] == problems and seen == [(1, 3), (2, 3), (3, 3)]
    assert all(w.error is None and w.chosen and w.seconds > 0 for w in warmed)
    known = dispatch.known_calls()  # the dense calls are remembered: the job's same calls find them
    assert [c.problem for c in known if c.problem.layout != "thd"] == [problems[0], problems[2]]
    forced = attnselect.warmup(problems[:1], device="cpu", backend="reference")
    assert forced[0].chosen == "reference native"


def test_warmup_reports_a_call_that_fails_and_refuses_what_it_cannot_make():
    problem = attnselect.AttentionProblem(1, 8, 8, 2, 2, 16, 16, torch.float32)
    (failed,) = attnselect.warmup([problem], device="cpu", backend="flash_attn4")  # not installed here
    assert failed.chosen == "" and failed.error.startswith("ForcedChoiceError")
    with pytest.raises(attnselect.ForcedChoiceError, match="backend: got 'no_such_backend'"):
        attnselect.warmup([problem], backend="no_such_backend")
    with pytest.raises(attnselect.InvalidInputError, match=r"problems\[1\]: got str"):
        attnselect.warmup([problem, "deepseek"])
    compiled = dataclasses.replace(problem, compiled_graph=True)
    with pytest.raises(attnselect.InvalidInputError, match=r"problems\[0\].compiled_graph: got True"):
        attnselect.warmup([compiled])


@pytest.mark.parametrize(
    "arguments,message",
    [
        (dict(device="cpuu"), r"^device: got 'cpuu', expected 'cpu', 'cuda'"),
        (dict(device="meta"), r"^device: got 'meta', expected"),
        (dict(device=3.5), r"^device: got 3.5, expected"),
        (dict(progress=5), r"^progress: got 5, expected None or a callable"),
    ],
)
def test_warmup_names_a_bad_argument_before_any_call(arguments, message, monkeypatch):
    problem = attnselect.AttentionProblem(1, 8, 8, 2, 2, 16, 16, torch.float32)
    monkeypatch.setattr(api, "_warm", lambda *a: pytest.fail("warmed up before its arguments were checked"))
    with pytest.raises(attnselect.InvalidInputError, match=message):
        attnselect.warmup([problem], **arguments)
    with pytest.raises(attnselect.InvalidInputError, match=r"^problems: got AttentionProblem, .*warmup\(\[problem\]\)"):
        attnselect.warmup(problem)
    with pytest.raises(attnselect.InvalidInputError, match=r"^problems: got int, expected an iterable"):
        attnselect.warmup(3)


@pytest.mark.parametrize(
    "fields,message",
    [
        (dict(batch=0), r"^problems\[0\].batch: got 0, expected at least 1"),
        (dict(seqlen_kv=0), r"^problems\[0\].seqlen_kv: got 0, expected at least 1"),
        (dict(layout="thd", tokens=17), r"^problems\[0\].tokens: got 17, expected at most batch x seqlen_q = 16"),
        (dict(layout="thd", varlen_gaps=True), r"^problems\[0\].varlen_gaps: got True, expected False"),
    ],
)
def test_warmup_refuses_a_problem_whose_call_it_cannot_make(fields, message, monkeypatch):
    """No queries or keys (nothing to warm), more tokens than the packing holds, gaps it never packs: refused before
    any call, naming the field, not reported as warmed."""
    sizes = dict(batch=2, seqlen_q=8, seqlen_kv=8, heads_q=2, heads_kv=2, head_dim_qk=16, head_dim_v=16)
    problem = attnselect.AttentionProblem(**{**sizes, **fields}, dtype=torch.float32)
    monkeypatch.setattr(api, "_warm", lambda *a: pytest.fail("warmed up before its problems were checked"))
    with pytest.raises(attnselect.InvalidInputError, match=message):
        attnselect.warmup([problem])


def test_warmup_makes_a_deterministic_problem_s_call_under_deterministic_algorithms(monkeypatch):
    """The job's deterministic call is what warm-up decides and runs (the problem reads torch's switch), and the
    switch is as the caller left it afterwards."""
    selected, original = [], api.select
    monkeypatch.setattr(api, "select", lambda problem, **kw: selected.append(problem) or original(problem, **kw))
    problem = attnselect.AttentionProblem(1, 8, 8, 2, 2, 16, 16, torch.float32, training=True, deterministic=True)
    attnselect.clear_cache()
    (warmed,) = attnselect.warmup([problem], device="cpu")
    assert warmed.error is None and not torch.are_deterministic_algorithms_enabled()
    assert selected and all(p.deterministic for p in selected)


def test_warmup_reports_a_call_unlike_its_problem_not_warmed(monkeypatch):
    """Where the call warm-up makes is not the problem's (a field it did not reproduce), it is reported, naming the
    field, not warmed."""
    problem = attnselect.AttentionProblem(1, 8, 8, 2, 2, 16, 16, torch.float32, return_lse=True)
    monkeypatch.setattr(api, "call_arguments", lambda p, device: {**call_arguments(p, device), "return_lse": False})
    (warmed,) = attnselect.warmup([problem], device="cpu")
    assert warmed.chosen == "" and "return_lse False where the problem has True" in warmed.error


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case")
def test_warmup_on_cuda_without_cuda_says_so():
    problem = attnselect.AttentionProblem(1, 8, 8, 2, 2, 16, 16, torch.float32)
    with pytest.raises(attnselect.InvalidInputError, match=r"^device: got 'cuda', but CUDA is not available"):
        attnselect.warmup([problem], device="cuda")


def test_warmup_reports_inputs_it_cannot_make_and_keeps_the_others():
    """A problem too large for the device fails making its inputs: reported as its call's failure would be, the
    other problems warmed up alike."""
    small = attnselect.AttentionProblem(1, 8, 8, 2, 2, 16, 16, torch.float32)
    huge = attnselect.AttentionProblem(10**6, 10**6, 10**6, 2, 2, 16, 16, torch.float32)
    done = attnselect.warmup([small, huge, small], device="cpu")
    assert [bool(w.error) for w in done] == [False, True, False] and done[2].chosen


@pytest.fixture
def two_rank_group():
    """A process group of two ranks in this one process (torch's fake backend: its collectives do nothing), so
    attention(cp_group=) runs its own checks here."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "options,lengths",
    [
        (dict(causal="bottom_right"), (4, 4)),
        (dict(dropout_p=0.1), (4, 4)),
        (dict(causal=True, window=(2, 0)), (4, 4)),
        (dict(causal=True), (4, 6)),  # keys of their own length under a causal mask
    ],
)
def test_select_and_explain_refuse_what_attention_cp_group_refuses(two_rank_group, options, lengths):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, n, 2, 8, generator=g, dtype=torch.float64) for n in lengths)
    with pytest.raises(attnselect.InvalidInputError, match="context_parallel_size=2") as raised:
        attnselect.attention(q, k, k, cp_group=two_rank_group, **options)
    problem = attnselect.AttentionProblem.from_tensors(q, k, k, context_parallel_size=2, **options)
    for entry in (attnselect.select, attnselect.explain) * 2:  # and again, where a decision could be memoized
        with pytest.raises(attnselect.InvalidInputError) as same:
            entry(problem)
        assert str(same.value) == str(raised.value)
    served = attnselect.AttentionProblem.from_tensors(q, q, q, causal=True, context_parallel_size=2)
    assert attnselect.select(served).chosen and "context parallel" in attnselect.explain(served)


@pytest.fixture
def meta_cudnn_h200(monkeypatch):
    """attention() on meta tensors as on an H200 with the cuDNN frontend, whose op records the max_seqlen it gets
    (meta boundaries: no device work, and the memo takes packed calls on them as on CUDA)."""
    import sys
    import types

    from attnselect import api
    from attnselect.backends import shape_cache
    from attnselect.spec.target import Target

    seen = []

    def sdpa_torch(q, k, v, **kwargs):
        seen.append((kwargs["max_seqlen_q"], kwargs["max_seqlen_kv"]))
        return torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)

    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(sdpa_torch=sdpa_torch))
    h200 = Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0"})
    monkeypatch.setattr(api, "target_for_device", lambda device: h200)
    monkeypatch.setattr(shape_cache, "padded_boundaries", lambda cu, count, target: cu)
    monkeypatch.setenv("ATTNSELECT_SELF_CHECK", "0")
    attnselect.clear_cache()
    yield seen
    attnselect.clear_cache()


def test_a_new_packing_on_the_cudnn_frontend_runs_with_its_own_max_seqlen(meta_cudnn_h200):
    """A new packing runs its sibling's packed runner, which reads each packing's max_seqlen: the cuDNN frontend's
    op sees the new packing's longest sequence (bucketed), not its sibling's."""
    q = torch.empty(4096, 16, 128, dtype=torch.bfloat16, device="meta")
    for longest in (1000, 3000):
        cu = torch.empty(5, dtype=torch.int32, device="meta")
        attnselect.attention(q, q, q, layout="thd", causal=True, cu_seqlens_q=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest, backend="cudnn_frontend")  # fmt: skip
    first, then = dispatch.known_calls()
    assert first.chosen.backend == then.chosen.backend == "cudnn_frontend" and then.runner is first.runner
    (first_q, first_kv), (then_q, then_kv) = meta_cudnn_h200
    assert first_q >= 1000 and first_kv >= 1000 and then_q >= 3000 and then_kv >= 3000


def test_a_packed_family_asks_for_a_self_check_once_per_size_class(meta_cudnn_h200, monkeypatch):
    """One problem at every packing's sizes has one signature per size class: where its choice needed no self-check
    at a class, a new packing of that class does not ask again."""
    from attnselect import api

    asked = []
    monkeypatch.setattr(api.self_check, "needed", lambda problem, *a: asked.append(problem.seqlen_q) or False)
    q = torch.empty(4096, 16, 128, dtype=torch.bfloat16, device="meta")
    for longest in (1000, 1001, 1002, 3000, 3001, 1003):  # 4 x 16 x 1000^2 scores: class 12; at 3000: 14
        cu = torch.empty(5, dtype=torch.int32, device="meta")
        attnselect.attention(q, q, q, layout="thd", causal=True, cu_seqlens_q=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest, backend="cudnn_frontend")  # fmt: skip
    assert asked == [1000, 3000] and len(dispatch.known_calls()) == 6


@pytest.mark.parametrize("calibrated", [False, True])
def test_a_new_packing_of_a_class_decided_before_is_that_class_s_call(meta_cudnn_h200, monkeypatch, calibrated):
    """A packed family's new packing in a class (work class, size class, rules table) whose decision stands
    (selection.standing_decisions) is the call attention() made in that class, at its own sizes: not selected again,
    its runner and choice; a class not seen, and one whose paid compiles changed, are selected."""
    from attnselect.choose import first_calls
    from attnselect.spec.target import Target

    if calibrated:  # the packaged H200 calibration holds: ranked by predicted time
        h200 = Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0"}, torch_version="2.11.0+cu130",
                             cudnn_version="9.19.0")  # fmt: skip
        monkeypatch.setattr(api, "target_for_device", lambda device: h200)
    selected, select_packed = [], api.select_packed
    monkeypatch.setattr(api, "select_packed", lambda p, **kw: selected.append(p.seqlen_q) or select_packed(p, **kw))
    q = torch.empty(4096, 16, 128, dtype=torch.bfloat16, device="meta")

    def call(longest: int) -> dispatch.KnownCall:
        cu = torch.empty(5, dtype=torch.int32, device="meta")
        attnselect.attention(q, q, q, layout="thd", causal=True, cu_seqlens_q=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)  # fmt: skip
        return dispatch.known_calls()[-1]

    calls = [call(longest) for longest in (1000, 1001, 1002, 1003, 3000, 3001)]
    assert selected == [1000, 1001, 3000]  # the family's first call; then a class carried, once each
    assert [c.problem.seqlen_q for c in calls] == [1000, 1001, 1002, 1003, 3000, 3001]
    assert calls[2].runner is calls[3].runner is calls[1].runner and calls[3].chosen == calls[1].chosen
    assert calls[3].problem == calls[1].problem._with(seqlen_q=1003, seqlen_kv=1003)
    try:
        first_calls.ran(attnselect.Candidate("flash_attn4"), calls[0].problem)  # a compile paid since
        call(1004)
        call(1005)
    finally:
        first_calls.forget()
    assert selected == [1000, 1001, 3000, 1004]
    family = next(entry.family for entry in dispatch._CALLS.values() if entry.family is not None)
    assert len(family.classes) == 2  # 1000's class (kept again at 1004) and 3000's
    monkeypatch.setattr(api, "MEMO_SIZE", 2)  # bounded: past its size the classes start again
    call(2000), call(2001)
    assert len(family.classes) == 1


def test_a_class_whose_choice_was_self_checked_is_not_reused(meta_cudnn_h200, monkeypatch):
    """A class's call is kept for new packings only where its choice needs no self-check at that size class: where
    the call checked it (or could not, say for want of a reference), each new packing of the class asks again."""
    from attnselect.spec.target import Target

    h200 = Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0"}, torch_version="2.11.0+cu130",
                         cudnn_version="9.19.0")  # fmt: skip
    monkeypatch.setattr(api, "target_for_device", lambda device: h200)
    monkeypatch.setattr(api.self_check, "needed", lambda *a: True)
    monkeypatch.setattr(api.self_check, "check", lambda *a, **kw: None)  # checked and passed, not kept as passed
    selected, select_packed = [], api.select_packed
    monkeypatch.setattr(api, "select_packed", lambda p, **kw: selected.append(p.seqlen_q) or select_packed(p, **kw))
    q = torch.empty(4096, 16, 128, dtype=torch.bfloat16, device="meta")
    for longest in (1000, 1001, 1002, 1003):
        cu = torch.empty(5, dtype=torch.int32, device="meta")
        attnselect.attention(q, q, q, layout="thd", causal=True, cu_seqlens_q=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)  # fmt: skip
    assert selected == [1000, 1001, 1002, 1003]


def test_a_new_packing_asks_for_its_self_check_where_its_sibling_had_nothing_to_check(meta_cudnn_h200, monkeypatch):
    """A sibling with no scores (max_seqlen 0) needed no self-check for want of work: a new packing at the same
    signature (size class 0 holds 0 to 3 scores) that has work asks again."""
    from attnselect import api

    asked = []
    monkeypatch.setattr(api.self_check, "needed", lambda problem, *a: asked.append(problem) or False)
    q = torch.empty(1, 1, 128, dtype=torch.bfloat16, device="meta")
    cu = torch.empty(2, dtype=torch.int32, device="meta")
    for longest in (0, 1):
        attnselect.attention(q, q, q, layout="thd", causal=True, cu_seqlens_q=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest, backend="cudnn_frontend")  # fmt: skip
    assert [p.seqlen_q for p in asked] == [0, 1] and asked[0].signature == asked[1].signature


def test_zero_dimensional_boundaries_get_the_library_s_error():
    q = torch.empty(12, 4, 24, device="meta")
    with pytest.raises(attnselect.InvalidInputError, match="cu_seqlens_q"):
        attnselect.attention(q, q, q, layout="thd", causal=True, cu_seqlens_q=torch.empty((), dtype=torch.int32,
                             device="meta"), max_seqlen_q=7, max_seqlen_kv=7)  # fmt: skip


def test_a_renting_class_s_call_counts_towards_the_price_until_it_is_paid(meta_cudnn_h200, monkeypatch):
    """A class whose decision rents (FA4 predicted faster, its compile unpaid: varlen_fa2 runs meanwhile) stands too:
    a new packing of it is that class's call, not selected again, and each of its calls counts towards the price
    (first_calls.rent); the call that pays it clears the decisions, so the next packing is selected again."""
    from attnselect.choose import first_calls
    from attnselect.spec.target import Target

    h200 = Target.preset("h200", packages={"nvidia-cudnn-frontend": "1.32.0", "flash-attn-4": "4.0.0b36"},
                         torch_version="2.11.0+cu130", cudnn_version="9.19.0")  # fmt: skip
    monkeypatch.setattr(api, "target_for_device", lambda device: h200)
    selected, select_packed = [], api.select_packed
    monkeypatch.setattr(api, "select_packed", lambda p, **kw: selected.append(p.seqlen_q) or select_packed(p, **kw))
    counted, rent = [], first_calls.rent
    monkeypatch.setattr(first_calls, "rent", lambda rental, key: counted.append(rental) or rent(rental, key))
    q = torch.empty(4096, 16, 128, dtype=torch.bfloat16, device="meta", requires_grad=True)

    def call(longest: int) -> dispatch.KnownCall:
        cu = torch.empty(5, dtype=torch.int32, device="meta")
        attnselect.attention(q, q, q, layout="thd", causal=True, cu_seqlens_q=cu, max_seqlen_q=longest,
                             max_seqlen_kv=longest)  # fmt: skip
        return dispatch.known_calls()[-1] if dispatch.known_calls() else None

    try:
        calls = [call(longest) for longest in (3000, 3001, 3002, 3003, 3004)]
        assert calls[1].problem.training and selected == [3000, 3001]  # the family's first call; the class carried
        rental = select_packed(calls[-1].problem, target=h200).rental
        assert rental is not None and rental.deferred == attnselect.Candidate("flash_attn4")
        assert [c.chosen for c in calls] == [rental.chosen] * 5 and len(counted) == 5  # each call counted
        assert calls[2].runner is calls[3].runner is calls[4].runner  # the class's call
        monkeypatch.setattr(first_calls, "rent", lambda rental, key: True)  # this call's rent reaches the price
        call(3005)
        assert dispatch.known_calls() == []  # the decisions cleared: the next packing is selected again
    finally:
        first_calls.forget()
