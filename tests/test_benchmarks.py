"""The GPU scripts stay runnable: each runs here in its smallest form on the CPU."""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

from attnselect.spec.problem import AttentionProblem
from helpers import benchmark_module

ROOT = pathlib.Path(__file__).resolve().parents[1]


_benchmark = benchmark_module


def _run(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True)


def test_thd_bench_smoke(tmp_path):
    _run(
        "benchmarks/thd_bench.py",
        "--packings",
        "smoke",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "--out",
        str(tmp_path / "bench"),
    )
    report = json.loads((tmp_path / "bench.json").read_text())
    assert {r["phase"] for r in report["results"]} == {"forward", "forward+backward"}
    for entry in report["results"]:
        assert entry["rules_choice"] and entry["candidates"] and entry["choice_vs_fastest"]
        for row in entry["candidates"]:  # every CPU candidate runs: none may fail
            assert row["median_ms"] > 0 and row["alone_median_ms"] > 0 and row["tflops"] > 0, row
    assert "| candidate | queued ms |" in (tmp_path / "bench.md").read_text()


def test_thd_bench_reruns_one_packing_into_an_earlier_report(tmp_path):
    common = (
        "benchmarks/thd_bench.py",
        "--packings",
        "smoke",
        "--repeats",
        "2",
        "--warmup",
        "1",
        "--skip",
        "reference,sdpa_math,sdpa_efficient",
    )
    _run(*common, "--out", str(tmp_path / "bench"))
    before = json.loads((tmp_path / "bench.json").read_text())
    _run(*common, "--only", "equal", "--out", str(tmp_path / "rerun"), "--into", str(tmp_path / "bench"))
    after = json.loads((tmp_path / "bench.json").read_text())
    assert [(e["packing"], e["phase"]) for e in after["results"]] == [
        ("smoke-mixed", "forward"),
        ("smoke-mixed", "forward+backward"),
        ("smoke-equal", "forward"),
        ("smoke-equal", "forward+backward"),
    ]
    assert after["results"][:2] == before["results"][:2]
    assert after["meta"]["reruns"][0]["packings"] == ["smoke-equal"]
    assert "after a change of their rules: smoke-equal" in (tmp_path / "bench.md").read_text()


def test_megatron_benchmark_hook_captures_query_key_value_and_leaves_the_call_alone():
    capture_qkv = _benchmark("megatron_mla").capture_qkv  # importable without megatron-core

    class Core(torch.nn.Module):
        def forward(self, query, key, value, attention_mask, packed_seq_params=None):
            return query + key + value

    seen, core = {}, Core()
    core.register_forward_pre_hook(capture_qkv(seen, "arm"), with_kwargs=True)
    q, k, v = torch.ones(2), torch.full((2,), 2.0), torch.full((2,), 3.0)
    assert torch.equal(core(q, k, value=v, attention_mask=None), torch.full((2,), 6.0))
    core(q * 0, k * 0, value=v * 0, attention_mask=None)  # only the first call is kept
    assert [t.tolist() for t in seen["arm"]] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


def test_rules_grid_smoke(tmp_path):
    out = tmp_path / "grid.jsonl"
    done = _run("benchmarks/rules_grid.py", "--out", str(out), "--limit", "3")
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) >= 3 * 4 and all(r["agrees"] for r in rows), done.stdout
    report = _run("benchmarks/grid_report.py", str(out)).stdout
    assert "3 problems" in report


def test_correctness_grid_smoke(tmp_path):
    done = _run("benchmarks/correctness_grid.py", "--out", str(tmp_path), "--workers", "2", "--ids", "0,1",
                "--deadline", "300")  # fmt: skip
    rows = [json.loads(line) for f in tmp_path.glob("rows-*.jsonl") for line in f.read_text().splitlines()]
    assert rows and all(r["passed"] for r in rows), done.stdout
    young = {(r["row_key"], r["repeat"]): r["pid"] for r in rows if r["backend"] == "flex"}
    assert {repeat for _, repeat in young} == {0, 1}  # young kernels run twice, in two processes
    assert all(young[key, 0] != young[key, 1] for key, repeat in young if repeat == 1)


def test_correctness_grid_stops_workers_past_the_deadline(tmp_path, monkeypatch, capsys):
    """A worker stopped past the deadline leaves its result for a rerun: not a death of the kernel's making."""
    grid = _benchmark("correctness_grid")
    monkeypatch.setattr(grid, "OVERTIME", 0.0)
    row = grid.rows()[0]
    pending = dict(row_key=grid.row_key(row), row=row, backend="flex", pad_to=None, repeat=1)
    (tmp_path / "pending-0.json").write_text(json.dumps(pending))  # what a worker stopped mid-result leaves
    grid.run_workers(str(tmp_path), 2, time.time() - 1, only_young=False, ids="0")
    assert "at row 0 flex pad None r1: left for a rerun" in capsys.readouterr().out
    assert not (tmp_path / "pending-0.json").exists()  # its next process has no death to record


def test_correctness_grid_repeats_a_first_result_the_rules_now_refuse(tmp_path, monkeypatch):
    """A young candidate that ran in repeat 0 runs in repeat 1 though the rules have since refused it (a refusal drawn
    from that first result): the repeat is the evidence that its failure holds in another process."""
    import attnselect.choose.candidates

    grid = _benchmark("correctness_grid")
    row = grid.rows()[0]
    first = dict(row_key=grid.row_key(row), row=row, backend="flex", pad_to=None, repeat=0, error="", passed=True)
    (tmp_path / "rows-earlier.jsonl").write_text(json.dumps(first) + "\n")
    (tmp_path / "claims").mkdir()
    (tmp_path / "claims" / f"{row['id']}-0").write_text("0")  # repeat 0 is another worker's
    monkeypatch.setattr(attnselect.choose.candidates, "judge", lambda problem, target: [])  # every candidate refused
    for name in ("ATTNSELECT_ALLOWLIST", "ATTNSELECT_SELF_CHECK"):
        monkeypatch.setenv(name, os.environ.get(name, "1"))  # the worker sets them: restored after the test
    for name in ("cache_size_limit", "accumulated_cache_size_limit"):
        monkeypatch.setattr(torch._dynamo.config, name, getattr(torch._dynamo.config, name))
    threads = torch.get_num_threads()
    try:
        assert grid.worker(1, str(tmp_path), time.time() + 120, only_young=True, ids={row["id"]}) == 0
    finally:
        torch.set_num_threads(threads)
    ran = [json.loads(line) for line in (tmp_path / "rows-1.jsonl").read_text().splitlines()]
    assert [(r["backend"], r["pad_to"], r["repeat"]) for r in ran] == [("flex", None, 1)] and ran[0]["passed"]


def _pending(path, proc, started, row):
    grid = _benchmark("correctness_grid")
    record = dict(row_key=grid.row_key(row), row=row, backend="flex", pad_to=None, repeat=0, pid=proc.pid)
    path.write_text(json.dumps({**record, "started": started}))


def test_correctness_grid_stops_a_result_past_its_patience_and_nothing_else(tmp_path):
    grid = _benchmark("correctness_grid")
    row = grid.rows()[0]
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    slow, quick, reborn = (subprocess.Popen(sleep, start_new_session=True) for _ in range(3))
    try:
        _pending(tmp_path / "pending-0.json", slow, time.time() - 31, row)
        _pending(tmp_path / "pending-1.json", quick, time.time() - 5, row)
        _pending(tmp_path / "pending-2.json", slow, time.time() - 31, row)  # a dead process's: not this one's
        assert grid._stop_the_slow(str(tmp_path), {0: slow, 1: quick, 2: reborn}, patience=30.0) == [0]
        assert slow.poll() is not None and quick.poll() is None and reborn.poll() is None
        assert not (tmp_path / "pending-0.json").exists() and (tmp_path / "pending-2.json").exists()
    finally:
        for proc in (slow, quick, reborn):
            proc.kill()
            proc.wait()
    (found,) = grid.read_rows([str(tmp_path)])  # recorded, never rerun: not a failure of the machine
    assert found["error"].startswith("did not finish within 30 s") and not found["passed"] and found["seconds"] >= 30
    assert found["stopped_after_s"] == 30.0 and "started" not in found


