"""torch.compile support: under tracing, attention is one custom op with a decision made from static shapes.

While torch.compile traces :func:`attnselect.attention`, the call becomes

* a decision made at trace time (``torch.compiler.assume_constant_result``) from the static shapes,
  dtypes, device and options: validation runs on meta tensors of the same shapes and selection
  as usual, so the graph holds one fixed candidate and stays static (sizes torch.compile made
  dynamic are specialized first, :func:`_constant`: a new size recompiles, up to dynamo's
  ``recompile_limit``, rather than breaking the graph);
* ``attnselect::attention``, a ``torch.library`` custom op running that candidate, with a fake
  implementation that sizes the output from the *value* head dim ((..., Dv), not (..., Dqk));
* an autograd registration whose backward is ``attnselect::attention_backward``. A custom op's body
  runs below autograd, so the forward cannot keep its autograd graph for later; the backward op
  recomputes the candidate's forward with autograd switched back on and differentiates it (one
  extra forward per backward, the price of an opaque op). With dropout the forward also returns
  the RNG state it started from, and the backward replays it, so the recomputed forward draws the
  same mask.

Packed (thd) calls need both ``max_seqlen_*`` under tracing: the boundaries cannot be read then, so
the packing facts are the conservative ones of :func:`attnselect.spec.validate.packing_facts`. The problem
says it runs in a compiled graph (``compiled_graph``), which backends that cannot run there refuse
(flex, whose block masks fail under AOTAutograd). The decision follows the ATTNSELECT_* variables
and ``overrides`` blocks in force while tracing; the guarded run-time fallback of eager calls does
not apply inside a compiled graph (a failing kernel raises).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import operator

import torch

from attnselect.choose import first_calls
from attnselect.choose.selection import select
from attnselect.errors import InvalidInputError
from attnselect.execution import kernel_call, run_call
from attnselect.spec.options import CallOptions, Candidate, Packing
from attnselect.spec.problem import AttentionProblem, describe_call
from attnselect.spec.target import target_for_device
from attnselect.spec.validate import DENSE_AXES, check_scale, placement

Tensor = torch.Tensor


def traced_attention(q, k, v, options: CallOptions):
    """:func:`attnselect.attention` while torch.compile traces it (its options as one object; same results)."""
    o = options
    # plain Python values for the decision: dynamo keeps numbers and bools symbolic where it can (a value of another
    # type goes to the decision as it is, whose validation names it, as an eager call's does)
    scale, causal = _constant(o.scale), _flag(o.causal)
    return_lse = (True if o.return_lse else False) if isinstance(o.return_lse, (bool, torch.SymBool)) else o.return_lse
    cu_kv, offsets_q, offsets_kv, shared = placement(
        o.cu_seqlens_q, o.cu_seqlens_kv, o.cu_seqlens_q_padded, o.cu_seqlens_kv_padded
    )
    packed = (o.cu_seqlens_q, o.cu_seqlens_kv, o.cu_seqlens_q_padded, o.cu_seqlens_kv_padded)
    spec = _decide(
        _refusal(o, scale),
        tuple(tuple(map(_constant, t.shape)) for t in (q, k, v)),
        tuple(str(t.dtype) for t in (q, k, v)),
        tuple(str(t.device) for t in (q, k, v)),
        tuple(None if t is None else (str(t.dtype), tuple(map(_constant, t.shape)), str(t.device)) for t in packed),
        shared,
        o.layout,
        causal,
        tuple(map(_constant, o.window)) if isinstance(o.window, (tuple, list)) else o.window,
        _constant(o.dropout_p),
        _constant(o.max_seqlen_q),
        _constant(o.max_seqlen_kv),
        return_lse,
        torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
        torch.are_deterministic_algorithms_enabled(),
        o.backend,
        o.pad,
        o.disable if o.disable is None or isinstance(o.disable, str) else tuple(o.disable),
    )
    out, lse, _ = torch.ops.attnselect.attention(
        q, k, v, o.cu_seqlens_q, cu_kv, offsets_q, offsets_kv, spec, None if scale is None else float(scale)
    )
    return (out, lse.detach()) if return_lse else out  # lse is detached, as in eager calls


def _refusal(o: CallOptions, scale) -> str | None:
    """Why a traced call is refused before its decision (what eager calls serve and traced ones do not yet, a bad
    scale), or None: raised by :func:`_decide`, as every refusal of a traced call is. Dynamo wraps an error raised
    there in its own, naming it; raised in the traced code, it would break the graph and skip the function for good,
    so this call would run eagerly where refused, and every later one, silently."""
    if o.cp_group is not None:
        return ("cp_group: got a process group under torch.compile, expected None: context-parallel attention runs "
                "in eager calls only for now")  # fmt: skip
    for name, off in (("softcap", None), ("sinks", None), ("return_max_logit", False)):
        value = getattr(o, name)
        if value is not off:
            shown = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
            return (f"{name}: got {shown} under torch.compile, expected {off}: softcap, sinks and the max logit are "
                    "served in eager calls only for now")  # fmt: skip
    if o.layout == "thd" and (o.max_seqlen_q is None or o.max_seqlen_kv is None):
        return (f"max_seqlen_q/max_seqlen_kv: got {o.max_seqlen_q}/{o.max_seqlen_kv}, expected both integers under "
                "torch.compile (cu_seqlens cannot be read while tracing)")  # fmt: skip
    try:
        check_scale(scale)
    except InvalidInputError as exc:
        return str(exc)
    return None


def _constant(x):
    """A size or number option as a plain Python number. Dynamo keeps sizes, ints and floats symbolic (under
    ``dynamic=True``, and under the default compile once a second value arrives), which the decision cannot
    take; ``operator.index`` and ``__float__`` specialize them: dynamo guards on the value and recompiles for a
    new one, so each graph is static with its own decision. A size the caller marked dynamic
    (``torch._dynamo.mark_dynamic``) cannot be specialized, and dynamo raises ConstraintViolationError.
    Anything else (None, bools, bad values) passes unchanged, for validation to name it."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return x
    return operator.index(x) if isinstance(x, int) else x.__float__()


