"""The timing of candidates (attnselect.choose.timing): warm-up, repeats, rounds, budget, spins, settling."""

from __future__ import annotations

import dataclasses
import logging
import weakref

import pytest
import torch

from attnselect import AttentionProblem
from attnselect.choose import timing
from attnselect.choose.timing import NewPackings


def test_time_step_counts_warmup_repeats_and_budget():
    calls = []
    timed = timing.time_step(lambda: calls.append(1), torch.device("cpu"), warmup=2, repeats=5)
    assert len(calls) == 7 and 0 <= timed.low_ms <= timed.median_ms <= timed.high_ms
    calls.clear()
    timing.time_step(lambda: calls.append(1), torch.device("cpu"), warmup=0, repeats=50, budget_s=0.0)
    assert len(calls) == 1 + 3  # one call sizes the repeats; a spent budget still times three
    calls.clear()
    timing.time_step(lambda: calls.append(1), torch.device("cpu"), warmup=0, repeats=4, queued=False)
    assert len(calls) == 4


def test_time_steps_interleave_rounds_and_report_failures():
    order = []

    def step(name):
        return lambda: order.append(name) or torch.ones(1)

    def nan():
        return torch.full((1,), float("nan"))

    def broken():
        raise RuntimeError("no kernel")

    results = timing.time_steps(
        {"a": step("a"), "b": step("b"), "nan": nan, "broken": broken},
        torch.device("cpu"),
        warmup=1,
        repeats=4,
        rounds=2,
        finite=True,
    )
    assert order == ["a", "b"] + ["a", "a", "b", "b"] + ["b", "b", "a", "a"]  # warm-up, then every step's turn
    assert isinstance(results["a"], timing.Timing) and isinstance(results["b"], timing.Timing)
    assert isinstance(results["nan"], FloatingPointError) and isinstance(results["broken"], RuntimeError)
    assert list(results) == ["a", "b", "nan", "broken"]