def test_correctness_grid_workers_past_their_patience_are_restarted_and_resume(tmp_path, monkeypatch, capsys):
    """run_workers kills a worker stuck on a result, records it, and starts the worker again: the stand-in worker
    records what it has not yet recorded, and sleeps on its first result."""
    grid = _benchmark("correctness_grid")
    row = grid.rows()[0]
    stand_in = f"""
import json, os, sys, time
rows, pending = {str(tmp_path)!r} + '/rows-0.jsonl', {str(tmp_path)!r} + '/pending-0.json'
if os.path.exists(rows):  # the second process: the next result, at once
    open(rows, 'a').write(json.dumps(dict(row_key='next', row={row!r}, backend='flex', pad_to=None, repeat=0,
                                          passed=True, error=None)) + chr(10))
    sys.exit(0)
json.dump(dict(row_key='stuck', row={row!r}, backend='flex', pad_to=None, repeat=0, pid=os.getpid(),
               started=time.time()), open(pending, 'w'))
time.sleep(60)
"""
    monkeypatch.setattr(grid, "_worker_command", lambda *args: [sys.executable, "-c", stand_in])
    started = time.time()
    grid.run_workers(str(tmp_path), 1, time.time() + 30, only_young=False, patience=2.0)
    assert time.time() - started < 25  # not the stand-in's 60 s sleep, nor the deadline
    found = {r["row_key"]: r for r in grid.read_rows([str(tmp_path)])}
    assert found["stuck"]["stopped_after_s"] == 2.0 and found["next"]["passed"]
    assert "did not finish within 2 s" in capsys.readouterr().out


def test_correctness_grid_units_start_with_the_costliest_rows():
    grid = _benchmark("correctness_grid")
    units = grid.units()
    assert len(units) == 2 * len(grid.rows()) and [repeat for _, repeat in units[:1]] == [0]
    first = [row["size"] for row, repeat in units if repeat == 0]
    assert first[0] in ("long", "large") and first[-1] in ("tiny", "small")
    assert sorted((row["id"], repeat) for row, repeat in grid.units({3, 5})) == [(3, 0), (3, 1), (5, 0), (5, 1)]


def test_new_packing_parts_smoke(tmp_path):
    _run("benchmarks/new_packing_parts.py", "--calls", "5", "--rounds", "1", "--out", str(tmp_path / "parts"))
    report = json.loads((tmp_path / "parts.json").read_text())
    assert len(report["rows"]["attention(), a new packing each call"]) == 1


def test_new_packing_parts_training_smoke(tmp_path):
    _run("benchmarks/new_packing_parts.py", "--training", "--calls", "3", "--rounds", "1", "--out",
         str(tmp_path / "parts"))  # fmt: skip
    report = json.loads((tmp_path / "parts.json").read_text())
    assert report["meta"]["training"] is True and len(report["rows"]["attention(), a new packing each call"]) == 1


def test_packed_work_estimates_reproduce_the_committed_table(tmp_path):
    """The table is computed, not typed: a rerun writes the committed file."""
    _run("benchmarks/packed_work_estimates.py", "--out", str(tmp_path / "estimates.md"))
    assert (tmp_path / "estimates.md").read_text() == (ROOT / "results" / "cpu_packed_work_estimates.md").read_text()


def test_new_packing_host_stages_run_without_a_gpu(tmp_path):
    _run("benchmarks/new_packing_parts.py", "--host-stages", "h200", "--calls", "5", "--rounds", "1", "--out",
         str(tmp_path / "stages"))  # fmt: skip
    report = json.loads((tmp_path / "stages.json").read_text())
    stages, by_class = report["stages"], report["by_class"]
    assert set(stages) == {"recall", "its class's call", "problem at the new sizes", "select_packed", "packed_runner",
                           "self_check.needed", "remember"} and all(len(t) == 1 for t in stages.values())  # fmt: skip
    seen, new = (by_class[f"select_packed, {kind} (calls)"][0] for kind in ("a work class seen", "a new work class"))
    assert seen + new == 5 and new >= 1  # the first packings' classes are new


def test_new_packing_host_stages_take_the_ladders_larger_packings(tmp_path):
    """--mla --tokens: the size ladder's packings of that many tokens (8192 here), FA4 forced and its compile paid."""
    _run("benchmarks/new_packing_parts.py", "--host-stages", "h200", "--fa4", "--paid", "--mla", "--tokens", "8192",
         "--backend", "flash_attn4", "--calls", "4", "--rounds", "1", "--out", str(tmp_path / "stages"))  # fmt: skip
    report = json.loads((tmp_path / "stages.json").read_text())
    assert report["tokens"] == 8192 and report["by_class"]["calls on flash_attn4 native"] == [4]


@pytest.mark.parametrize("timeout, status", [(120, "passed"), (1, "killed at 1 s")])
def test_flex_hooks_probe_smoke(tmp_path, timeout, status):
    """Each hook in its own process, counting what it packs (row 15, training, on the reference backend: flex has no
    CPU backward); one past the timeout is killed."""
    _run("benchmarks/flex_hooks_probe.py", "--ids", "15", "--backend", "reference", "--timeout", str(timeout),
         "--out", str(tmp_path / "p"))  # fmt: skip
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [r["hook"] for r in rows] == ["detached", "as themselves", "Tensor.detach", "none"]
    assert all(r["status"].startswith(status) for r in rows), rows
    if status == "passed":  # each hook took the rerun's saved tensors, and without one nothing was packed
        assert [r["packed"] > 0 for r in rows] == [True, True, True, False]


def test_new_packing_host_stages_compare_two_checkouts(tmp_path):
    src = str(ROOT / "src")
    _run("benchmarks/new_packing_parts.py", "--host-stages", "h200", "--compare", src, src, "--calls", "3",
         "--rounds", "1", "--repeats", "1", "--out", str(tmp_path / "cmp"))  # fmt: skip
    runs = json.loads((tmp_path / "cmp.json").read_text())["runs"]
    assert set(runs) == {"False", "True"} and all(set(sides) == {"before", "after"} for sides in runs.values())
    assert (tmp_path / "cmp.md").read_text().count("| remember |") == 2
    assert (tmp_path / "cmp.md").read_text().count("| select_packed, a new work class |") == 2


def test_new_packing_host_measures_a_packed_backend_on_a_packing_seen_and_on_new_ones(monkeypatch):
    from attnselect.bench import calibrate

    monkeypatch.setattr(calibrate, "PACKED_LADDER", ((2, 16),))
    monkeypatch.setattr(calibrate, "HOST_ROUNDS", 2)
    bench = _benchmark("new_packing_host")
    assert {"thd inference", "thd training"} <= set(bench.packaged_keys()["flash_attn4"])
    data = bench.measure({"flex": ["thd inference", "dense inference"]})  # flex packs inference on the CPU
    assert set(data["seen_packing_us"]) == {"flex"} and set(data["seen_packing_us"]["flex"]) == {"thd inference"}
    assert data["new_packing_us"]["flex"]["thd inference"] > 0
    assert "| flex | thd inference |" in bench.report(data)


def test_calibrate_smoke(tmp_path):
    for pair in ("64/64", "128/128"):
        _run("benchmarks/calibrate.py", "--quick", "--pairs", pair, "--out", str(tmp_path / pair.replace("/", "_")))
    _run("benchmarks/calibrate.py", "--merge", str(tmp_path / "64_64.json"), str(tmp_path / "128_128.json"),
         "--out", str(tmp_path / "both"))  # fmt: skip
    data = json.loads((tmp_path / "both.json").read_text())
    assert set(data["gpu"]["sdpa_flash"]) == {f"dense {pair} training" for pair in ("64/64", "128/128")}
    assert "## Host time per call (us)" in (tmp_path / "both.md").read_text()


