"""The caller's controls (attnselect.choose.settings): the ATTNSELECT_* variables, keyword controls and overrides()."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

import attnselect
from attnselect import Candidate
from attnselect.choose import settings
from helpers import CPU, SELECTION_PROBLEM

P = SELECTION_PROBLEM


def test_unknown_forced_backend_lists_known_ones(monkeypatch):
    with pytest.raises(attnselect.ForcedChoiceError, match="backend: got 'nope', expected one of .*sdpa_cudnn"):
        attnselect.select(P, target=CPU, backend="nope")
    monkeypatch.setenv("ATTNSELECT_BACKEND", "nope")
    with pytest.raises(attnselect.ForcedChoiceError, match="ATTNSELECT_BACKEND: got 'nope'"):
        attnselect.select(P, target=CPU)


@pytest.mark.parametrize(
    "variable,value",
    [("ATTNSELECT_PAD", "sometimes"), ("ATTNSELECT_POLICY", "guess"), ("ATTNSELECT_DISABLE", "sdpa_fast")],
)
def test_bad_environment_values_name_the_variable(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(attnselect.InvalidInputError, match=variable):
        attnselect.select(P, target=CPU)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        ({"pad": ["always"]}, "pad"),
        ({"backend": ["reference"]}, "backend"),
        ({"disable": [1]}, "disable"),
        ({"disable": 3}, "disable"),
        ({"disable": {"flex": 1}}, "disable"),
        ({"pad": 1}, "pad"),
        ({"policy": 3}, "policy"),
    ],
)
def test_control_of_the_wrong_type_names_the_argument(kwargs, name):
    attnselect.select(P, target=CPU, pad=True)  # memoized: pad=1 == True must not find it
    with pytest.raises(attnselect.InvalidInputError, match=f"^{name}: got"):
        attnselect.select(P, target=CPU, **kwargs)
    if name != "policy":  # warmup takes the others, and resolves them as select does
        with pytest.raises(attnselect.InvalidInputError, match=f"^{name}: got"):
            attnselect.warmup([P], **kwargs)


def test_overrides_block_like_sdpa_kernel(monkeypatch):
    assert attnselect.select(P, target=CPU).chosen == Candidate("sdpa_flash", 24)
    with attnselect.overrides(pad=False):
        assert attnselect.select(P, target=CPU).chosen == Candidate("sdpa_math")
        with attnselect.overrides(backend="reference"):  # nested: adds a field, keeps pad
            assert attnselect.select(P, target=CPU).chosen == Candidate("reference")
        assert attnselect.select(P, target=CPU, pad=True).chosen == Candidate("sdpa_flash", 24)  # keyword wins
    monkeypatch.setenv("ATTNSELECT_BACKEND", "sdpa_math")
    with attnselect.overrides(backend="reference"):  # the block wins over the environment
        assert attnselect.select(P, target=CPU).chosen.backend == "reference"
    assert attnselect.select(P, target=CPU).chosen.backend == "sdpa_math"


def test_overrides_are_checked_on_entry():
    with pytest.raises(attnselect.ForcedChoiceError, match="backend: got 'nope'"):
        with attnselect.overrides(backend="nope"):
            pass
    with pytest.raises(attnselect.InvalidInputError, match="disable"):
        with attnselect.overrides(disable=["sdpa_fast"]):
            pass
    with attnselect.overrides(disable="flex,"):  # a comma-separated string, read as attention(disable=) reads it
        assert "flex" in attnselect.select(P, target=CPU).overrides.disable


def test_overrides_reach_the_attention_fast_path():
    q, k, v = (torch.randn(1, 8, 2, d, dtype=torch.float64) for d in (24, 24, 16))
    attnselect.attention(q, k, v)
    with attnselect.overrides(backend="reference", disable="sdpa_flash"):
        inside = attnselect.attention(q, k, v)
    from attnselect import dispatch

    assert {known.chosen.backend for known in dispatch.known_calls()} == {"sdpa_flash", "reference"}
    assert torch.allclose(inside, attnselect.attention(q, k, v), atol=1e-12)


# A junk value for every ATTNSELECT_* variable that is validated: each raises, naming the variable, the value and
# what was expected.
JUNK = {
    "ATTNSELECT_POLICY": "guess",
    "ATTNSELECT_BACKEND": "nope",
    "ATTNSELECT_PAD": "sometimes",
    "ATTNSELECT_DISABLE": "sdpa_fast",
    "ATTNSELECT_DEBUG": "yes",
    "ATTNSELECT_DEBUG_LEVEL": "9",
    "ATTNSELECT_STRICT": "maybe",
    "ATTNSELECT_SELF_CHECK": "often",
    "ATTNSELECT_ALLOWLIST": "on",
}
# A directory, not a choice: any string names one; it is read only where a file is (test below).
NOT_VALIDATED = {"ATTNSELECT_CACHE_DIR"}


def test_every_variable_the_package_reads_is_tested_here():
    source = Path(attnselect.__file__).parent
    read = {name for path in source.rglob("*.py") for name in re.findall(r"ATTNSELECT_[A-Z][A-Z_]*[A-Z]",
                                                                            path.read_text())}  # fmt: skip
    assert read == set(JUNK) | NOT_VALIDATED
    assert set(settings.ENV_VARS) == set(JUNK)  # each in the memo's key: a memoized call cannot skip it
    assert {settings.CACHE_DIR_VARIABLE} == NOT_VALIDATED  # in the memo keys apart (test_selection checks it)


def _calls():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, 2, d, generator=g, dtype=torch.float64) for d in (24, 24, 16))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    return (
        lambda: attnselect.attention(q, k, v, causal=True),  # memoized: the fast path on a repeat
        lambda: attnselect.attention(q[0], k[0], v[0], layout="thd", cu_seqlens_q=cu),  # packed
    )


@pytest.mark.parametrize("variable", sorted(JUNK))
def test_a_junk_variable_fails_a_first_and_a_memoized_call_alike(variable, monkeypatch):
    error = attnselect.ForcedChoiceError if variable == "ATTNSELECT_BACKEND" else attnselect.InvalidInputError
    message = f"^{variable}: got .*{JUNK[variable]!r}.*, expected "
    for call in _calls():
        first = call()  # decided and memoized under a clean environment
        monkeypatch.setenv(variable, JUNK[variable])
        for fresh in (False, True):  # the call memoized before, then a memo that has never seen it
            if fresh:
                attnselect.clear_cache()
            for _ in range(2):  # and its identical repeat
                with pytest.raises(error, match=message):
                    call()
        monkeypatch.delenv(variable)
        assert torch.equal(call(), first)


def test_a_cache_dir_that_cannot_hold_files_serves_every_call_alike(tmp_path, monkeypatch, caplog):
    """ATTNSELECT_CACHE_DIR is not validated up front: it is read only where a file is (the decision cache: run-time
    failures recorded, measured decisions), and one that cannot be read or written is then ignored with one warning,
    on the first call as on every later one (the decisions stay in memory)."""
    junk = tmp_path / "a-file"
    junk.write_text("not a directory")
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", str(junk))
    for policy in ("rules", "measure"):
        with attnselect.overrides(policy=policy), caplog.at_level(logging.WARNING, logger="attnselect"):
            caplog.clear()
            for call in _calls():
                assert torch.equal(call(), call())
        assert len([r for r in caplog.records if str(junk) in r.getMessage()]) <= 1  # reading, then writing
    assert junk.read_text() == "not a directory"


@pytest.mark.parametrize("argument", ["policy", "backend", "pad"])
def test_an_empty_argument_is_refused_though_an_empty_variable_is_unset(argument, monkeypatch):
    q = torch.randn(1, 6, 2, 8, dtype=torch.float64)
    problem = attnselect.AttentionProblem.from_tensors(q, q, q)
    with pytest.raises(attnselect.InvalidInputError, match=f"^{argument}: got '', expected None"):
        attnselect.select(problem, **{argument: ""})
    if argument != "policy":  # attention() takes no policy: the variable or overrides() set it
        with pytest.raises(attnselect.InvalidInputError, match=f"^{argument}: got '', expected None"):
            attnselect.attention(q, q, q, **{argument: ""})
    with pytest.raises(attnselect.InvalidInputError, match=f"^{argument}: got ''"):
        with attnselect.overrides(**{argument: ""}):
            pass
    monkeypatch.setenv(f"ATTNSELECT_{argument.upper()}", "")
    attnselect.clear_cache()
    assert attnselect.attention(q, q, q).shape == q.shape


def test_a_misspelt_variable_is_named_once(monkeypatch, caplog):
    monkeypatch.setenv("ATTNSELECT_POLCY", "measure")
    settings._warn_unknown_variables.cache_clear()
    with caplog.at_level("WARNING", logger="attnselect"):
        settings.resolve()
        settings.resolve()
    assert caplog.text.count("ignoring unknown variable(s) ATTNSELECT_POLCY (did you mean ATTNSELECT_POLICY?)") == 1
    settings._warn_unknown_variables.cache_clear()


def test_a_cache_directory_under_home_is_expanded(monkeypatch, tmp_path):
    from attnselect import memos

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("ATTNSELECT_CACHE_DIR", "~/attnselect-cache")
    assert memos.cache_dir() == tmp_path / "attnselect-cache"
