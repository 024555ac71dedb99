"""attnselect calibrate (attnselect.bench.calibrate): its measurement is a calibration the rules can read."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import statistics

import pytest
import torch

import attnselect
from attnselect import cli
from attnselect.bench import calibrate
from attnselect.choose import calibration, predict
from attnselect.choose.predict import work
from attnselect.choose.timing import NewPackings
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def small_first_calls(monkeypatch):
    """First calls measured at small sizes: the CPU's time is the tests', not the sizes'."""
    monkeypatch.setattr(calibrate, "FIRST_CALL_SIZES", {"bshd": ((1, 32), (1, 64)), "thd": ((2, 16), (2, 32))})


def test_a_quick_calibration_on_the_cpu_is_one_the_rules_can_read():
    seen = []
    data = calibrate.run(
        attention=attnselect.attention, quick=True, progress=lambda done, total, what: seen.append((done, total))
    )
    assert calibration._problem(data) is None and data["fingerprint"]["name"] == "cpu"
    # first calls (dense, packed), then the ladder: dense, packed (nothing packs on the CPU in training), host again
    assert seen[0] == (0, 2) and seen[-1] == (3, 3)
    curves = data["gpu"]["sdpa_flash"]
    assert set(curves) == {"dense 192/128+pad training"} and "flex" in data["skipped"]
    assert all(len(points) == 2 and points[0][0] < points[1][0] for points in curves.values())
    problem = AttentionProblem(1, 256, 256, 16, 16, 192, 128, mask="causal", training=True)
    time = predict.predict(Candidate("sdpa_flash", 192), problem, data)
    assert time is not None and time.host_us == data["host_us"]["sdpa_flash"]["dense+pad training"]
    assert data["first_call_ms"]["sdpa_flash"]["dense+pad training"] >= 0
    assert data["new_size_ms"]["sdpa_flash"]["dense+pad training"] >= 0


def test_first_calls_are_priced_by_configuration_and_size_with_the_process_start_up_left_out(monkeypatch):
    """A backend's first call in the process (start-up), a configuration's first call, a new size's: each paid once,
    each found where it belongs (attnselect.bench.calibrate.first_call_costs); a one-off at the first larger size (a
    kernel variant loaded) is not a size's cost."""
    import time

    seen: set = set()
    costs = {"start-up": 1.0, "configuration": 0.3, "size": 0.1, "variant": 0.2}
    monkeypatch.setattr(calibrate, "FIRST_CALL_SIZES", {"bshd": ((1, 32), (1, 64), (2, 48))})

    def attention(q, k, v, **kwargs):
        assert os.environ["ATTNSELECT_SELF_CHECK"] == "0"  # the self-check's cost is no backend's
        backend, padded, training = kwargs["backend"], kwargs["pad"], q.requires_grad
        for part, key in (
            ("start-up", (backend, training)),
            ("configuration", (backend, padded, training, q.shape[-1], v.shape[-1])),
            ("size", (backend, padded, training, q.shape[-1], v.shape[-1], q.shape)),
            # a kernel variant loaded at the first larger size, once a configuration
            ("variant", (backend, padded, training, q.shape[-1], v.shape[-1]) if q.shape[1] == 64 else ()),
        ):
            if key and (part, *key) not in seen:
                seen.add((part, *key))
                time.sleep(costs[part])
        d_v = v.shape[-1]
        return q[..., :d_v] + k[..., :d_v] + v  # no kernel: the sleeps are all the time there is to find

    before = os.environ.get("ATTNSELECT_SELF_CHECK")
    found = calibrate.first_call_costs(attention=attention, pairs=((24, 16), (32, 32)), phases=(True,))
    assert set(found) == {"first_call_ms", "new_size_ms"}
    configuration, size = found["first_call_ms"]["sdpa_flash"], found["new_size_ms"]["sdpa_flash"]
    assert set(configuration) == set(size) == {"dense training", "dense+pad training"}
    # a configuration's first call pays its first size too (400 ms); with the start-up, the median would be 900
    assert all(250 <= ms < 800 for ms in configuration.values()), configuration
    assert all(50 <= ms < 250 for ms in size.values()), size
    assert os.environ.get("ATTNSELECT_SELF_CHECK") == before  # as it was
    with pytest.raises(ValueError, match="no pair but the start-up's"):
        calibrate.first_call_costs(attention=attention, pairs=(calibrate.START_UP,))