def test_calibrate_packages_a_whole_gpu_calibration_only(tmp_path, monkeypatch):
    """--package refuses a quick run's calibration, a checkpoint of a run not finished and a CPU's: each would become
    the package data the rules rank by. A whole one becomes its GPU model's file."""
    from attnselect.bench import calibrate

    tool = _benchmark("calibrate")
    monkeypatch.setattr(tool, "ROOT", tmp_path)  # where it would package: never the checkout's data
    (tmp_path / "src" / "attnselect" / "data").mkdir(parents=True)
    whole = json.loads((ROOT / "src" / "attnselect" / "data" / "calibration_sm90_nvidia-h200.json").read_text())
    for changes in ({"source": whole["source"] + calibrate.PARTIAL}, {"source": "attnselect calibrate --quick"},
                    {"fingerprint": {**whole["fingerprint"], "capability": None}}):  # fmt: skip
        (tmp_path / "c.json").write_text(json.dumps({**whole, **changes}))
        monkeypatch.setattr(sys, "argv", ["calibrate.py", "--package", str(tmp_path / "c.json")])
        with pytest.raises(SystemExit, match="calibration"):
            tool.main()
    assert not list((tmp_path / "src" / "attnselect" / "data").iterdir())
    parts = [tmp_path / "whole.json", tmp_path / "quick.json"]  # a quick part makes the merge no whole one
    parts[0].write_text(json.dumps(whole))
    parts[1].write_text(json.dumps({**whole, "source": "attnselect calibrate --quick"}))
    monkeypatch.setattr(sys, "argv", ["calibrate.py", "--merge", *map(str, parts), "--out", str(tmp_path / "m")])
    tool.main()
    monkeypatch.setattr(sys, "argv", ["calibrate.py", "--package", str(tmp_path / "m.json")])
    with pytest.raises(SystemExit, match="calibration"):
        tool.main()
    (tmp_path / "c.json").write_text(json.dumps(whole))
    monkeypatch.setattr(sys, "argv", ["calibrate.py", "--package", str(tmp_path / "c.json")])
    tool.main()
    data = tmp_path / "src" / "attnselect" / "data"
    assert json.loads((data / "calibration_sm90_nvidia-h200.json").read_text()) == whole
    h100 = {**whole, "fingerprint": {**whole["fingerprint"], "name": "NVIDIA H100 80GB HBM3"}}
    (tmp_path / "c.json").write_text(json.dumps(h100))
    tool.main()  # another GPU of the arch: its own file, beside the H200's
    assert json.loads((data / "calibration_sm90_nvidia-h100-80gb-hbm3.json").read_text()) == h100
    assert json.loads((data / "calibration_sm90_nvidia-h200.json").read_text()) == whole


def test_calibrate_merge_keeps_each_kind_s_least_host_time(tmp_path, monkeypatch):
    """Parts timed apart time a kind each at their first pair's size, on a host whose load varies: the merge keeps
    each kind's least host time (a busy host only adds time), whichever part it came from, and every kind a single
    part timed."""
    tool = _benchmark("calibrate")
    whole = json.loads((ROOT / "src" / "attnselect" / "data" / "calibration_sm90_nvidia-h200.json").read_text())
    first = {**whole, "host_us": {"sdpa_cudnn": {"dense inference": 36.6, "dense training": 308.6},
                                  "flash_attn4": {"dense inference": 102.0}},
             "new_packing_us": {"varlen_fa2": {"thd inference": 54.9}}}  # fmt: skip
    second = {**whole, "host_us": {"sdpa_cudnn": {"dense inference": 62.2, "dense training": 241.0},
                                   "sdpa_flash": {"dense inference": 24.0}},
              "new_packing_us": {"varlen_fa2": {"thd inference": 103.9, "thd training": 258.4}}}  # fmt: skip
    for name, part in (("a", first), ("b", second)):
        (tmp_path / f"{name}.json").write_text(json.dumps(part))
    for order in (("a", "b"), ("b", "a")):
        argv = ["calibrate.py", "--merge", *(str(tmp_path / f"{name}.json") for name in order), "--out",
                str(tmp_path / "m")]  # fmt: skip
        monkeypatch.setattr(sys, "argv", argv)
        tool.main()
        merged = json.loads((tmp_path / "m.json").read_text())
        assert merged["host_us"] == {
            "sdpa_cudnn": {"dense inference": 36.6, "dense training": 241.0},
            "flash_attn4": {"dense inference": 102.0},
            "sdpa_flash": {"dense inference": 24.0},
        }
        assert merged["new_packing_us"] == {"varlen_fa2": {"thd inference": 54.9, "thd training": 258.4}}
        assert merged["host"] == {}  # neither part recorded its CPU
    # each kind's least host time is one host's only where every part ran on it
    for name, host in (("a", {"cpu": "CPU A"}), ("b", {"cpu": "CPU B"})):
        (tmp_path / f"{name}.json").write_text(json.dumps({**(first if name == "a" else second), "host": host}))
    monkeypatch.setattr(sys, "argv", ["calibrate.py", "--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"),
                                      "--out", str(tmp_path / "m")])  # fmt: skip
    with pytest.raises(SystemExit, match="different hosts"):
        tool.main()


def test_calibrate_first_calls_again_keeps_the_costs_of_backends_not_measured_here(tmp_path, monkeypatch):
    """--first-calls-from on a machine without one of the calibrated backends (FA4 not installed) measures the others
    again and keeps that one's costs: dropped, its first call would look free."""
    from attnselect.bench import calibrate

    tool = _benchmark("calibrate")
    _run("benchmarks/calibrate.py", "--quick", "--pairs", "64/64", "--out", str(tmp_path / "cpu"))
    data = json.loads((tmp_path / "cpu.json").read_text())
    data["first_call_ms"]["flash_attn4"] = {"dense training": 7869.766}
    (tmp_path / "cpu.json").write_text(json.dumps(data))
    measured = {"first_call_ms": {"sdpa_flash": {"dense training": 1.5}}, "new_size_ms": {}}
    monkeypatch.setattr(calibrate, "first_call_costs", lambda *args, **kwargs: measured)
    monkeypatch.setattr(sys, "argv", ["calibrate.py", "--first-calls-from", str(tmp_path / "cpu.json"),
                                      "--out", str(tmp_path / "again")])  # fmt: skip
    tool.main()
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["first_call_ms"]["flash_attn4"] == {"dense training": 7869.766}
    assert again["first_call_ms"]["sdpa_flash"] == {"dense training": 1.5}


def test_hf_deepseek_smoke(tmp_path):
    pytest.importorskip("transformers", reason="the test extra installs transformers")
    _run("benchmarks/hf_deepseek.py", "--smoke", "--out", str(tmp_path / "hf"))
    rows = {r["implementation"]: r for r in json.loads((tmp_path / "hf.json").read_text())["rows"]}
    for name in ("attnselect", "sdpa"):  # flex has no CPU backward: its failure is recorded, not raised
        assert rows[name]["tokens_per_s"] > 0, rows[name]
    assert "error" in rows["flex_attention"]


def test_noise_floor_smoke(tmp_path):
    _run("benchmarks/noise_floor.py", "--smoke", "--sessions", "2", "--out", str(tmp_path / "noise"))
    case = json.loads((tmp_path / "noise.json").read_text())["cases"][0]
    for mode in ("spin", "no spin"):
        medians = case[mode]["medians_ms"]
        assert set(medians) == {"sdpa_math native (A)", "sdpa_math native (B)", "reference native", "torch-default"}
        assert all(len(v) == 2 and all(t > 0 for t in v) for v in medians.values())
        assert len(case[mode]["a_over_b"]) == 2
    assert "A/B (the same kernel, spin)" in (tmp_path / "noise.md").read_text()


def test_median_convergence_smoke(tmp_path):
    _run(
        "benchmarks/median_convergence.py",
        "--smoke",
        "--sessions",
        "2",
        "--scale",
        "2",
        "--out",
        str(tmp_path / "convergence"),
    )
    sessions = json.loads((tmp_path / "convergence.json").read_text())["cases"][0]["sessions"]
    assert [s["rounds"] for s in sessions] == [32, 32, 64]  # the bench's rounds twice, then twice as many
    for session in sessions:
        assert set(session["medians_ms"]) == {
            "sdpa_math native (A)",
            "sdpa_math native (B)",
            "reference native",
            "torch-default",
        }
        assert session["over_a"]["sdpa_math native (A)"] == 1.0 and all(v > 0 for v in session["over_a"].values())
    assert "| 64 |" in (tmp_path / "convergence.md").read_text()


def test_training_loop_smoke(tmp_path):
    _run(
        "benchmarks/training_loop.py",
        "--smoke",
        "--steps",
        "11",
        "--warmup",
        "1",
        "--rounds",
        "2",
        "--out",
        str(tmp_path / "loop"),
    )
    report = json.loads((tmp_path / "loop.json").read_text())
    default = report["rows"]["attnselect default, max_seqlen given"]["smoke"]
    assert default["steps"] == 22 and default["rounds"] == 2 and default["median_ms"] > 0 and default["tflops"] > 0
    assert len(default["step_ms"]) == 2 and default["worst_after_10_over_median"] > 0
    assert "error" in report["rows"]["torch varlen_attn, V padded"]["smoke"]  # no CPU kernel: said, not hidden
    assert report["goals"][0]["distribution"] == "smoke" and "## Goals" in (tmp_path / "loop.md").read_text()


