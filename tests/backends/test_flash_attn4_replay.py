"""FlashAttention-4's dense forward replayed without its Python interface (attnselect.backends.flash_attn4_replay),
against a stand-in of FA4's interface as 4.0.0b36 lays it out: flash_attn_func prepares the call in Python, looks its
compiled kernel up in ``_flash_attn_fwd.compile_cache`` and calls it with (q, k, v, out, lse, scalars...). The GPU
test against the real package is in tests/backends/test_flash_attn4.py."""

from __future__ import annotations

import sys
import threading
import types

import pytest
import torch

import attnselect
from attnselect import backends
from attnselect.backends import flash_attn4_replay
from attnselect.execution import kernel_call
from helpers import dense_inputs, rel_err


@pytest.fixture(autouse=True)
def _no_configuration_checked(monkeypatch):
    monkeypatch.setattr(flash_attn4_replay, "_CHECKED", {})


def _kernel(q, k, v, out, lse, scale, causal, window_left, aux):
    """The stand-in's compiled kernel: attention of (B, S, H, D) tensors into ``out`` (and ``lse``, (B, H, S)). Like
    FA4's, through DLPack, it takes no tensor that requires a gradient."""
    assert not (q.requires_grad or k.requires_grad or v.requires_grad)
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    v = v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    if causal:
        sq, skv = q.shape[1], k.shape[1]
        allowed = torch.arange(skv).unsqueeze(0) <= torch.arange(sq).unsqueeze(1) + skv - sq
        scores = scores.masked_fill(~allowed, float("-inf"))
    out.copy_(torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, -1), v.float()))
    if lse is not None:
        lse.copy_(torch.logsumexp(scores, -1))


def _varlen_kernel(q, k, v, out, lse, scale, cu_q, cu_k, causal, aux):
    """The stand-in's compiled packed kernel: each sequence's attention of (T, H, D) tensors, lse (H, T)."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        sq, sk = slice(bq[i], bq[i + 1]), slice(bk[i], bk[i + 1])
        one = torch.empty(1, bq[i + 1] - bq[i], *out.shape[1:], dtype=out.dtype)
        one_lse = torch.empty(1, out.shape[1], bq[i + 1] - bq[i]) if lse is not None else None
        _kernel(q[sq][None], k[sk][None], v[sk][None], one, one_lse, scale, causal, None, aux)
        out[sq] = one[0]
        if lse is not None:
            lse[:, sq] = one_lse[0]


class StandIn:
    """A stand-in of FA4's flash_attn.cute and its interface module, counting its Python preparations."""

    def __init__(self, split=False, copies=False, extra_tensor=False, returns_copy=False, copies_boundaries=False,
                 works_after=False):  # fmt: skip
        self.prepared, self.works_after = 0, works_after
        self.split, self.copies, self.extra_tensor = split, copies, extra_tensor
        self.returns_copy, self.copies_boundaries = returns_copy, copies_boundaries
        interface = types.ModuleType("flash_attn.cute.interface")

        def _flash_attn_fwd(q, k, v, softmax_scale, causal, return_lse):
            self.prepared += 1
            if self.copies or q.data_ptr() % 16:  # maybe_contiguous
                q = q.clone()
            key = (q.dtype, q.shape[-1], v.shape[-1], q.shape[2] // k.shape[2], causal, return_lse)  # FA4's reads more
            if key not in _flash_attn_fwd.compile_cache:
                _flash_attn_fwd.compile_cache[key] = _kernel
            out = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype)
            lse = torch.empty(q.shape[0], q.shape[2], q.shape[1]) if return_lse else None
            aux = torch.zeros(1) if self.extra_tensor else None
            _flash_attn_fwd.compile_cache[key](q.detach(), k.detach(), v.detach(), out, lse, softmax_scale, causal,
                                               None, aux)  # fmt: skip
            if self.split:
                _combine.compile_cache.get("combine")
                _combine.compile_cache["combine"](out)
            if self.works_after:  # more work on the output after the kernel, in place
                out.mul_(2.0)
            return (out.clone() if self.returns_copy else out), lse

        def _combine(out):
            pass

        def _flash_attn_fwd_varlen(q, k, v, cu_q, cu_k, softmax_scale, causal, return_lse):
            self.prepared += 1
            key = ("varlen", q.dtype, q.shape[-1], v.shape[-1], causal, return_lse)
            if key not in _flash_attn_fwd.compile_cache:
                _flash_attn_fwd.compile_cache[key] = _varlen_kernel
            out = torch.empty(*q.shape[:2], v.shape[-1], dtype=q.dtype)
            lse = torch.empty(q.shape[1], q.shape[0]) if return_lse else None
            if self.split:  # more than 256 sequences: FA4 sums the tiles first (another compiled kernel)
                _combine.compile_cache["combine"](out)
            if self.copies_boundaries:
                cu_q, cu_k = cu_q.clone(), cu_k.clone()
            _flash_attn_fwd.compile_cache[key](q.detach(), k.detach(), v.detach(), out, lse, softmax_scale, cu_q, cu_k,
                                               causal, None)  # fmt: skip
            return out, lse

        _flash_attn_fwd.compile_cache = {}
        _combine.compile_cache = {"combine": lambda out: None}
        interface._flash_attn_fwd, interface._combine = _flash_attn_fwd, _combine
        cute = types.ModuleType("flash_attn.cute")

        def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(None, None), deterministic=False,
                            softcap=0.0, return_lse=False):  # fmt: skip
            assert window_size == (None, None) and softcap == 0.0
            return _flash_attn_fwd(q, k, v, softmax_scale, causal, return_lse)

        def flash_attn_varlen_func(q, k, v, cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=None,
                                   max_seqlen_k=None, softmax_scale=None, causal=False, window_size=(None, None),
                                   deterministic=False, softcap=0.0, return_lse=False):  # fmt: skip
            assert window_size == (None, None) and softcap == 0.0 and max_seqlen_q and max_seqlen_k
            return _flash_attn_fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, causal, return_lse)

        cute.flash_attn_func, cute.flash_attn_varlen_func = flash_attn_func, flash_attn_varlen_func
        cute.interface = interface
        self.cute, self.interface = cute, interface

    def install(self, monkeypatch, version="4.0.0b36"):
        monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
        monkeypatch.setitem(sys.modules, "flash_attn.cute", self.cute)
        monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", self.interface)
        monkeypatch.setattr(flash_attn4_replay, "_installed_version", lambda: version)
        return self


