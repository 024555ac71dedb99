"""``attnselect calibrate``: measure what each installed backend costs on this GPU, for the rules' predicted times.

For each head-dim pair of :data:`PAIRS`, phase (inference, training) and supported candidate (native, and padded
where the dims differ; not those of :data:`SKIPPED`), it times a dense causal call over a ladder of sizes
(:data:`LADDER`) side by side (:func:`attnselect.choose.timing.time_steps`, queued behind a spin, so each time is the
GPU's); per backend, padding and phase, the host's time to issue one call at the smallest size that serves it, while
the GPU is busy (the candidates side by side, in interleaved rounds: :func:`_host_us`; taken again at that pair once
the ladder is done, the least kept: :func:`host_times`), through
:func:`attnselect.attention` as a model's layers call it again and again (:func:`attention_step`: its memoized path
and prepared runner), and for packed calls also on a new packing each call (a step's first layer, which
prepares for the packing and, at sizes not seen, decides: ``new_packing_us``, forced to the candidate as the host
times are, the self-check off); and per backend, what the first call of a
configuration costs on top of a later one (a JIT compile). Packed (thd) calls are timed too, by candidates that pack
(sequence by sequence is never the fast path), over :data:`PACKED_LADDER` with a new packing every call
(:class:`~attnselect.choose.timing.NewPackings`: a typical packing of the problem's size, so per-packing builds
show): their curves are keyed ``thd`` and their work is the mean of the packings' as a prediction reads a call's
(:func:`attnselect.choose.predict.work`, from each packing's sequences, longest lengths and tokens:
:func:`_timed_work`). The result is the format :mod:`attnselect.choose.calibration` reads, for this GPU and these
versions; ``attnselect calibrate`` stores it in the cache directory, where it takes precedence over the packaged
one. ``quick`` measures one pair, one phase and two sizes (a smoke test, never stored there).

FlashAttention-4's forward replay (attnselect.backends.flash_attn4_replay) is paused throughout, but for the
replayed steps below: its host times are its interface's, what a shape's first two calls pay (FA4's runner on an
H100 at 192/128: 14.4-15.6 us a call replayed against 81.9-87.5 not, results/h100_fa4_forward_replay_8e72048.md). A
backend that replays (``Backend.calls_before_replay``) is timed replayed too, in inference, in the same rounds as
through its interface (:func:`host_times`, ``replayed_host_us``): the rules rank it by that time and price a shape's
calls before the replay (attnselect.choose.first_calls.replay_start_ms)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import statistics
import sys
import time

import torch

from attnselect.backends import flash_attn4_replay
from attnselect.backends.base import get as backend_named
from attnselect.choose import calibration
from attnselect.choose.candidates import judge
from attnselect.choose.predict import work
from attnselect.choose.timing import NewPackings, _sized_call, candidate_step, random_inputs, time_steps
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Target

log = logging.getLogger("attnselect")

PAIRS = ((192, 128), (128, 128), (64, 64), (256, 256))
# (batch, sequence length): from host-bound to GPU-bound, 16 heads, causal
LADDER = ((1, 128), (1, 512), (2, 1024), (1, 4096), (2, 8192), (1, 32768))
# (sequences, longest): packings of 1k to 64k tokens (NewPackings fills half of sequences x longest)
PACKED_LADDER = ((4, 512), (8, 1024), (8, 4096), (8, 16384))
HEADS = 16
# Left out and ranked after the calibrated candidates: the reference and sdpa_math are never the fastest where
# anything else serves; flex compiles for every dense shape (40-56 s a compile on the H200:
# results/h200_flex_probe.md), more than a calibration can spend.
SKIPPED = ("reference", "sdpa_math", "flex")
# First calls (first_call_costs): each backend's process start-up paid at START_UP, then each configuration's
# first call at the first size of FIRST_CALL_SIZES and new sizes of it at the others (the least of those: a first
# larger size may load another kernel variant once, not per size)
START_UP = (128, 128)
# (the packed (8, 1536), not (8, 768), whose packings fall in (8, 1024)'s cuDNN-frontend bucket, which shares a graph
# between packings: backends/shape_cache.py; a later candidate's packing of it may still fall there, as each
# candidate takes the next packing: packed shapes are not priced, attnselect.choose.first_calls)
FIRST_CALL_SIZES = {"bshd": ((1, 1024), (1, 2048), (2, 1536)), "thd": ((4, 512), (8, 1024), (8, 1536))}
PARTIAL = " (partial: a checkpoint of a run not finished)"  # marks a checkpoint's source: never packaged or read
HOST_ROUNDS = 5
HOST_CALLS = 10  # a round's calls of each step
COMPILING_MS = 1000.0  # a backend whose first call took this much longer at two sizes in a row compiles per shape


@flash_attn4_replay.paused()  # FA4 timed through its interface, as on a new shape
def run(
    target: Target | None = None, *, attention, quick: bool = False, pairs=PAIRS, progress=None, checkpoint=None
) -> dict:
    """Measure this machine's backends at the head-dim ``pairs``, host times through ``attention``
    (:func:`attnselect.attention`, passed in by its callers above the API): a calibration (the
    :mod:`attnselect.choose.calibration` format), handed to ``checkpoint`` after each pair and phase too. A backend
    that compiles per shape (its first call :data:`COMPILING_MS` longer than the next at two sizes in a row; a
    compile per configuration, FA4's, costs once) is timed at the ladder's first, middle and last sizes after that.
    A CUDA error that leaves the context unusable stops the run (raised; the checkpoints keep what was measured).
    The first calls' costs are measured first (:func:`first_call_costs`), before the ladder pays those compiles; the
    host times are taken twice, in the ladder (each kind at the first pair and size that has it) and once it is done
    (:func:`host_times` at the same pairs), each kind's least kept (:func:`least_times`)."""
    target = target or Target.current()
    device = torch.device("cuda" if target.is_cuda else "cpu")
    dtype = torch.bfloat16 if target.is_cuda else torch.float32
    pairs, phases = (pairs[:1], (True,)) if quick else (tuple(pairs), (False, True))
    # the start-up's pair has paid a configuration there: measured at the others (at PAIRS' where none is left)
    first_pairs = [p for p in pairs if p != START_UP] or [p for p in PAIRS if p != START_UP]
    first = first_call_costs(target, attention=attention, pairs=first_pairs, phases=phases, progress=progress)
    ladders = {"bshd": LADDER[:2] if quick else LADDER, "thd": PACKED_LADDER[:2] if quick else PACKED_LADDER}
    jobs = [(pair, layout, training) for pair in pairs for training in phases for layout in ladders]
    gpu: dict = {}
    host: dict = {}
    new_packing: dict = {}
    total = len(jobs) + 1  # and the host times taken again
    for index, (pair, layout, training) in enumerate(jobs):
        if progress:
            progress(index, total, f"{layout} {pair[0]}/{pair[1]} {'training' if training else 'inference'}")
        compiled: dict = {}  # backend -> ladder sizes in a row whose first call compiled
        ladder = ladders[layout]
        sparse = {ladder[0], ladder[len(ladder) // 2], ladder[-1]}
        for batch, seqlen in ladder:
            problem = AttentionProblem(batch, seqlen, seqlen, HEADS, HEADS, *pair, dtype=dtype, layout=layout,
                                       mask="causal", training=training)  # fmt: skip
            candidates = [c for c in _calibrated(problem, target)
                          if compiled.get(c.backend, 0) < 2 or (batch, seqlen) in sparse]  # fmt: skip
            try:
                inputs = random_inputs(problem, device)
            except torch.OutOfMemoryError:
                continue
            steps = {c: candidate_step(c, problem, target, inputs) for c in candidates}
            compiling_now = set()
            for c in candidates:  # the first call at this size, then a second one
                extra = _first_call_extra(steps[c], device)
                if extra is not None and extra > COMPILING_MS:
                    compiling_now.add(c.backend)
            for c in candidates:  # compiled again at a second size in a row: it compiles per shape
                compiled[c.backend] = compiled.get(c.backend, 0) + 1 if c.backend in compiling_now else 0
            timed = time_steps(steps, device, budget_s=2.0 if not quick else 0.5)
            broken = [t for t in timed.values() if isinstance(t, Exception) and _context_lost(t)]
            if broken:  # a sticky CUDA error: nothing after it in this process can be trusted
                raise RuntimeError(f"calibration stopped: {type(broken[0]).__name__}: {broken[0]}") from broken[0]
            for c, timing in timed.items():
                if isinstance(timing, Exception):
                    continue
                key = calibration.curve_key(layout, *pair, c.padded, training)
                point = [round(_timed_work(problem, inputs[4]), 3), round(timing.median_ms * 1e3, 2)]
                gpu.setdefault(c.backend, {}).setdefault(key, []).append(point)
            kinds = {c: calibration.host_key(layout, c.padded, training) for c in candidates
                     if not isinstance(timed.get(c), Exception)}  # fmt: skip
            unmeasured = {  # at the smallest size that serves it, side by side
                c: attention_step(attention, c, problem, inputs, device)
                for c, kind in kinds.items()
                if kind not in host.get(c.backend, {})
            }
            measured = _host_us(unmeasured, device)
            for c, issued in measured.items():
                host.setdefault(c.backend, {})[kinds[c]] = round(issued, 2)
            if layout == "thd":  # and on a new packing each call, at the size its seen packing's time was taken
                steps = _new_packing_steps(attention, measured, problem, inputs, device)
                for c, issued in _new_packing_us(steps, device).items():
                    new_packing.setdefault(c.backend, {})[kinds[c]] = round(issued, 2)
            del steps, inputs
        if checkpoint:
            checkpoint(_result(target, quick, host, new_packing, gpu, first))
    if progress:
        progress(len(jobs), total, "host times again")
    data = _result(target, quick, host, new_packing, gpu, first)
    # a kind timed once can be off by twice: an H100's calibration run in two parts timed the same kinds 0.61 to 2.37
    # times apart, either part the slower by kind (native kinds at their first pairs, 192/128 and 64/64:
    # results/h100_calibration_part_a.md, results/h100_calibration_part_b.md)
    try:
        again = host_times(data, target, attention=attention, native=pairs[0], padded=_padded_pair(pairs))
    except Exception as exc:  # the ladder's times stand (a lost context has raised in the ladder already)
        log.warning("attnselect calibrate: the host times could not be taken again (%s: %s); the ladder's stand",
                    type(exc).__name__, exc)  # fmt: skip
        again = data
    data = dict(data, host_us=least_times(host, again["host_us"]),
                new_packing_us=least_times(new_packing, again["new_packing_us"]),
                replayed_host_us=again.get("replayed_host_us", {}))  # fmt: skip
    if checkpoint:
        checkpoint(data)
    if progress:
        progress(total, total, "done")
    return data


def _padded_pair(pairs) -> tuple[int, int] | None:
    """The first pair of ``pairs`` whose dims differ (where the ladder times padded candidates first), or None."""
    return next((pair for pair in pairs if pair[0] != pair[1]), None)


def least_times(*tables: dict) -> dict:
    """``{backend: {kind: us}}`` tables of host times joined, each kind's least kept: a busy host only adds time (the
    rule :func:`_host_us` applies to its rounds, timeit's)."""
    joined: dict = {}
    for table in tables:
        for backend, times in table.items():
            into = joined.setdefault(backend, {})
            for kind, us in times.items():
                into[kind] = min(us, into.get(kind, us))
    return joined


def _timed_work(problem: AttentionProblem, packings) -> float:
    """The work a curve's point is keyed by: the call's; packed, the mean over the packings timed of each one's, read
    as a prediction reads a call of it (its sequences, longest lengths and tokens)."""
    if packings is None:
        return work(problem)
    return statistics.fmean(
        work(dataclasses.replace(problem, batch=batch, seqlen_q=max_q, seqlen_kv=max_kv, tokens=tokens))
        for batch, max_q, max_kv, tokens in packings.sizes()
    )


def _new_packing_steps(attention, candidates, problem: AttentionProblem, inputs: tuple, device) -> dict:
    """{candidate: :func:`attention_step` on a new packing each call}: each candidate its own seeded packings of
    the problem's size (as many as its host rounds draw), so that none comes back to one it has seen."""
    q, k, v, grad_out, _ = inputs
    steps = {}
    for index, c in enumerate(candidates):
        own = (q, k, v, grad_out, NewPackings(problem, device, seed=1 + index))
        steps[c] = attention_step(attention, c, problem, own, device, new_packing=True)
    return steps


def _new_packing_us(steps: dict, device) -> dict:
    """:func:`_host_us` of steps on a new packing each call, the self-check off: a packing of a new size class may
    run a reference check (attnselect.self_check), a one-off of a signature, not a cost of the packing."""
    with _self_check_off():
        return _host_us(steps, device)


def _result(target: Target, quick: bool, host: dict, new_packing: dict, gpu: dict, first: dict) -> dict:
    return {
        "format": calibration.FORMAT,
        "fingerprint": calibration.fingerprint(target),
        "device": target.describe(),
        "date": time.strftime("%Y-%m-%d"),
        "source": "attnselect calibrate" + (" --quick" if quick else ""),
        "host": {"cpu": calibration.host_of()},
        "host_us": host,
        "new_packing_us": new_packing,
        "replayed_host_us": {},  # host_times
        "gpu": {b: {k: _increasing(points) for k, points in curves.items()} for b, curves in gpu.items()},
        **first,
        "skipped": list(SKIPPED),
    }


@flash_attn4_replay.paused()  # FA4 timed through its interface, as on a new shape
def first_call_costs(
    target: Target | None = None, *, attention, pairs=PAIRS, phases=(False, True), progress=None
) -> dict:
    """``{"first_call_ms": {backend: {host key: ms}}, "new_size_ms": {backend: {host key: ms}}}``: what the first
    call of a new configuration costs beyond a later call of it, and what a new size of a configuration already run
    costs (the least of two new sizes), each the median over ``pairs`` (native, and padded where the dims differ),
    by layout, padding and phase (:func:`attnselect.choose.calibration.host_key`), through ``attention`` with the
    candidate forced.

    A process's first calls of a backend also pay one-off start-up that no later configuration pays: CUDA's lazy
    module loading, cuDNN's handle and engines, FA4's compiler (on the H200, 0.04-9.4 s a forward and 1.9-7.6 s a
    forward and backward, against 0.01-5.0 s for a new configuration: results/h200_first_calls_probe_40a2f27_fa4.md).
    Each backend's start-up is paid first, at :data:`START_UP`'s dims in each layout and phase, and left out. Run in a
    process where the ``pairs`` have not run yet (:func:`run` measures these first); FA4's disk cache of compiled
    kernels, where it holds a configuration, makes that configuration's first call cheaper. The self-check is off
    meanwhile (whichever candidate runs a signature first pays it). Raises ValueError where ``pairs`` holds no pair
    but the start-up's."""
    pairs = [p for p in pairs if p != START_UP]
    if not pairs:
        raise ValueError(f"first_call_costs: got no pair but the start-up's {START_UP}, expected another")
    with _self_check_off():  # paid by whichever candidate runs a signature first: not a reason to rent
        return _first_call_costs(target or Target.current(), attention, pairs, phases, progress)


@contextlib.contextmanager
def _self_check_off():
    """ATTNSELECT_SELF_CHECK=0 for the block (attnselect.self_check: the first call of a signature the correctness
    grid has not checked runs references on slices of it), restored after."""
    before = os.environ.get("ATTNSELECT_SELF_CHECK")
    os.environ["ATTNSELECT_SELF_CHECK"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["ATTNSELECT_SELF_CHECK"]
        else:
            os.environ["ATTNSELECT_SELF_CHECK"] = before


def _first_call_costs(target: Target, attention, pairs, phases, progress) -> dict:
    device = torch.device("cuda" if target.is_cuda else "cpu")
    dtype = torch.bfloat16 if target.is_cuda else torch.float32
    jobs = [(layout, training) for training in phases for layout in FIRST_CALL_SIZES]
    configuration: dict = {}
    new_size: dict = {}
    for index, (layout, training) in enumerate(jobs):
        if progress:
            progress(index, len(jobs), f"first calls {layout} {'training' if training else 'inference'}")
        for pair in (START_UP, *pairs):
            measured = []
            for b, s in FIRST_CALL_SIZES[layout]:
                problem = AttentionProblem(b, s, s, HEADS, HEADS, *pair, dtype=dtype, layout=layout, mask="causal",
                                           training=training)  # fmt: skip
                candidates = _calibrated(problem, target)
                try:
                    inputs = random_inputs(problem, device)
                except torch.OutOfMemoryError:
                    break
                measured.append({c: _first_call_extra(attention_step(attention, c, problem, inputs, device), device)
                                 for c in candidates})  # fmt: skip
                del inputs
            if pair == START_UP:
                continue  # the process's start-up, and the start-up pair's configuration with it
            for c, extra in (measured[0] if measured else {}).items():
                key = calibration.host_key(layout, c.padded, training)
                if extra is not None:
                    configuration.setdefault(c.backend, {}).setdefault(key, []).append(extra)
                sized = [m[c] for m in measured[1:] if m.get(c) is not None]
                if sized:
                    new_size.setdefault(c.backend, {}).setdefault(key, []).append(min(sized))
    if progress:
        progress(len(jobs), len(jobs), "first calls done")

    def medians(found: dict) -> dict:
        return {b: {k: round(statistics.median(v), 3) for k, v in sorted(keys.items())} for b, keys in found.items()}

    return {"first_call_ms": medians(configuration), "new_size_ms": medians(new_size)}


def _calibrated(problem: AttentionProblem, target: Target) -> list:
    """The candidates a calibration times for ``problem``: those supported, but :data:`SKIPPED`'s and, packed, those
    that run sequence by sequence (they read the boundaries on the host: never the fast path)."""
    candidates = [v.candidate for v in judge(problem, target) if v.supported and v.candidate.backend not in SKIPPED]
    if problem.layout == "thd":
        candidates = [c for c in candidates if backend_named(c.backend).packs_thd(target)]
    return candidates


def _increasing(points: list) -> list:
    """The curve's points by work, one per work size (the faster kept)."""
    best: dict = {}
    for w, us in points:
        best[w] = min(us, best.get(w, us))
    return [[w, best[w]] for w in sorted(best)]


def _context_lost(exc: BaseException) -> bool:
    """An error after which the CUDA context is unusable (an illegal memory access, a launch failure)."""
    return "illegal memory access" in str(exc) or "unspecified launch failure" in str(exc)


def _first_call_extra(step, device) -> float | None:
    """Milliseconds the first call of a configuration took beyond the second (a compile, a plan); None where the
    call failed (time_steps reports it)."""
    try:
        (first, _), (second, _) = _sized_call(step, device), _sized_call(step, device)
    except Exception:
        return None
    return max(first - second, 0.0)


def attention_step(attention, candidate, problem: AttentionProblem, inputs: tuple, device: torch.device,
                   *, new_packing: bool = False):  # fmt: skip
    """``step()``: the call as a model makes it again and again, ``attention`` (:func:`attnselect.attention`) with
    the candidate forced (``backend=``, ``pad=``), with its backward in training; packed, on one packing (the layers
    of a step share it), or with ``new_packing`` on the next packing each call, drawn by ``step.prepare()`` (a data
    loader's work, before the clock starts: :func:`_host_us`). Its host time is what the rules predict with:
    attention()'s memoized path and the runner it prepared (the SDPA kernels' aten ops called directly), not a
    backend's unprepared run. The calibration's problems are causal, without the options a call may add."""
    q, k, v, grad_out, packings = inputs
    kwargs = dict(layout=problem.layout, causal=True, backend=candidate.backend, pad=candidate.padded)

    def prepare():
        p = packings()
        kwargs.update(cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_kv=p.cu_seqlens_kv, max_seqlen_q=p.max_seqlen_q,
                      max_seqlen_kv=p.max_seqlen_kv)  # fmt: skip

    if packings is not None:
        prepare()

    def step():
        out = attention(q, k, v, **kwargs)
        if problem.training:
            torch.autograd.grad(out, (q, k, v), grad_out)
        return out

    if packings is not None and new_packing:
        step.prepare = prepare
    return step


@flash_attn4_replay.paused()  # FA4 timed through its interface, as on a new shape
def host_times(
    data: dict, target: Target | None = None, *, attention, progress=None, native=(128, 128), padded=(192, 128)
) -> dict:
    """``data`` (a calibration of this machine) with the host times of its installed backends measured again
    through ``attention`` (:func:`attention_step`), at the smallest ladder size, the pair ``native`` native and
    ``padded`` padded (None: padded candidates not measured again),
    packed ones on one packing (``host_us``) and on a new packing each call (``new_packing_us``), and in inference
    those whose runner replays (``Backend.calls_before_replay``) replayed too, in the same rounds
    (``replayed_host_us``); the others' are kept (their packages absent here: a package measured again needs the
    version calibrated, which the fingerprint's packages keep). Raises ValueError where ``data`` ran on another GPU
    or library versions."""
    target = target or Target.current()
    if calibration.machine(data["fingerprint"]) != calibration.machine(calibration.fingerprint(target)):
        raise ValueError(f"the calibration ran on {data['device']}, not here ({target.describe()})")
    device = torch.device("cuda" if target.is_cuda else "cpu")
    dtype = torch.bfloat16 if target.is_cuda else torch.float32
    host = {backend: dict(times) for backend, times in data["host_us"].items()}
    new_packing = {backend: dict(times) for backend, times in data.get("new_packing_us", {}).items()}
    replayed = {backend: dict(times) for backend, times in data.get("replayed_host_us", {}).items()}
    again: set[tuple[str, str]] = set()  # the (backend, host key) measured again here
    jobs = [(layout, is_padded, training) for layout in ("bshd", "thd") for is_padded in (False, True)
            for training in (False, True) if not (is_padded and padded is None)
            and any(calibration.host_key(layout, is_padded, training) in times for times in host.values())]  # fmt: skip
    for index, (layout, is_padded, training) in enumerate(jobs):
        if progress:
            progress(index, len(jobs), f"host {layout} {'padded ' if is_padded else ''}{training}")
        batch, seqlen = LADDER[0] if layout == "bshd" else PACKED_LADDER[0]
        problem = AttentionProblem(batch, seqlen, seqlen, HEADS, HEADS, *(padded if is_padded else native),
                                   dtype=dtype, layout=layout, mask="causal", training=training)  # fmt: skip
        inputs = random_inputs(problem, device)
        key = calibration.host_key(layout, is_padded, training)
        steps = {}
        for verdict in judge(problem, target):
            c = verdict.candidate
            if not verdict.supported or c.padded != is_padded or key not in host.get(c.backend, {}):
                continue
            if layout == "thd" and not backend_named(c.backend).packs_thd(target):
                continue
            steps[c] = attention_step(attention, c, problem, inputs, device)
        replays = {}  # the same calls replayed: their runner's, as attention() memoized it for the steps above
        for c in steps if not training else ():
            if backend_named(c.backend).calls_before_replay:
                replays[c] = attention_step(attention, c, problem, inputs, device)
                replays[c].context = flash_attn4_replay.replaying
        timed = _host_us({**steps, **{(c, "replayed"): step for c, step in replays.items()}}, device)
        for c in replays:  # a pair measured together, or none (not an earlier run's replay beside this interface)
            replayed.get(c.backend, {}).pop(key, None)
        for c, issued in timed.items():
            if isinstance(c, tuple):
                replayed.setdefault(c[0].backend, {})[key] = round(issued, 2)
                continue
            host[c.backend][key] = round(issued, 2)
            again.add((c.backend, key))
        if layout == "thd":
            for c, issued in _new_packing_us(
                _new_packing_steps(attention, steps, problem, inputs, device), device
            ).items():
                new_packing.setdefault(c.backend, {})[key] = round(issued, 2)
    if progress:
        progress(len(jobs), len(jobs), "done")
    return dict(data, host=_measured_on(data.get("host", {}), host, again), host_us=host, new_packing_us=new_packing,
                replayed_host_us=replayed)  # fmt: skip


def _measured_on(before: dict, host: dict, again: set) -> dict:
    """A calibration's ``host`` once :func:`host_times` has measured the ``again`` pairs of ``host`` (its host times)
    here: this CPU where it measured every one or the earlier ones were this CPU's too, else both (the times it kept
    were another host's, or one not recorded)."""
    here, earlier = calibration.host_of(), before.get("cpu")
    if earlier == here or all((backend, key) in again for backend, times in host.items() for key in times):
        return {"cpu": here}
    return {"cpu": f"{here}; times not measured again: {earlier or 'a host not recorded'}"}


def _host_us(steps: dict, device) -> dict:
    """{key: microseconds the host takes to issue one call of ``steps[key]`` while the GPU is busy}, the steps side
    by side: :data:`HOST_ROUNDS` rounds in alternating order, each of :data:`HOST_CALLS` calls of every step, after
    warm-up calls (a first call decides, prepares and compiles); a step's time is its least round median (a busy
    host only adds time, and a phase of it falls on every step of a round alike: timeit's rule, the least of
    repeats). A step that fails is left out. A step's ``context``, where it has one, is entered around its warm-up
    and each of its rounds, outside the clock (FA4's replay, lifted for its replayed step)."""
    issued: dict = {}
    for key, step in steps.items():
        try:
            with getattr(step, "context", contextlib.nullcontext)():
                for _ in range(3):
                    step()
            issued[key] = []
        except Exception:
            continue
    order = list(issued)
    for index in range(HOST_ROUNDS):
        for key in order if index % 2 == 0 else order[::-1]:
            if key not in issued:
                continue
            times = []
            prepare = getattr(steps[key], "prepare", _nothing)  # a new packing's boundaries, before the clock starts
            try:
                with getattr(steps[key], "context", contextlib.nullcontext)():
                    for _ in range(HOST_CALLS):
                        prepare()
                        if device.type == "cuda":
                            torch.cuda._sleep(2_000_000)  # about a millisecond: the call's issue does not wait
                        started = time.perf_counter()
                        steps[key]()
                        times.append(time.perf_counter() - started)
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
            except Exception:
                del issued[key]
                continue
            issued[key].append(statistics.median(times))
    return {key: min(rounds) * 1e6 for key, rounds in issued.items()}


def _nothing() -> None:
    pass


def print_progress(done: int, total: int, what: str) -> None:
    bar = "#" * (20 * done // max(total, 1))
    sys.stderr.write(f"\r[{bar:<20}] {done}/{total} {what:<40}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