def test_the_grid_summary_ships_the_sweeps_kernel_failures_and_keeps_those_shipped_on_the_same_stack():
    grid = _benchmark("correctness_grid")
    meta = {"device": "d", "arch": "sm90", "date": "x", "fingerprint": {"torch": "1"}, "packages": {"flex": None}}
    sig = [64, 64, 1, "none", "thd", "float16", "training", 4, []]

    def record(status, backend, error):
        return {"status": status, "signature": sig, "candidate": {"backend": backend, "pad_to": None}, "case": "c",
                "error": error}  # fmt: skip

    sweeps = [("s.jsonl", record("wrong", "flex", "dq wrong")), ("s.jsonl", record("ok", "sdpa_flash", None)),
              ("s.jsonl", record("raised", "cudnn_frontend", "CUDA out of memory. Tried to allocate"))]  # fmt: skip
    data = grid.summary([], meta, sweeps=sweeps)
    assert [(backend, finding[:19]) for backend, _, _, finding in data["failed"]] == [("flex", "wrong in s.jsonl: c")]
    shipped = dict(data, failed=[["varlen_fa2", None, sig, "raised in s.jsonl: c: earlier"]])
    assert grid.summary([], meta, shipped=shipped)["failed"] == shipped["failed"]  # a later sweep chose another
    assert grid.summary([], dict(meta, packages={"flex": "2"}), shipped=shipped)["failed"] == []  # other versions


def test_the_grid_summary_counts_a_result_stopped_at_its_patience_neither_as_a_pass_nor_as_a_kernel_failure():
    """How long a compile runs depends on what shares the machine: a result stopped at --patience refuses no kernel
    key, and its signature is not covered (the self-check checks it)."""
    grid = _benchmark("correctness_grid")
    meta = {"device": "d", "arch": "sm90", "date": "x", "fingerprint": {"torch": "1"}, "packages": {"flex": None}}
    row = grid.rows()[0]
    problem, *_ = grid.build(row, "cpu")
    base = dict(row_key=grid.row_key(row), row=row, problem=problem.to_dict(), backend="flex", pad_to=None)
    passed = dict(base, repeat=1, passed=True, error=None, judgement={"errors": {}, "bounds": {}}, failures=[])
    stopped = dict(base, repeat=0, passed=False, error="did not finish within 9 s", stopped_after_s=9.0)
    data = grid.summary([passed, stopped], meta)
    assert [entry for entry in data["kernels"]["flex"].values()] == [
        {"passed": 1, "failed": 0, "by_grouping": {"MHA": {"passed": 1, "failed": 0}}}
    ]
    assert data["covered"] == [] and grid.summary([passed], meta)["covered"] != []


def test_the_grid_summary_limits_a_key_to_the_length_it_passed_where_its_head_dims_failed_longer():
    """flex passed dense 64/256 inference at 77 tokens and failed thd 64/256 inference at 333 (out of shared
    memory): the dense key is served only up to 77 tokens; a key whose failures are shorter is not limited."""
    grid = _benchmark("correctness_grid")
    meta = {"device": "d", "arch": "sm90", "date": "x", "fingerprint": {"torch": "1"}, "packages": {"flex": None}}
    row = grid.rows()[0]

    def result(passed, seqlen, **changes):
        problem = AttentionProblem(batch=1, seqlen_q=seqlen, seqlen_kv=seqlen, heads_q=2, heads_kv=2, head_dim_qk=64,
                                   head_dim_v=256, **changes)  # fmt: skip
        return dict(row_key="k", row=row, problem=problem.to_dict(), backend="flex", pad_to=None, repeat=0,
                    passed=passed, error=None if passed else "out of resource", failures=[],
                    judgement={"errors": {}, "bounds": {}})  # fmt: skip

    thd = dict(layout="thd")
    data = grid.summary([result(True, 77), result(True, 40, **thd), result(False, 333, **thd)], meta)
    dense = data["kernels"]["flex"]["dense 64/256 inference"]
    assert dense["passed_up_to"] == 77 and dense["failed_beyond"] == "row 0: out of resource (a span of 333 tokens)"
    assert data["kernels"]["flex"]["thd 64/256 inference"]["passed_up_to"] == 40  # refused by its failure anyway
    other_phase = grid.summary([result(True, 77), result(False, 333, training=True)], meta)
    assert "passed_up_to" not in other_phase["kernels"]["flex"]["dense 64/256 inference"]
    shorter = grid.summary([result(True, 1024), result(False, 333, **thd)], meta)
    assert "passed_up_to" not in shorter["kernels"]["flex"]["dense 64/256 inference"]


def test_training_loop_packings_fill_every_step_and_repeat_by_seed():
    training_loop = _benchmark("training_loop")
    for spec in training_loop.DISTRIBUTIONS.values():
        loop = training_loop.packings(spec, training_loop.TOKENS, 5)
        assert all(sum(p) == training_loop.TOKENS and max(p) <= spec["high"] for p in loop)
        assert loop == training_loop.packings(spec, training_loop.TOKENS, 5)


def test_packing_buckets_choose_the_least_expected_step():
    packing_buckets = _benchmark("packing_buckets")
    row = dict(distribution="d", keys_built=10, ms_per_build=100.0)
    rows = [
        dict(row, counts="exact", max_seqlen="exact", steady_median_ms=5.0, keys_in_2000_steps=2000),
        dict(row, counts="pow2", max_seqlen="pow2", steady_median_ms=5.5, keys_in_2000_steps=10),
        dict(row, counts="pow2", max_seqlen="tokens", steady_median_ms=8.0, keys_in_2000_steps=1),
    ]
    chosen = packing_buckets.choose(rows)
    assert (chosen["counts"], chosen["max_seqlen"], chosen["build_ms"]) == ("pow2", "pow2", 100.0)


def test_training_loop_goals_judge_the_default_without_fa4_against_the_rows_without_fa4():
    loop = _benchmark("training_loop")

    def row(ms):
        return {"median_ms": ms, "step_ms": [[ms] * 4], "worst_after_10_over_median": 1.0}

    rows = {
        loop.DEFAULT_GIVEN: row(5.0),
        loop.WITHOUT_FA4: row(8.0),
        loop.FA4: row(5.1),
        "flash_attn4 native": row(5.0),
        "cudnn_frontend native": row(7.8),
        loop.TORCH_DEFAULT: row(12.0),
    }
    report = {
        "distributions": {"RL rollouts": {}},
        "choices": {},
        "rows": {name: {"RL rollouts": r} for name, r in rows.items()},
    }
    (goal,) = loop.goals(report)
    assert goal["fastest_forced"] == "flash_attn4 native" and goal["within_5_percent"]
    assert goal["vs_torch_default"] == 12.0 / 5.0 and not goal["vs_torch_met"]  # 2.4x < 2.5x
    assert goal["without_fa4_fastest"] == "cudnn_frontend native"
    assert goal["without_fa4_vs_fastest"] == 7.8 / 8.0 and goal["without_fa4_within_5_percent"]


def test_thd_inference_smoke(tmp_path):
    _run("benchmarks/thd_inference.py", "--smoke", "--steps", "3", "--warmup", "1", "--out", str(tmp_path / "inf"))
    report = json.loads((tmp_path / "inf.json").read_text())
    (entry,) = report["results"]
    assert entry["default_chose"] and entry["work"][0] > 0
    row = entry["rows"]["attnselect default"]
    assert row["wall_us"]["median"] > 0 and row["wall_us"]["n"] == 3
    assert "| row | wall us a call | GPU us a call |" in (tmp_path / "inf.md").read_text()


