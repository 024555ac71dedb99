"""Candidates that raised at run time, or whose result the self-check found wrong: remembered in this process and,
unless the failure may pass (out of memory), in the decision cache for later processes on the same target
fingerprint. Failures are kept per problem signature (:attr:`AttentionProblem.signature`: head dims, GQA ratio, mask,
layout, dtype, phase, size class), so a packed loop whose sizes change every step does not meet the same failure
at every new packing."""

from __future__ import annotations

import json

import torch

from attnselect import correctness, memos
from attnselect.choose import debug, store
from attnselect.choose.distributed import is_distributed
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target

# Candidates that failed in this process: (problem signature, target) -> {candidate: error}. Kept across
# clear_cache(): they are facts about this machine and its library versions, not memoized choices.
_FAILED: dict[tuple, dict] = {}
# Those earlier processes recorded in the decision cache: its entry key -> {candidate: error}, read once per process.
_RECORDED: dict | None = None
FAILED_AT_RUN_TIME = "failed at run time"  # the policy field of their cache entries
_FAILED_VALUE = json.dumps(FAILED_AT_RUN_TIME)  # as it appears in their keys


def failures(problem: AttentionProblem, target: Target) -> dict:
    """{candidate: error} of the candidates that failed at run time for ``problem`` on ``target``: in this
    process, or recorded in the decision cache by an earlier one on the same target fingerprint (not under
    torch.distributed, where ranks could read different cache files and then disagree). A captured or compiled
    call's are its own signature's and its eager call's (:func:`eager_signature`): what failed in the eager warm-up
    is refused in the graph, and what failed in a graph alone is not refused to eager calls."""
    shared = (problem,) if problem.eager is problem else (problem.eager, problem)  # the graph's own last: it wins
    failed = {c: e for p in shared for c, e in _FAILED.get((p.signature, target), {}).items()}
    recorded = _recorded_failures()
    if not recorded or is_distributed():
        return failed
    key = _entry_key(problem, target)
    earlier = {c: e for p in shared for c, e in recorded.get(_entry_key(p, target), {}).items()}
    if not earlier:
        return failed
    fresh = [c for c in earlier if c not in failed]
    if fresh:  # what an earlier process met changes this one's choice: said once per signature, not silently
        memos.warn_once(
            f"recorded failure:{key}",
            "attnselect: skipping %s for %s: %s in an earlier process on this GPU and these library versions "
            "(recorded in %s; remove that entry, or the file, to try %s again)",
            ", ".join(map(str, fresh)), problem.describe(), "; ".join(earlier[c] for c in fresh), store.cache_file(),
            "it" if len(fresh) == 1 else "them",
        )  # fmt: skip
    return {**earlier, **failed}


def _recorded_failures() -> dict:
    global _RECORDED
    if _RECORDED is None:
        recorded = {}
        for key, entry in store.entries().items():
            if not _is_failure_key(key):  # another policy's entry, or not one of attnselect's keys at all
                continue
            try:
                found = {
                    Candidate(**f["candidate"]): (str(f["error"]), f.get("criterion")) for f in entry.get("failed", ())
                }
            except (TypeError, KeyError, ValueError, AttributeError) as exc:  # written by hand, or by another version
                store.malformed(key, exc, f"the failures recorded at signature {json.loads(key).get('signature')}")
                continue
            recorded[key] = {
                c: error for c, (error, criterion) in found.items() if not _judged_before(error, criterion)
            }
            for c, (error, _) in found.items():
                if c not in recorded[key]:
                    debug.LOGGER.info(
                        "attnselect: %s's wrong result recorded in %s was judged by an earlier correctness criterion: "
                        "checked again (%s)", c, store.cache_file(), error,
                    )  # fmt: skip
        _RECORDED = recorded
    return _RECORDED


def _judged_before(error: str, criterion) -> bool:
    """Whether a recorded failure is a wrong result the self-check found under an earlier correctness criterion (one
    recorded before criteria were recorded has none): a right kernel it failed passes now."""
    return error.startswith("WrongResultError") and criterion != correctness.CRITERION


def mark_failed(
    problem: AttentionProblem, target: Target, candidate: Candidate, error: BaseException, *, falls_back: bool = True
) -> None:
    """Record a run-time failure (one warning) and forget decisions, so the next call re-selects without it.

    Failures that may pass (out of memory) and results just past the self-check's bound (not ``error.lasting``:
    attnselect.self_check.CLEARLY_WRONG) stay in this process; others are also recorded in the decision cache under
    the target fingerprint, so later processes on the same GPU and library versions skip the candidate too (the
    fingerprint changes with any version, which retries it)."""
    text = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
    _FAILED.setdefault((problem.signature, target), {})[candidate] = text
    near = getattr(error, "lasting", True) is False
    transient = near or is_transient(error)
    if not transient:
        judged = {"criterion": error.criterion} if getattr(error, "criterion", None) is not None else {}
        store.remember(
            _entry_key(problem, target),
            {"failed": [{"candidate": candidate.to_dict(), "error": text, **judged}]},
            combine=_with_earlier,
        )
    kept = (
        "for this process only: just past its bound, a later process checks it again" if near
        else "for this process only: it may pass" if transient
        else "recorded in the decision cache for this target"
    )  # fmt: skip
    debug.LOGGER.warning(
        "attnselect: %s failed on %s (%s); %s (%s)",
        candidate,
        problem.describe(),
        text,
        "falling back to the next candidate; ATTNSELECT_STRICT=1 raises instead" if falls_back else "raising it",
        kept,
    )
    memos.clear_cache()


