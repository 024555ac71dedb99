"""The measure policy and its persistent decision cache, on the CPU candidates."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import attnselect
from attnselect import AttentionProblem, Candidate, Target, memos
from attnselect.choose import measure, store, timing

P = AttentionProblem(
    batch=2,
    seqlen_q=64,
    seqlen_kv=64,
    heads_q=4,
    heads_kv=4,
    head_dim_qk=24,
    head_dim_v=16,
    dtype=torch.float32,
    mask="causal",
)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    store._memory.clear()
    memos._WARNED.clear()
    return tmp_path


def test_measure_times_every_supported_candidate_and_keeps_the_fastest(caplog, monkeypatch):
    # every candidate timed: past the budget's half, warm-ups stop and the rest keep the rules order (by design)
    monkeypatch.setattr(measure, "TUNING_BUDGET_S", 600.0)
    monkeypatch.setenv("ATTNSELECT_DEBUG", "1")
    monkeypatch.setenv("ATTNSELECT_DEBUG_LEVEL", "2")
    with caplog.at_level("DEBUG", logger="attnselect"):
        d = attnselect.select(P, target=Target.current("cpu"), policy="measure")
    rules = attnselect.select(P, target=Target.current("cpu"))
    assert set(d.timings) == set(rules.ranked) and all(t.median_ms > 0 for t in d.timings.values())
    fastest = min(d.timings, key=lambda c: d.timings[c].median_ms)
    assert d.timings[d.chosen].median_ms <= d.timings[fastest].high_ms
    assert "measured" in d.why and ", measured " in caplog.text


def test_ties_inside_the_spread_go_to_the_rules_order():
    ranked = (Candidate("sdpa_flash", 24), Candidate("sdpa_math"), Candidate("reference"))
    timings = {ranked[0]: timing.Timing(1.015, 1.0, 1.1), ranked[1]: timing.Timing(1.0, 0.9, 1.08), ranked[2]: None}
    assert measure.choose(ranked, timings) == (ranked[0], ranked[1])
    timings[ranked[0]] = timing.Timing(1.05, 1.0, 1.1)  # inside the spread, but 5% slower: no tie
    assert measure.choose(ranked, timings) == (ranked[1], ranked[0])
    timings[ranked[1]] = timing.Timing(1.0, 0.99, 1.01)  # a tight spread decides below 2%
    timings[ranked[0]] = timing.Timing(1.015, 1.0, 1.1)
    assert measure.choose(ranked, timings) == (ranked[1], ranked[0])


def test_a_candidate_with_non_finite_output_is_out_of_tuning(monkeypatch, caplog):
    from attnselect import execution

    real = execution.run_call

    def nan_for_math(candidate, *args, **kwargs):
        out, lse = real(candidate, *args, **kwargs)
        return (out * float("nan"), lse) if candidate.backend == "sdpa_math" else (out, lse)

    monkeypatch.setattr(execution, "run_call", nan_for_math)
    ranked = attnselect.select(P, target=Target.current("cpu")).ranked
    with caplog.at_level("WARNING", logger="attnselect"):
        timings = measure.measure(P, Target.current("cpu"), ranked)
    assert all(timings[c] is None for c in ranked if c.backend == "sdpa_math")
    assert all(timings[c] is not None for c in ranked if c.backend != "sdpa_math")
    assert "failed while tuning" in caplog.text and "non-finite output" in caplog.text


def test_decisions_persist_across_processes(cache_dir):
    attnselect.select(P, target=Target.current("cpu"), policy="measure")
    entries = json.loads((cache_dir / "decisions.json").read_text())["entries"]
    assert len(entries) == 1
    code = (
        "import torch, attnselect, attnselect.choose.measure as m\n"
        "m.measure = lambda *a, **k: (_ for _ in ()).throw(AssertionError('measured again'))\n"
        "p = attnselect.AttentionProblem(2, 64, 64, 4, 4, 24, 16, torch.float32, mask='causal')\n"
        "print(attnselect.select(p, target=attnselect.Target.current('cpu'), policy='measure').chosen)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "ATTNSELECT_CACHE_DIR": str(cache_dir)},
    ).stdout.strip()
    assert out == str(attnselect.select(P, target=Target.current("cpu"), policy="measure").chosen)


def test_another_target_fingerprint_ignores_old_entries(cache_dir, monkeypatch):
    attnselect.select(P, target=Target.current("cpu"), policy="measure")
    key = next(iter(json.loads((cache_dir / "decisions.json").read_text())["entries"]))
    newer = store.fingerprint(Target.current("cpu"))
    assert json.loads(key)["target"] == newer
    other = Target.current("cpu").with_versions(torch_version="9.9.9")
    assert store.lookup(store.entry_key(measure.bucket(P), "measure", other)) is None


@pytest.mark.parametrize("damage", ["garbage", "truncated", "binary", "a list", "another format"])
def test_corrupt_cache_warns_once_and_is_rebuilt(cache_dir, caplog, damage):
    path = cache_dir / "decisions.json"
    attnselect.select(dataclasses.replace(P, seqlen_q=5, seqlen_kv=5), target=Target.current("cpu"), policy="measure")
    valid = path.read_text()  # a real cache of one entry, for the truncated case
    attnselect.clear_cache()
    damaged = {
        "garbage": "{not json",
        "truncated": valid[: len(valid) // 2],
        "a list": "[]",
        "another format": json.dumps({"format": -1, "entries": {}}),
    }
    if damage == "binary":
        path.write_bytes(bytes(range(128, 256)))
    else:
        path.write_text(damaged[damage])
    with caplog.at_level("WARNING", logger="attnselect"):
        attnselect.select(P, target=Target.current("cpu"), policy="measure")
        attnselect.clear_cache()
        attnselect.select(P, target=Target.current("cpu"), policy="measure")
    assert caplog.text.count("ignoring the unreadable decision cache") == 1
    assert len(json.loads((cache_dir / "decisions.json").read_text())["entries"]) == 1


@pytest.mark.parametrize("blocked", ["read-only", "missing and uncreatable"])
def test_read_only_directory_falls_back_to_memory(tmp_path, monkeypatch, caplog, blocked):
    if blocked == "missing and uncreatable":  # below a file
        blocker = tmp_path / "file"
        blocker.write_text("")
        monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(blocker / "cache"))
    elif os.geteuid() == 0:  # root writes into a 0o500 directory anyway: refuse the writes as the OS would

        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied", str(tmp_path))

        monkeypatch.setattr(store.tempfile, "mkstemp", refuse)
    else:
        tmp_path.chmod(0o500)
    with caplog.at_level("WARNING", logger="attnselect"):
        first = attnselect.select(P, target=Target.current("cpu"), policy="measure")
        attnselect.clear_cache()
        assert attnselect.select(P, target=Target.current("cpu"), policy="measure").chosen == first.chosen
    assert "keeping decisions in memory" in caplog.text and store._memory
    assert len(caplog.records) == 1, "one warning for the directory, whether its read or its write failed first"


def test_an_unreadable_file_in_a_usable_directory_is_rebuilt(cache_dir, monkeypatch, caplog):
    """Permission denied on the file alone: one warning, and the next write replaces it (not memory alone)."""
    path = cache_dir / "decisions.json"
    path.write_text("{}")
    read_text = pathlib.Path.read_text

    def denied(self, *args, **kwargs):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)

    with monkeypatch.context() as patched, caplog.at_level("WARNING", logger="attnselect"):
        patched.setattr(pathlib.Path, "read_text", denied)
        attnselect.select(P, target=Target.current("cpu"), policy="measure")
    assert "ignoring the unreadable decision cache" in caplog.text and "keeping decisions in memory" not in caplog.text
    assert not store._memory and json.loads(path.read_text())["entries"]


def test_a_malformed_entry_is_named_in_its_warning(cache_dir, caplog, monkeypatch):
    from attnselect.choose import failures

    attnselect.select(P, target=Target.current("cpu"), policy="measure")
    path = cache_dir / "decisions.json"
    data = json.loads(path.read_text())
    (key,) = data["entries"]
    data["entries"][key] = {"ranked": [{"backend": 5}], "timings": [{"candidate": {"nope": 1}, "ms": None}]}
    path.write_text(json.dumps(data))
    attnselect.clear_cache()
    with caplog.at_level("WARNING", logger="attnselect"):
        attnselect.select(P, target=Target.current("cpu"), policy="measure")
    assert f"the measured decision for {P.describe()}" in caplog.text
    assert "malformed" in caplog.text and caplog.text.count("decision cache") == 1
    failure_key = failures._entry_key(P, Target.current("cpu"))
    path.write_text(json.dumps({"format": store.FORMAT, "entries": {failure_key: {"failed": [{"candidate": {}}]}}}))
    store._seen.clear()
    memos._WARNED.clear()
    monkeypatch.setattr(failures, "_RECORDED", None)
    caplog.clear()
    with caplog.at_level("WARNING", logger="attnselect"):
        attnselect.select(P, target=Target.current("cpu"))
    assert "the failures recorded at signature [" in caplog.text


def test_measure_refuses_simulated_targets():
    with pytest.raises(attnselect.InvalidInputError, match="'measure' times kernels on this machine"):
        attnselect.select(P, target=Target.preset("h200"), policy="measure")


def test_packed_problems_share_a_bucket():
    a = AttentionProblem(5, 300, 300, 4, 4, 24, 16, torch.float32, layout="thd", mask="causal", tokens=1200)
    b = AttentionProblem(7, 500, 500, 4, 4, 24, 16, torch.float32, layout="thd", mask="causal", tokens=2000)
    assert measure.bucket(a) == measure.bucket(b) and measure.bucket(a).seqlen_q == 512
    assert measure.bucket(a).tokens == 0  # timed on packings of its own: `attnselect tune`'s problems have no tokens


def test_measure_through_attention_and_environment(monkeypatch):
    monkeypatch.setenv("ATTNSELECT_POLICY", "measure")
    q, k, v = (torch.randn(1, 32, 2, d) for d in (24, 24, 16))
    out = attnselect.attention(q, k, v, causal=True)
    ref = attnselect.attention(q, k, v, causal=True, backend="reference")
    assert torch.allclose(out, ref, atol=1e-5)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    packed = attnselect.attention(q[0, :12], k[0, :12], v[0, :12], layout="thd", cu_seqlens_q=cu, causal=True)
    assert packed.shape == (12, 2, 16)


def test_eight_processes_writing_at_once_keep_every_entry(cache_dir):
    code = (
        "import sys, attnselect.choose.store as s\n"
        "for i in range(20): s.remember(f'{sys.argv[1]}-{i}', {'ranked': [], 'timings': {}})"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(n)], env={**os.environ, "ATTNSELECT_CACHE_DIR": str(cache_dir)}
        )
        for n in range(8)
    ]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    entries = json.loads((cache_dir / "decisions.json").read_text())["entries"]
    assert set(entries) == {f"{n}-{i}" for n in range(8) for i in range(20)}


def test_under_cuda_graph_capture_measure_reuses_the_warm_up_decision(monkeypatch, caplog):
    warm = attnselect.select(P, policy="measure")
    monkeypatch.setattr(measure, "measure", lambda *a, **k: pytest.fail("timed kernels while capturing"))
    captured = attnselect.select(dataclasses.replace(P, cuda_graph_capture=True), policy="measure")
    assert captured.chosen == warm.chosen and captured.timings
    store._memory.clear()
    other = dataclasses.replace(P, seqlen_q=32, seqlen_kv=32, cuda_graph_capture=True)  # never warmed up
    with caplog.at_level("INFO", logger="attnselect"):
        cold = attnselect.select(other, policy="measure")
    assert cold.chosen == attnselect.select(other).chosen and "using the rules order" in caplog.text


@pytest.mark.gpu
def test_measure_on_the_gpu_keeps_the_fastest_contender(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    # Room for a cold process: first calls compile (cuDNN's runtime kernels, flex) for seconds, which under the
    # default budget can end warm-up after the first candidate (as the log then says); this checks the choice.
    monkeypatch.setattr(measure, "TUNING_BUDGET_S", 120.0)
    mla = AttentionProblem(
        batch=2,
        seqlen_q=1024,
        seqlen_kv=1024,
        heads_q=16,
        heads_kv=16,
        head_dim_qk=192,
        head_dim_v=128,
        dtype=torch.bfloat16,
        mask="causal",
        training=True,
    )
    decision = attnselect.select(mla, policy="measure")
    timed = {c: t for c, t in decision.timings.items() if t is not None}
    fastest = min(t.median_ms for t in timed.values())
    assert len(timed) >= 2 and decision.chosen in timed
    assert timed[decision.chosen].median_ms <= fastest * (1 + measure.TIE_TOLERANCE)


def test_a_candidate_that_builds_per_packing_pays_for_it_in_its_measurement(monkeypatch):
    """candidate_step hands every call the next packing, so a per-packing cost lands in every timed call."""
    problem = AttentionProblem(8, 64, 64, 2, 2, 16, 16, layout="thd", mask="causal")
    inputs = timing.random_inputs(problem, torch.device("cpu"))
    handed = []
    from attnselect import execution

    real = execution.run_call
    monkeypatch.setattr(
        execution, "run_call", lambda *a, packing, **kw: handed.append(packing) or real(*a, packing=packing, **kw)
    )
    step = timing.candidate_step(Candidate("reference"), problem, Target.current("cpu"), inputs)
    for _ in range(3):
        step()
    assert len({id(p.cu_seqlens_q) for p in handed}) == 3


def test_a_deeply_nested_key_or_a_timing_past_a_float_is_an_entry_ignored_not_a_crash(cache_dir, caplog, monkeypatch):
    """decisions.json's keys are not parsed unless they are a failure record's (a key nested past Python's
    recursion limit failed every call, under every policy, and was never rebuilt); a measured timing too large for a
    float is a malformed entry, named in one warning."""
    from attnselect.choose import failures

    path = cache_dir / "decisions.json"
    path.write_text(json.dumps({"format": store.FORMAT, "entries": {"[" * 50000 + "]" * 50000: {}}}))
    monkeypatch.setattr(failures, "_RECORDED", None)
    assert attnselect.select(P, target=Target.current("cpu")).chosen  # the rules policy reads the failures
    attnselect.select(P, target=Target.current("cpu"), policy="measure")
    data = json.loads(path.read_text())
    key = next(k for k in data["entries"] if not k.startswith("["))
    data["entries"][key]["timings"][0]["ms"] = [1, 1, 1]
    path.write_text(json.dumps(data).replace("[1, 1, 1]", "[" + "9" * 400 + ", 1, 1]"))
    store._seen.clear()
    attnselect.clear_cache()
    with caplog.at_level("WARNING", logger="attnselect"):
        assert attnselect.select(P, target=Target.current("cpu"), policy="measure").chosen
    assert f"the measured decision for {P.describe()}" in caplog.text and "malformed" in caplog.text


def test_a_problem_too_large_to_time_keeps_the_rules_order_and_says_so(caplog):
    """The measure policy cannot make inputs past the device's memory: the rules order stands, logged, nothing stored
    (a process with more memory times it)."""
    huge = AttentionProblem(4096, 65536, 65536, 128, 128, 192, 128, torch.float32)
    with caplog.at_level("WARNING", logger="attnselect"):
        decision = attnselect.select(huge, target=Target.current(), policy="measure")
    rules = attnselect.select(huge, target=Target.current(), policy="rules")
    assert decision.timings is None and decision.ranked == rules.ranked
    assert any("cannot make inputs to time" in r.getMessage() and "the rules order stands" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    assert store.lookup(store.entry_key(measure.bucket(huge), "measure", Target.current())) is None