def test_packed_calls_are_timed_by_the_candidates_that_pack_with_a_new_packing_every_call(monkeypatch):
    monkeypatch.setattr(calibrate, "SKIPPED", ("reference", "sdpa_math"))  # flex packs on the CPU (inference)
    monkeypatch.setattr(calibrate, "LADDER", ((1, 16),))
    monkeypatch.setattr(calibrate, "PACKED_LADDER", ((2, 16),))
    data = calibrate.run(attention=attnselect.attention, pairs=((24, 16),))
    assert calibration._problem(data) is None
    assert {"thd 24/16 inference", "thd 24/16+pad inference"} <= set(data["gpu"]["flex"])
    assert "thd inference" in data["host_us"]["flex"]
    assert not any(key.startswith("thd") for key in data["gpu"]["sdpa_flash"])  # sequence by sequence: not timed
    # a packed point's work: the mean over the packings timed of each one's as a prediction reads it
    problem = AttentionProblem(2, 16, 16, 16, 16, 24, 16, torch.float32, layout="thd", mask="causal")
    packings = NewPackings(problem, torch.device("cpu"))
    expected = statistics.fmean(work(dataclasses.replace(problem, batch=b, seqlen_q=mq, seqlen_kv=mkv, tokens=t))
                                for b, mq, mkv, t in packings.sizes())  # fmt: skip
    assert data["gpu"]["flex"]["thd 24/16 inference"][0][0] == round(expected, 3) != round(work(problem), 3)


def test_packed_host_times_are_taken_on_a_packing_seen_and_on_a_new_packing_each_call(monkeypatch):
    """A packed step's first layer decides and prepares for a new packing: new_packing_us times a call on a packing
    drawn (before the clock starts) for it alone, each candidate on packings of its own; host_us one repeated."""
    monkeypatch.setattr(calibrate, "SKIPPED", ("reference", "sdpa_math"))  # flex packs on the CPU (inference)
    monkeypatch.setattr(calibrate, "LADDER", ((1, 16),))
    monkeypatch.setattr(calibrate, "PACKED_LADDER", ((2, 16),))
    packings = []

    def attention(*args, **kwargs):
        if kwargs.get("layout") == "thd":
            packings.append((kwargs["backend"], kwargs["pad"], kwargs["cu_seqlens_q"]))  # kept: ids stay apart
        return attnselect.attention(*args, **kwargs)

    data = calibrate.run(attention=attention, pairs=((24, 16),))
    assert calibration._problem(data) is None
    assert set(data["new_packing_us"]["flex"]) == {"thd inference", "thd+pad inference"} <= set(data["host_us"]["flex"])
    assert not any(key.startswith("dense") for times in data["new_packing_us"].values() for key in times)
    calls = 3 + calibrate.HOST_ROUNDS * calibrate.HOST_CALLS  # warm-up and timed calls of a step
    assert calls <= NewPackings.COUNT  # none comes back to a packing it has seen
    for pad in (False, True):
        drawn = [id(cu) for backend, padded, cu in packings if backend == "flex" and padded == pad]
        assert len(drawn) >= 2 * calls and len(set(drawn)) >= calls  # one packing repeated, then a new one each call
    # a candidate's packings are its own: seeded apart
    problem = AttentionProblem(2, 16, 16, 16, 16, 24, 16, torch.float32, layout="thd", mask="causal")
    seeds = []

    def seeded(problem, device, seed=0):
        seeds.append(seed)
        return NewPackings(problem, device, seed)

    monkeypatch.setattr(calibrate, "NewPackings", seeded)
    inputs = (None, None, None, None, NewPackings(problem, torch.device("cpu")))
    candidates = [Candidate("flex"), Candidate("flex", 24)]
    steps = calibrate._new_packing_steps(attention, candidates, problem, inputs, torch.device("cpu"))
    assert all(callable(step.prepare) for step in steps.values())
    assert len(seeds) == 2 and len(set(seeds)) == 2 and 0 not in seeds  # not the seen packings' seed either
    assert (
        NewPackings(problem, torch.device("cpu"), seed=1).sizes() != NewPackings(problem, torch.device("cpu")).sizes()
    )
    # measured again with the host times (attnselect calibrate's host step)
    stale = dict(data, new_packing_us={b: {key: 1e9 for key in times} for b, times in data["new_packing_us"].items()})
    again = calibrate.host_times(stale, attention=attnselect.attention)["new_packing_us"]
    assert again.keys() == data["new_packing_us"].keys() and all(us < 1e9 for us in again["flex"].values())