def test_time_steps_warm_up_while_half_the_budget_lasts(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def slow():  # each call takes 1 s of the clock
        now[0] += 1.0

    steps = {"first": slow, "second": slow, "third": slow}
    results = timing.time_steps(
        steps, torch.device("cpu"), warmup=1, repeats=3, rounds=3, budget_s=4.0, warmup_budget_s=2.0
    )
    assert list(results) == ["first", "second"]  # warm-up and sizing took 4 s: the third is left out
    assert all(isinstance(t, timing.Timing) for t in results.values())
    now[0] = 0.0  # a budget alone sizes the repeats (three at least) and never leaves a step out
    assert list(timing.time_steps(steps, torch.device("cpu"), warmup=1, repeats=30, budget_s=1.0)) == list(steps)


def test_no_step_always_follows_the_same_one():
    keys = ["torch-default", "a", "b", "c"]
    orders = [timing._round_order(keys, index) for index in range(4)]
    assert orders[0] == keys and all(sorted(o) == sorted(keys) for o in orders)
    before = {tuple(o[i - 1] for i in range(1, len(o)) if o[i] == "torch-default") for o in orders}
    assert len(before) >= 3  # first of its round, or after two different steps
    assert timing._round_order([], 3) == []


def test_on_a_gpu_each_turn_starts_behind_a_spin_long_enough_to_issue_its_repeats(monkeypatch):
    events, now = [], [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(timing.torch.cuda, "_sleep", lambda cycles: events.append(("spin", cycles)))

    def timed_call(step, device, *, wait):
        step()
        return lambda: 1.0

    monkeypatch.setattr(timing, "_timed_call", timed_call)

    def issuing(name, host_s):  # the host needs host_s to issue one call
        def step():
            events.append(name)
            now[0] += host_s

        return step

    timing.time_steps(
        {"slow_host": issuing("slow_host", 0.002), "fast_host": issuing("fast_host", 0.0001)},
        torch.device("cuda"),
        warmup=1,
        repeats=6,
        rounds=2,
    )
    timed = events[4:]  # after warm-up and the sizing calls (each took 1 ms on the GPU's clock)
    # slow_host: 2 ms to issue, about 0 on the GPU: twice (2 + 3 repeats x 2) ms; fast_host: twice its 0.1 ms
    assert timed[:4] == [("spin", int(2 * (2.0 + 3 * 2.0) * timing.SPIN_CYCLES_PER_MS) + 1)] + ["slow_host"] * 3
    assert timed[4][0] == "spin" and timed[4][1] == pytest.approx(2 * 0.1 * timing.SPIN_CYCLES_PER_MS, rel=1e-5)
    assert sum(e[0] == "spin" for e in timed) == 4  # one per step and round


def test_the_budget_counts_the_spins(monkeypatch):
    events, now = [], [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(timing.torch.cuda, "_sleep", lambda cycles: events.append(cycles))

    def timed_call(step, device, *, wait):
        step()
        return lambda: 1.0  # 1 ms on the GPU's clock, synchronised

    monkeypatch.setattr(timing, "_timed_call", timed_call)
    calls = {"slow_host": 0, "fast_host": 0}

    def issuing(name, host_s):
        def step():
            calls[name] += 1
            now[0] += host_s

        return step

    timing.time_steps(
        {"slow_host": issuing("slow_host", 0.002), "fast_host": issuing("fast_host", 0.0001)},
        torch.device("cuda"),
        warmup=1,
        repeats=30,
        rounds=2,
        budget_s=0.1,
    )
    # warm-up and sizing took 4.2 ms; a round of n costs the spins' 4.2 ms plus n x 6 ms (sizes 2 ms, and 4 ms
    # of the slow host's spin per repeat): (95.8 / 2 - 4.2) / 6 -> 7 repeats a round instead of 15
    assert calls == {"slow_host": 2 + 2 * 7, "fast_host": 2 + 2 * 7}
    assert events[0] == int(2 * (2.0 + 7 * 2.0) * timing.SPIN_CYCLES_PER_MS) + 1


def test_a_step_failing_in_a_timed_round_leaves_the_rounds_with_its_error():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 4:
            raise MemoryError("out of memory on the fourth call")

    results = timing.time_steps(
        {"flaky": flaky, "steady": lambda: None}, torch.device("cpu"), warmup=1, repeats=6, rounds=3
    )
    assert isinstance(results["flaky"], MemoryError) and isinstance(results["steady"], timing.Timing)
    assert len(calls) == 4  # no more calls after its failure


def test_time_step_spread_stays_inside_the_samples(monkeypatch):
    clock = iter([0.0, 0.0, 0.001, 0.001, 0.003, 0.003, 0.004])  # start, then repeats of 1, 2 and 1 ms
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock))
    timed = timing.time_step(lambda: None, torch.device("cpu"), warmup=0, repeats=3)
    assert (timed.low_ms, timed.median_ms, timed.high_ms) == pytest.approx((1.0, 1.0, 1.6))  # not beyond 1..2


def _clocked_steps(monkeypatch, seconds: dict):
    """Steps that each advance a mocked clock by their time, counting their calls."""
    now, calls = [0.0], {name: 0 for name in seconds}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def takes(name):
        def step():
            calls[name] += 1
            now[0] += seconds[name]

        return step

    return {name: takes(name) for name in seconds}, calls


def test_after_the_first_round_only_the_contenders_go_on(monkeypatch):
    steps, calls = _clocked_steps(monkeypatch, {"fast": 1.0, "close": 1.1, "slow": 3.0})
    results = timing.time_steps(steps, torch.device("cpu"), warmup=0, repeats=6, rounds=3, keep_within=1.25)
    # one sizing call each; the first round screens with three, then two a round
    assert calls == {"fast": 1 + 3 + 2 + 2, "close": 1 + 3 + 2 + 2, "slow": 1 + 3}
    assert results["slow"].median_ms == pytest.approx(3000.0)  # its first round's timing stands


def test_the_budget_left_after_the_first_round_goes_to_the_contenders(monkeypatch):
    seconds = {"fast": 0.010, "close": 0.011, "slow": 0.020, "far": 0.050}
    steps, calls = _clocked_steps(monkeypatch, seconds)
    results = timing.time_steps(
        steps, torch.device("cpu"), warmup=1, repeats=30, rounds=3, budget_s=1.0, keep_within=1.25
    )
    # warm-up and sizing: 2 calls each (182 ms); "far" (over 4x the fastest) leaves on its sizing call; the
    # screening round runs three of the others (123 ms); "slow" leaves, and the 695 ms left buy the full
    # 10 per round for the two contenders.
    assert calls == {"fast": 2 + 3 + 20, "close": 2 + 3 + 20, "slow": 2 + 3, "far": 2}
    assert results["far"].median_ms == pytest.approx(50.0) and results["slow"].median_ms == pytest.approx(20.0)
    steps, calls = _clocked_steps(monkeypatch, seconds)
    timing.time_steps(steps, torch.device("cpu"), warmup=1, repeats=30, rounds=3, budget_s=0.3, keep_within=1.25)
    # 118 ms left after sizing: half of it buys one screening repeat (41 ms each); the contenders still
    # get three repeats in all
    assert calls == {"fast": 2 + 1 + 2, "close": 2 + 1 + 2, "slow": 2 + 1, "far": 2}


def test_near_ties_settle_in_more_rounds_until_the_cap_or_the_time(monkeypatch):
    seconds = {"fast": 0.010, "tie": 0.0102, "close": 0.011}  # "close" contends (within 25%), but no tie (3%)
    steps, calls = _clocked_steps(monkeypatch, seconds)
    results = timing.time_steps(
        steps,
        torch.device("cpu"),
        warmup=0,
        repeats=6,
        rounds=3,
        keep_within=1.25,
        settle=timing.Settle(within=1.03, seconds=60.0, rounds=10),
    )
    # one sizing call; three in the screening round, two in each of the two others; then 7 settling rounds of two
    assert calls == {"fast": 1 + 3 + 4 + 14, "tie": 1 + 3 + 4 + 14, "close": 1 + 3 + 4}
    assert results["close"].median_ms == pytest.approx(11.0) and results["tie"].median_ms == pytest.approx(10.2)
    steps, calls = _clocked_steps(monkeypatch, seconds)
    timing.time_steps(
        steps,
        torch.device("cpu"),
        warmup=0,
        repeats=6,
        rounds=3,
        keep_within=1.25,
        settle=timing.Settle(within=1.03, seconds=0.1, rounds=100),
    )
    # 100 ms of settling: each round of the tied pair takes 40.4 ms, so a third round starts at 80.8 ms
    assert calls["fast"] == 1 + 3 + 4 + 2 * 3 and calls["close"] == 1 + 3 + 4
    steps, calls = _clocked_steps(monkeypatch, {"fast": 0.010, "close": 0.011})
    timing.time_steps(
        steps,
        torch.device("cpu"),
        warmup=0,
        repeats=6,
        rounds=3,
        keep_within=1.25,
        settle=timing.Settle(within=1.03, seconds=60.0, rounds=10),
    )
    assert calls == {"fast": 1 + 3 + 4, "close": 1 + 3 + 4}  # no tie, nothing to settle


def test_one_round_with_contenders_is_the_screening_alone(monkeypatch):
    steps, calls = _clocked_steps(monkeypatch, {"fast": 0.010, "close": 0.011})
    for budget in (None, 1.0):
        calls.update(fast=0, close=0)
        results = timing.time_steps(
            steps, torch.device("cpu"), warmup=0, repeats=6, rounds=1, budget_s=budget, keep_within=1.25
        )
        assert calls == {"fast": 1 + 3, "close": 1 + 3} and results["fast"].repeats == 3


def test_only_gpu_time_puts_a_step_far_behind_on_its_sizing_call(monkeypatch):
    now, last = [0.0], [None]
    host_s = {"fast": 0.0001, "host_bound": 0.005, "far": 0.0001}
    gpu_ms = {"fast": 1.0, "host_bound": 5.2, "far": 10.0}  # host_bound: the GPU waits on its 5 ms of issuing
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(timing.torch.cuda, "_sleep", lambda cycles: None)

    def timed_call(step, device, *, wait):
        step()
        elapsed = gpu_ms[last[0]]
        return lambda: elapsed

    monkeypatch.setattr(timing, "_timed_call", timed_call)

    def issuing(name):
        def step():
            last[0] = name
            now[0] += host_s[name]

        return step

    results = timing.time_steps(
        {name: issuing(name) for name in host_s}, torch.device("cuda"), warmup=0, repeats=6, rounds=3, keep_within=10.0
    )
    assert results["far"].repeats == 1 and results["far"].median_ms == 10.0  # 9.9 ms on the GPU: over 4x
    assert results["host_bound"].repeats == 3 + 4  # 5.2 ms in all, but 0.2 on the GPU: screened, and contends


def test_a_budget_short_of_a_repeat_a_round_runs_fewer_rounds_not_empty_ones(monkeypatch):
    steps, calls = _clocked_steps(monkeypatch, {"fast": 0.100, "close": 0.105})
    results = timing.time_steps(
        steps, torch.device("cpu"), warmup=0, repeats=32, rounds=16, budget_s=2.0, keep_within=1.25
    )
    # sizing 205 ms, screening three (615 ms); the 1180 ms left buy five more rounds of one, not 15 rounds of none
    assert calls == {"fast": 1 + 3 + 5, "close": 1 + 3 + 5} and results["close"].repeats == 8


def test_a_step_failing_while_settling_keeps_its_earlier_timing(monkeypatch, caplog):
    steps, calls = _clocked_steps(monkeypatch, {"fast": 0.010, "tie": 0.0102})
    steady = steps["tie"]

    def tie():
        if calls["tie"] >= 12:  # fine through the rounds and two settling rounds, then fails in the third
            raise RuntimeError("launch failure")
        steady()

    steps["tie"] = tie
    with caplog.at_level(logging.WARNING, logger="attnselect"):
        results = timing.time_steps(
            steps,
            torch.device("cpu"),
            warmup=0,
            repeats=6,
            rounds=3,
            keep_within=1.25,
            settle=timing.Settle(within=1.03, seconds=60.0, rounds=10),
        )
    assert isinstance(results["tie"], timing.Timing) and results["tie"].repeats == 3 + 4 + 4
    assert calls["fast"] == 1 + 3 + 4 + 2 * 3  # settling stops when no near-tie is left
    assert "tie failed while settling a near-tie, after 11 timed calls; those stand" in caplog.text


def test_no_settling_when_its_rounds_are_spent_already(monkeypatch):
    steps, calls = _clocked_steps(monkeypatch, {"fast": 0.010, "tie": 0.0102})
    timing.time_steps(
        steps,
        torch.device("cpu"),
        warmup=0,
        repeats=6,
        rounds=3,
        keep_within=1.25,
        settle=timing.Settle(within=1.03, seconds=60.0, rounds=3),
    )
    assert calls == {"fast": 1 + 3 + 4, "tie": 1 + 3 + 4}


def test_a_failed_step_keeps_its_error_but_not_the_tensors_its_frames_held():
    held = []

    def broken():
        big = torch.ones(4)
        held.append(weakref.ref(big))
        try:
            raise MemoryError("out of memory")
        except MemoryError as inner:
            raise RuntimeError("allocation failed") from inner

    error = timing.time_steps({"broken": broken}, torch.device("cpu"), warmup=1)["broken"]
    assert isinstance(error, RuntimeError) and isinstance(error.__cause__, MemoryError)
    assert error.__traceback__ is not None and held[0]() is None  # printable, and the tensor is freed


@pytest.mark.parametrize("batch,sq,skv", [(32, 512, 512), (4, 64, 256), (8, 100, 60), (1, 128, 128)])
def test_measure_times_a_new_packing_of_the_bucket_every_call(batch, sq, skv):
    problem = AttentionProblem(batch, sq, skv, 2, 2, 16, 16, layout="thd", mask="causal", training=True)
    q, k, v, grad_out, packings = timing.random_inputs(problem, torch.device("cpu"))
    assert (
        q.shape[0] == packings.tokens_q
        and k.shape[0] == v.shape[0] == packings.tokens_kv == grad_out.shape[0] * skv // sq
    )
    seen = set()
    for _ in range(timing.NewPackings.COUNT):
        p = packings()
        lengths_q, lengths_kv = (torch.diff(cu).tolist() for cu in (p.cu_seqlens_q, p.cu_seqlens_kv))
        assert sum(lengths_q) == q.shape[0] and sum(lengths_kv) == k.shape[0]
        assert max(lengths_q) == p.max_seqlen_q <= sq and max(lengths_kv) == p.max_seqlen_kv <= skv
        assert (p.cu_seqlens_kv is p.cu_seqlens_q) == (sq == skv)
        if batch > 1:
            assert batch // 2 < len(lengths_q) <= batch and p.max_seqlen_q > sq // 2
            assert [n * skv for n in lengths_q] == [n * sq for n in lengths_kv]  # the problem's ratio, per sequence
        seen.add(tuple(lengths_q))
    assert packings().cu_seqlens_q is not packings().cu_seqlens_q  # new tensors every call
    assert len(seen) >= (1 if batch == 1 else timing.NewPackings.COUNT // 2)


def test_a_packed_problem_s_packings_hold_its_tokens():
    problem = AttentionProblem(8, 16, 16, 2, 2, 16, 16, torch.float32, layout="thd", mask="causal", tokens=100)
    packings = NewPackings(problem, torch.device("cpu"))
    assert packings.tokens_q == 100
    for _ in range(packings.COUNT):
        p = packings()
        assert int(p.cu_seqlens_q[-1]) == 100 and p.cu_seqlens_q.numel() - 1 <= 8 and p.max_seqlen_q <= 16
    assert NewPackings(dataclasses.replace(problem, tokens=0), torch.device("cpu")).tokens_q == 64  # B x S / 2
    few = dataclasses.replace(problem, tokens=5)  # fewer tokens than the longest sequence may hold
    assert all(int(p.cu_seqlens_q[-1]) == 5 for p in (NewPackings(few, torch.device("cpu"))() for _ in range(64)))


@pytest.mark.parametrize("batch,seqlen,tokens", [(8, 16, 100), (64, 16384, 65536), (4, 512, 0), (8, 16, 10), (1, 9, 0)])
def test_spanning_packings_range_the_longest_sequence_from_an_even_share_to_the_most(batch, seqlen, tokens):
    problem = AttentionProblem(batch, seqlen, seqlen, 2, 2, 16, 16, torch.float32, layout="thd", mask="causal",
                               tokens=tokens)  # fmt: skip
    packings = NewPackings(problem, torch.device("cpu"))
    spanning = packings.spanning()
    total = packings.tokens_q
    for p in spanning:
        lengths = torch.diff(p.cu_seqlens_q)
        assert int(lengths.sum()) == total and int(lengths.min()) >= 1 and int(lengths.max()) == p.max_seqlen_q
        assert lengths.numel() <= batch and p.cu_seqlens_kv is p.cu_seqlens_q
    longest = sorted({p.max_seqlen_q for p in spanning})
    assert longest[0] == -(-total // batch) and longest[-1] == min(seqlen, total)
    assert all(b <= a * 1.5 for a, b in zip(longest, longest[1:]))  # steps of about sqrt(2)


def test_spanning_packings_keep_the_query_to_key_ratio():
    problem = AttentionProblem(4, 6, 9, 2, 2, 16, 16, torch.float32, layout="thd", mask="causal_bottom_right")
    for p in NewPackings(problem, torch.device("cpu")).spanning():
        assert (torch.diff(p.cu_seqlens_kv) * 2 == torch.diff(p.cu_seqlens_q) * 3).all()
        assert p.max_seqlen_kv * 2 == p.max_seqlen_q * 3
