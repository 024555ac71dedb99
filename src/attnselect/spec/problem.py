"""`AttentionProblem`: an immutable, hashable description of one attention call."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import operator
from dataclasses import dataclass

import torch

from attnselect.spec.options import (
    DESCRIBING,
    DTYPE_CHOICES,
    DTYPES,
    INT32_MAX,
    LAYOUTS,
    MASKS,
    CallOptions,
    Packing,
    dtype_name,
    is_integer,
    require,
)
from attnselect.spec.validate import read_call


@dataclass(frozen=True)
class AttentionProblem:
    """One attention call, described by shapes and options only (no tensors).

    Dense layouts: q is (B, Sq, Hq, Dqk) for ``bshd``, (Sq, B, Hq, Dqk) for ``sbhd`` and
    (B, Hq, Sq, Dqk) for ``bhsd``; k has Hkv heads and Skv positions; v has head dim Dv.
    ``thd`` packs sequences: q is (Tq, Hq, Dqk), ``batch`` is the number of sequences,
    ``seqlen_q``/``seqlen_kv`` are the longest sequence lengths and ``tokens`` is Tq (0: not known).

    Masks: ``causal`` is top-left aligned (query i sees keys j <= i, as SDPA's is_causal);
    ``causal_bottom_right`` aligns the diagonal to the last key (j <= i + Skv - Sq, as
    FlashAttention-2 and cuDNN); ``sliding_window`` takes ``window=(left, right)``, also
    bottom-right aligned: key j is visible to query i when
    ``i + Skv - Sq - left <= j <= i + Skv - Sq + right``, and -1 means unbounded;
    ``sliding_window_top_left`` anchors the window at the top-left diagonal instead
    (``i - left <= j <= i + right``: top-left causal with a window, TransformerEngine's
    ``padding_causal`` with ``window_size``), a mask of its own only where Sq != Skv.
    """

    batch: int
    seqlen_q: int
    seqlen_kv: int
    heads_q: int
    heads_kv: int
    head_dim_qk: int
    head_dim_v: int
    dtype: torch.dtype = torch.bfloat16
    layout: str = "bshd"
    mask: str = "none"
    window: tuple[int, int] | None = None
    dropout_p: float = 0.0
    training: bool = False
    deterministic: bool = False
    return_lse: bool = False
    softcap: bool = False  # logits are capped: softcap * tanh(logits / softcap)
    sinks: bool = False  # learnable per-head sink logits join each row's softmax denominator
    return_max_logit: bool = False  # the per-head maximum logit is returned too
    context_parallel_size: int = 1
    fp8: bool = False
    cuda_graph_capture: bool = False  # the call is being captured into a CUDA graph (no host syncs, no timing)
    compiled_graph: bool = False  # the call runs inside a torch.compile graph (attnselect.ops)
    # thd only, facts about the packed sequences (dense problems derive them from the lengths):
    # every sequence has as many queries as keys; some key sequence has exactly one key; some
    # query of some sequence sees no key under the mask; sequences sit at padded offsets with
    # gaps between them (cu_seqlens_*_padded). attnselect.spec.validate.packing_facts derives them.
    varlen_seqlens_match: bool = True
    varlen_single_key: bool = False
    varlen_rows_without_keys: bool = False
    varlen_gaps: bool = False
    # thd only: q's rows (Tq), the packed query tokens with any gaps; 0 where not known. With the longest lengths it
    # estimates the pack's work (attnselect.choose.predict.work), which batch x the longest overstates.
    tokens: int = 0

    def __post_init__(self) -> None:
        # Each check builds its message only when it fails: this runs for every new problem (a packed loop makes
        # one a step).
        for name in ("batch", "seqlen_q", "seqlen_kv", "tokens"):
            value = getattr(self, name)
            if not (is_integer(value) and 0 <= value <= INT32_MAX):
                _size_refused(name, value, 0)
        for name in ("heads_q", "heads_kv", "head_dim_qk", "head_dim_v", "context_parallel_size"):
            value = getattr(self, name)
            if not (is_integer(value) and 1 <= value <= INT32_MAX):
                _size_refused(name, value, 1)
        if self.heads_q % self.heads_kv:
            require(
                False, "heads_q", f"{self.heads_q} with heads_kv={self.heads_kv}", "a multiple of heads_kv (GQA/MQA)"
            )
        if self.tokens and self.layout != "thd":
            require(False, "tokens", repr(self.tokens), "0 unless layout is 'thd' (q's rows of a packing)")
        if self.dtype not in DTYPES:
            require(False, "dtype", repr(self.dtype), DTYPE_CHOICES)
        if self.layout not in LAYOUTS:
            require(False, "layout", repr(self.layout), f"one of {LAYOUTS}")
        if self.mask not in MASKS:
            require(False, "mask", repr(self.mask), f"one of {MASKS}")
        if self.mask == "sliding_window_top_left" and self.square:  # the anchors coincide: one mask, one name
            object.__setattr__(self, "mask", "sliding_window")
        if self.mask in ("sliding_window", "sliding_window_top_left"):
            w = self.window
            if not (isinstance(w, tuple) and len(w) == 2 and all(is_integer(x) and -1 <= x <= INT32_MAX for x in w)):
                require(False, "window", repr(w), "a (left, right) pair of integers from -1 (unbounded) to 2**31 - 1")
        elif self.window is not None:
            require(False, "window", repr(self.window), "None unless mask is a sliding window")
        if not (isinstance(self.dropout_p, float) and 0.0 <= self.dropout_p < 1.0):
            require(False, "dropout_p", repr(self.dropout_p), "a float in [0, 1)")
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                require(False, name, repr(getattr(self, name)), "True or False")

    def _with(self, **changes) -> AttentionProblem:
        """This problem with ``changes`` to fields that do not enter another field's check or normalisation (sizes of
        a packed problem, head dims), each checked alone: a copy without __post_init__'s other checks, which this
        problem passed. Other changes take :func:`dataclasses.replace`."""
        if not changes.keys() <= _CHECKED_ALONE or (self.layout != "thd" and not changes.keys() <= _HEAD_DIMS):
            return dataclasses.replace(self, **changes)
        for name, value in changes.items():
            low = 1 if name in _HEAD_DIMS else 0
            if not (is_integer(value) and low <= value <= INT32_MAX):
                _size_refused(name, value, low)
        return self._copy(changes, _CACHED if not changes.keys() <= _SIZES else _CACHED_BY_SIZE)

    def _at_sizes(self, batch: int, seqlen_q: int, seqlen_kv: int) -> AttentionProblem:
        """:meth:`_with` of a packed problem's sizes, given as integers >= 0 (attention() has checked a new
        packing's: the boundaries' length and both max_seqlen)."""
        return self._copy({"batch": batch, "seqlen_q": seqlen_q, "seqlen_kv": seqlen_kv}, _CACHED_BY_SIZE)

    def _copy(self, changes: dict, stale: tuple) -> AttentionProblem:
        """This problem with ``changes``, the derived values cached (functools.cached_property) kept but ``stale``."""
        fields = self.__dict__.copy()
        for name in stale:
            fields.pop(name, None)
        fields.update(changes)
        copy = object.__new__(AttentionProblem)
        object.__setattr__(copy, "__dict__", fields)
        return copy

    @functools.cached_property
    def sizeless(self) -> AttentionProblem:
        """This problem at size 0 (batch, both sequence lengths and tokens): what a packed loop's calls share whatever
        their packing, the key of the decisions and compiles kept across packings. Kept by the copies :meth:`_with`
        makes at other sizes, so a loop's new packing does not make it again."""
        return self._with(batch=0, seqlen_q=0, seqlen_kv=0, tokens=0)

    @property
    def eager(self) -> AttentionProblem:
        """This problem as an eager call makes it (neither captured nor compiled): what a graph's call shares with the
        eager calls before it (their failures, compiles and decided calls)."""
        if self.cuda_graph_capture or self.compiled_graph:
            return dataclasses.replace(self, cuda_graph_capture=False, compiled_graph=False)
        return self

    def __hash__(self) -> int:
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        """The hash of the fields (what dataclass would hash), worked out once: a packed loop's memo keys hash its
        problem without its sizes on every new packing. A copy at other values drops it with the other derived
        values (:meth:`_copy`); a pickle leaves it out (:meth:`__getstate__`): str hashes differ between processes."""
        return hash(_field_values(self))

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_hash", None)
        return state

    @functools.cached_property
    def _padded_sizeless(self) -> dict[int, AttentionProblem]:
        """{head dim: this problem padded to it}, on a sizeless problem (:meth:`padded` keeps its copies' sizeless)."""
        return {}

    @classmethod
    def from_tensors(
        cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, context_parallel_size: int = 1, **call_arguments
    ) -> AttentionProblem:
        """Describe a call from its tensors and the call's keyword arguments: those of :func:`attnselect.attention`
        that describe the problem (all but cp_group, backend, pad and disable), and the context-parallel group's
        size."""
        known = (*DESCRIBING, "context_parallel_size")
        for name in call_arguments:  # a misspelt or unknown name is named, with the closest known one
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                require(False, name, "an argument", "one of " + ", ".join(known)
                        + (f" (did you mean {close[0]!r}?)" if close else ""))  # fmt: skip
        options = CallOptions(**call_arguments)
        return describe_call(q, k, v, options, context_parallel_size=context_parallel_size)[0]

    def check_context_parallel(self) -> None:
        """Refuse, naming the argument, what attnselect's context-parallel ring does not serve (context_parallel_size
        > 1): a window, bottom-right causal, dropout, CUDA graph capture, gaps between packed sequences, and under a
        causal mask keys of their own lengths. attention(cp_group=) and select/explain refuse alike."""
        if self.context_parallel_size == 1:
            return
        cp = f"with context_parallel_size={self.context_parallel_size}"
        require(self.window is None, "window", f"{self.window} {cp}",
                "None: sliding windows are not served under context parallelism yet")  # fmt: skip
        require(self.mask in ("none", "causal"), "causal", f"mask {self.mask!r} {cp}",
                "no mask or top-left causal: bottom-right is not served under context parallelism yet")  # fmt: skip
        require(self.dropout_p == 0.0, "dropout_p", f"{self.dropout_p} {cp}",
                "0.0: the ring's backward recomputes each chunk pair, which would draw a new dropout mask")  # fmt: skip
        require(not self.cuda_graph_capture, "cp_group", "a call under CUDA graph capture",
                "a call outside capture: the ring checks its ranks on the host")  # fmt: skip
        require(not (self.layout == "thd" and self.varlen_gaps), "cu_seqlens_q_padded/cu_seqlens_kv_padded",
                f"gaps between sequences {cp}", "none: pad each sequence to a multiple of 2 x the group's size "
                "and pass it whole")  # fmt: skip
        require(
            self.mask == "none" or self.square,
            "k.shape" if self.layout != "thd" else "cu_seqlens_kv",
            f"keys of their own lengths under a causal mask {cp}",
            "as many keys as queries (self-attention)",
        )

    # -- derived facts -------------------------------------------------------------------
    @property
    def square(self) -> bool:
        """Every sequence has as many queries as keys (top-left and bottom-right causal coincide)."""
        return self.varlen_seqlens_match if self.layout == "thd" else self.seqlen_q == self.seqlen_kv

    @property
    def single_key(self) -> bool:
        """Some sequence has exactly one key."""
        return self.varlen_single_key if self.layout == "thd" else self.seqlen_kv == 1

    @property
    def may_have_rows_without_keys(self) -> bool:
        """Some query may see no key (its output is 0 and its lse -inf).

        Dense: exact, from the mask band. thd: from the sequence lengths when they were read
        (``varlen_rows_without_keys``); the tokens in gaps between sequences see no key either.
        """
        from attnselect.spec import masks

        if self.layout == "thd":
            return self.varlen_rows_without_keys or self.varlen_gaps
        return masks.has_rows_without_keys(self.mask, self.window, self.seqlen_q, self.seqlen_kv)

    @property
    def needs_mask_tensor(self) -> bool:
        """SDPA-style kernels (is_causal = top-left) need an explicit mask for this mask."""
        from attnselect.spec import masks

        return masks.needs_explicit_mask(self.mask, self.square)

    @property
    def different_head_dims(self) -> bool:
        return self.head_dim_qk != self.head_dim_v

    @property
    def default_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim_qk)

    @property
    def pad_target(self) -> int | None:
        """The one head dim padding may go to: max(d_qk, d_v) rounded up to a multiple of 8, the granule most
        kernels need (16 bytes of a 16-bit dtype); None when both head dims already are that (nothing to pad)."""
        target = -(-max(self.head_dim_qk, self.head_dim_v) // 8) * 8
        return None if self.head_dim_qk == self.head_dim_v == target else target

    @property
    def size_class(self) -> int:
        """The problem's size as a power of 4 of its score count, batch x Hq x Sq x Skv (thd: sequences x the longest
        lengths): kernels pick tiles, splits and schedules by size, and FlashAttention-4 4.0.0b36's sm90 backward at
        128/64 was right at B2 H16 S640 and wrong at B2 H16 S1024 in one process (results/h200_correctness_grid.md)."""
        return size_class_of(self.batch * self.heads_q * self.seqlen_q * self.seqlen_kv)

    @functools.cached_property
    def signature(self) -> tuple:
        """What a kernel's correctness is known for (attnselect.self_check): head dims, GQA ratio ("mqa" for one K/V
        head), mask kind, layout (thd with or without gaps), dtype, phase, size class, and the options that
        change the kernel run (dropout, determinism, lse, softcap, sinks, max logit, fp8, capture, compile, context
        parallelism, keyless rows)."""
        if self.layout == "thd" and "sizeless" in self.__dict__ and (self.batch or self.seqlen_q or self.seqlen_kv):
            # a packed problem's signature reads no size but its class: a loop's new packing takes the rest as made
            known = self.sizeless.signature
            return (*known[:7], self.size_class, known[8])
        ratio = "mqa" if self.heads_kv == 1 and self.heads_q > 1 else self.heads_q // self.heads_kv
        layout = "thd with gaps" if self.layout == "thd" and self.varlen_gaps else self.layout
        options = tuple(
            name
            for name, on in (
                ("dropout", self.dropout_p > 0),
                ("deterministic", self.deterministic and self.training),
                ("lse", self.return_lse),
                ("softcap", self.softcap),
                ("sinks", self.sinks),
                ("max_logit", self.return_max_logit),
                ("fp8", self.fp8),
                ("cuda graph", self.cuda_graph_capture),
                ("compiled", self.compiled_graph),
                ("context parallel", self.context_parallel_size > 1),
                ("keyless rows", self.may_have_rows_without_keys),
            )
            if on
        )
        phase = "training" if self.training else "inference"
        return (self.head_dim_qk, self.head_dim_v, ratio, self.mask, layout, dtype_name(self.dtype), phase,
                self.size_class, options)  # fmt: skip

    def padded(self, head_dim: int) -> AttentionProblem:
        """The problem after zero-padding Q, K and V to ``head_dim`` on the last dim."""
        require(
            is_integer(head_dim) and head_dim >= max(self.head_dim_qk, self.head_dim_v),
            "head_dim",
            head_dim,
            f"an integer >= max(head_dim_qk, head_dim_v) = {max(self.head_dim_qk, self.head_dim_v)}",
        )
        copy = self._with(head_dim_qk=head_dim, head_dim_v=head_dim)
        if self.layout == "thd" and "sizeless" in self.__dict__:  # a packed loop pads each packing's problem
            base = self.sizeless
            held = base._padded_sizeless
            sizeless = held.get(head_dim)
            if sizeless is None:
                sizeless = held[head_dim] = copy if base is self else base.padded(head_dim)
            copy.__dict__["sizeless"] = sizeless
        return copy

    def describe(self) -> str:
        mask = self.mask if self.window is None else f"{self.mask}{self.window}"
        if self.layout == "thd" and not self.varlen_seqlens_match:
            mask += " (q/kv lengths differ)"
        if self.layout == "thd" and self.varlen_gaps:
            mask += " (gaps between sequences)"
        phase = "training" if self.training else "inference"
        seq = (
            f"{self.batch} seqs{f' in {self.tokens} tokens' if self.tokens else ''}, max sq={self.seqlen_q} "
            f"skv={self.seqlen_kv}"
            if self.layout == "thd"
            else f"B={self.batch} Sq={self.seqlen_q} Skv={self.seqlen_kv}"
        )
        extras = [f"dropout={self.dropout_p}"] if self.dropout_p else []
        extras += [n for n in ("deterministic", "return_lse", "fp8") if getattr(self, n)]
        extras += ["under CUDA graph capture"] if self.cuda_graph_capture else []
        extras += ["in a compiled graph"] if self.compiled_graph else []
        extras += [f"cp={self.context_parallel_size}"] if self.context_parallel_size > 1 else []
        return (
            f"{self.layout} {seq} Hq={self.heads_q} Hkv={self.heads_kv} "
            f"d_qk={self.head_dim_qk} d_v={self.head_dim_v} {dtype_name(self.dtype)} "
            f"mask={mask} {phase}" + (" " + " ".join(extras) if extras else "")
        )

    def to_dict(self) -> dict:
        """The fields as JSON values; ``tokens`` only where known (a packed call's), so the keys of decisions stored,
        and of reports, before the field existed still name the same problems."""
        d = dataclasses.asdict(self)
        d["dtype"] = dtype_name(self.dtype)
        d["window"] = list(self.window) if self.window else None
        if not self.tokens:
            del d["tokens"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> AttentionProblem:
        """The inverse of :meth:`to_dict`; fields left out take their defaults, unknown ones are refused."""
        require(isinstance(d, dict), "problem", type(d).__name__, "a dict of AttentionProblem fields (to_dict())")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(map(str, set(d) - known))
        require(not unknown, "problem", f"unknown field(s) {unknown}", f"fields of AttentionProblem: {sorted(known)}")
        fields = dict(d)
        if "dtype" in fields:
            names = {dtype_name(t): t for t in DTYPES}
            require(isinstance(fields["dtype"], str) and fields["dtype"] in names, "dtype", repr(fields["dtype"]),
                    f"one of {sorted(names)}")  # fmt: skip
            fields["dtype"] = names[fields["dtype"]]
        window = fields.get("window")
        if isinstance(window, list):
            fields["window"] = tuple(window)
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in fields and
                         f.default is dataclasses.MISSING)  # fmt: skip
        require(not missing, "problem", f"no {missing}", "every required field of AttentionProblem")
        return cls(**fields)


_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionProblem))
_field_values = operator.attrgetter(*_FIELDS)  # the fields' values, as eq compares them
_FLAGS = tuple(f.name for f in dataclasses.fields(AttentionProblem) if f.type in ("bool", bool))
_HEAD_DIMS = frozenset({"head_dim_qk", "head_dim_v"})
# Sizes that no other field's check reads on a packed problem (its squareness is a varlen fact), and head dims.
_SIZES = frozenset({"batch", "seqlen_q", "seqlen_kv", "tokens"})
_CHECKED_ALONE = _SIZES | _HEAD_DIMS