def _runner(q, k, v, **kwargs):
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, **kwargs)
    return backends.get("flash_attn4").runner(kernel_call(problem), repeated=True)


@pytest.mark.parametrize("kwargs", [dict(causal=True), dict(return_lse=True), dict(causal=True, return_lse=True)])
def test_a_call_of_known_shapes_replays_the_recorded_kernel_without_the_interface(monkeypatch, kwargs):
    stand_in = StandIn().install(monkeypatch)
    q, k, v = dense_inputs(sq=24, skv=24, hq=4, hkv=2, dqk=24, dv=16, requires_grad=False)
    run = _runner(q, k, v, **kwargs)
    first = run(q, k, v)
    run(q, k, v)  # the key's second call: recorded
    assert stand_in.prepared == 2
    for _ in range(3):
        q2, k2, v2 = (torch.randn_like(t) for t in (q, k, v))
        out, lse = run(q2, k2, v2)
        expected = stand_in.cute.flash_attn_func(q2, k2, v2, softmax_scale=q.shape[-1] ** -0.5,
                                                 causal=kwargs.get("causal", False), return_lse=True)  # fmt: skip
        assert torch.equal(out, expected[0])
        assert (lse is None) == (not kwargs.get("return_lse"))
        if lse is not None:
            assert torch.equal(lse, expected[1])
    assert stand_in.prepared == 2 + 3  # the replays prepared nothing: the three counted are the expected ones
    assert first[0].shape == out.shape


