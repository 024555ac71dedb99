"""Building and loading the compiled check of repeated calls, each in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from attnselect import compiled_lookup

CALL = """
import logging, sys, torch, attnselect
from attnselect import call_memo, compiled_lookup
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
q = torch.randn(1, 2, 4, 8)
attnselect.attention(q, q, q)
print("before", compiled_lookup.find is not None)
print("ready", compiled_lookup.ready(timeout=600))
attnselect.attention(q, q, q)
print("recent", call_memo._RECENT_COMPILED != [None])
"""


def _run(tmp_path, **env) -> str:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSELECT_")}
    environment.update(ATTNSELECT_CACHE_DIR=str(tmp_path), **env)
    done = subprocess.run([sys.executable, "-c", CALL], env=environment, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_library_built_before_is_loaded_at_the_first_call_without_a_build():
    if compiled_lookup.loaded is None:
        pytest.skip("the compiled check could not be built here (no C++ compiler: see the log)")
    out = _run(compiled_lookup.loaded.parent.parent)
    assert "before True" in out and "ready True" in out and "recent True" in out, out


def test_attnselect_compile_0_never_builds(tmp_path):
    out = _run(tmp_path, ATTNSELECT_COMPILE="0")
    assert "ATTNSELECT_COMPILE=0" in out and "ready False" in out and "recent False" in out, out
    assert not (tmp_path / "build").exists()


def test_a_failed_build_is_logged_and_calls_keep_the_python_check(tmp_path):
    out = _run(tmp_path, CXX=str(tmp_path / "no-such-compiler"))
    assert "cannot build the compiled check" in out and "ready False" in out and "recent False" in out, out
    assert not list((tmp_path / "build").glob("*.so"))  # no half-written library left to load
