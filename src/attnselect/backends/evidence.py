"""What the correctness grid showed: the young kernels' allowlists and the signatures a grid has checked.

Young kernels (FlashAttention-4, flex on CUDA, the cuDNN frontend: :attr:`Backend.evidence_required`) break claims
their documentation makes: FA4 4.0.0b36's sm90 backward gives wrong gradients at 128/64 in some processes and
sizes, cannot launch at 64/128, fails to compile at 128/96 (docs/sources/h200-measurements-2026-12-02.md). So on
the GPUs where they need evidence, their surface is an allowlist: a kernel configuration (layout kind, the head
dims the kernel gets, phase) is served only where benchmarks/correctness_grid.py ran it and every one of its rows
passed, in every process; where some of its rows failed, a call is served only if rows of its own K/V grouping
(MHA, GQA or MQA) ran and all of them passed (flex's packed 128/128 inference failed only with one K/V head, for
want of an inductor template); and where rows of the same head dims and phase, in either layout, failed at a longer
:func:`span` than any of the key's rows passed, only up to its rows' span (``passed_up_to``: flex's dense 64/256
inference rows passed at 77 tokens, its thd 64/256 inference rows ran out of shared memory from a span of 666, and a
peer sweep's dense call at 1024 ran out of it too). Everything else is refused with a reason that names the grid's
file.

The grid's summary ships as package data, one file per GPU (``attnselect/data/correctness_<arch>.json``, written by
``python benchmarks/correctness_grid.py --report DIR --earlier``). Its ``covered`` signatures also spare the first-use
self-check (:mod:`attnselect.self_check`) for calls the grid checked on the same GPU and library versions; its
``failed`` ones, where the peer sweeps found a chosen candidate wrong or crashing, are refused there as failures
(:func:`known_failures`, read by :mod:`attnselect.choose.selection`).
``ATTNSELECT_ALLOWLIST=0`` serves the young kernels' full documented surface instead (to test a kernel; the
self-check still runs).
"""

from __future__ import annotations

import functools
import json
import logging
from importlib import resources

from attnselect.errors import InvalidInputError
from attnselect.memos import environment_reader
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target

log = logging.getLogger("attnselect")
FORMAT = 1


_allowlist_variable = environment_reader("ATTNSELECT_ALLOWLIST")  # read for every candidate of a new packing


def allowlist_enabled() -> bool:
    """ATTNSELECT_ALLOWLIST: '1' (default) serves the young kernels only where the correctness grid passed them;
    '0' serves their documented surface (attnselect.backends.evidence)."""
    value = _allowlist_variable()
    value = "1" if value is None else value.strip()
    if value not in ("0", "1"):
        raise InvalidInputError(f"ATTNSELECT_ALLOWLIST: got {value!r}, expected '0' or '1'")
    return value == "1"


def kernel_key(problem: AttentionProblem) -> str:
    """The allowlist's key of a kernel configuration: layout kind, the head dims the kernel gets, phase."""
    layout = "thd" if problem.layout == "thd" else "dense"
    phase = "training" if problem.training else "inference"
    return f"{layout} {problem.head_dim_qk}/{problem.head_dim_v} {phase}"


def span(problem: AttentionProblem) -> int:
    """The most tokens a kernel may take as one sequence for ``problem``: the longer of its query and key sequences,
    and for packed input all its sequences together (flex runs a packing as one sequence under a document mask)."""
    longest = max(problem.seqlen_q, problem.seqlen_kv)
    return longest * problem.batch if problem.layout == "thd" else longest


def grouping(problem: AttentionProblem) -> str:
    """The K/V grouping a key's counts are split by: 'MHA', 'GQA' or 'MQA' (one K/V head)."""
    if problem.heads_kv == problem.heads_q:
        return "MHA"
    return "MQA" if problem.heads_kv == 1 else "GQA"


def _counts(entry) -> bool:
    return isinstance(entry, dict) and type(entry.get("passed")) is int and type(entry.get("failed")) is int


def _limit(entry: dict) -> bool:
    """A key's size limit, where it has one: the longest :func:`span` its rows passed at, and the failure beyond it."""
    if "passed_up_to" not in entry:
        return "failed_beyond" not in entry
    return (
        type(entry["passed_up_to"]) is int and entry["passed_up_to"] > 0 and isinstance(entry.get("failed_beyond"), str)
    )