def test_a_replay_is_recorded_per_shape(monkeypatch):
    stand_in = StandIn().install(monkeypatch)
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    run = _runner(q, k, v, causal=True)
    run(q, k, v)
    assert stand_in.prepared == 1  # a first call goes through the interface, unrecorded
    run(q, k, v)
    longer = dense_inputs(sq=32, skv=32, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    out = run(*longer)[0]
    run(*longer)
    assert stand_in.prepared == 4 and out.shape == (2, 32, 2, 16)
    run(*longer)
    run(q, k, v)
    assert stand_in.prepared == 4


def test_paused_every_call_goes_through_the_interface_and_none_is_recorded(monkeypatch):
    stand_in = StandIn().install(monkeypatch)
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    run = _runner(q, k, v, causal=True)
    with flash_attn4_replay.paused():
        with flash_attn4_replay.paused():  # nested, as the calibration's functions call one another
            run(q, k, v)
        for _ in range(3):
            run(q, k, v)
    assert stand_in.prepared == 4 and not flash_attn4_replay._CHECKED
    run(q, k, v)  # after it: its first and second calls, then replays
    run(q, k, v)
    run(q, k, v)
    assert stand_in.prepared == 6 and flash_attn4_replay._PAUSED == [0]
    with flash_attn4_replay.paused():  # a key replayed before: its calls go through the interface meanwhile
        run(q, k, v)
        run(q, k, v)
    assert stand_in.prepared == 8
    run(q, k, v)  # replayed again after it
    assert stand_in.prepared == 8


def test_replaying_lifts_the_pauses_around_it_and_a_shape_replays_from_its_third_call(monkeypatch):
    """attnselect.bench.calibrate times FA4 replayed within its paused run: replaying() lifts the pauses for its
    block, and a key replays after CALLS_BEFORE_REPLAY calls through the interface (what the rules price)."""
    stand_in = StandIn().install(monkeypatch)
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    run = _runner(q, k, v, causal=True)
    with flash_attn4_replay.paused(), flash_attn4_replay.paused():
        run(q, k, v)
        with flash_attn4_replay.replaying():
            for _ in range(flash_attn4_replay.CALLS_BEFORE_REPLAY + 3):
                run(q, k, v)
            assert flash_attn4_replay._PAUSED == [0]
        assert flash_attn4_replay._PAUSED == [2]
        run(q, k, v)  # paused again: through the interface
    assert stand_in.prepared == 1 + flash_attn4_replay.CALLS_BEFORE_REPLAY + 1
    assert flash_attn4_replay._PAUSED == [0]


@pytest.mark.parametrize(
    "stand_in",
    [dict(split=True), dict(copies=True), dict(extra_tensor=True), dict(returns_copy=True)],
    ids=["another kernel ran", "FA4 copied q", "another tensor argument", "it returned another output"],
)
def test_a_call_that_ran_more_than_its_kernel_or_on_other_tensors_keeps_the_interface(monkeypatch, stand_in):
    stand_in = StandIn(**stand_in).install(monkeypatch)
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    run = _runner(q, k, v, causal=True)
    for _ in range(3):
        run(q, k, v)
    assert stand_in.prepared == 3


def test_an_unaligned_pointer_goes_through_the_interface(monkeypatch):
    stand_in = StandIn().install(monkeypatch)
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    run = _runner(q, k, v, causal=True)
    run(q, k, v)
    run(q, k, v)
    storage = torch.randn(q.numel() + 1, dtype=q.dtype)
    shifted = storage[1:].view_as(q)  # 4 bytes past an aligned pointer, same shape and strides
    assert shifted.stride() == q.stride() and shifted.data_ptr() % 16
    out = run(shifted, k, v)[0]
    assert stand_in.prepared == 3  # FA4 copies it (maybe_contiguous)
    ref = _runner(q, k, v, causal=True)
    assert rel_err(out, ref(shifted.clone(), k, v)[0]) == 0


def test_a_call_that_needs_gradients_goes_through_the_interface(monkeypatch):
    stand_in = StandIn().install(monkeypatch)
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=True)
    run = _runner(q, k, v, causal=True)
    for _ in range(2):
        run(q, k, v)
    assert stand_in.prepared == 2
    with torch.no_grad():  # no gradient taken: recorded at its second call, then replayed (on detached views)
        for _ in range(4):
            out = run(q, k, v)[0]
    assert stand_in.prepared == 4 and not out.requires_grad
    with torch.autograd.forward_ad.dual_level():  # a tangent: FA4's own call (its autograd Function refuses it)
        run(q.detach(), k.detach(), v.detach())
    assert stand_in.prepared == 5


