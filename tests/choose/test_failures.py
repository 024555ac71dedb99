"""Run-time failures: transient ones (out of memory, interrupts, torch.compile's state) stay in the process; the
rest are recorded."""

from __future__ import annotations

import json

import pytest
import torch

import attnselect
from attnselect.choose import failures, store
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem

P = AttentionProblem(1, 8, 8, 2, 2, 16, 16, dtype=torch.float32)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4294967296 bytes"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("cudnnHandle Create failed cudaStreamCreateWithFlags(&ctx->streamPool[0][i], 0x01)"),
        RuntimeError("cuDNN error: CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"),  # inside a graph capture
        MemoryError(),
        InterruptedError("interrupted system call"),
        AssertionError("all unwrapped values must be FakeTensor, int, or SymInt, got [<class 'torch.Tensor'>]"),
    ],
)
def test_transient_failures_are_kept_in_the_process_only(error, tmp_path):
    target = attnselect.Target.current()
    failures.mark_failed(P, target, Candidate("sdpa_math"), error)
    assert Candidate("sdpa_math") in failures.failures(P, target)
    assert not (tmp_path / "decisions.json").exists() or failures.FAILED_AT_RUN_TIME not in (
        store.cache_file().read_text() if store.cache_file().exists() else ""
    )


def test_a_lasting_failure_is_recorded_for_the_signature():
    target = attnselect.Target.current()
    failures.mark_failed(P, target, Candidate("sdpa_math"), RuntimeError("no kernel image is available"))
    entries = json.loads(store.cache_file().read_text())["entries"]
    assert [json.loads(k)["signature"] for k in entries] == [list(json.loads(json.dumps(P.signature)))]
    failures._FAILED.clear()
    failures._RECORDED = None
    bigger = AttentionProblem(1, 9, 9, 2, 2, 16, 16, dtype=torch.float32)  # the same size class: the same signature
    assert failures.failures(bigger, target) == {Candidate("sdpa_math"): "RuntimeError: no kernel image is available"}


def test_a_wrong_result_judged_by_an_earlier_criterion_is_checked_again(caplog):
    """A self-check's wrong result is recorded with the correctness criterion that judged it; one recorded under an
    earlier criterion, or before criteria were recorded, is not read (a right kernel it failed passes now), while a
    run-time error and a wrong result under the current criterion are."""
    from attnselect import correctness
    from attnselect.self_check import WrongResultError

    target = attnselect.Target.current()
    failures.mark_failed(P, target, Candidate("sdpa_math"), WrongResultError("self-check of sdpa_math: dq wrong"))
    failures.mark_failed(P, target, Candidate("sdpa_efficient"), RuntimeError("no kernel image is available"))
    data = json.loads(store.cache_file().read_text())
    (entry,) = data["entries"].values()
    assert [f.get("criterion") for f in entry["failed"]] == [correctness.CRITERION, None]
    earlier = [
        {"candidate": Candidate("sdpa_flash").to_dict(), "error": "WrongResultError: self-check: dq wrong"},
        {"candidate": Candidate("flex").to_dict(), "error": "WrongResultError: self-check: dk wrong", "criterion": 1},
    ]
    entry["failed"] += earlier
    store.cache_file().write_text(json.dumps(data))
    failures._FAILED.clear()
    failures._RECORDED = None
    with caplog.at_level("INFO", logger="attnselect"):
        recorded = failures.failures(P, target)
    assert set(recorded) == {Candidate("sdpa_math"), Candidate("sdpa_efficient")}
    assert caplog.text.count("judged by an earlier correctness criterion") == 2


def test_only_cuda_s_invalidated_capture_error_is_taken_for_an_earlier_one():
    assert failures.broke_capture_before(
        RuntimeError("CUDA error: operation failed due to a previous error during capture")
    )
    assert not failures.broke_capture_before(
        RuntimeError("CUDA error: operation not permitted when stream is capturing")
    )
    assert failures.broke_capture_before(RuntimeError("CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"))  # the driver's name
    assert not failures.broke_capture_before(RuntimeError("no kernel image is available"))


def test_a_failure_under_capture_is_refused_there_and_an_eager_one_everywhere():
    """An eager call's failure (the warm-up before a capture) is refused under capture too; one met under capture
    alone is refused to captured calls and not to eager ones, in this process and later (an out-of-memory one, kept
    in this process alone, too)."""
    import dataclasses

    target = attnselect.Target.current()
    captured = dataclasses.replace(P, cuda_graph_capture=True)
    in_graph, eager = Candidate("sdpa_math"), Candidate("sdpa_efficient")
    transient = Candidate("sdpa_flash")
    failures.mark_failed(captured, target, in_graph, RuntimeError("operation not permitted when stream is capturing"))
    failures.mark_failed(P, target, eager, RuntimeError("no kernel image is available"))
    failures.mark_failed(P, target, transient, RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert set(failures.failures(captured, target)) == {in_graph, eager, transient}
    assert set(failures.failures(P, target)) == {eager, transient}
    failures._FAILED.clear()  # a later process reads the decision cache
    failures._RECORDED = None
    assert set(failures.failures(captured, target)) == {in_graph, eager}
    assert set(failures.failures(P, target)) == {eager}
