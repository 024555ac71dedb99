"""The memo of repeated calls: a call is known again only where everything validation and selection read is equal."""

from __future__ import annotations

import pytest
import torch

import attnselect
from attnselect import dispatch
from attnselect.dispatch import KnownCall, Unknown
from attnselect.spec.options import CallOptions
from attnselect.spec.problem import describe_call


def _qkv(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 9, 2, d, generator=g, dtype=dtype) for d in (24, 24, 16)]


def _recall(q, k, v, **options):
    """dispatch.recall for attention(q, k, v, **options)."""
    return dispatch.recall(q, k, v, CallOptions(**options))


def test_a_repeated_call_is_found_among_the_recent_ones():
    q, k, v = _qkv()
    assert type(_recall(q, k, v, causal=True)) is Unknown
    attnselect.attention(q, k, v, causal=True)
    assert len(dispatch._RECENT) == 1
    known = _recall(*(t.clone() for t in (q, k, v)), causal=True)  # new tensors, the same description
    assert type(known) is KnownCall and known is dispatch.known_calls()[0]


def test_a_call_passing_one_tensor_twice_is_found_among_the_recent_ones_and_known_by_which_it_repeats():
    q, _, v = _qkv()
    attnselect.attention(q, q, v)  # self-attention: k is q
    dispatch._CALLS.clear()  # what is found now is found among the recent calls
    assert type(_recall(q, q, v)) is KnownCall
    assert type(_recall(q, q.clone(), v)) is Unknown  # no longer the same tensor twice
    w = torch.randn(2, 9, 2, 16, dtype=q.dtype)
    with pytest.raises(attnselect.InvalidInputError, match="head dim"):  # k is v: q 24, k 16, unlike the call above
        attnselect.attention(q, w, w)
    k = q.clone()
    attnselect.attention(q, k, q)  # v is q: the same two tensors as (q, k, k), another call
    assert type(_recall(q, k, k)) is Unknown


@pytest.mark.parametrize(
    "change",
    [
        lambda t: t.float(),  # dtype
        lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),  # strides
        lambda t: t.detach().requires_grad_(),  # gradients
        lambda t: torch.cat([t.flatten(), t.flatten()])[t.numel() :].view(t.shape),  # storage offset
        lambda t: t[:1],  # shape
        lambda t: t.to("meta"),  # device
    ],
    ids=["dtype", "strides", "requires_grad", "storage_offset", "shape", "device"],
)
def test_a_call_whose_tensors_differ_in_what_validation_reads_is_not_known(change):
    q, k, v = _qkv()
    attnselect.attention(q, k, v)
    assert type(_recall(change(q), k, v)) is Unknown
    assert type(_recall(q, k, change(v))) is Unknown


def test_global_state_and_options_are_part_of_the_call(monkeypatch):
    q, k, v = _qkv()
    attnselect.attention(q, k, v)
    assert type(_recall(q, k, v)) is KnownCall
    with torch.no_grad():
        assert type(_recall(q, k, v)) is Unknown
    with attnselect.overrides(backend="reference"):
        assert type(_recall(q, k, v)) is Unknown
    assert type(_recall(q, k, v, scale=0.5)) is Unknown and type(_recall(q, k, v, causal=True)) is Unknown
    monkeypatch.setenv("ATTNSELECT_PAD", "never")
    assert type(_recall(q, k, v)) is Unknown


def test_values_equal_to_a_known_one_but_of_another_type_are_not_known():
    q, k, v = _qkv()
    attnselect.attention(q, k, v, causal=True, scale=1.0, return_lse=True)
    assert type(_recall(q, k, v, causal=True, scale=1.0, return_lse=True)) is KnownCall
    for other in (dict(causal=1), dict(scale=True), dict(return_lse=1), dict(window=[0, 0]), dict(dropout_p=False)):
        assert _recall(q, k, v, **{**dict(causal=True, scale=1.0, return_lse=True), **other}) is None, other


def test_alternating_calls_stay_recent_and_the_list_is_bounded(monkeypatch):
    monkeypatch.setattr(dispatch, "RECENT", 2)
    q, k, v = _qkv()
    for causal in (False, True, False, True):
        attnselect.attention(q, k, v, causal=causal)
    assert len(dispatch._RECENT) == 2 and len(dispatch.known_calls()) == 2
    attnselect.attention(q, k, v, window=(2, 0))
    assert len(dispatch._RECENT) == 2 and len(dispatch.known_calls()) == 3
    evicted = [e for e in dispatch._CALLS.values() if not any(e is r for r in dispatch._RECENT)]
    assert len(evicted) == 1 and evicted[0].known.problem.mask == "none"
    assert type(_recall(q, k, v)) is KnownCall and dispatch._RECENT[0] is evicted[0]  # found by its key: recent


