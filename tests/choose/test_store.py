"""The decision cache file with any content: ignored with one warning and rebuilt, never a crash
(attnselect.choose.store and its readers, attnselect.choose.failures and the measure policy)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import attnselect
from attnselect import memos
from attnselect.choose import failures, measure, store
from attnselect.spec.options import Candidate
from attnselect.spec.problem import AttentionProblem

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
READERS_FIELDS = st.fixed_dictionaries({}, optional={"failed": JSON, "ranked": JSON, "timings": JSON})
FAILURE_KEY = json.dumps({"signature": [], "policy": failures.FAILED_AT_RUN_TIME, "target": {}})
MEASURE_KEY = json.dumps({"problem": {}, "policy": "measure", "target": {}})
CONTENT = st.one_of(
    st.binary(max_size=64).map(lambda b: ("bytes", b)),
    JSON.map(lambda j: ("text", json.dumps(j))),  # any JSON document
    st.dictionaries(st.text(max_size=12), JSON, max_size=3).map(  # the format, with entries of any content
        lambda entries: ("text", json.dumps({"format": store.FORMAT, "entries": entries}))
    ),
    JSON.map(lambda j: ("text", json.dumps({"format": store.FORMAT, "entries": {FAILURE_KEY: j, MEASURE_KEY: j}}))),
    st.tuples(READERS_FIELDS, READERS_FIELDS, JSON).map(  # entries of the readers' shape, with anything in it
        lambda t: (
            "text",
            json.dumps({"format": store.FORMAT, "entries": {FAILURE_KEY: t[0], MEASURE_KEY: t[1], "x": t[2]}}),
        )
    ),
    st.integers(1, 40).map(lambda n: ("text", json.dumps({"format": store.FORMAT, "entries": {"a": {}}})[:n])),
)


def _fake_timings(problem, target, ranked, budget_s=None):
    """Timings in the rules order, without running a kernel (the file's rebuild is what is tested)."""
    return {c: measure.Timing(1.0 + i, 1.0 + i, 1.0 + i) for i, c in enumerate(ranked)}


def _measured(key: str) -> bool:
    try:
        return json.loads(key)["policy"] == "measure"
    except (ValueError, TypeError, KeyError):  # the junk's own keys
        return False


def _new_process(monkeypatch):
    """What a later process starts with: no memo, no entries in memory, nothing read or warned yet."""
    attnselect.clear_cache()
    store._memory.clear()
    monkeypatch.setattr(failures, "_RECORDED", None)
    memos._WARNED.clear()


MALFORMED = {"failed": 5, "ranked": 1, "timings": [1]}


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=CONTENT)
@example(content=("text", json.dumps({"format": 1, "entries": {FAILURE_KEY: MALFORMED, MEASURE_KEY: MALFORMED}})))
@example(content=("text", json.dumps({"format": 1, "entries": {FAILURE_KEY: MALFORMED, "x": 3}})))
@example(content=("text", json.dumps({"format": 1, "entries": {FAILURE_KEY: {"failed": [{"candidate": {}}]}}})))
def test_any_content_of_the_cache_file_is_ignored_with_one_warning_and_rebuilt(
    content, tmp_path_factory, monkeypatch, caplog
):
    directory = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(directory))
    _new_process(monkeypatch)
    kind, data = content
    path = directory / "decisions.json"
    path.write_bytes(data) if kind == "bytes" else path.write_text(data)
    q, k, v = (torch.randn(1, 6, 2, d) for d in (8, 8, 8))
    problem = AttentionProblem.from_tensors(q, k, v)
    monkeypatch.setattr(measure, "measure", _fake_timings)
    with caplog.at_level(logging.WARNING, logger="attnselect"):
        caplog.clear()
        out = attnselect.attention(q, k, v)  # the rules policy: reads the file's recorded failures
        assert failures.failures(problem, attnselect.Target.current()) == {}
        assert measure._from_store(store.lookup(MEASURE_KEY), (Candidate("sdpa_math"),), MEASURE_KEY, problem) in (
            None,
            ((Candidate("sdpa_math"),), {Candidate("sdpa_math"): measure.Timing(1.0, 1.0, 1.0)}),
        )
        with attnselect.overrides(policy="measure"):  # a measured decision: written to the file
            measured = attnselect.attention(q, k, v)
    assert torch.isfinite(out).all() and torch.isfinite(measured).all()
    assert len([r for r in caplog.records if "decision cache" in r.getMessage()]) <= 1
    rebuilt = json.loads(path.read_text())
    assert rebuilt["format"] == store.FORMAT and isinstance(rebuilt["entries"], dict)
    assert any(_measured(key) for key in rebuilt["entries"] if key != MEASURE_KEY)

    _new_process(monkeypatch)  # a later process reads the rebuilt file back: no warning, nothing measured again
    monkeypatch.setattr(measure, "measure", lambda *a, **kw: pytest.fail("measured again"))
    with caplog.at_level(logging.WARNING, logger="attnselect"):
        caplog.clear()
        attnselect.attention(q, k, v)
        with attnselect.overrides(policy="measure"):
            assert torch.equal(attnselect.attention(q, k, v), measured)
    assert not [r for r in caplog.records if "decision cache" in r.getMessage()]


def test_a_lock_held_too_long_times_out_and_the_entry_stays_in_memory(tmp_path, monkeypatch, caplog):
    import fcntl

    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(store, "LOCK_TIMEOUT_S", 0.2)
    memos._WARNED.clear()
    store._memory.clear()
    with open(tmp_path / "decisions.lock", "a") as held:  # another open file: flock treats it as another holder
        fcntl.flock(held, fcntl.LOCK_EX)
        with caplog.at_level(logging.WARNING, logger="attnselect"):
            store.remember('{"a": 1}', {"x": 1})
    assert "held by another process for 0 s" in caplog.text and store.lookup('{"a": 1}') == {"x": 1}
    store._memory.clear()


def test_a_write_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch, caplog):
    """decisions.json a directory: the write's temporary file is removed, not left behind one per write."""
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(tmp_path))
    (tmp_path / "decisions.json").mkdir()
    monkeypatch.setattr(store, "_memory", {})
    with caplog.at_level(logging.WARNING, logger="attnselect"):
        for n in range(3):
            store.remember(f"key {n}", {"value": n})
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".decisions-")]
    assert store._memory["key 2"] == {"value": 2}