def test_ladder_smoke(tmp_path):
    out = str(tmp_path / "ladder")
    args = ("--smoke", "--rounds", "2", "--calls", "2", "--warmup", "1", "--layers", "2", "--out", out)
    _run("benchmarks/ladder.py", *args, "--only", "B1 S16")
    report = json.loads((tmp_path / "ladder.json").read_text())
    assert [e["rung"] for e in report["results"]] == ["bshd B1 S16 24/16 inference", "bshd B1 S16 24/16 training"]
    _run("benchmarks/ladder.py", *args)  # resumes: the rungs done stay, the rest run
    report = json.loads((tmp_path / "ladder.json").read_text())
    assert len(report["results"]) == 6 and report["results"][0]["rung"] == "bshd B1 S16 24/16 inference"
    stats = report["results"][0]["stats"]
    assert {"latency", "stack"} == set(stats) and "attnselect default" in stats["latency"]
    assert "F.sdpa default" in stats["latency"]
    # a call alone varies more than a step: the latency way times as many calls as the stack way's steps make
    assert stats["latency"]["attnselect default"]["n"] == 2 * 2 * 2 and stats["stack"]["attnselect default"]["n"] == 4
    # each round's median apart (a spread a round's, or every call's)
    by_round = report["results"][0]["by_round"]
    assert {len(r) for way in by_round.values() for r in way.values()} == {2}
    assert (report["meta"]["order"], report["meta"]["round_warmup"]) == ("shuffle", 1)
    assert "| row | ms a call | speed | paired |" in (tmp_path / "ladder.md").read_text()
    assert set(by_round["latency"]) == set(stats["latency"])
    assert "## Goals" in (tmp_path / "ladder.md").read_text()
    # the control row: the default's calls timed again, never counted as a single-kernel way
    assert stats["latency"]["attnselect default, again"]["n"] == 2 * 2 * 2
    assert "## Noise" in (tmp_path / "ladder.md").read_text() and report["noise"]["rows"]
    assert all(r["best"] != "attnselect default, again" for g in report["goals"].values() for r in g.get("rows", [])
               if "best" in r)  # fmt: skip


def test_the_ladder_s_noise_counts_the_misses_no_larger_than_the_default_against_itself():
    """A miss by less than the default's two rows of the same calls differ by on its rung-way is counted as within
    the noise (the goal stays missed: the count is beside it)."""
    ladder = _benchmark("ladder")

    def t(ms):
        return {"median": ms, "q1": ms, "q3": ms, "n": 1}

    near = {"rung": "a", "errors": {}, "stats": {"latency": {ladder.DEFAULT: t(1.0), ladder.AGAIN: t(0.94),
                                                             "forced x": t(0.95)}}}  # fmt: skip
    far = {"rung": "b", "errors": {}, "stats": {"latency": {ladder.DEFAULT: t(1.0), ladder.AGAIN: t(1.01),
                                                            "forced x": t(0.9)}}}  # fmt: skip
    found = ladder.goals([near, far])
    first = "against the fastest single-kernel row (goal >= 0.97 everywhere)"
    assert not found[first]["met"] and {r["best"] for r in found[first]["rows"]} == {"forced x"}
    spread = ladder.noise([near, far], found)
    assert spread["within"][first] == {"misses": 2, "within": 1, "unjudged": 0}
    assert (spread["least"], spread["most"]) == (0.94, 1.01)
    assert ladder.noise([far | {"stats": {"latency": {ladder.DEFAULT: t(1.0)}}}], found) is None
    assert "1 of its 2 misses" in "\n".join(ladder.noise_lines(spread))
    unjudged = ladder.noise([near, far | {"stats": {"latency": {ladder.DEFAULT: t(1.0), "forced x": t(0.9)}}}], found)
    assert unjudged["within"][first] == {"misses": 2, "within": 1, "unjudged": 1}
    assert "(1 on rung-ways without the second row)" in "\n".join(ladder.noise_lines(unjudged))


def test_the_ladder_pairs_each_row_with_the_default_round_by_round():
    """A row as fast as the default in every round is at 1.0 paired, whatever the rounds' drift that spreads both
    rows' pooled calls; the fastest single-kernel row and F.sdpa's default are judged so; rungs without rounds
    (run before they were kept) give None."""
    ladder = _benchmark("ladder")
    drift = [1.0, 1.5, 1.0, 1.5, 1.0]  # the host slowed in two rounds, every row with it
    by_round = {"latency": {
        ladder.DEFAULT: drift, ladder.AGAIN: [d * 1.01 for d in drift], "forced x": drift,
        "forced y": [d * 0.9 if i == 1 else d * 1.2 for i, d in enumerate(drift)],
        ladder.SDPA: [d * 0.96 for d in drift],
        "forced z": [1.0],  # a row with fewer rounds (it failed) is not paired
    }}  # fmt: skip
    found = ladder.paired([{"rung": "a", "by_round": by_round}, {"rung": "old"}])
    best = found["against the fastest single-kernel row"]  # F.sdpa's default is a single-kernel way too
    assert best == [{"rung": "a", "way": "latency", "best": ladder.SDPA, "speed": 0.96}]
    assert found["against F.sdpa's default dispatch"][0]["speed"] == 0.96
    assert found["again"][0]["again"] == 1.01
    lines = "\n".join(ladder.paired_lines(found))
    assert lines.count("at least 0.97 on 0 of 1 rung-ways, worst 0.960") == 2 and "0.960 against F.sdpa" in lines
    del by_round["latency"][ladder.SDPA]  # then forced x, as fast as the default every round; y faster in one only
    assert ladder.paired([{"rung": "a", "by_round": by_round}])["against the fastest single-kernel row"] == [
        {"rung": "a", "way": "latency", "best": "forced x", "speed": 1.0}
    ]
    assert ladder.paired([{"rung": "old", "stats": {}}]) is None and ladder.paired_lines(None) == []
    # each policy's geometric mean paired (forced y: 1.2 in four rounds of five), a rung without rounds counted apart
    found = ladder.paired([{"rung": "a", "by_round": by_round}, {"rung": "old", "stats": {"latency": {}}}])
    assert found["policies"]["x"] == {"speed": 1.0, "rungs": 1} and found["policies"]["y"]["speed"] == 1.2
    assert found["unjudged"] == 1
    lines = "\n".join(ladder.paired_lines(found))
    assert (
        "(1 rungs kept no rounds" in lines and "at least 1.05 against 1 of 2 single-kernel policies; x 1.000" in lines
    )
    # without FA4: its own default against the rows without FA4, FA4's rows left out
    by_round["latency"] |= {
        ladder.NO_FA4: [d * 1.1 for d in drift],
        "forced flash_attn4 native": [d * 0.5 for d in drift],
    }
    without = ladder.paired([{"rung": "a", "by_round": by_round}])[
        "without FA4: its default against the fastest single-kernel row without FA4"
    ]
    assert [(r["best"], round(r["speed"], 6)) for r in without] == [("forced x", round(1 / 1.1, 6))]


def test_the_ladder_s_rounds_shuffle_their_rows_reproducibly_or_alternate():
    ladder = _benchmark("ladder")
    rows = list("abcdefgh")
    orders = [ladder.round_order(rows, f"rung/{r}", "shuffle", r % 2) for r in range(6)]
    assert all(sorted(o) == rows for o in orders) and rows == list("abcdefgh")  # a permutation; the list not moved
    assert orders == [ladder.round_order(rows, f"rung/{r}", "shuffle", r % 2) for r in range(6)]  # reproducible
    assert len({tuple(o) for o in orders}) > 1  # the rounds differ, and so do the rungs
    assert ladder.round_order(rows, "rung/0", "shuffle", False) != ladder.round_order(rows, "other/0", "shuffle", False)
    assert ladder.round_order(rows, "x", "alternate", False) == rows
    assert ladder.round_order(rows, "x", "alternate", True) == rows[::-1]


def test_the_ladder_s_second_default_row_keeps_memo_entries_of_its_own():
    """The default's second row must not find what the first row's calls made known (packed on the GPU, the sizes of
    its new packings: they would be known packings): it gives the default scale, so its calls have memo entries of
    their own (here a dense rung's, on the CPU, where packed calls are not memoized), and the same result."""
    import attnselect
    from attnselect import dispatch

    ladder = _benchmark("ladder")
    rung = next(r for r in ladder.rungs(smoke=True) if r["layout"] == "bshd" and r["phase"] == "inference")
    x = ladder.Inputs(rung, "cpu", ladder.SMOKE["heads"], torch.float32)
    rows = ladder.callers(rung, x.problem(), attnselect.Target.current("cpu"), "cpu", control=True)
    attnselect.clear_cache()
    first = rows[ladder.DEFAULT](x, None)
    assert len(dispatch._CALLS) == 1
    again = rows[ladder.AGAIN](x, None)
    assert len(dispatch._CALLS) == 2 and torch.equal(first, again)
    # the same kernel call to the bit: the scale given is the one attnselect works out (SDPA passes none then)
    first_call, again_call = (entry.known.call for entry in dispatch._CALLS.values())
    assert first_call == again_call


