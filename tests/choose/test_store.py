"""The decision cache file with any content: ignored with one warning and rebuilt, never a crash
(attnselect.choose.store and its readers, attnselect.choose.failures and the measure policy)."""

from __future__ import annotations

import json
import logging

import torch
from hypothesis import HealthCheck, given, settings
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
FAILURE_KEY = json.dumps({"signature": [], "policy": failures.FAILED_AT_RUN_TIME, "target": {}})
MEASURE_KEY = json.dumps({"problem": {}, "policy": "measure", "target": {}})
CONTENT = st.one_of(
    st.binary(max_size=64).map(lambda b: ("bytes", b)),
    JSON.map(lambda j: ("text", json.dumps(j))),  # any JSON document
    st.dictionaries(st.text(max_size=12), JSON, max_size=3).map(  # the format, with entries of any content
        lambda entries: ("text", json.dumps({"format": store.FORMAT, "entries": entries}))
    ),
    JSON.map(lambda j: ("text", json.dumps({"format": store.FORMAT, "entries": {FAILURE_KEY: j, MEASURE_KEY: j}}))),
    st.integers(1, 40).map(lambda n: ("text", json.dumps({"format": store.FORMAT, "entries": {"a": {}}})[:n])),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=CONTENT)
def test_any_content_of_the_cache_file_is_ignored_with_one_warning(content, tmp_path_factory, monkeypatch, caplog):
    directory = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(directory))
    monkeypatch.setattr(failures, "_RECORDED", None)
    memos._WARNED.clear()
    kind, data = content
    path = directory / "decisions.json"
    path.write_bytes(data) if kind == "bytes" else path.write_text(data)
    q, k, v = (torch.randn(1, 6, 2, d) for d in (8, 8, 8))
    problem = AttentionProblem.from_tensors(q, k, v)
    with caplog.at_level(logging.WARNING, logger="attnselect"):
        caplog.clear()
        out = attnselect.attention(q, k, v)
        assert failures.failures(problem, attnselect.Target.current()) == {}
        assert measure._from_store(store.lookup(MEASURE_KEY), (Candidate("sdpa_math"),)) in (
            None,
            ((Candidate("sdpa_math"),), {Candidate("sdpa_math"): measure.Timing(1.0, 1.0, 1.0)}),
        )
        attnselect.clear_cache()
        monkeypatch.setattr(failures, "_RECORDED", None)
        attnselect.attention(q, k, v)
    assert torch.isfinite(out).all()
    assert len([r for r in caplog.records if "decision cache" in r.getMessage()]) <= 2  # the file, and one entry


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