def test_a_step_s_next_packing_is_drawn_before_its_clock_starts(monkeypatch):
    monkeypatch.setattr(calibrate, "HOST_ROUNDS", 1)
    monkeypatch.setattr(calibrate, "HOST_CALLS", 3)
    clock = []
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: clock.append("clock") or 0.0)

    def step():
        clock.append("call")

    step.prepare = lambda: clock.append("prepare")
    calibrate._host_us({"a": step}, torch.device("cpu"))
    assert clock[3:] == ["prepare", "clock", "call", "clock"] * 3  # after the warm-up's 3 calls


def test_host_times_are_measured_again_through_attention_on_the_machine_that_calibrated(monkeypatch):
    monkeypatch.setattr(calibrate, "LADDER", ((1, 16),))
    data = calibrate.run(attention=attnselect.attention, pairs=((24, 16),))
    calls = []

    def attention(*args, **kwargs):
        calls.append(kwargs)
        return attnselect.attention(*args, **kwargs)

    stale = dict(data, host_us={b: {key: 1e9 for key in times} for b, times in data["host_us"].items()})
    again = calibrate.host_times(stale, attention=attention)
    assert again["host_us"].keys() == data["host_us"].keys() and again["gpu"] == data["gpu"]
    assert all(us < 1e9 for times in again["host_us"].values() for us in times.values())
    assert {(c["backend"], c["pad"]) for c in calls} == {("sdpa_flash", True)}  # as attention() runs it, forced
    # the CPU its host times were measured on: this one, where it measured them all or they were this one's before
    here = calibration.host_of()
    assert data["host"] == again["host"] == {"cpu": here}
    assert calibrate.host_times(dict(stale, host={"cpu": "Old CPU"}), attention=attention)["host"] == {"cpu": here}
    kept = dict(stale, host={"cpu": "Old CPU"}, host_us={**stale["host_us"], "flash_attn4": {"dense training": 5.0}})
    mixed = calibrate.host_times(kept, attention=attention)
    assert mixed["host_us"]["flash_attn4"] == {"dense training": 5.0}  # not installed here: kept
    assert mixed["host"] == {"cpu": f"{here}; times not measured again: Old CPU"}
    elsewhere = dict(data, fingerprint=dict(data["fingerprint"], torch="2.0.0"))
    with pytest.raises(ValueError, match="the calibration ran on"):
        calibrate.host_times(elsewhere, attention=attention)


def test_flash_attention_4_is_timed_through_its_interface_not_its_replay(monkeypatch):
    from attnselect.backends import flash_attn4_replay

    monkeypatch.setattr(calibrate, "LADDER", ((1, 16),))
    paused = []

    def attention(*args, **kwargs):
        paused.append(flash_attn4_replay._PAUSED[0] > 0)
        return attnselect.attention(*args, **kwargs)

    data = calibrate.run(attention=attention, pairs=((24, 16),))
    calibrate.host_times(data, attention=attention)
    before = len(paused)  # the calls of run() and host_times()
    calibrate.first_call_costs(attention=attention, pairs=((24, 16),), phases=(False,))
    assert len(paused) > before > 0 and all(paused)
    assert flash_attn4_replay._PAUSED == [0]