def _is_failure_key(key: str) -> bool:
    if _FAILED_VALUE not in key:  # a key of another policy, or anything else, is not parsed
        return False
    try:
        parsed = json.loads(key)
    except (ValueError, RecursionError):
        return False
    return isinstance(parsed, dict) and parsed.get("policy") == FAILED_AT_RUN_TIME


def eager_signature(problem: AttentionProblem) -> tuple:
    """The call's signature as if made eagerly: what a graph's call shares with the eager calls before it (the
    packaged evidence of wrong kernels, first calls; :func:`failures` reads a graph's failures and its eager call's)."""
    return problem.eager.signature


def _entry_key(problem: AttentionProblem, target: Target) -> str:
    """The decision cache's key of a problem signature's failures on a target fingerprint."""
    return json.dumps(
        {
            "signature": list(problem.signature),
            "policy": FAILED_AT_RUN_TIME,
            "target": store.fingerprint(target),
        },
        sort_keys=True,
    )


def is_transient(error: BaseException) -> bool:
    """A failure that may pass: out of memory on the GPU or the CPU (torch's allocators' messages), an interrupt, or
    torch.compile's state in a long process (:data:`_COMPILER_STATE_SIGNS`)."""
    text = str(error).lower()
    return isinstance(error, (*_OUT_OF_MEMORY, KeyboardInterrupt, InterruptedError)) or any(
        sign in text for sign in (*_MEMORY_SIGNS, *_COMPILER_STATE_SIGNS)
    )


# torch's CUDA caching allocator ("CUDA out of memory"), its CPU allocator ("DefaultCPUAllocator: can't allocate
# memory"), cuBLAS and the CUDA runtime's allocation failures, and cuDNN's: its handle cannot be made when no stream
# can be created ("cudnnHandle Create failed cudaStreamCreateWithFlags", seen on the H200 while other processes held
# its memory, results/h200_correctness_grid.md; the same call passed in another process).
# cuDNN's allocation inside a CUDA graph capture fails so too: sdpa_cudnn's "CUDNN_STATUS_INTERNAL_ERROR_DEVICE_
# ALLOCATION_FAILED" on an H100 with eight test processes sharing the GPU, where the same test passed in every earlier
# run of fewer (results/h100_pytest_api_dispatch_backends_0994536.txt).
_MEMORY_SIGNS = (
    "out of memory",
    "can't allocate memory",
    "cublas_status_alloc_failed",
    "cudaerrormemoryallocation",
    "cudnn_status_alloc_failed",
    "cudnnhandle create failed cudastreamcreatewithflags",
    "device_allocation_failed",
)


def broke_capture_before(error: BaseException) -> bool:
    """Whether ``error`` is CUDA's for a graph capture that an earlier error invalidated (the runtime's
    cudaErrorStreamCaptureInvalidated, "operation failed due to a previous error during capture"; the driver's
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, as cuda-python names it): every later operation in that capture fails so,
    whatever the kernel, so it is not the candidate's failure."""
    text = str(error).lower()
    return "previous error during capture" in text or "stream_capture_invalidated" in text


# torch.compile's state in a process, not the kernel: torch 2.11's packed flex training, compiled after another
# softcap with floats symbolic, fails in create_fw_bw_graph ("all unwrapped values must be FakeTensor, int, or
# SymInt") where the same call alone passes (results/h200_flex_probe_softcap_pair.md). The flex backend compiles
# floats as constants (attnselect.backends.flex._recompile_settings); another path to the error stays transient.
_COMPILER_STATE_SIGNS = ("all unwrapped values must be faketensor",)
_OUT_OF_MEMORY = (MemoryError, *((torch.OutOfMemoryError,) if hasattr(torch, "OutOfMemoryError") else ()))


def _with_earlier(old: dict | None, new: dict) -> dict:
    """A failure entry merged with what the file already holds (another process may have added to it; what is
    malformed there is dropped)."""
    replaced = [f["candidate"] for f in new["failed"]]
    earlier = (old or {}).get("failed", ())
    kept = [f for f in (earlier if isinstance(earlier, list) else ()) if isinstance(f, dict) and "candidate" in f]
    return {"failed": [f for f in kept if f["candidate"] not in replaced] + new["failed"]}
