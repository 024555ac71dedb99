"""The backend contract: a support surface as data, readable reasons, one dense kernel call, and the registry.

A backend declares, per device type, a :class:`Surface` (what it serves) and may add
arch- or version-dependent rules in :meth:`Backend.extra_reasons`. The executor hands
:meth:`Backend.run` dense tensors in the backend's ``layout`` (already padded, when the
candidate pads) and a :class:`KernelCall`; the backend returns ``(out, lse)`` where lse
is float32 (B, Hq, Sq) or None when not requested.

The registry (:func:`register`, :func:`get`, :func:`all_backends`) lives here, beside the contract, so that the
choice reads it without importing the kernels: :mod:`attnselect.backends` registers the built-in backends on import
(which importing any module of the package does first). Every change forgets the memoized decisions
(:func:`attnselect.clear_cache`), which may have chosen or refused the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from attnselect.backends.shape_cache import ShapeCache
from attnselect.memos import clear_cache
from attnselect.spec.options import MASKS, KernelCall, Packing, dtype_name
from attnselect.spec.problem import AttentionProblem
from attnselect.spec.target import Package, Target, register_package, unregister_package

HALF = frozenset({torch.float16, torch.bfloat16})
ALL_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
# Surface.reasons of packed problems at size 0: (id of the surface, problem, target) -> (surface, reasons).
_PACKED_REASONS: dict[tuple, tuple] = {}


@dataclass(frozen=True)
class Surface:
    """What one backend serves on one device type, as data."""

    dtypes: frozenset = HALF
    min_capability: tuple[int, int] | None = None
    max_capability: tuple[int, int] | None = None
    max_head_dim: int | None = None  # for both d_qk and d_v
    min_head_dim: int = 1
    head_dim_multiple: int = 1
    equal_head_dims: bool = False  # True: d_qk must equal d_v
    masks: frozenset = frozenset(MASKS)
    dropout: bool = True
    backward: bool = True
    lse: bool = True
    lse_gradient: bool = False  # its lse carries a gradient (sinks rescale the output by it in training)
    softcap: bool = False  # caps logits: softcap * tanh(logits / softcap)
    max_logit: bool = False  # returns the per-head maximum logit
    deterministic_backward: bool = True
    fp8: bool = False
    # The kernel's causal flag is bottom-right aligned (FlashAttention), so top-left causal
    # is served only where the two coincide: as many queries as keys.
    causal_is_bottom_right: bool = False
    dense: bool = True  # serves (B, S, H, D)-style input
    packed: bool = False  # serves thd (T, H, D) + cu_seqlens in one call (else thd runs per sequence)
    gaps: bool = False  # packed: honours padded offsets (cu_seqlens_*_padded)
    cuda_graphs: bool = True  # its calls can be captured into a CUDA graph (after a warm-up call)
    compiled_graphs: bool = True  # it runs inside a torch.compile graph (as attnselect's custom op)

    def reasons(self, p: AttentionProblem, t: Target) -> list[str]:
        """Why this surface does not serve ``p`` on ``t``. A packed problem's reasons read no size (its facts stand
        for every sequence): they are worked out once per problem at size 0, as a packed loop makes a problem at new
        sizes every step."""
        if p.layout != "thd":
            return self._reasons(p, t)
        key = (id(self), p.sizeless, t)
        held = _PACKED_REASONS.get(key)
        if held is None or held[0] is not self:  # an id reused by another surface (a test's backend) is not it
            held = _PACKED_REASONS[key] = (self, tuple(self._reasons(p.sizeless, t)))
            if len(_PACKED_REASONS) > 4096:
                _PACKED_REASONS.pop(next(iter(_PACKED_REASONS)))
        return list(held[1])

    def _reasons(self, p: AttentionProblem, t: Target) -> list[str]:
        r: list[str] = []
        if p.layout == "thd" and self.packed and p.varlen_gaps and not self.gaps:
            r.append("cannot skip the gaps between sequences (cu_seqlens_*_padded); pass unpadded packing")
        if p.compiled_graph and not self.compiled_graphs:
            r.append(
                f"cannot run inside a compiled graph on the {t.device_type.upper()}; call it outside torch.compile"
            )
        if p.cuda_graph_capture and not self.cuda_graphs:
            r.append("is not verified under CUDA graph capture; warm up and capture with another backend")
        if p.cuda_graph_capture and p.layout == "thd" and not self.packed:
            r.append(
                "runs packed input sequence by sequence, reading cu_seqlens on the host, which CUDA graph "
                "capture forbids"
            )
        if p.layout != "thd" and not self.dense:
            r.append(f"serves packed input only (layout='thd'), got layout={p.layout!r}")
        if p.fp8 and not self.fp8:
            r.append("does not run fp8 attention (fp8=True)")
        if p.dtype not in self.dtypes:
            r.append(
                f"dtype {dtype_name(p.dtype)} is not supported (supports "
                f"{', '.join(sorted(map(dtype_name, self.dtypes)))})"
            )
        if t.is_cuda and self.min_capability and t.capability < self.min_capability:
            r.append(f"needs compute capability >= {_cc(self.min_capability)}, the target has {_cc(t.capability)}")
        if t.is_cuda and self.max_capability and t.capability > self.max_capability:
            r.append(
                f"supports compute capability up to {_cc(self.max_capability)}, the target has {_cc(t.capability)}"
            )
        if self.equal_head_dims and p.different_head_dims:
            r.append(f"needs equal head dims, got d_qk={p.head_dim_qk} and d_v={p.head_dim_v}")
        if self.max_head_dim and max(p.head_dim_qk, p.head_dim_v) > self.max_head_dim:
            r.append(f"head dims up to {self.max_head_dim} only, got d_qk={p.head_dim_qk}, d_v={p.head_dim_v}")
        if min(p.head_dim_qk, p.head_dim_v) < self.min_head_dim:
            r.append(f"head dims of at least {self.min_head_dim} only, got d_qk={p.head_dim_qk}, d_v={p.head_dim_v}")
        if self.head_dim_multiple > 1 and (
            p.head_dim_qk % self.head_dim_multiple or p.head_dim_v % self.head_dim_multiple
        ):
            r.append(f"head dims must be multiples of {self.head_dim_multiple}, got {p.head_dim_qk}/{p.head_dim_v}")
        if p.mask not in self.masks:
            r.append(f"mask {p.mask!r} is not supported (supports {', '.join(sorted(self.masks))})")
        if self.causal_is_bottom_right and p.mask == "causal" and not p.square:
            r.append(
                "its causal mask is bottom-right aligned, so top-left causal needs as many queries as keys "
                + (f"(got {p.seqlen_q} and {p.seqlen_kv})" if p.layout != "thd" else "in every sequence")
            )
        if self.causal_is_bottom_right and p.mask == "sliding_window_top_left":
            r.append(
                "its window is anchored bottom-right, so a window with top-left causal needs as many queries as keys "
                + (f"(got {p.seqlen_q} and {p.seqlen_kv})" if p.layout != "thd" else "in every sequence")
            )
        if p.dropout_p and not self.dropout:
            r.append(f"does not support dropout (dropout_p={p.dropout_p})")
        if p.training and not self.backward:
            r.append("has no backward kernel, and training needs one")
        if p.return_lse and not self.lse:
            r.append("cannot return the log-sum-exp (return_lse=True)")
        if p.softcap and not self.softcap:
            r.append("has no logit softcapping (softcap=); flex, FlashAttention 2/3/4 and the reference have it")
        if p.sinks and not self.lse:
            r.append("returns no log-sum-exp, which attnselect needs to apply sinks (sinks=)")
        elif p.sinks and p.training and not self.lse_gradient:
            r.append("cannot train sinks (sinks=): its log-sum-exp carries no gradient, which the sink rescaling needs")
        if p.return_max_logit and not self.max_logit:
            r.append("cannot return the max logit (return_max_logit=True); flex on CUDA and the reference can")
        if p.compiled_graph and (p.sinks or p.return_max_logit):
            r.append("sinks and the max logit are served outside torch.compile only")
        if p.training and p.deterministic and not self.deterministic_backward:
            r.append("has no deterministic backward (deterministic=True)")
        # attnselect.context_parallel merges each chunk pair's result by its lse, and trains through it
        if p.context_parallel_size > 1 and not self.lse and not p.return_lse:
            r.append("returns no log-sum-exp, by which context parallelism merges its chunks")
        elif p.context_parallel_size > 1 and p.training and not self.lse_gradient:
            r.append("cannot train under context parallelism: its log-sum-exp carries no gradient")
        return r


class Backend:
    """Base class: subclasses set the class attributes and implement :meth:`run`."""

    name: ClassVar[str]
    summary: ClassVar[str]
    layout: ClassVar[str] = "bhsd"  # dense layout that run() takes
    surfaces: ClassVar[dict[str, Surface]]  # keyed by device type ("cuda", "cpu")
    package: ClassVar[Package | None] = None  # the pip distribution it needs, if any
    shape_cache: ClassVar[ShapeCache | None] = None  # None: nothing is built per shape
    # Device types where the surface is an allowlist from the correctness grid (attnselect.backends.evidence, which
    # attnselect.choose.candidates applies after these reasons): young kernels.
    evidence_required: ClassVar[frozenset[str]] = frozenset()
    # Whether extra_reasons reads a problem's sizes (batch, seqlen_q, seqlen_kv): a packed loop's new packing judges
    # such a backend's candidates again (attnselect.choose.selection), one whose reasons read none once per family.
    # A class whose extra_reasons or not_supported_reasons comes from below the class that says so (an override, a
    # mixin) reads them (__init_subclass__).
    extra_reasons_read_sizes: ClassVar[bool] = False
    # The calls of a shape (packed: of a packing's sizes) its runner of repeated calls makes through the kernel's
    # interface before it replays a forward that needs no gradient, for less host time (FA4's: 2,
    # attnselect.backends.flash_attn4_replay); 0: it replays nothing. The calibration times both host times
    # (``replayed_host_us``), and the rules price a shape's first calls (attnselect.choose.first_calls).
    calls_before_replay: ClassVar[int] = 0

    def replay_start_calls(self, problem: AttentionProblem) -> int:
        """The calls of ``problem``'s shape its runner makes before it replays (:attr:`calls_before_replay`; 0 where
        it replays none of ``problem``'s calls)."""
        return self.calls_before_replay

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)

        def owner(name: str) -> type:  # the class of the MRO whose body defines ``name``
            return next(k for k in cls.__mro__ if name in vars(k))

        said = owner("extra_reasons_read_sizes")
        if any(not issubclass(said, owner(name)) for name in ("extra_reasons", "not_supported_reasons")):
            cls.extra_reasons_read_sizes = True

    def not_supported_reasons(self, problem: AttentionProblem, target: Target) -> list[str]:
        """Why this backend's documented surface does not serve ``problem`` on ``target``; empty when it does (the
        young kernels' allowlists come on top: attnselect.choose.candidates.kernel_reasons)."""
        absent = self.target_reasons(target)
        if absent:
            return absent
        return self.surfaces[target.device_type].reasons(problem, target) + self.extra_reasons(problem, target)

    def target_reasons(self, target: Target) -> list[str]:
        """Why this backend serves no problem at all on ``target`` (its package, its device types)."""
        if self.package and target.version(self.package.distribution) is None:
            return [f"package {self.package.distribution} is not installed"]
        if target.device_type not in self.surfaces:
            return [f"runs on {' and '.join(self.surfaces)} only, not on {target.device_type}"]
        return []

    def package_version(self, target: Target) -> str | None:
        """The version of its package on ``target`` (None: none needed, or not installed)."""
        return target.version(self.package.distribution) if self.package else None

    def extra_reasons(self, problem: AttentionProblem, target: Target) -> list[str]:
        """Rules that are not plain data (arch- and version-dependent head-dim pairs...)."""
        return []

    def packs_thd(self, target: Target) -> bool:
        """Whether thd input runs through :meth:`run_packed` (else sequence by sequence)."""
        surface = self.surfaces.get(target.device_type)
        return surface is not None and surface.packed

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Dense attention in ``self.layout``; lse float32 (B, Hq, Sq) or None."""
        raise TypeError(f"{self.name} serves packed (thd) input only")

    def run_packed(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall, packing: Packing
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed attention: q (Tq, Hq, Dqk), k (Tk, Hkv, Dqk), v (Tk, Hkv, Dv); lse (Hq, Tq) or None."""
        raise TypeError(f"{self.name} has no packed (thd) kernel; it runs sequence by sequence")

    def runner(self, call: KernelCall, *, repeated: bool = False, like: tuple | None = None):
        """``run(q, k, v)``: :meth:`run` with ``call`` bound. A backend prepares here what does not change between
        calls. ``repeated``: every call has the first one's shapes, strides, storage offsets, dtypes and gradients,
        under the same grad mode, autocast and TorchFunctionModes (the memoized calls of attnselect.attention,
        keyed on them), so what the first call finds holds for the rest; ``like``: such a call's (q, k, v) as the
        kernel gets them, where they are known before the first call (None: they are known at the first call)."""
        return lambda q, k, v: self.run(q, k, v, call)

    def bshd_runner(self, call: KernelCall, like: tuple):
        """A repeated call's ``run(q, k, v)`` on (batch, seq, heads, dim) tensors like ``like`` (unpadded, head dim
        at stride 1), where this backend's :attr:`layout` is another but its kernel reads this one (SDPA's ops
        transpose to it and back: attnselect.backends._sdpa); None where it has none. See :meth:`runner`."""
        return None

    def packed_runner(self, call: KernelCall, *, repeated: bool = False):
        """``run(q, k, v, packing)``: :meth:`run_packed` with ``call`` bound (see :meth:`runner`). It reads each
        call's packing whole, sizes included: one runner serves a packed call at every packing's sizes
        (attnselect.execution.packed_runner)."""
        return lambda q, k, v, packing: self.run_packed(q, k, v, call, packing)

    def __repr__(self) -> str:
        return f"<backend {self.name}>"


def expand_kv_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int = 1):
    """Repeat K/V heads to match Q's (GQA/MQA) for kernels without native grouped heads."""
    groups = q.shape[head_dim] // k.shape[head_dim]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=head_dim), v.repeat_interleave(groups, dim=head_dim)


def _cc(cc: tuple[int, int]) -> str:
    return f"{cc[0]}.{cc[1]}"


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> None:
    """Add (or replace) a backend under ``backend.name``."""
    _REGISTRY[backend.name] = backend
    if backend.package is not None:  # Target.current reads its version from now on
        register_package(backend.package)
    clear_cache()


def unregister(name: str) -> None:
    gone = _REGISTRY.pop(name, None)
    if gone is not None and gone.package and not any(b.package == gone.package for b in _REGISTRY.values()):
        unregister_package(gone.package.distribution)
    clear_cache()


def all_backends() -> tuple[Backend, ...]:
    return tuple(_REGISTRY.values())


def get(name: str) -> Backend | None:
    return _REGISTRY.get(name)