def test_a_backend_that_replays_is_timed_replayed_too_in_inference_with_the_pause_lifted(monkeypatch):
    """calibrate times a replaying backend's calls (Backend.calls_before_replay) replayed, in the same rounds as
    through its interface, in inference only (a gradient needs its own call): replayed_host_us."""
    from attnselect.backends import flash_attn4_replay
    from attnselect.backends.base import get as backend_named

    monkeypatch.setattr(calibrate, "LADDER", ((1, 16),))
    monkeypatch.setattr(type(backend_named("sdpa_flash")), "calls_before_replay", 2)  # a stand-in that replays
    calls = []

    def attention(q, *args, **kwargs):
        calls.append((kwargs["backend"], q.requires_grad, flash_attn4_replay._PAUSED[0] > 0))
        return attnselect.attention(q, *args, **kwargs)

    data = calibrate.run(attention=attention, pairs=((24, 16),))
    inference = {key for key in data["host_us"]["sdpa_flash"] if key.endswith("inference")}
    assert inference and set(data["replayed_host_us"]) == {"sdpa_flash"}
    assert set(data["replayed_host_us"]["sdpa_flash"]) == inference
    assert all(us > 0 for us in data["replayed_host_us"]["sdpa_flash"].values())
    lifted = {(backend, grad) for backend, grad, paused in calls if not paused}
    assert lifted == {("sdpa_flash", False)}  # the replayed steps alone, in inference
    assert any(paused for _, _, paused in calls) and flash_attn4_replay._PAUSED == [0]
    assert calibration._problem(data) is None
    again = calibrate.host_times(dict(data, replayed_host_us={}), attention=attnselect.attention)
    assert set(again["replayed_host_us"]["sdpa_flash"]) == inference


def test_the_command_needs_a_gpu_and_keeps_a_quick_run_out_of_the_cache(capsys, tmp_path):
    assert cli.main(["calibrate", "--out", str(tmp_path / "x.json")]) == 2
    assert "without a CUDA GPU, expected one" in capsys.readouterr().err
    assert cli.main(["calibrate", "--quick"]) == 2
    assert "--quick: got no --out" in capsys.readouterr().err


@pytest.fixture
def on_an_h200(tmp_path, monkeypatch):
    """``attnselect calibrate`` as on an H200 (Target.current), its measurement the sample's, handed the progress bar
    and a checkpoint; the cache directory a fresh one. Yields the arguments each run got."""
    from helpers import CALIBRATED_H200, calibration_sample

    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(attnselect.Target, "current", classmethod(lambda cls: CALIBRATED_H200))
    runs = []

    def run(target, *, attention, quick, progress, checkpoint):
        runs.append(dict(target=target, progress=progress, checkpoint=checkpoint))
        progress(0, 1, "dense 192/128 training")
        return calibration_sample(target)

    monkeypatch.setattr(calibrate, "run", run)
    attnselect.clear_cache()
    yield runs
    attnselect.clear_cache()


def test_the_command_stores_the_calibration_where_it_takes_precedence(on_an_h200, capsys):
    from helpers import CALIBRATED_H200

    assert calibration.for_target(CALIBRATED_H200)[0] is None  # the packaged one is for other versions
    assert cli.main(["calibrate"]) == 0
    path = calibration.user_path(CALIBRATED_H200)
    assert on_an_h200[0]["progress"] is calibrate.print_progress and f"-> {path}" in capsys.readouterr().out
    found, source = calibration.for_target(CALIBRATED_H200)  # read at once: the command cleared the caches
    assert found is not None and source == str(path)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temporary or partial file left