def _size_refused(name: str, value, low: int) -> None:
    """Refuse a size, count or head dim ``value`` (not an integer from ``low`` to INT32_MAX), naming ``name``."""
    if is_integer(value) and value > INT32_MAX:
        require(False, name, repr(value), "at most 2**31 - 1 (the kernels index in int32)")
    require(False, name, repr(value), f"an integer >= {low}")


def size_class_of(scores: int) -> int:
    """:attr:`AttentionProblem.size_class` of a call of ``scores`` scores (batch x Hq x Sq x Skv)."""
    return (scores.bit_length() - 1) // 2 if scores else 0


# The derived values a problem caches, and those its sizes change (sizeless does not: a copy at other sizes keeps it).
_CACHED = tuple(name for name, value in vars(AttentionProblem).items() if isinstance(value, functools.cached_property))
_CACHED_BY_SIZE = tuple(name for name in _CACHED if name != "sizeless")


def describe_call(
    q, k, v, options: CallOptions, *, context_parallel_size: int = 1
) -> tuple[AttentionProblem, Packing | None]:
    """Validate q, k, v and the options that describe the call; return the problem and, for thd, the packing."""
    fields, packing = read_call(q, k, v, options, context_parallel_size=context_parallel_size)
    return AttentionProblem(**fields), packing