def _flag(x):
    """A bool option as a plain bool (one computed from sizes stays symbolic under dynamo; a branch on it
    specializes it); anything else (a mask name, a bad value) passes unchanged."""
    return (True if x else False) if isinstance(x, bool) else x


@torch.compiler.assume_constant_result
def _decide(
    refusal,
    shapes,
    dtypes,
    devices,
    packed,
    shared_boundaries,
    layout,
    causal,
    window,
    dropout_p,
    max_seqlen_q,
    max_seqlen_kv,
    return_lse,
    training,
    deterministic,
    backend,
    pad,
    disable,
) -> str:
    """Validate and select on meta tensors of the traced shapes; the spec string the op runs. ``refusal``: why the
    traced code refused the call (:func:`_refusal`), raised here."""
    if refusal is not None:
        raise InvalidInputError(refusal)

    def meta(shape, dtype):
        return torch.empty(shape, dtype=getattr(torch, dtype.replace("torch.", "")), device="meta")

    q, k, v = (meta(s, d) for s, d in zip(shapes, dtypes))
    cu = [None if p is None else meta(p[1], p[0]) for p in packed]
    if shared_boundaries and cu[0] is not None:
        cu[1] = None
    options = CallOptions(
        layout, causal, window, dropout_p=dropout_p, cu_seqlens_q=cu[0], cu_seqlens_kv=cu[1],
        max_seqlen_q=max_seqlen_q, max_seqlen_kv=max_seqlen_kv, cu_seqlens_q_padded=cu[2], cu_seqlens_kv_padded=cu[3],
        return_lse=return_lse,
    )  # fmt: skip
    problem, _ = describe_call(q, k, v, options)
    # What the meta tensors cannot carry: the traced call's grad mode and determinism, and its graph.
    problem = dataclasses.replace(problem, training=training, deterministic=deterministic, compiled_graph=True)
    for name, device in zip(("k", "v"), devices[1:]):
        if device != devices[0]:
            raise InvalidInputError(f"{name}.device: got {device}, expected q's device {devices[0]}")
    device = torch.device(devices[0])  # a graph traced on meta tensors (no kernel runs) is decided as on the CPU
    target = target_for_device(device if device.type != "meta" else torch.device("cpu"))
    decision = select(problem, target=target, backend=backend, pad=pad, disable=disable)
    return json.dumps(
        {"problem": problem.to_dict(), "backend": decision.chosen.backend, "pad_to": decision.chosen.pad_to}
    )


@functools.lru_cache(maxsize=4096)
def _parse(spec: str) -> tuple[AttentionProblem, Candidate]:
    d = json.loads(spec)
    return AttentionProblem.from_dict(d["problem"]), Candidate(d["backend"], d["pad_to"])