def test_the_command_refuses_a_path_it_cannot_write_before_measuring(on_an_h200, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli.main(["calibrate", "--out", str(blocker / "h200.json")]) == 2
    assert f"--out: cannot write {blocker / 'h200.json'}" in capsys.readouterr().err and not on_an_h200
    (tmp_path / "a-dir").mkdir()
    assert cli.main(["calibrate", "--out", str(tmp_path / "a-dir")]) == 2
    assert "is a directory" in capsys.readouterr().err and not on_an_h200


def test_a_stopped_calibration_keeps_what_it_measured_apart_and_says_where(on_an_h200, monkeypatch, capsys):
    from helpers import CALIBRATED_H200, calibration_sample

    def stopped(target, *, attention, quick, progress, checkpoint):
        checkpoint(calibration_sample(target))
        raise RuntimeError("calibration stopped: AcceleratorError: an illegal memory access")

    monkeypatch.setattr(calibrate, "run", stopped)
    assert cli.main(["calibrate"]) == 1
    path = calibration.user_path(CALIBRATED_H200)
    partial = path.with_name(path.stem + ".partial.json")
    err = capsys.readouterr().err
    assert "stopped (RuntimeError: calibration stopped: AcceleratorError" in err and str(partial) in err
    assert not path.exists() and calibrate.PARTIAL in json.loads(partial.read_text())["source"]
    assert calibration.for_target(CALIBRATED_H200)[0] is None  # a partial calibration is never read


@pytest.mark.gpu
def test_the_command_writes_a_calibration_that_holds_here(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    calibration._parsed.cache_clear()
    out = tmp_path / "quick.json"
    assert cli.main(["calibrate", "--quick", "--out", str(out)]) == 0
    assert calibration.parse(out.read_text(), str(out)) is not None


def test_host_times_are_taken_side_by_side_the_least_round_of_each_and_a_failing_step_is_left_out(monkeypatch):
    monkeypatch.setattr(calibrate, "HOST_ROUNDS", 3)
    monkeypatch.setattr(calibrate, "HOST_CALLS", 2)
    order = []

    def step(name, fail_after=None):
        def run():
            order.append(name)
            if fail_after is not None and order.count(name) > fail_after:
                raise RuntimeError("broken")

        return run

    issued = calibrate._host_us({"a": step("a"), "b": step("b"), "c": step("c", fail_after=4)}, torch.device("cpu"))
    assert set(issued) == {"a", "b"} and all(0 < us < 1e6 for us in issued.values())
    timed = [name for name in order[9:] if name != "c"]  # after 3 warm-up calls each
    assert timed == ["a", "a", "b", "b", "b", "b", "a", "a", "a", "a", "b", "b"]  # rounds in alternating order


def test_the_packaged_packed_points_are_keyed_by_the_work_of_the_packings_they_timed():
    """Each packed curve's point is keyed as the calibration now keys it (format 2): the mean work of its size's
    seeded packings as a prediction reads each; the results copy is the packaged file."""
    from importlib import resources

    packaged = json.loads((resources.files("attnselect") / "data" / "calibration_sm90_nvidia-h200.json").read_text())
    assert json.loads((ROOT / "results" / "h200_calibration.json").read_text()) == packaged
    keyed = {}
    for pair in calibrate.PAIRS:
        for batch, seqlen in calibrate.PACKED_LADDER:
            problem = AttentionProblem(batch, seqlen, seqlen, calibrate.HEADS, calibrate.HEADS, *pair,
                                       torch.bfloat16, layout="thd", mask="causal")  # fmt: skip
            keyed.setdefault(pair, set()).add(round(calibrate._timed_work(problem, NewPackings(problem, "cpu")), 3))
    points = [(key, w) for curves in packaged["gpu"].values() for key, pts in curves.items() if key.startswith("thd")
              for w, _ in pts]  # fmt: skip
    assert len(points) > 50
    for key, w in points:
        pair = tuple(int(d) for d in key.split()[1].removesuffix("+pad").split("/"))
        assert w in keyed[pair], (key, w)


def test_a_calibration_that_cannot_be_written_or_stops_at_once_says_so_without_an_old_partial(on_an_h200, monkeypatch,
                                                                                             capsys):  # fmt: skip
    from helpers import CALIBRATED_H200

    path = calibration.user_path(CALIBRATED_H200)
    partial = path.with_name(path.stem + ".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)
    partial.write_text("{}")  # an earlier run's

    def stopped(target, **kwargs):
        raise RuntimeError("calibration stopped: at the first size")

    monkeypatch.setattr(calibrate, "run", stopped)
    assert cli.main(["calibrate"]) == 1
    err = capsys.readouterr().err
    assert "stopped (RuntimeError: calibration stopped: at the first size)" in err and "partial" not in err
    assert not partial.exists()
    # a run that keeps a checkpoint, then a disk that refuses the calibration's own file
    monkeypatch.setattr(calibrate, "run", lambda target, **kwargs: kwargs["checkpoint"](sample := {"source": "x"})
                        or sample)  # fmt: skip
    real = cli._write_json
    monkeypatch.setattr(cli, "_write_json", lambda p, data: real(p, data) if p == partial else (_ for _ in ()).throw(
        OSError(28, "No space left on device")))  # fmt: skip
    assert cli.main(["calibrate"]) == 1
    err = capsys.readouterr().err
    assert "stopped (OSError: [Errno 28] No space left on device)" in err and str(partial) in err


def test_host_times_are_taken_again_after_the_ladder_at_its_pairs_and_each_kind_s_least_kept(monkeypatch):
    """The ladder times a kind's host time once, at the first job that has it; run() takes every kind's again once the
    ladder is done (host_times, at the run's first pair native and its first pair of unequal dims padded) and keeps
    the least of the two, packed calls on a new packing too; a second pass that fails leaves the ladder's."""
    monkeypatch.setattr(calibrate, "SKIPPED", ("reference", "sdpa_math"))  # flex packs on the CPU (inference)
    monkeypatch.setattr(calibrate, "LADDER", ((1, 16),))
    monkeypatch.setattr(calibrate, "PACKED_LADDER", ((2, 16),))
    again, shapes = [], set()
    measure_again = calibrate.host_times

    def host_times(*args, **kwargs):
        again.append(kwargs)
        return measure_again(*args, **kwargs)

    def host_us(steps, device):  # the ladder's pass 10 us a call; the pass after it 5 padded, 20 native
        return {key: (5.0 if key.padded else 20.0) if again else 10.0 for key in steps}

    step = calibrate.attention_step

    def attention_step(attention, candidate, problem, *args, **kwargs):
        if again:
            shapes.add((problem.head_dim_qk, problem.head_dim_v, candidate.padded))
        return step(attention, candidate, problem, *args, **kwargs)

    attention = attnselect.attention
    monkeypatch.setattr(calibrate, "attention_step", attention_step)
    monkeypatch.setattr(calibrate, "host_times", host_times)
    monkeypatch.setattr(calibrate, "_host_us", host_us)
    monkeypatch.setattr(calibrate, "_new_packing_us", host_us)
    data = calibrate.run(attention=attention, pairs=((24, 16), (32, 32)))
    assert calibration._problem(data) is None
    assert again == [{"attention": attention, "native": (24, 16), "padded": (24, 16)}]
    assert shapes == {(24, 16, False), (24, 16, True)}  # the pair the ladder timed first
    for name in ("host_us", "new_packing_us"):
        times = {(backend, kind): us for backend, kinds in data[name].items() for kind, us in kinds.items()}
        assert {us for (_, kind), us in times.items() if "+pad" in kind} == {5.0}  # the second pass's, less
        assert {us for (_, kind), us in times.items() if "+pad" not in kind} == {10.0}  # the ladder's, less

    def failing(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(calibrate, "host_times", failing)
    again.clear()  # the ladder's pass again: 10 us
    data = calibrate.run(attention=attnselect.attention, pairs=((24, 16),))
    assert calibration._problem(data) is None
    assert {us for kinds in data["host_us"].values() for us in kinds.values()} == {10.0}