def test_without_tensor_guards_calls_are_found_by_key(monkeypatch):
    monkeypatch.setattr(dispatch, "TensorGuards", None)
    q, k, v = _qkv()
    first = attnselect.attention(q, k, v, causal=True)
    assert not dispatch._RECENT and type(_recall(q, k, v, causal=True)) is KnownCall
    assert torch.equal(attnselect.attention(q, k, v, causal=True), first)
    assert type(_recall(q.float(), k, v, causal=True)) is Unknown


def test_calls_with_sinks_are_known_by_the_sinks_too():
    q, k, v = _qkv()
    sinks = torch.zeros(2, dtype=torch.float64)
    first = attnselect.attention(q, k, v, sinks=sinks)
    assert type(_recall(q, k, v, sinks=sinks.clone())) is KnownCall
    assert type(_recall(q, k, v)) is Unknown and type(_recall(q, k, v, sinks=sinks.float())) is Unknown
    assert torch.equal(attnselect.attention(q, k, v, sinks=sinks), first)


def test_calls_the_memo_cannot_describe_still_get_the_library_s_own_error():
    import numpy as np

    q, k, v = _qkv()
    attnselect.attention(q, k, v)
    nested = torch.nested.nested_tensor([q[0], q[1]])  # torch's tensor guards would abort the process on it
    assert _recall(nested, k, v) is None
    with pytest.raises(attnselect.InvalidInputError):
        attnselect.attention(nested, k, v)
    with pytest.raises(attnselect.InvalidInputError, match="backend"):
        attnselect.attention(q, k, v, backend=np.array(["reference", "flex"]))  # == gives an array, not a bool