def _run(spec, scale, q, k, v, cu_q, cu_kv, offsets_q, offsets_kv):
    problem, candidate = _parse(spec)
    packing = None
    if problem.layout == "thd":
        packing = Packing(cu_q, cu_kv, problem.seqlen_q, problem.seqlen_kv, offsets_q, offsets_kv)
    out, lse = run_call(
        candidate, problem, kernel_call(problem, scale), q, k, v, packing=packing, target=target_for_device(q.device)
    )
    first_calls.ran_once(spec, candidate, problem)  # compiled in the graph: an eager call rents around it no more
    return out, (lse.float() if lse is not None else None)  # the op's lse is float32 (the reference keeps float64)


@torch.library.custom_op("attnselect::attention", mutates_args=())
def attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_kv: Tensor | None,
    offsets_q: Tensor | None,
    offsets_kv: Tensor | None,
    spec: str,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, lse or an empty tensor, the RNG state dropout started from or an empty tensor)."""
    problem, _ = _parse(spec)
    rng = _rng_state(q.device) if problem.dropout_p else _no_rng_state()
    with torch.no_grad():
        out, lse = _run(spec, scale, q, k, v, cu_seqlens_q, cu_seqlens_kv, offsets_q, offsets_kv)
    # Contiguous, as the fake implementation describes them (cuDNN's packed lse is a transposed view).
    return out.contiguous(), (lse.contiguous() if lse is not None else _no_lse(q)), rng


@attention_op.register_fake
def _attention_fake(q, k, v, cu_seqlens_q, cu_seqlens_kv, offsets_q, offsets_kv, spec, scale):
    problem, _ = _parse(spec)
    out = q.new_empty(*q.shape[:-1], v.shape[-1])  # the value head dim, not d_qk
    if not problem.return_lse:
        lse = _no_lse(q)
    elif problem.layout == "thd":
        lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    else:
        b, s, h = (q.shape[axis] for axis in DENSE_AXES[problem.layout])
        lse = q.new_empty(b, h, s, dtype=torch.float32)
    rng = torch.empty(_rng_state_size(q.device.type), dtype=torch.uint8) if problem.dropout_p else _no_rng_state()
    return out, lse, rng


@torch.library.custom_op("attnselect::attention_backward", mutates_args=())
def attention_backward_op(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor | None,
    cu_seqlens_kv: Tensor | None,
    offsets_q: Tensor | None,
    offsets_kv: Tensor | None,
    rng: Tensor,
    spec: str,
    scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv: the candidate's forward recomputed with autograd (from the forward's RNG state)."""
    devices = [q.device] if q.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, enabled=rng.numel() > 0), _autograd_inside_op(), torch.enable_grad():
        if rng.numel():
            _set_rng_state(rng, q.device)
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, _ = _run(spec, scale, *leaves, cu_seqlens_q, cu_seqlens_kv, offsets_q, offsets_kv)
        grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    return tuple(torch.zeros_like(t) if g is None else g.contiguous() for g, t in zip(grads, (q, k, v)))


@attention_backward_op.register_fake
def _attention_backward_fake(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_kv, offsets_q, offsets_kv, rng, spec, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_kv, offsets_q, offsets_kv, spec, scale = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_kv, offsets_q, offsets_kv, output[2])
    ctx.spec, ctx.scale = spec, scale


def _backward(ctx, grad_out, grad_lse, grad_rng):
    # lse is returned detached (as in eager calls), so its gradient is not propagated.
    q, k, v, cu_q, cu_kv, offsets_q, offsets_kv, rng = ctx.saved_tensors
    dq, dk, dv = torch.ops.attnselect.attention_backward(
        grad_out, q, k, v, cu_q, cu_kv, offsets_q, offsets_kv, rng, ctx.spec, ctx.scale
    )
    return dq, dk, dv, None, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)


@contextlib.contextmanager
def _autograd_inside_op():
    """Let autograd record inside a custom op's body.

    The dispatcher runs a custom op's implementation with the autograd keys excluded
    (c10 AutoDispatchBelowADInplaceOrView, set by the op's autograd kernel), so nothing inside
    would be recorded. This restores the autograd keys for the block, as the recompute needs;
    torch.func transforms would avoid the private guard but break torch.library.opcheck's
    schema check (its mode cannot read functorch's wrapped tensors).
    """
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    with torch._C._ForceDispatchKeyGuard(
        torch._C._dispatch_tls_local_include_set(),
        exclude.remove(keys.AutogradFunctionality).remove(keys.ADInplaceOrView),
    ):
        yield


def _no_lse(q: Tensor) -> Tensor:
    return q.new_empty(0, dtype=torch.float32)


def _no_rng_state() -> Tensor:
    return torch.empty(0, dtype=torch.uint8)


def _rng_state(device: torch.device) -> Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


@functools.cache
def _rng_state_size(device_type: str) -> int:
    return (torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()).numel()