@functools.cache
def grid_for(arch: str) -> dict | None:
    """The packaged grid summary for an arch ('sm90'), or None; a foreign or corrupt file gives one warning."""
    name = f"correctness_{arch}.json"
    try:
        text = resources.files("attnselect").joinpath("data", name).read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        log.warning("attnselect: ignoring the correctness summary %s (%s)", name, exc)
        return None
    try:
        data = json.loads(text)
        kernels = data.get("kernels") if isinstance(data, dict) else None
        if not (
            data.get("format") == FORMAT
            and isinstance(data.get("covered"), list)
            and isinstance(data.get("source"), str)
            and isinstance(kernels, dict)
            and all(
                isinstance(entries, dict)
                and all(
                    _counts(e)
                    and _limit(e)
                    and isinstance(e.get("by_grouping", {}), dict)
                    and all(_counts(g) for g in e.get("by_grouping", {}).values())
                    for e in entries.values()
                )
                for entries in kernels.values()
            )
        ):
            raise ValueError(f"not a correctness summary of format {FORMAT}")
        failed = data.get("failed", [])
        if not (
            isinstance(failed, list)
            and all(
                isinstance(f, list) and len(f) == 4 and isinstance(f[0], str) and _pad(f[1])
                and isinstance(f[2], list) and isinstance(f[3], str)
                for f in failed
            )
        ):  # fmt: skip
            raise ValueError("its failed signatures are not [backend, pad_to, signature, finding] lists")
        covered = data["covered"]
        if not all(
            isinstance(c, list) and len(c) == 3 and isinstance(c[0], str) and _pad(c[1]) and isinstance(c[2], list)
            for c in covered
        ):
            raise ValueError("its covered signatures are not [backend, pad_to, signature] lists")
        # as (backend, pad_to, AttentionProblem.signature): looked up at each first call of a signature
        data["covered"] = frozenset((backend, pad_to, _as_tuples(signature)) for backend, pad_to, signature in covered)
        data["failed"] = {}  # problem signature (as AttentionProblem.signature holds it) -> {backend: finding}
        for backend, _, signature, finding in failed:
            data["failed"].setdefault(_as_tuples(signature), {}).setdefault(backend, finding)
        return data
    except (ValueError, TypeError, AttributeError) as exc:
        log.warning("attnselect: ignoring the correctness summary %s (%s)", name, exc)
        return None


def reasons(backend: str, problem: AttentionProblem, target: Target) -> list[str]:
    """Why the allowlist refuses ``backend`` for ``problem`` (the problem the kernel gets, padded where the
    candidate pads) on ``target``; empty where the grid passed it, or the allowlist is off."""
    if not allowlist_enabled():
        return []
    grid = grid_for(target.arch)
    if grid is None:
        return [f"no correctness grid has passed it on {target.arch} (benchmarks/correctness_grid.py)"]
    key = kernel_key(problem)
    seen = grid["kernels"].get(backend, {}).get(key)
    if seen is None:
        return [f"no correctness grid row ran it at {key} ({grid['source']})"]
    if "passed_up_to" in seen and span(problem) > seen["passed_up_to"]:
        return [
            f"passed at {key} only up to a span of {seen['passed_up_to']} tokens (this call: {span(problem)}); "
            f"failed beyond at the same head dims: {seen['failed_beyond']} ({grid['source']})"
        ]
    if not seen.get("failed"):
        return []
    kind = grouping(problem)
    own = seen.get("by_grouping", {}).get(kind)
    if own and own["passed"] and not own["failed"]:  # the failures were at other groupings
        return []
    found = f"{own['failed']} of {own['failed'] + own['passed']} {kind} rows" if own else f"no {kind} row"
    return [f"failed {seen['failed']} of {seen['failed'] + seen['passed']} rows at {key} ({found}) in {grid['source']}"]


def reads_sizes(backend: str, problem: AttentionProblem, target: Target) -> bool:
    """Whether :func:`reasons` for ``backend`` reads ``problem``'s sizes (the problem the kernel gets): only where the
    grid passed its key up to a span (``passed_up_to``); elsewhere they follow from the key and the K/V grouping."""
    if not allowlist_enabled():
        return False
    grid = grid_for(target.arch)
    seen = grid["kernels"].get(backend, {}).get(kernel_key(problem)) if grid is not None else None
    return seen is not None and "passed_up_to" in seen


def base_fingerprint(target: Target) -> dict:
    """The GPU and the libraries every backend runs on: what a grid's covered signatures hold for."""
    return {
        "name": target.name,
        "capability": list(target.capability) if target.capability else None,
        "torch": target.torch_version,
        "cudnn": target.cudnn_version,
    }


def covers(backend: str, pad_to: int | None, problem: AttentionProblem, target: Target, version: str | None) -> bool:
    """Whether the packaged grid checked this candidate at this problem's signature on this GPU and these library
    versions (``version``: the backend's own package version, None for none), and it passed in every process."""
    grid = grid_for(target.arch) if target.is_cuda else None
    if grid is None or grid.get("fingerprint") != base_fingerprint(target):
        return False
    if grid.get("packages", {}).get(backend) != version:
        return False
    return (backend, pad_to, problem.signature) in grid["covered"]


def known_failures(signature: tuple, target: Target, version_of) -> dict:
    """{backend: finding} of the backends a peer sweep on this GPU and these library versions found wrong or
    crashing at this problem ``signature`` (an eager call's: the sweeps call eagerly; benchmarks/correctness_grid.py:
    SWEEPS), to be refused there as a failure recorded at run time would be, padded or not (flex failed at the same
    signature natively and padded, results/h200_peer_sweep_fa4.md). ``version_of(backend)``: its package's version
    here, None for none."""
    grid = grid_for(target.arch) if target.is_cuda else None
    if not grid or not grid.get("failed") or grid.get("fingerprint") != base_fingerprint(target):
        return {}
    found = grid["failed"].get(signature)
    if not found:
        return {}
    packages = grid.get("packages", {})
    return {
        backend: finding
        for backend, finding in found.items()
        if packages.get(backend, "unknown") == version_of(backend)
    }


def _as_tuples(value):
    """A JSON list, nested lists included, as the tuples it was written from."""
    return tuple(map(_as_tuples, value)) if isinstance(value, list) else value


def _pad(value) -> bool:
    return value is None or (type(value) is int and value > 0)