def test_other_strides_are_another_key(monkeypatch):
    stand_in = StandIn().install(monkeypatch)
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    run = _runner(q, k, v, causal=True)
    run(q, k, v)
    run(q, k, v)
    strided = k.transpose(1, 2).contiguous().transpose(1, 2)  # (B, S, H, D) with heads outermost
    assert strided.shape == k.shape and strided.stride() != k.stride()
    out = run(q, strided, v)[0]
    assert stand_in.prepared == 3
    assert torch.equal(out, run(q, k, v)[0])


@pytest.mark.parametrize("version", ["4.0.0b35", None])
def test_another_fa4_version_is_not_replayed(monkeypatch, version):
    stand_in = StandIn().install(monkeypatch, version=version)
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    run = _runner(q, k, v, causal=True)
    for _ in range(2):
        run(q, k, v)
    assert stand_in.prepared == 2


def test_a_window_softcap_or_one_off_runner_is_not_replayed(monkeypatch):
    StandIn().install(monkeypatch)
    asked = []
    monkeypatch.setattr(flash_attn4_replay, "replays", lambda *args, **kwargs: asked.append(args))
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    base = backends.get("flash_attn4")
    base.runner(kernel_call(attnselect.AttentionProblem.from_tensors(q, k, v, window=(4, 0))), repeated=True)
    base.runner(kernel_call(attnselect.AttentionProblem.from_tensors(q, k, v), softcap=30.0), repeated=True)
    assert not asked  # a window's edges read the lengths; softcap becomes a score_mod
    causal = kernel_call(attnselect.AttentionProblem.from_tensors(q, k, v, causal=True))
    base.runner(causal)  # a one-off runner (a call under torch.compile, the self-check's) never calls again
    assert not asked
    base.runner(causal, repeated=True)
    assert len(asked) == 1


def test_recording_restores_the_compile_caches_and_notes_the_recording_thread_only(monkeypatch):
    stand_in = StandIn().install(monkeypatch)
    caches = (stand_in.interface._flash_attn_fwd.compile_cache, stand_in.interface._combine.compile_cache)
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    other: list = []

    def call():
        # another thread's FA4 call meanwhile runs through the watched caches, unnoted
        fa4 = stand_in.cute.flash_attn_func
        thread = threading.Thread(target=lambda: other.append(fa4(q, k, v, softmax_scale=1.0)))
        thread.start()
        thread.join()
        return stand_in.cute.flash_attn_func(q, k, v, softmax_scale=1.0)

    result, recorded = flash_attn4_replay.record(stand_in.interface, call, q, k, v)
    assert recorded is not None and len(other) == 1
    assert (stand_in.interface._flash_attn_fwd.compile_cache, stand_in.interface._combine.compile_cache) == caches
    assert torch.equal(recorded(q, k, v)[0], result[0])


def test_a_runner_keeps_a_bounded_number_of_shapes(monkeypatch):
    StandIn().install(monkeypatch)
    monkeypatch.setattr(flash_attn4_replay, "KEYS_KEPT", 3)
    q, k, v = dense_inputs(sq=8, skv=8, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    replays = flash_attn4_replay.replays(sys.modules["flash_attn.cute"], sys.modules["flash_attn.cute"].flash_attn_func,
                                         dict(softmax_scale=0.25, causal=True, return_lse=False))  # fmt: skip
    for s in range(8, 14):
        replays(*dense_inputs(sq=s, skv=s, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False))
    assert len(replays.kept) == 3


def _packing(lengths):
    from attnselect.spec.options import Packing

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return Packing(cu, cu, max(lengths), max(lengths), cu, cu)


@pytest.mark.parametrize("return_lse", [False, True])
def test_a_packed_call_replays_with_its_own_boundaries(monkeypatch, return_lse):
    """A packing of the same sequence count and longest lengths as a recorded one replays the kernel on its own
    boundaries; another longest length is another key."""
    stand_in = StandIn().install(monkeypatch)
    torch.manual_seed(0)
    q, k = (torch.randn(20, 2, 16, dtype=torch.float64) for _ in range(2))
    v = torch.randn(20, 2, 8, dtype=torch.float64)
    problem = attnselect.AttentionProblem(3, 9, 9, 2, 2, 16, 8, layout="thd", mask="causal", return_lse=return_lse,
                                          dtype=torch.float64, tokens=20)  # fmt: skip
    run = backends.get("flash_attn4").packed_runner(kernel_call(problem), repeated=True)
    with torch.no_grad():
        for _ in range(2):
            run(q, k, v, _packing([9, 6, 5]))
        assert stand_in.prepared == 2
        other = _packing([5, 6, 9])  # other boundaries, the same count and longest
        out, lse = run(q, k, v, other)
        assert stand_in.prepared == 2
        cu = other.cu_seqlens_q
        expected = stand_in.cute.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, softmax_scale=16**-0.5, causal=True,
                                                        return_lse=True)  # fmt: skip
        assert torch.equal(out, expected[0]) and (lse is None) == (not return_lse)
        assert lse is None or torch.equal(lse, expected[1])
        run(q, k, v, _packing([8, 8, 4]))  # another longest length: another key, not recorded yet
        assert stand_in.prepared == 4