def test_a_call_under_autocast_is_remembered_apart_from_the_same_call_outside_it():
    """Autocast is not in the recent calls' state: their tensor check fails when it changes, and the key holds it."""
    q, k, v = _qkv(torch.float32)
    attnselect.attention(q, k, v)
    outside = _recall(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attnselect.attention(q, k, v)
        inside = _recall(q, k, v)
        assert type(inside) is KnownCall and inside is not outside
        assert _recall(q, k, v) is inside
    assert _recall(q, k, v) is outside


def test_autocast_function_modes_and_subclasses_are_part_of_the_call():
    from torch.overrides import TorchFunctionMode

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Sub(torch.Tensor):
        pass

    q, k, v = _qkv(torch.float32)
    attnselect.attention(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert type(_recall(q, k, v)) is Unknown
    with Mode():
        assert type(_recall(q, k, v)) is Unknown
    assert type(_recall(q.as_subclass(Sub), k, v)) is Unknown
    assert type(_recall(q, k, v)) is KnownCall


def test_a_change_to_the_backend_registry_forgets_every_call():
    from attnselect import backends
    from attnselect.backends.sdpa_math import SdpaMath

    class Fake(SdpaMath):
        name = "fake_registered"

    q, k, v = _qkv()
    attnselect.attention(q, k, v)
    assert dispatch.known_calls() and dispatch._RECENT
    backends.register(Fake())
    try:
        assert not dispatch.known_calls() and not dispatch._RECENT
        attnselect.attention(q, k, v)
        assert len(dispatch.known_calls()) == 1
    finally:
        backends.unregister("fake_registered")
    assert not dispatch.known_calls()


def test_a_recent_call_on_cuda_tensors_is_known_only_under_its_capture_state(monkeypatch):
    """A recent entry made on CUDA tensors holds its capture state (one made on others, None); the check reads the
    capture state only off the default stream, where a capture can run. Stood in for on the CPU."""
    q, k, v = _qkv()
    attnselect.attention(q, k, v)
    dispatch._CALLS.clear()  # what is found now is found among the recent calls
    made_on_cuda = dispatch._RECENT[0]._replace(capturing=False)  # as made on CUDA tensors, not capturing
    dispatch._set_recent([])
    dispatch._make_recent(made_on_cuda)
    asked = []
    monkeypatch.setattr(dispatch, "stream_capturing", lambda: asked.append(1) or True)
    monkeypatch.setattr(dispatch, "raw_stream", lambda index: 0)  # the default stream: no capture, none asked
    assert type(_recall(q, k, v)) is KnownCall and not asked
    monkeypatch.setattr(dispatch, "raw_stream", lambda index: 1234)  # a side stream, capturing
    assert type(_recall(q, k, v)) is Unknown and asked
    monkeypatch.setattr(dispatch, "stream_capturing", lambda: False)  # a side stream, not capturing
    assert type(_recall(q, k, v)) is KnownCall


def test_a_call_decided_while_the_memo_is_cleared_is_not_kept(monkeypatch):
    """A backend registered by another thread while a call is decided clears the memo: that decision may rest on the
    registry it forgot, so neither the call memo nor selection's keeps it."""
    from attnselect.choose import selection

    decide = selection._decide

    def decide_while_cleared(*args):
        attnselect.clear_cache()  # what backends.register does, in the middle of the decision
        return decide(*args)

    monkeypatch.setattr(selection, "_decide", decide_while_cleared)
    q, k, v = _qkv()
    attnselect.attention(q, k, v)
    assert not dispatch.known_calls() and not dispatch._RECENT and not selection._MEMO
    monkeypatch.setattr(selection, "_decide", decide)
    attnselect.attention(q, k, v)
    assert len(dispatch.known_calls()) == 1 and type(_recall(q, k, v)) is KnownCall


def test_threads_calling_at_once_share_the_recent_calls_without_errors():
    """Twelve calls alternating over six threads, switching as often as the interpreter lets them: the recent calls
    change under each other's checks, and each list is swapped in whole."""
    import sys
    import threading

    shapes = [torch.randn(1, 2 + i, 2, 8) for i in range(12)]
    expected = [attnselect.attention(q, q, q) for q in shapes]
    errors = []

    def work(seed):
        try:
            for n in range(600):
                i = (seed * 7 + n) % len(shapes)
                if not torch.equal(attnselect.attention(shapes[i], shapes[i], shapes[i]), expected[i]):
                    errors.append(f"another result for shape {i}")
        except Exception as exc:  # the test reports it
            errors.append(repr(exc))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]
    assert len(dispatch._RECENT) == dispatch.RECENT


def test_a_check_that_raises_leaves_the_call_to_the_slow_path(monkeypatch):
    """Reading the capture state raises: the lookup does not know the call, and attention() decides it afresh."""
    q, k, v = _qkv()
    first = attnselect.attention(q, k, v)
    made_on_cuda = dispatch._RECENT[0]._replace(capturing=False)
    dispatch._CALLS.clear()
    dispatch._set_recent([])
    dispatch._make_recent(made_on_cuda)
    monkeypatch.setattr(dispatch, "raw_stream", lambda index: 1234)  # a side stream

    def broken():
        raise RuntimeError("no capture state")

    monkeypatch.setattr(dispatch, "stream_capturing", broken)
    assert _recall(q, k, v) is None
    assert torch.equal(attnselect.attention(q, k, v), first)


def _packed(count=2, longest=7, heads=(4, 2), dims=(24, 16), tokens=12, **options):
    """(q, k, v, CallOptions) of a packed self-attention call on meta tensors (no boundary is read)."""
    q, k = (torch.empty(tokens, h, dims[0], device="meta") for h in heads)
    v = torch.empty(tokens, heads[1], dims[1], device="meta")
    cu = torch.empty(count + 1, dtype=torch.int32, device="meta")
    options = CallOptions("thd", **{"causal": True, "max_seqlen_q": longest, "max_seqlen_kv": longest, **options},
                          cu_seqlens_q=cu)  # fmt: skip
    return q, k, v, options


def test_a_packed_call_known_but_for_its_packing_s_sizes_has_that_call_as_its_sibling():
    first = dispatch.recall(*_packed())
    assert type(first) is Unknown and first.sibling is None
    known = KnownCall(None, None, None, None, False, None)
    first.remember(known)
    again = dispatch.recall(*_packed(count=5, longest=9))  # a new packing: other sizes, the rest alike
    assert type(again) is Unknown and again.sibling is known
    assert dispatch.recall(*_packed(tokens=13)).sibling is None  # other tensors
    assert dispatch.recall(*_packed(count=5, causal=False)).sibling is None  # other options
    assert dispatch.recall(*_packed(count=5, return_lse=True)).sibling is None
    attnselect.clear_cache()
    assert dispatch.recall(*_packed(count=5)).sibling is None


def test_a_new_packing_shares_its_sibling_s_guard_and_is_told_apart_by_its_boundaries_count():
    first = dispatch.recall(*_packed(count=2, longest=7))
    first.remember(two := KnownCall(None, None, None, None, False, "two"))
    again = dispatch.recall(*_packed(count=5, longest=7))  # the same longest sequence, more of them
    assert type(again) is Unknown and again.sibling is two
    again.remember(five := KnownCall(None, None, None, None, False, "five"))
    assert again.key is None  # found among the recent calls as its family: no key built
    entries = [value for value in dispatch._CALLS.values() if type(value) is dispatch._Entry]
    assert len(entries) == 1 and dispatch._RECENT == entries  # the family's one entry and guard: none made again
    assert dispatch.recall(*_packed(count=2, longest=7)) is two  # both recent: the count tells them apart
    assert dispatch.recall(*_packed(count=5, longest=7)) is five
    assert type(dispatch.recall(*_packed(count=3, longest=7))) is Unknown
    q, k, v, options = _packed(count=5, longest=7)
    assert type(dispatch.recall(q.half(), k, v, options)) is Unknown  # the shared guard still checks the rest


def _standing_family(standing=None, decision=None):
    """A packed family (:func:`_packed`'s) whose first call is kept for one class, "class", on ``decision`` (a new
    one by default), and whose ``standing`` is the one given (by default: every packing's class stands on that
    decision). (The family, its first call, the decision.)"""
    q, k, v, options = _packed()
    problem, _ = describe_call(q, k, v, options)
    made = KnownCall(problem, "its choice", "its target", "its call", False, "its runner")
    family = dispatch.recall(q, k, v, options).remember(made)
    decision = decision or object()
    family.classes["class"] = (decision, made)
    family.standing = standing or (lambda problem: ("class", decision))
    return family, made, decision


def test_a_new_packing_of_a_standing_class_is_that_class_s_call_at_its_sizes():
    """dispatch._class_call: known without a decision, the class's call at the new sizes (then the family's last
    call, and the call at those sizes); not where the class stands on another decision, or on none."""
    family, made, decision = _standing_family()
    known = dispatch.recall(*_packed(count=5, longest=9))
    assert type(known) is KnownCall and known.problem == made.problem._at_sizes(5, 9, 9)
    assert known[1:] == made[1:] and family.last is known
    assert dispatch.recall(*_packed(count=5, longest=9)) is known
    assert type(dispatch.recall(*_packed(count=6, longest=9))) is KnownCall
    for standing in (lambda problem: ("class", object()), lambda problem: None, lambda problem: ("another", decision)):
        family.standing = standing
        unknown = dispatch.recall(*_packed(count=7, longest=9))
        assert type(unknown) is Unknown and unknown.problem == made.problem._at_sizes(7, 9, 9)
        assert unknown.sibling is family.last


def test_a_new_packing_whose_sizes_validation_must_name_is_not_a_class_s_call():
    """A boundaries count or max_seqlen out of range is not classified (validation names it): not known, no problem
    made, standing not asked; and attention() refuses it."""
    asked = []
    family, made, decision = _standing_family(lambda problem: asked.append(problem) or ("class", decision))
    for count, longest in ((5, -9), (5, 2**31)):
        unknown = dispatch.recall(*_packed(count=count, longest=longest))
        assert type(unknown) is Unknown and unknown.problem is None and unknown.sibling is not None
    assert asked == []
    q, k, v, options = _packed(count=5, longest=-9)
    with pytest.raises(attnselect.InvalidInputError, match="max_seqlen_q"):
        attnselect.attention(q, k, v, **options._asdict())


@pytest.mark.parametrize("recent", [True, False])
def test_a_standing_that_raises_raises_from_the_lookup(monkeypatch, recent):
    """An error asking whether a class stands reaches the caller, whether the family was found among the recent
    calls or by its key (not taken for a call the memo cannot describe)."""

    def broken(problem):
        raise RuntimeError("standing broke")

    _standing_family(broken)
    if not recent:
        dispatch._set_recent([])
    with pytest.raises(RuntimeError, match="standing broke"):
        dispatch.recall(*_packed(count=5, longest=9))


@pytest.mark.parametrize("stands", [True, False])
def test_a_memo_cleared_while_a_class_is_asked_keeps_nothing_of_it(stands):
    """A clear of the caches while the family asks whether a class stands: a class's call made then is not kept at
    its sizes, and a call to decide is one whose decision is not kept (Unknown.generation is from before)."""
    decision = object()

    def clearing(problem):
        attnselect.clear_cache()
        return ("class", decision) if stands else None

    family, made, _ = _standing_family(clearing, decision)
    found = dispatch.recall(*_packed(count=5, longest=9))
    assert all(sizes != (6, 9, 9) for _, sizes in dispatch._SIZED)
    if stands:
        assert type(found) is KnownCall and found.problem == made.problem._at_sizes(5, 9, 9)
    else:
        assert type(found) is Unknown
        found.remember(KnownCall(found.problem, "another", None, None, False, None))
        assert dispatch.known_calls() == []


def test_a_family_outlives_more_new_packings_than_the_memo_holds(monkeypatch):
    """A loop's new packing every step adds a call of its family's; those are bounded apart from the families, so
    a family looked up by key (more families than the recent calls hold) is still known after MEMO_SIZE packings."""
    monkeypatch.setattr(dispatch, "MEMO_SIZE", 4)
    monkeypatch.setattr(dispatch, "RECENT", 0)  # every family found by its key
    first = dispatch.recall(*_packed(count=2))
    first.remember(known := KnownCall(None, None, None, None, False, "first"))
    for count in range(3, 13):
        again = dispatch.recall(*_packed(count=count))
        assert type(again) is Unknown and again.sibling is not None and again.key is not None, count
        again.remember(known := KnownCall(None, None, None, None, False, count))
    assert dispatch.recall(*_packed(count=12)) is known
    assert len(dispatch._SIZED) == 4 and dispatch.known_calls()[-1] is known
    assert type(dispatch.recall(*_packed(count=2))) is Unknown  # the oldest sizes left the memo, not the family
    assert dispatch.recall(*_packed(count=2)).sibling is known


@pytest.mark.parametrize(
    "options",
    [{}, {"causal": "bottom_right"}, {"causal": False, "window": (5, 3)}, {"causal": True, "window": (4, 0)},
     {"softcap": 30.0, "return_lse": True}, {"dropout_p": 0.1}, {"causal": False}],
)  # fmt: skip
@pytest.mark.parametrize("grad", [False, True])
def test_a_sibling_s_problem_at_other_sizes_is_the_one_validation_describes(options, grad):
    from attnselect.spec.problem import describe_call

    with torch.set_grad_enabled(grad):
        q, k, v, first = _packed(**options)
        for t in (q, k, v):
            t.requires_grad_(grad)
        problem, _ = describe_call(q, k, v, first)
        for count, longest in ((5, 9), (0, 0), (11, 1), (1, 12)):
            *_, later = _packed(count=count, longest=longest, **options)
            expected, _ = describe_call(q, k, v, later)
            derived = problem._at_sizes(count, longest, longest)  # what attention() makes of a new packing
            assert derived == expected and derived.signature == expected.signature
            assert derived.describe() == expected.describe()
            assert derived == problem._with(batch=count, seqlen_q=longest, seqlen_kv=longest)


def test_a_shape_forgotten_forgets_its_captured_and_compiled_calls_too():
    """forget_dense (a shape's rental paid, attnselect.choose.first_calls) forgets the calls decided for that shape
    under CUDA graph capture or in a compiled graph as well: they keep their candidate for the graph's life, so the
    next capture must choose again."""
    import dataclasses

    from attnselect.spec.problem import AttentionProblem

    q, k, v = _qkv()
    attnselect.attention(q, k, v, causal=True)
    (eager,) = dispatch.known_calls()
    captured = eager._replace(problem=dataclasses.replace(eager.problem, cuda_graph_capture=True))
    _recall(*(t[:, :5] for t in (q, k, v)), causal=True).remember(captured)  # as a capture's call is remembered
    other = _qkv()
    attnselect.attention(*(t[:1] for t in other), causal=True)  # another shape: kept
    assert len(dispatch.known_calls()) == 3
    dispatch.forget_dense(AttentionProblem.from_tensors(q, k, v, causal=True))
    assert [known.problem.batch for known in dispatch.known_calls()] == [1]


def test_a_memoized_dense_call_given_max_seqlen_is_refused_as_a_first_one_is():
    """max_seqlen belongs to packed calls: a dense call that names it is refused whatever ran before (the memo's
    lookup leaves it to validation)."""
    q, k, v = _qkv()
    attnselect.attention(q, k, v)
    for name, value in (("max_seqlen_q", 5), ("max_seqlen_kv", "x")):
        with pytest.raises(attnselect.InvalidInputError, match=f"^{name}: got .*, expected None for layout"):
            attnselect.attention(q, k, v, **{name: value})