def test_the_ladder_s_parts_are_judged_together_by_pool(tmp_path):
    """--pool: the goals over parts run apart (--only), as one run over their rungs would judge them; the rungs no
    part ran are named; parts of two devices, or a rung in two parts, are refused."""
    args = ("--smoke", "--rounds", "1", "--calls", "1", "--warmup", "1", "--layers", "2")
    for part, only in (("a", "B1 S16"), ("b", "B2 S8")):
        _run("benchmarks/ladder.py", *args, "--only", only, "--out", str(tmp_path / part))
    parts = [tmp_path / f"{part}.json" for part in "ab"]
    _run("benchmarks/ladder.py", "--pool", *map(str, parts), "--out", str(tmp_path / "pooled"))
    ladder = _benchmark("ladder")
    pooled = json.loads((tmp_path / "pooled.json").read_text())
    results = [e for p in parts for e in json.loads(p.read_text())["results"]]
    assert pooled["goals"] == json.loads(json.dumps(ladder.goals(results)))
    assert len(pooled["rungs"]) == 4 and pooled["meta"]["not run"] == ["thd 48 tokens, new packing a step 24/16 "
                                                                          "inference", "thd 48 tokens, new packing a "
                                                                          "step 24/16 training"]  # fmt: skip
    assert "Rungs run: 4 of 6; not run:" in (tmp_path / "pooled.md").read_text()
    other = json.loads(parts[1].read_text())
    other["meta"]["device"] = "another GPU"
    (tmp_path / "c.json").write_text(json.dumps(other))
    for bad in ([str(parts[0]), str(tmp_path / "c.json")], [str(parts[0])] * 2):
        found = subprocess.run([sys.executable, "benchmarks/ladder.py", "--pool", *bad, "--out", str(tmp_path / "x")],
                               cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert found.returncode != 0 and "--pool" in found.stderr


def test_ladder_isolated_by_group_runs_every_rung_once(tmp_path):
    """--isolate --group: one process for the rungs of each layout, head-dim pair and phase; every rung's result
    recorded once, as a run in one process records it."""
    out = str(tmp_path / "ladder")
    args = ("--smoke", "--rounds", "1", "--calls", "1", "--warmup", "1", "--layers", "2", "--out", out)
    _run("benchmarks/ladder.py", *args, "--isolate", "--group")
    report = json.loads((tmp_path / "ladder.json").read_text())
    names = [e["rung"] for e in report["results"]]
    assert sorted(names) == sorted(set(names)) and len(names) == 6
    assert all(e["chosen"] and not e["errors"] for e in report["results"])
    assert "## Goals" in (tmp_path / "ladder.md").read_text()


def test_the_ladder_runs_dense_shapes_off_the_ladder_in_isolated_processes(tmp_path):
    """--dense B,S,DQK,DV: that shape's rungs, both phases, after the ladder's; --isolate passes it to each process
    and the report keeps the shapes; a malformed shape is refused by name."""
    ladder = _benchmark("ladder")
    # a shape on the ladder, or given twice, adds no rung
    names = [ladder.rung_name(r) for r in ladder.rungs(False, ((1, 2048, 128, 128), (1, 1024, 128, 128),
                                                                  (1, 2048, 128, 128)))]  # fmt: skip
    assert names[-2:] == ["bshd B1 S2048 128/128 inference", "bshd B1 S2048 128/128 training"]
    assert names[:-2] == [ladder.rung_name(r) for r in ladder.rungs(False)]
    with pytest.raises(argparse.ArgumentTypeError, match="B,S,DQK,DV"):
        ladder.dense_shape("1,2048,128")
    out = str(tmp_path / "ladder")
    args = ("--smoke", "--rounds", "1", "--calls", "1", "--warmup", "1", "--layers", "2", "--out", out)
    _run("benchmarks/ladder.py", *args, "--isolate", "--dense", "1,48,16,8", "--only", "B1 S48 16/8")
    report = json.loads((tmp_path / "ladder.json").read_text())
    assert [e["rung"] for e in report["results"]] == ["bshd B1 S48 16/8 inference", "bshd B1 S48 16/8 training"]
    assert report["meta"]["dense off the ladder"] == [[1, 48, 16, 8]]
    pooled = ladder.pool([out + ".json"], str(tmp_path / "pooled"))  # the goals are the ladder's: probes apart
    assert pooled["meta"]["off the ladder"] == [e["rung"] for e in report["results"]] and pooled["rungs"] == []


def test_the_ladder_s_goals_are_missed_while_a_rung_way_has_no_default_times():
    """A rung whose process failed, or whose default row raised, leaves no time to compare: no goal can be shown met
    (a faster single-kernel row there would otherwise go unseen)."""
    ladder = _benchmark("ladder")
    fast = {"median": 1.0, "q1": 1.0, "q3": 1.0, "n": 1}
    slow = {"median": 10.0, "q1": 10.0, "q3": 10.0, "n": 1}
    good = {"rung": "a", "stats": {"latency": {ladder.DEFAULT: fast, "forced x": slow, ladder.SDPA: slow}},
            "errors": {}}  # fmt: skip
    assert all(g["met"] for g in ladder.goals([good]).values())
    raised = {"rung": "b", "stats": {"latency": {"forced x": fast}}, "errors": {ladder.DEFAULT: "RuntimeError: x"}}
    crashed = {"rung": "c", "stats": {}, "errors": {"the rung": "its process exited with 1"}}
    for bad in (raised, crashed):
        found = ladder.goals([good, bad])
        assert not any(g["met"] for g in found.values())
        (unmeasured,) = (g["rows"] for name, g in found.items() if name.startswith("unmeasured"))
        assert unmeasured[0]["rung"] == bad["rung"]
    assert "unmeasured" in ladder.markdown({"meta": {"device": "d", "date": "t"}, "goals": found, "results": []})
    packed = {"rung": "thd", "stats": {"latency": {ladder.DEFAULT: fast, "forced x": slow}}, "errors": {}}
    sdpa_goal = next(g for name, g in ladder.goals([packed]).items() if "F.sdpa" in name)
    assert sdpa_goal["met"] is None  # packed rungs have no F.sdpa row: not measured, not missed


def test_the_ladder_refuses_a_screen_that_could_leave_the_fastest_row_out(tmp_path):
    for bad in (["--screen", "0.5"], ["--screen", "3", "--warmup", "0"]):
        found = subprocess.run([sys.executable, "benchmarks/ladder.py", "--smoke", "--out", str(tmp_path / "l"), *bad],
                               cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert found.returncode == 2 and "--screen" in found.stderr


def test_the_ladder_s_screen_keeps_a_row_whose_first_call_alone_is_slow():
    """A forced row's first call at a new packing may pay a one-off (a self-check at a new size class, a graph for a
    new shape): the screen takes each row's least of SCREEN_CALLS calls, so only a row slow at every call leaves."""
    import types

    ladder = _benchmark("ladder")
    calls = {"forced once slow": 0}

    def once_slow(x, packing):
        calls["forced once slow"] += 1
        time.sleep(0.05 if calls["forced once slow"] == 1 else 0.001)

    rows = {"attnselect default": lambda x, p: time.sleep(0.001), "forced once slow": once_slow,
            "forced always slow": lambda x, p: time.sleep(0.05)}  # fmt: skip
    x = types.SimpleNamespace(grad=None, packing=lambda name: None)
    screened = ladder.screen(rows, x, types.SimpleNamespace(screen=3.0, device="cpu"), {})
    assert list(screened) == ["forced always slow"] and calls["forced once slow"] == ladder.SCREEN_CALLS


def test_hot_path_smoke(tmp_path):
    _run("benchmarks/hot_path.py", "--calls", "3", "--repeats", "3", "--out", str(tmp_path / "hot"))
    cases = json.loads((tmp_path / "hot.json").read_text())["cases"]
    rows = cases[0]["rows"]
    assert next(iter(rows)).startswith("attnselect.attention")
    assert "F.scaled_dot_product_attention, default dispatch" in rows
    # the cases: dense and a new packing each call, inference and training (fwd+bwd)
    firsts = [next(iter(case["rows"])) for case in cases]
    assert sum(row.endswith("a new packing each call") for row in firsts) == 2
    assert sum(row.endswith("fwd+bwd") for row in firsts) == 1 and "training" in cases[3]["problem"]
    # the ladder's rung on bshd tensors, beside F.sdpa on their transposed views
    bshd = next(case for case in cases if "bshd" in case["problem"] and "causal" in case["problem"])
    assert "F.scaled_dot_product_attention on the transposed views, default dispatch" in bshd["rows"]


def test_hot_path_parts_smoke(tmp_path):
    baseline = ROOT / "src" / "attnselect" / "dispatch.py"
    args = ("--parts", "1", "--calls", "3", "--repeats", "3", "--baseline", str(baseline), "--out", str(tmp_path / "p"))
    _run("benchmarks/hot_path_parts.py", *args)
    rows = json.loads((tmp_path / "p.json").read_text())["parts"][0]
    assert list(rows)[:2] == ["attention()", "attention() on dispatch.py"]
    assert "attention() on a fixed known call (no lookup)" in rows


def test_torchtitan_steps_smoke(tmp_path):
    pytest.importorskip("torchtitan", reason="torchtitan is not installed (the test extra installs it)")
    _run("benchmarks/torchtitan_steps.py", "--smoke", "--out", str(tmp_path / "titan"))
    report = json.loads((tmp_path / "titan.json").read_text())
    way = report["ways"]["attnselect"]
    assert len(way["losses"]) == 3 and all(math.isfinite(x) for x in way["losses"]) and way["tokens_per_s"] > 0


def test_the_readme_performance_table_is_the_ladder_s():
    """README.md's size-ladder table is benchmarks/ladder.py's readme_table of the committed run (its four parts,
    every rung once, in the ladder's order), line for line."""
    ladder = _benchmark("ladder")
    parts = [json.loads((ROOT / "results" / f"h200_ladder_{part}_94ce3f9_fa4.json").read_text())["results"]
             for part in ("small", "medium", "packed", "large")]  # fmt: skip
    order = [ladder.rung_name(r) for r in ladder.rungs(False)]
    report = {"results": sorted((entry for part in parts for entry in part), key=lambda e: order.index(e["rung"]))}
    assert [e["rung"] for e in report["results"]] == order
    table = "\n".join("  " + line for line in ladder.readme_table(report).splitlines())
    assert table in (ROOT / "README.md").read_text()
    assert table.count("\n") == 1 + sum(" 192/128 " in e["rung"] for e in report["results"])


def test_the_grid_restarts_a_worker_on_a_sticky_cuda_error_and_not_on_a_transient_one():
    grid = _benchmark("correctness_grid")
    assert grid._spoils_context("the reference failed: AcceleratorError: CUDA error: an illegal memory access")
    assert grid._spoils_context("CUDADialectError: CUDA launch failed: cudaErrorInvalidValue (1)")
    assert not grid._spoils_context("RuntimeError: CUDA error: out of memory")  # the machine: run again
    assert not grid._spoils_context("MLIRError: Operation creation failed")
    assert not grid._spoils_context("")


def test_ladder_rules_scores_each_rule_s_picks_on_committed_ladders(tmp_path):
    """benchmarks/ladder_rules.py on two committed ladders: every dense rung-way scored for every rule, each score
    the fastest forced row's time over the pick's; the max, sum and stack rules (attnselect's ranking, with its tie
    band) there; one choice in hindsight at least as good in its worse way as every rule's on every rung; "as run"
    the ladder's own default's choice."""
    from attnselect.choose.rules import TIE_BAND

    ladders = ("results/h200_ladder_20c9c6a_fa4.json", "results/h200_ladder.json")
    _run("benchmarks/ladder_rules.py", *ladders, "--out", str(tmp_path / "rules"))
    picks = json.loads((tmp_path / "rules.json").read_text())["picks"]
    assert picks and all(0 < p["score"] <= 1 and p["fastest_ms"] <= p["ms"] for p in picks)
    assert {p["ladder"] for p in picks} == set(ladders)
    rules = {(p["rule"], p["band"], p["settled_by"]) for p in picks}
    assert {("max", 0.0, ""), ("sum", 0.0, ""), ("alone", 0.0, ""), ("stack", 0.0, ""), ("stack", TIE_BAND, "sum"),
            ("stack", TIE_BAND, "alone"), ("one choice in hindsight", 0.0, "")} <= rules  # fmt: skip
    per_rule = {rule: sum(1 for p in picks if (p["rule"], p["band"], p["settled_by"]) == rule) for rule in rules}
    as_run = per_rule.pop(("as run", 0.0, ""))  # where the default's own choice was forced both ways
    assert len(set(per_rule.values())) == 1 and 0 < as_run <= min(per_rule.values())  # the rules on the same ones
    chosen = {
        (path, e["rung"]): e["chosen"] for path in ladders for e in json.loads((ROOT / path).read_text())["results"]
    }
    stats = {
        (path, e["rung"]): e["stats"] for path in ladders for e in json.loads((ROOT / path).read_text())["results"]
    }
    for p in picks:  # every pick scored by its forced row's median, the ladder's own choice too
        assert p["ms"] == stats[(p["ladder"], p["rung"])][p["way"]][f"forced {p['chosen']}"]["median"]
        assert p["rule"] != "as run" or p["chosen"] == chosen[(p["ladder"], p["rung"])]
    worse = {}
    for p in picks:
        key = (p["ladder"], p["rung"], p["rule"], p["band"], p["settled_by"])
        worse[key] = min(worse.get(key, 1.0), p["score"])
    for (ladder, rung, *_), score in worse.items():
        assert worse[(ladder, rung, "one choice in hindsight", 0.0, "")] >= score
    text = (tmp_path / "rules.md").read_text()
    assert "| stack, sum within 15% | both |" in text and "| stack, alone within 15% | both |" in text
    assert "| stack, max + 0.25 min |" in text and "| latency, alone, training rows |" in text


def test_ladder_rules_predicts_by_a_calibration_given(tmp_path):
    """--calibration: the rules pick by that calibration's predictions (its GPU's, for the ladder's target), not by the
    packaged H200's: an H100 ladder judged by the H100's calibration, and by a copy whose sdpa_flash host times are made
    a hundred times dearer, which no rule's pick (but hindsight's and the ladder's own) is then on a rung where
    another candidate is forced."""
    from attnselect.choose import calibration

    ladders = ("results/h100_ladder_small_82917ac_fa4.json",)
    data = json.loads((ROOT / "results" / "h100_calibration.json").read_text())
    data["fingerprint"]["attnselect"] = calibration._version()  # it holds for this version of attnselect too
    (tmp_path / "own_calibration.json").write_text(json.dumps(data))
    _run("benchmarks/ladder_rules.py", *ladders, "--calibration", str(tmp_path / "own_calibration.json"), "--out",
         str(tmp_path / "own"))  # fmt: skip
    assert "own_calibration.json's predictions" in (tmp_path / "own.md").read_text()
    own = json.loads((tmp_path / "own.json").read_text())["picks"]
    assert any(p["chosen"] == "sdpa_flash native" and p["rule"] == "sum" for p in own)
    data["host_us"]["sdpa_flash"] = {kind: us * 100 for kind, us in data["host_us"]["sdpa_flash"].items()}
    (tmp_path / "dear_calibration.json").write_text(json.dumps(data))
    _run("benchmarks/ladder_rules.py", *ladders, "--calibration", str(tmp_path / "dear_calibration.json"), "--out",
         str(tmp_path / "dear"))  # fmt: skip
    dear = json.loads((tmp_path / "dear.json").read_text())["picks"]
    judged = [p for p in dear if p["rule"] not in ("one choice in hindsight", "as run")]
    assert {(p["rung"], p["way"]) for p in judged} == {(p["rung"], p["way"]) for p in own if p["rule"] == "sum"}
    assert not any(p["chosen"] == "sdpa_flash native" for p in judged)
    data["fingerprint"]["attnselect"] = "0.0.1"  # made by another attnselect: refused, not scored with the H200's
    (tmp_path / "other_calibration.json").write_text(json.dumps(data))
    with pytest.raises(subprocess.CalledProcessError):
        _run("benchmarks/ladder_rules.py", *ladders, "--calibration", str(tmp_path / "other_calibration.json"),
             "--out", str(tmp_path / "other"))  # fmt: skip


def test_first_calls_probe_splits_start_up_configuration_and_size():
    """benchmarks/first_calls_probe.py (GPU only): its split of a process's first calls, from made-up times."""
    probe = _benchmark("first_calls_probe")
    rows = {
        "A first": {"first_ms": 500.0, "second_ms": 1.0},  # start-up, configuration and size
        "A new size": {"first_ms": 31.0, "second_ms": 1.0},
        "A another size": {"first_ms": 41.0, "second_ms": 1.0},
        "B new configuration": {"first_ms": 101.0, "second_ms": 1.0},
        "B new size": {"error": "RuntimeError: no"},
    }
    assert probe.derived(rows) == {"configuration_ms": 100.0, "start_up_ms": 399.0, "size_ms": 40.0}


def test_new_lengths_draws_the_same_lengths_every_run():
    """benchmarks/new_lengths.py (GPU only): every row of a workload meets the same lengths, in the same order."""
    new_lengths = _benchmark("new_lengths")
    drawn = new_lengths.lengths(200, 100)
    assert drawn == new_lengths.lengths(200, 100) and len(set(drawn)) <= 100
    assert all(256 <= n <= 4096 and n % 16 == 0 for n in drawn)


def test_self_check_probe_takes_a_slice_s_gradient_errors_apart_on_the_cpu(tmp_path):
    """benchmarks/self_check_probe.py on the CPU: the self-check's slices (the longest sequence's last head first, then
    sequence i with head i), each with its judgement, the parts of its dq and dk errors and criterion 2's verdict; a
    one-token causal sequence has no gradient to get wrong."""
    _run("benchmarks/self_check_probe.py", "--device", "cpu", "--lengths", "24,1,2", "--out", str(tmp_path / "probe"))
    report = json.loads((tmp_path / "probe.json").read_text())
    assert report["meta"]["lengths"] == [24, 1, 2]
    assert [(r["sequence"], r["head"]) for r in report["rows"][:4]] == [(0, 15), (0, 0), (1, 1), (2, 2)]
    assert report["meta"]["failed"] == {"criterion 2": sum(not r["criterion 2 passed"] for r in report["rows"]),
                                        "criterion 3": sum(not r["passed"] for r in report["rows"])}  # fmt: skip
    parts = {"exact", "read back (exact out rounded)", "read back (own out)", "naive", "rounding", "max |exact|"}
    for row in report["rows"]:
        assert row["passed"] == all(e <= row["judged"]["bounds"][n] for n, e in row["judged"]["errors"].items())
        for name in ("dq", "dk"):
            assert set(row[name]) == parts and all(value >= 0 for value in row[name].values())
            judged = min(row[name]["exact"], row[name]["read back (own out)"])  # either reference (criterion 3)
            assert row["judged"]["errors"][name] == pytest.approx(judged)
    one = report["rows"][2]
    assert one["length"] == 1 and one["dq"]["max |exact|"] == 0.0 and one["dq"]["exact"] < 1e-6


def test_pack_crossover_times_each_packing_and_finds_the_bound_that_loses_least(tmp_path):
    """benchmarks/pack_crossover.py on the CPU (two sdpa kernels): every packing timed both ways in both phases with
    its three work counts, and each count's best bound loses no more than sending every packing to either kernel."""
    _run("benchmarks/pack_crossover.py", "--device", "cpu", "--smoke", "--out", str(tmp_path / "crossover"))
    report = json.loads((tmp_path / "crossover.json").read_text())
    rows = report["rows"]
    assert {r["phase"] for r in rows} == {"training", "inference"} and len(rows) == 6
    for r in rows:
        assert r["exact"] <= r["estimate"] * 2 and r["estimate"] <= r["count"] and r["tokens"] == 256
        assert set(r["ms"]) == {f"{b} {w}" for b in ("sdpa_math", "sdpa_flash") for w in ("stack", "latency")}
    crossover = _benchmark("pack_crossover")
    for count in crossover.COUNTS:
        bound = crossover.best_bound(rows, count, ("stack",), "sdpa_math", "sdpa_flash")
        lost = crossover.scored(rows, crossover.at_most(count, bound), "sdpa_math", "sdpa_flash")["stack"]["lost"]
        for every in (lambda r: True, lambda r: False):
            assert 0 <= lost <= crossover.scored(rows, every, "sdpa_math", "sdpa_flash")["stack"]["lost"]
    made_up = [{"count": c, "ms": {"a stack": a, "b stack": b, "a latency": a, "b latency": b}}
               for c, a, b in ((1, 1.0, 2.0), (2, 1.0, 3.0), (3, 5.0, 2.0))]  # fmt: skip
    assert crossover.best_bound(made_up, "count", ("stack", "latency"), "a", "b") == 2
    assert crossover.scored(made_up, lambda r: True, "a", "b")["stack"] == {"lost": 3.0, "best": 4.0, "worst": 2.5}
    assert "| attnselect's tables (estimate <= " in (tmp_path / "crossover.md").read_text()


def test_pack_crossover_counts_a_pack_s_work_as_the_rules_do():
    """benchmarks/pack_crossover.py's count and estimate are attnselect.choose.rules' _work and _pack_estimate (any
    size) of the pack as a call describes it, on the size ladder's packings; its exact work is at least the
    estimate."""
    crossover, ladder = _benchmark("pack_crossover"), _benchmark("ladder")
    from attnselect import AttentionProblem
    from attnselect.choose import rules

    for tokens in (4096, 16384, 24576):
        for seed in range(1, 9):
            lengths = ladder.packing_lengths(tokens, seed)
            found = crossover.works(lengths, (128, 128))
            p = AttentionProblem(len(lengths), max(lengths), max(lengths), crossover.HEADS, crossover.HEADS, 128, 128,
                                 layout="thd", mask="causal", tokens=tokens)  # fmt: skip
            assert (found["count"], found["estimate"]) == (rules._work(p), rules._pack_estimate(p, None))
            assert found["estimate"] <= found["exact"] <= found["count"]


def test_self_check_model_fails_a_fused_kernel_under_criterion_2_alone(tmp_path):
    """benchmarks/self_check_model.py: with a GPU's naive reference, two-token slices of a fused kernel that rounds its
    numerators fail the bound where the read-back reference reads the exact output rounded, and none fail where it
    reads the output the kernel returned (attnselect.correctness.CRITERION 3); without that rounding none fail."""
    _run("benchmarks/self_check_model.py", "--seeds", "100", "--lengths", "2", "--out", str(tmp_path / "model"))
    rows = json.loads((tmp_path / "model.json").read_text())["rows"]
    by = {(r["rounded numerators"], r["rounded dS"]): r["failed"] for r in rows}
    assert by[(True, True)]["criterion 2 dq"] > 0 and by[(True, True)]["criterion 2 dk"] > 0
    assert all(f["criterion 3 dq"] == f["criterion 3 dk"] == 0 for f in by.values())
    assert all(sum(by[(False, ds)].values()) == 0 for ds in (True, False))


def test_replay_prices_run_fa4_at_once_where_its_interface_is_no_slower_and_rent_around_it_where_it_is(tmp_path):
    """benchmarks/replay_prices.py on the packaged H100 calibration: long calls run FA4 at once, short ones rent a
    kernel with nothing to pay, which FA4 through its interface is slower than."""
    _run("benchmarks/replay_prices.py", "--out", str(tmp_path / "prices"))
    rows = json.loads((tmp_path / "prices.json").read_text())["rows"]
    assert rows[-1]["chosen"] == "flash_attn4 native" and rows[-1]["rental_calls"] == 0
    assert rows[0]["chosen"] != "flash_attn4 native" and rows[0]["rental_calls"] > 0
    for r in rows:
        assert r["fa4_replayed_us"] < r["fa4_through_interface_us"]
        if r["rental_calls"]:  # its calls before the replay cost more than the kernel rented, which is slower after
            assert r["fa4_replayed_us"] < r["chosen_us"] < r["fa4_through_interface_us"] and r["price_ms"] > 0
        else:
            assert r["chosen"] == "flash_attn4 native" and r["chosen_us"] == r["fa4_replayed_us"]