def test_a_packed_call_that_ran_another_kernel_keeps_the_interface(monkeypatch):
    stand_in = StandIn(split=True).install(monkeypatch)
    q, k = (torch.randn(20, 2, 16, dtype=torch.float64) for _ in range(2))
    v = torch.randn(20, 2, 8, dtype=torch.float64)
    problem = attnselect.AttentionProblem(3, 9, 9, 2, 2, 16, 8, layout="thd", mask="causal", dtype=torch.float64,
                                          tokens=20)  # fmt: skip
    run = backends.get("flash_attn4").packed_runner(kernel_call(problem), repeated=True)
    with torch.no_grad():
        for _ in range(4):
            run(q, k, v, _packing([9, 6, 5]))
    assert stand_in.prepared == 4


def test_a_packing_of_other_q_and_kv_boundaries_replays_each_in_its_place(monkeypatch):
    stand_in = StandIn().install(monkeypatch)
    from attnselect.spec.options import Packing

    torch.manual_seed(1)
    q = torch.randn(12, 2, 16, dtype=torch.float64)
    k = torch.randn(20, 2, 16, dtype=torch.float64)
    v = torch.randn(20, 2, 8, dtype=torch.float64)
    problem = attnselect.AttentionProblem(3, 6, 9, 2, 2, 16, 8, layout="thd", mask="causal_bottom_right",
                                          dtype=torch.float64, tokens=12)  # fmt: skip

    def packing(q_lengths, kv_lengths):
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(ls).cumsum(0).tolist()], dtype=torch.int32)
                      for ls in (q_lengths, kv_lengths))  # fmt: skip
        return Packing(cu_q, cu_k, max(q_lengths), max(kv_lengths), cu_q, cu_k)

    run = backends.get("flash_attn4").packed_runner(kernel_call(problem), repeated=True)
    for _ in range(2):
        run(q, k, v, packing([6, 2, 4], [9, 5, 6]))
    other = packing([2, 4, 6], [6, 5, 9])
    out = run(q, k, v, other)[0]
    assert stand_in.prepared == 2
    expected = stand_in.cute.flash_attn_varlen_func(q, k, v, other.cu_seqlens_q, other.cu_seqlens_kv, 6, 9,
                                                    softmax_scale=16**-0.5, causal=True)  # fmt: skip
    assert torch.equal(out, expected[0])


def test_a_packed_call_whose_boundaries_fa4_copied_keeps_the_interface(monkeypatch):
    stand_in = StandIn(copies_boundaries=True).install(monkeypatch)
    q, k = (torch.randn(20, 2, 16, dtype=torch.float64) for _ in range(2))
    v = torch.randn(20, 2, 8, dtype=torch.float64)
    problem = attnselect.AttentionProblem(3, 9, 9, 2, 2, 16, 8, layout="thd", mask="causal", dtype=torch.float64,
                                          tokens=20)  # fmt: skip
    run = backends.get("flash_attn4").packed_runner(kernel_call(problem), repeated=True)
    for _ in range(4):
        run(q, k, v, _packing([9, 6, 5]))
    assert stand_in.prepared == 4


def test_a_replay_that_differs_from_fa4s_own_call_at_its_recording_is_not_kept(monkeypatch, caplog):
    """FA4 worked on the output after its kernel (in place): the replay, checked at its recording, differs, and the
    key keeps FA4's own call, warned of."""
    stand_in = StandIn(works_after=True).install(monkeypatch)
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    run = _runner(q, k, v, causal=True)
    with caplog.at_level("WARNING", logger="attnselect"):
        outs = [run(q, k, v)[0] for _ in range(4)]
    assert stand_in.prepared == 4 and all(torch.equal(out, outs[0]) for out in outs)
    assert "differed from FA4's own call" in caplog.text


