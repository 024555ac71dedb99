"""The public entry points: `attention`, `explain` and `warmup` (`select` lives in
:mod:`attnselect.choose.selection`).

Warm-up makes a model's attention calls once, ahead of its first step, so what their first calls cost is paid then:
a configuration's first call in a process decides (the rules, or the measure policy's timings), self-checks its
signature where the committed grid does not cover it (:mod:`attnselect.self_check`) and compiles what its kernel
compiles on first use: FlashAttention-4's CuTe DSL kernels (3.8-6.8 s each on the H200,
results/h200_fa4_compile.md), flex's Triton kernels, cuDNN graphs. FA4 keeps its compiled kernels under attnselect's
cache directory (``ATTNSELECT_CACHE_DIR``): ranks of a job that share that directory, and later processes, load them
instead of compiling again, as they share the measure policy's decisions.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import NamedTuple

import torch
import torch.utils.checkpoint

from attnselect import backends, self_check
from attnselect.choose import first_calls, settings
from attnselect.choose.distributed import is_distributed
from attnselect.choose.failures import broke_capture_before, mark_failed
from attnselect.choose.selection import select, select_packed, standing_decisions
from attnselect.choose.settings import MEMO_SIZE, strict
from attnselect.choose.timing import random_inputs
from attnselect.context_parallel.call import attention as context_parallel_attention
from attnselect.context_parallel.call import group_size
from attnselect.dispatch import KnownCall, forget_dense, recall
from attnselect.errors import AttnSelectError, InvalidInputError
from attnselect.execution import TIMING_SOFTCAP, apply_sinks, dense_runner, kernel_call, packed_runner, run_call
from attnselect.memos import clear_cache
from attnselect.spec.options import CallOptions, Candidate, Packing
from attnselect.spec.problem import AttentionProblem, describe_call
from attnselect.spec.target import Target, target_for_device

Causal = bool | str

log = logging.getLogger("attnselect")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    layout: str = "bshd",
    causal: Causal = False,
    window: tuple[int, int] | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_kv: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_kv: int | None = None,
    cu_seqlens_q_padded: torch.Tensor | None = None,
    cu_seqlens_kv_padded: torch.Tensor | None = None,
    return_lse: bool = False,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    return_max_logit: bool = False,
    cp_group=None,
    backend: str | None = None,
    pad: bool | str | None = None,
    disable=None,
):
    """Scaled dot-product attention on the fastest candidate that serves the call.

    Shapes (layout): ``bshd`` q (B, Sq, Hq, Dqk), k (B, Skv, Hkv, Dqk), v (B, Skv, Hkv, Dv);
    ``sbhd`` and ``bhsd`` permute those axes; ``thd`` q (Tq, Hq, Dqk), k (Tkv, Hkv, Dqk),
    v (Tkv, Hkv, Dv) with int32 ``cu_seqlens_q``/``cu_seqlens_kv`` (B + 1 boundaries from 0
    to T; cu_seqlens_kv defaults to cu_seqlens_q). Hq must be a multiple of Hkv (GQA/MQA).

    Args:
        causal: False, True or "top_left" (query i sees keys j <= i, as SDPA's is_causal), or
            "bottom_right" (j <= i + Skv - Sq, as FlashAttention-2).
        window: (left, right) sliding window, -1 = unbounded, anchored where the causal diagonal is:
            bottom-right without causal and with "bottom_right" (FlashAttention's window_size), top-left with
            top-left causal (TransformerEngine's padding_causal); with ``causal`` its right edge is 0.
        scale: softmax scale; default 1/sqrt(Dqk) of the unpadded q.
        dropout_p: attention dropout probability; only candidates with dropout serve it.
        max_seqlen_q, max_seqlen_kv: longest sequences for thd; read from cu_seqlens if omitted (a host
            sync on CUDA; pass both to avoid it, the values are then trusted).
        cu_seqlens_q_padded, cu_seqlens_kv_padded: thd only, where each sequence starts when the packing
            leaves gaps between sequences (Megatron's cu_seqlens_*_padded); gap tokens get a zero output.
        return_lse: also return the natural log-sum-exp of the scaled scores, float32,
            (B, Hq, Sq) dense or (Hq, Tq) thd, detached. -inf on rows with no visible key. With sinks it
            includes them: logaddexp(lse, sink).
        softcap: cap the scaled logits at ``softcap * tanh(logits / softcap)`` before the mask (Gemma 2), a
            number > 0.
        sinks: learnable sink logits, a (Hq,) tensor (gpt-oss): each head's sink joins every row's softmax
            denominator and is dropped, ``softmax([logits, sink])[:-1]``; not scaled; it gets a gradient.
        return_max_logit: also return each query head's largest logit (after scale and softcap, sinks
            left out, as TransformerEngine's return_max_logit), float32 (Hq,), detached: the maximum over
            the batch, every query and its visible keys (thd: over every sequence); -inf for a head with
            no visible key. A rank of a context-parallel or data-parallel group holds its local maximum: an
            all-reduce with MAX gives the global one (what Megatron's QK-clip does).
        cp_group: a torch.distributed process group of N ranks that split the sequence (context parallelism):
            q, k, v are this rank's shard in the load-balanced layout (the sequence, or each packed sequence, cut
            into 2N equal chunks; rank r holds chunks r and 2N-1-r, in that order; :func:`attnselect.context_parallel
            .shard` makes it), thd cu_seqlens are the local ones (each global length / N, a multiple of 2N
            globally), and the result is this rank's shard. No mask or top-left causal; no dropout. Every rank
            must make the call. A group of one rank is no context parallelism.
        backend, pad, disable: force a backend, force ("always"/True) or forbid ("never"/False)
            padding, exclude backends; default to ATTNSELECT_BACKEND / _PAD / _DISABLE.

    Returns:
        ``out`` in the layout of q with head dim Dv; with return_lse and/or return_max_logit a tuple in
        this order: ``(out, lse)``, ``(out, max_logit)`` or ``(out, lse, max_logit)``.

    Packed (thd) input runs on a packed kernel where one serves the call, else sequence by
    sequence (which reads the boundaries on the host). When an automatically chosen kernel
    raises, attnselect logs one warning, marks the candidate failed for this problem and runs
    the next one; a forced backend, or ATTNSELECT_STRICT=1, re-raises instead.
    """
    options = (
        layout, causal, window, scale, dropout_p, cu_seqlens_q, cu_seqlens_kv, max_seqlen_q, max_seqlen_kv,
        cu_seqlens_q_padded, cu_seqlens_kv_padded, return_lse, softcap, sinks, return_max_logit, cp_group, backend, pad,
        disable,
    )  # a CallOptions' fields; the object itself is built off the hot path  # fmt: skip
    if torch.compiler.is_compiling():  # one custom op, decided from the traced shapes (attnselect.ops)
        from attnselect.ops import traced_attention

        return traced_attention(q, k, v, CallOptions(*options))
    if cp_group is not None:  # the sequence is split over a process group (attnselect.context_parallel)
        options = CallOptions._make(options)
        if group_size(cp_group) == 1:
            return attention(q, k, v, **options._replace(cp_group=None)._asdict())
        out, lse, *max_logit = context_parallel_attention(q, k, v, options)
        return out if not (return_lse or return_max_logit) else _with_statistics(out, lse, max_logit, return_lse)
    known = recall(q, k, v, options)
    packing, checking, collective, compiled = None, False, False, False
    if type(known) is not KnownCall:  # else the same shapes, dtypes, devices and options were validated and decided
        unknown = known
        sibling = unknown.sibling if unknown is not None else None
        # a packed call known but for its packing's sizes (attnselect.dispatch): its problem at these sizes
        problem = unknown.sized_problem(sibling) if sibling is not None else None
        if problem is not None:
            target = sibling.target  # the same device
        else:
            problem, packing = describe_call(q, k, v, CallOptions._make(options))
            sibling, target = None, target_for_device(q.device)
        if sibling is not None:  # its packing, as its sibling's was validated
            packing = Packing(cu_seqlens_q, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_q)
        decision = (
            select(problem, target=target, backend=backend, pad=pad, disable=disable)
            if packing is None
            else select_packed(problem, target=target, backend=backend, pad=pad, disable=disable)
        )
        call = sibling.call if sibling is not None else kernel_call(problem, scale, softcap)  # not the sizes'
        chosen = backends.get(decision.chosen.backend)
        # the sibling's choice again: its packed runner reads each packing's boundaries and sizes
        again = sibling is not None and sibling.chosen == decision.chosen and sibling.runner is not None
        if layout != "thd":
            runner = dense_runner(
                chosen, decision.chosen.pad_to, layout, call, like=(q, k, v) if unknown is not None else None
            )
        elif not (again or chosen.packs_thd(target)):
            runner = None
        elif again:  # the sibling's runner, without its rental's counting (a rental is counted per decision)
            runner = getattr(sibling.runner, "unrented", sibling.runner)
        elif unknown is not None:  # later calls are like this one: the runner takes their boundaries and sizes
            runner = packed_runner(chosen, decision.chosen.pad_to, call, like=(q, k, v, packing))
        else:  # this call alone, on its validated packing
            runner = _on_packing(packed_runner(chosen, decision.chosen.pad_to, call), packing)
        if decision.rental and decision.rental.calls and runner is not None:  # a compile to pay later, first_calls
            runner = _renting(runner, decision.rental, problem)
        # what compiles is tracked (a configuration is the call at any size: its sibling's ran), whatever ranked
        # it: a call the rules table ranks (a decode step's few queries) compiles what a calibrated one may rent
        # around
        compiled = not again
        # reads ATTNSELECT_SELF_CHECK (in the memo's key): before memoizing. A packed family's problem at any sizes
        # has one signature per size class: where its choice needed no check at that class, it needs none (a check
        # passed since only makes the answer no)
        unchecked = unknown.family.unchecked if unknown is not None and unknown.family is not None else ()
        answered = bool(unchecked) and (decision.chosen, problem.size_class) in unchecked
        checking = not answered and self_check.needed(problem, decision.chosen, target)
        collective = checking and decision.overrides.policy == "measure" and is_distributed()
        known = KnownCall(problem, decision.chosen, target, call, decision.overrides.backend is not None, runner)
        if unknown is not None:
            family = unknown.remember(known)
            if family is not None and not (answered or checking) and self_check.has_work(problem):
                family.unchecked.add((decision.chosen, problem.size_class))
            _keep_class(family, problem, decision, known, target=target, backend=backend, pad=pad, disable=disable)
    try:
        if known.runner is None:  # thd sequence by sequence
            if packing is None:  # a known packed call, whose problem follows from its key (attnselect.dispatch)
                packing = Packing(cu_seqlens_q, cu_seqlens_q, max_seqlen_q, max_seqlen_kv, cu_seqlens_q, cu_seqlens_q)
            result = run_call(known.chosen, known.problem, known.call, q, k, v, packing=packing, target=known.target)
        else:  # a prepared runner: (out, lse) or (out, lse, max_logit)
            result = (
                known.runner(q, k, v)
                if layout != "thd"
                else known.runner(q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_kv)
            )
        if checking:  # the first call of its signature in this process (attnselect.self_check)
            self_check.check(known.problem, known.chosen, known.target, known.call, result, q, k, v, packing,
                             lambda q, k, v: run_call(known.chosen, known.problem, known.call, q, k, v,
                                                      packing=packing, target=known.target))  # fmt: skip
        if sinks is not None:
            result = (*apply_sinks(result[0], result[1], sinks, layout), *result[2:])
    except Exception as exc:  # a kernel that fails at run time or gives a wrong result: fall back unless told not to
        if not _kernel_failure(exc):
            raise
        wrong = isinstance(exc, self_check.WrongResultError)
        if broke_capture_before(exc):  # no candidate can run in this capture now: raise, recording nothing
            note = (f"attnselect: {known.chosen} did not fail on {known.problem.describe()}: an earlier error "
                    "invalidated this CUDA graph capture (where a kernel attnselect chose raised it, a warning above "
                    "names it, and this process skips it now); capture again")  # fmt: skip
            log.warning(note)
            if hasattr(exc, "add_note"):  # Python 3.11 and later
                exc.add_note(note)
            raise
        # A rank alone cannot choose again where choosing is collective (measure under torch.distributed).
        falls_back = not (known.forced or strict() or (wrong and collective))
        if wrong or falls_back:  # a wrong result is known for its signature (explain shows it) whoever chose it
            mark_failed(known.problem, known.target, known.chosen, exc, falls_back=falls_back)
        if not falls_back:
            raise
        return attention(q, k, v, **CallOptions._make(options)._asdict())
    if compiled:  # its configuration has run in this process: no compile left to pay for it (choose.first_calls)
        first_calls.ran(known.chosen, known.problem)
    if not (return_lse or return_max_logit):
        return result[0]
    return _with_statistics(result[0], result[1], result[2:], return_lse)


# Exceptions that are not failures: activation checkpointing stops its recomputation with one (torch.utils.checkpoint).
_CONTROL_FLOW = tuple(
    t for t in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),) if isinstance(t, type)
)


def _kernel_failure(exc: Exception) -> bool:
    """Whether ``exc``, raised by a call, is its kernel's failure (a run-time error or a wrong result), which a call
    not forced falls back from, not attnselect's own error about the call or activation checkpointing's control flow."""
    wrong = isinstance(exc, self_check.WrongResultError)
    return not ((isinstance(exc, AttnSelectError) and not wrong) or isinstance(exc, _CONTROL_FLOW))


def _keep_class(
    family, problem: AttentionProblem, decision, known: KnownCall, *, target, backend, pad, disable
) -> None:
    """Keep ``known``, the call made of ``decision`` for ``problem``, as what a new packing of ``family`` (a
    :class:`attnselect.dispatch` family of packed calls) gets at ``problem``'s class while the selection's decision
    there (under this target and these controls) stands and is this one, where it runs a prepared runner and its
    choice needs no self-check at that size class (attention() answered it for the class). The family asks the
    selection's family of its calls as select_packed keeps it now (a new one where the memo dropped the last)."""
    if family is None or known.runner is None or (decision.chosen, problem.size_class) not in family.unchecked:
        return  # a dense call's (no family), or one its class's packings cannot share
    family.standing = standing_decisions(problem, target=target, backend=backend, pad=pad, disable=disable)
    holds = family.standing(problem) if family.standing is not None else None
    if holds is not None and holds[1] is decision:
        if len(family.classes) >= MEMO_SIZE and holds[0] not in family.classes:  # bounded as the selection's classes
            family.classes.clear()
        family.classes[holds[0]] = decision, known


def _renting(run, rental: first_calls.Rental, problem: AttentionProblem):
    """``run``, counting its calls (:func:`attnselect.choose.first_calls.rent`): at the rental's count the deferred
    candidate's compile is paid for in lost time, and the decisions are forgotten, so the next call chooses it: every
    decision for a configuration's compile (it holds at every size), the calls of this shape alone for a shape's
    build (a server's many recurring lengths each end a rental: select() draws a paid one again itself). So too
    where a candidate the rental was drawn over has been paid for another way (:func:`first_calls.settled`: a
    comparison of counts while nothing has been paid since it last stood)."""

    key, paid = first_calls.rent_key(rental, problem), [False]

    def renting(*args):
        if not paid[0]:
            if first_calls.settled(rental, problem):  # paid for another way since
                end("a candidate it was drawn over has been paid for since")
            elif first_calls.rent(rental, key):
                end("the rent reached the price")
        return run(*args)

    def end(why: str) -> None:
        paid[0] = True
        log.info("attnselect: %s; %s: choosing again for %s", rental.describe(), why, problem.describe())
        if rental.shape:
            forget_dense(problem)
        else:
            clear_cache()

    renting.unrented = run
    return renting


def _on_packing(run, packing: Packing):
    """A packed runner, ``run(q, k, v, packing)``, as attention() calls a known call's: ``(q, k, v, cu_seqlens_q,
    max_seqlen_q, max_seqlen_kv)``, here on the one packing it was validated with."""
    return lambda q, k, v, cu_seqlens_q, max_seqlen_q, max_seqlen_kv: run(q, k, v, packing)


def _with_statistics(out, lse, max_logit, return_lse: bool) -> tuple:
    """attention()'s result with its statistics: (out, lse), (out, max_logit) or (out, lse, max_logit)."""
    return (out, *((lse.detach().float(),) if return_lse else ()), *max_logit)


def explain(
    problem: AttentionProblem,
    *,
    target: Target | None = None,
    backend: str | None = None,
    pad=None,
    disable=None,
    show_all: bool = False,
) -> str:
    """A readable report: the problem, the target, every candidate's verdict and rank, the choice.

    Raises what :func:`select` raises, e.g. :class:`ForcedChoiceError` when a forced backend cannot serve (its
    message lists the reasons) and :class:`NoSupportedCandidateError` when nothing can.
    """
    if not isinstance(show_all, bool):
        raise InvalidInputError(f"show_all: got {show_all!r}, expected True or False")
    return select(problem, target=target, backend=backend, pad=pad, disable=disable).report(show_all=show_all)


class WarmedUp(NamedTuple):
    problem: AttentionProblem
    chosen: str  # the candidate the call ran on (after any fallback), or "" where it raised
    seconds: float  # the first call's wall time, forward and backward, synchronised
    error: str | None  # what the call raised, if it did


def warmup(
    problems: Iterable[AttentionProblem],
    *,
    device: str | torch.device | None = None,
    backend: str | None = None,
    pad=None,
    disable=None,
    progress=None,
) -> list[WarmedUp]:
    """Make each problem's first call now on ``device`` (default: CUDA where available, else the CPU), as
    :func:`attnselect.attention` with these ``backend``, ``pad`` and ``disable`` would make it in the job; return
    what each ran on and how long its first call took. Where the fastest candidate compiles on its first call in a
    process and would run only after a cheaper one had lost that much time (:mod:`attnselect.choose.first_calls`),
    its first call is made here too, so the job's calls run on it from the start. A packed problem (``thd``: at most
    ``batch`` sequences of at most ``seqlen_q`` tokens, in ``tokens`` where it holds them) is called on packings
    whose longest sequence spans that range, and each candidate they choose makes its first call (a packed job's
    choice follows each packing's work); ``chosen`` names the first packing's. A problem with
    ``cuda_graph_capture=True`` is warmed as its job warms a graph, eagerly, and the candidate its capture ranks first
    (which leaves out host time) makes its first call here too, forced, so that the capture runs it (a captured call
    keeps what has run eagerly); ``chosen`` names the capture's choice. A call that raises is reported,
    not raised: the job's own call would raise or fall back the same way. ``progress(done, total, text)`` is
    called after each problem."""
    if isinstance(problems, AttentionProblem) or not isinstance(problems, Iterable):
        hint = " (warmup([problem]))" if isinstance(problems, AttentionProblem) else ""
        raise InvalidInputError(
            f"problems: got {type(problems).__name__}, expected an iterable of AttentionProblem{hint}"
        )
    if progress is not None and not callable(progress):
        raise InvalidInputError(f"progress: got {progress!r}, expected None or a callable progress(done, total, text)")
    problems = list(problems)
    for i, problem in enumerate(problems):
        if not isinstance(problem, AttentionProblem):
            raise InvalidInputError(f"problems[{i}]: got {type(problem).__name__}, expected an AttentionProblem")
        for name, expected in (("context_parallel_size", 1), ("compiled_graph", False), ("fp8", False)):
            if getattr(problem, name) != expected:
                raise InvalidInputError(
                    f"problems[{i}].{name}: got {getattr(problem, name)!r}, expected {expected!r}: warm-up makes "
                    "plain eager calls (a compiled call's eager warm-up is the one made here)"
                )
        _check_warmable(problem, f"problems[{i}]")
    settings.resolve(backend=backend, pad=pad, disable=disable)  # a bad control is the caller's error, raised now
    device = _warm_device(device)
    done = []
    for i, problem in enumerate(problems, 1):
        done.append(_warm(problem, device, dict(backend=backend, pad=pad, disable=disable)))
        if progress is not None:
            w = done[-1]
            progress(i, len(problems), f"{problem.describe()}: {w.chosen or w.error} in {w.seconds:.2f} s")
    return done


def _check_warmable(problem: AttentionProblem, name: str) -> None:
    """Refuse, naming the field, a problem whose call warm-up cannot make: one of no queries or keys (no first call
    to make), or a packing warm-up does not draw (:class:`attnselect.choose.timing.NewPackings` packs sequences
    back to back, in at most batch x seqlen_q tokens)."""
    for field in ("batch", "seqlen_q", "seqlen_kv"):
        if getattr(problem, field) < 1:
            raise InvalidInputError(f"{name}.{field}: got {getattr(problem, field)}, expected at least 1: a call of "
                                    "no queries or keys has no first call to make")  # fmt: skip
    if problem.layout != "thd":
        return
    if problem.tokens > problem.batch * problem.seqlen_q:
        raise InvalidInputError(
            f"{name}.tokens: got {problem.tokens}, expected at most batch x seqlen_q = "
            f"{problem.batch * problem.seqlen_q} (q's rows of at most {problem.batch} sequences of at most "
            f"{problem.seqlen_q} tokens)"
        )
    if problem.varlen_gaps:
        raise InvalidInputError(f"{name}.varlen_gaps: got True, expected False: warm-up packs sequences back to back "
                                "(it passes no cu_seqlens_*_padded)")  # fmt: skip


def _warm_device(device) -> torch.device:
    """warmup()'s ``device``: CUDA where available, else the CPU, by default; a CPU or an available CUDA device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        found = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        found = None
    if found is None or found.type not in ("cpu", "cuda"):
        raise InvalidInputError(f"device: got {device!r}, expected 'cpu', 'cuda', 'cuda:N' or a torch.device of those")
    if found.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"device: got {device!r}, but CUDA is not available here (torch.cuda.is_available())")
    if found.type == "cuda" and found.index is not None and found.index >= torch.cuda.device_count():
        raise InvalidInputError(f"device: got {device!r}, expected a CUDA index below {torch.cuda.device_count()}")
    return found


def _warm(problem: AttentionProblem, device: torch.device, controls: dict) -> WarmedUp:
    target = target_for_device(device)  # the device warmed up, not the machine's default one
    captured, problem = problem, dataclasses.replace(problem, cuda_graph_capture=False)  # its calls are eager
    started = time.perf_counter()
    try:  # its inputs too: a problem too large for the device is reported, as its call would be
        q, k, v, grad_out, packings = random_inputs(problem, device)
    except Exception as exc:
        return WarmedUp(captured, "", time.perf_counter() - started, f"{type(exc).__name__}: {exc}"[:300])
    kwargs = call_arguments(problem, device)
    if packings is not None:
        p = packings()
        kwargs.update(cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_kv=p.cu_seqlens_kv, max_seqlen_q=p.max_seqlen_q,
                      max_seqlen_kv=p.max_seqlen_kv)  # fmt: skip
    _sync(device)
    started = time.perf_counter()
    with torch.enable_grad() if problem.training else torch.no_grad(), _deterministic(problem.deterministic):
        try:
            described = AttentionProblem.from_tensors(q, k, v, **kwargs)
            unlike = _unlike(described, problem)
            if unlike:  # not the job's call: warming it would pay another problem's first call
                return WarmedUp(captured, "", 0.0, f"warm-up could not make this problem's call: {unlike}")
            _warm_call(described, select(described, target=target, **controls), q, k, v, grad_out, kwargs, controls,
                       device)  # fmt: skip
            chosen = select(described, target=target, **controls).chosen
            warmed = {chosen}
            if captured.cuda_graph_capture:
                chosen = _warm_capture(described, target, q, k, v, grad_out, kwargs, controls, device)
            for p in packings.spanning() if packings is not None else ():
                # a packed job's choice follows each packing's work (attnselect.choose.predict.work): the first
                # calls of what packings of this size choose, from short sequences to the longest, are made here too
                kwargs.update(cu_seqlens_q=p.cu_seqlens_q, cu_seqlens_kv=p.cu_seqlens_kv,
                              max_seqlen_q=p.max_seqlen_q, max_seqlen_kv=p.max_seqlen_kv)  # fmt: skip
                other = AttentionProblem.from_tensors(q, k, v, **kwargs)
                decision = select(other, target=target, **controls)
                if decision.ranked[0] not in warmed:  # the fastest, paid below where it has a first call to pay
                    _warm_call(other, decision, q, k, v, grad_out, kwargs, controls, device)
                    warmed.add(decision.ranked[0])
                if captured.cuda_graph_capture:
                    _warm_capture(other, target, q, k, v, grad_out, kwargs, controls, device)
        except Exception as exc:  # reported: the job's call would meet the same
            return WarmedUp(captured, "", time.perf_counter() - started, f"{type(exc).__name__}: {exc}"[:300])
        seconds = time.perf_counter() - started
    return WarmedUp(captured, str(chosen), seconds, None)


def _warm_capture(
    described: AttentionProblem, target: Target, q, k, v, grad_out, kwargs: dict, controls: dict, device
) -> Candidate:
    """For a call a CUDA graph will capture (``described``, made eagerly): the candidate its capture's ranking puts
    first (by prediction, or by the rules table, which leave out the host time a replay does not spend), called
    eagerly now where it has not run the call, forced, so that the capture keeps it (a captured call runs first what
    has run the call eagerly: first_calls.ran_first) and its first call builds, compiles and is checked here, not
    inside the capture. Where that call fails, the failure is recorded and warned of, as the job's call would record
    it, and the capture falls back. Returns what the capture then chooses."""
    graph = dataclasses.replace(described, cuda_graph_capture=True)
    decision = select(graph, target=target, **controls)
    first = decision.first_ranked
    if first is None or decision.policy != "rules" or decision.overrides.backend or first_calls.has_run(first, graph):
        return decision.chosen
    try:
        _call(q, k, v, grad_out, kwargs, {**controls, "backend": first.backend, "pad": first.padded},
              described.training, device)  # fmt: skip
    except Exception as exc:  # a forced call does not fall back: the capture does, from what is recorded here
        if not _kernel_failure(exc):
            raise
        if not isinstance(exc, self_check.WrongResultError):  # a wrong result is recorded where it was found
            mark_failed(described, target, first, exc)
    return select(graph, target=target, **controls).chosen


@contextlib.contextmanager
def _deterministic(on: bool):
    """torch's deterministic algorithms switched to ``on`` (AttentionProblem.deterministic reads them), warn-only mode
    kept, restored after."""
    was, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    if was == on:
        yield
        return
    torch.use_deterministic_algorithms(on, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn_only)


def _unlike(described: AttentionProblem, problem: AttentionProblem) -> str:
    """Where the call warm-up made (``described``) is not of ``problem``: its fields that differ, a packed call's
    packing aside (warm-up calls packings within its sizes, as a data loader draws them: their sizes and what their
    boundaries' values show); empty where none does."""
    sizes = _PACKING_FIELDS if problem.layout == "thd" else ()
    return ", ".join(
        f"{f.name} {getattr(described, f.name)!r} where the problem has {getattr(problem, f.name)!r}"
        for f in dataclasses.fields(AttentionProblem)
        if f.name not in sizes and getattr(described, f.name) != getattr(problem, f.name)
    )


_PACKING_FIELDS = ("batch", "seqlen_q", "seqlen_kv", "tokens", "varlen_seqlens_match", "varlen_single_key",
                   "varlen_rows_without_keys")  # fmt: skip


def _warm_call(described: AttentionProblem, decision, q, k, v, grad_out, kwargs: dict, controls: dict, device) -> None:
    """A warm-up call of these tensors and arguments (``described``, decided as ``decision``). Where the fastest
    candidate has a first call to pay, warm-up makes it, not the rented one's (a rental may defer another one on the
    way); a failure falls back and is recorded as in the job."""
    if decision.rental is not None:
        first_calls.paid(decision.ranked[0], described)
        clear_cache()
    _call(q, k, v, grad_out, kwargs, controls, described.training, device)


def _call(q, k, v, grad_out, kwargs: dict, controls: dict, training: bool, device: torch.device) -> None:
    out = attention(q, k, v, **kwargs, **controls)
    out = out[0] if isinstance(out, tuple) else out
    if training:
        torch.autograd.grad(out, (q, k, v), grad_out)
    _sync(device)


def call_arguments(problem: AttentionProblem, device: torch.device) -> dict:
    """:func:`attnselect.attention`'s keyword arguments that make a call of ``problem`` (its layout, mask and
    options; the softcap of :data:`~attnselect.execution.TIMING_SOFTCAP` and zero sinks where it has them), the
    boundaries of a packed call aside."""
    causal, window = {
        "none": (False, None),
        "causal": (True, None),
        "causal_bottom_right": ("bottom_right", None),
        "sliding_window": (False, problem.window),
        "sliding_window_top_left": (True, problem.window),
    }[problem.mask]
    return dict(
        layout=problem.layout, causal=causal, window=window, dropout_p=problem.dropout_p,
        return_lse=problem.return_lse, softcap=TIMING_SOFTCAP if problem.softcap else None,
        sinks=torch.zeros(problem.heads_q, device=device, dtype=torch.float32) if problem.sinks else None,
        return_max_logit=problem.return_max_logit,
    )  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