def test_a_replay_that_raises_at_its_recording_is_not_kept(monkeypatch, caplog):
    stand_in = StandIn().install(monkeypatch)
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    run = _runner(q, k, v, causal=True)
    run(q, k, v)
    calls = []

    def broken(self, *args):
        calls.append(args)
        raise RuntimeError("a kernel argument the recording missed")

    monkeypatch.setattr(flash_attn4_replay.Recorded, "__call__", broken)
    with caplog.at_level("WARNING", logger="attnselect"):
        for _ in range(3):
            run(q, k, v)
    assert len(calls) == 1 and stand_in.prepared == 4 and "raised RuntimeError" in caplog.text
    longer = dense_inputs(sq=32, skv=32, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    for _ in range(3):  # another key of the configuration: recorded, not replayed, not checked again
        run(*longer)
    assert len(calls) == 1 and stand_in.prepared == 7


def test_a_compiled_kernel_is_checked_once_a_process(monkeypatch):
    """Runners of the same options whose calls ran one compiled kernel (a dense call's runner is per shape) share its
    check; another kernel (FA4's compile key reads the heads per K/V head) is checked again."""
    stand_in = StandIn().install(monkeypatch)
    checks, check = [], flash_attn4_replay._checked
    monkeypatch.setattr(flash_attn4_replay, "_checked", lambda *args: checks.append(args) or check(*args))
    for s in (16, 24, 32):
        tensors = dense_inputs(sq=s, skv=s, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
        run = _runner(*tensors, causal=True)  # as the memo makes a runner for each new shape
        for _ in range(3):
            run(*tensors)
    assert len(checks) == 1 and stand_in.prepared == 3 * 2
    grouped = dense_inputs(sq=16, skv=16, hq=4, hkv=2, dqk=16, dv=16, requires_grad=False)
    run = _runner(*grouped, causal=True)
    for _ in range(3):
        run(*grouped)
    assert len(checks) == 2


def test_the_check_compares_bits_so_a_nan_in_the_output_passes_it(monkeypatch):
    """A warm-up on uninitialized memory may give NaN: equal bits pass the check (torch.equal calls NaN unequal)."""
    StandIn().install(monkeypatch)
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    q[0, 0, 0, 0] = float("nan")
    run = _runner(q, k, v, causal=True)
    for _ in range(2):
        run(q, k, v)
    assert list(flash_attn4_replay._CHECKED.values()) == [True]


def test_a_failure_reading_a_recording_is_not_the_kernels(monkeypatch):
    """An error in this module's reading of what FA4 ran leaves the call's result and FA4's own call, not a failure
    of the kernel (which would refuse FA4 for the signature)."""
    stand_in = StandIn().install(monkeypatch)

    def unreadable(*args):
        raise RuntimeError("a tensor without a data pointer")

    monkeypatch.setattr(flash_attn4_replay, "_recorded", unreadable)
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    run = _runner(q, k, v, causal=True)
    outs = [run(q, k, v)[0] for _ in range(3)]
    assert stand_in.prepared == 3 and all(torch.equal(out, outs[0]) for out in outs)


def test_a_runner_of_calls_like_its_first_works_out_no_key(monkeypatch):
    """attention()'s memoized dense calls (the runner made with ``like``) are each like the first, its memo checked
    them: the runner replays without working out the tensors' key again."""
    stand_in = StandIn().install(monkeypatch)
    q, k, v = dense_inputs(sq=16, skv=16, hq=2, hkv=2, dqk=16, dv=16, requires_grad=False)
    problem = attnselect.AttentionProblem.from_tensors(q, k, v, causal=True)
    run = backends.get("flash_attn4").runner(kernel_call(problem), repeated=True, like=(q, k, v))
    monkeypatch.setattr(flash_attn4_replay, "_tensors_key", None)  # called, it would raise
    outs = [run(q, k, v)[0] for _ in range(4)]
    assert stand_in.prepared == 2 and all(torch.equal(out, outs[0]) for out in outs)
