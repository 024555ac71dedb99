"""The compiled check of repeated calls: what it tells apart, and its build and load (those in fresh processes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import attnselect
from attnselect import call_memo, compiled_lookup
from attnselect.call import CallOptions

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


def _start(tmp_path, **env) -> subprocess.Popen:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSELECT_")}
    environment.update(ATTNSELECT_CACHE_DIR=str(tmp_path), **env)
    pipe = subprocess.PIPE
    return subprocess.Popen([sys.executable, "-c", CALL], env=environment, stdout=pipe, stderr=pipe, text=True)


def _run(tmp_path, timeout=900, **env) -> str:
    process = _start(tmp_path, **env)
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err
    return out


def test_a_library_built_before_is_loaded_at_the_first_call_without_a_build():
    if compiled_lookup.loaded is None:
        pytest.skip("the compiled check could not be built here (no C++ compiler: see the log)")
    out = _run(compiled_lookup.loaded.parent.parent, ATTNSELECT_BUILD_DIR=str(compiled_lookup.loaded.parent))
    assert "before True" in out and "ready True" in out and "recent True" in out, out
    assert compiled_lookup.loaded.stat().st_mode & 0o055 == 0o055  # a shared cache directory serves every user


def test_attnselect_compile_0_never_builds(tmp_path):
    out = _run(tmp_path, ATTNSELECT_COMPILE="0")
    assert "ATTNSELECT_COMPILE=0" in out and "ready False" in out and "recent False" in out, out
    assert not (tmp_path / "build").exists()  # the library's default place: the cache directory's build folder


def test_a_failed_build_is_logged_and_calls_keep_the_python_check(tmp_path):
    out = _run(tmp_path, timeout=120, CXX=str(tmp_path / "no-such-compiler"))  # ready() returns: no waiting on it
    assert "cannot build the compiled check" in out and "ready False" in out and "recent False" in out, out
    assert not list((tmp_path / "build").glob("*.so"))  # no half-written library left to load


def test_a_compiler_that_fails_is_logged_with_its_error(tmp_path):
    compiler = tmp_path / "failing-c++"
    compiler.write_text("#!/bin/sh\necho 'fatal: stand-in compiler' >&2\nexit 1\n")
    compiler.chmod(0o755)
    out = _run(tmp_path, timeout=120, CXX=str(compiler))
    assert "building the compiled check failed" in out and "stand-in compiler" in out and "ready False" in out, out
    assert not list((tmp_path / "build").glob("*.so"))


def test_processes_started_together_build_once_and_each_loads_it(tmp_path):
    if compiled_lookup.loaded is None:
        pytest.skip("the compiled check could not be built here (no C++ compiler: see the log)")
    processes = [_start(tmp_path) for _ in range(2)]
    outs = [process.communicate(timeout=900)[0] for process in processes]
    assert all("ready True" in out and "recent True" in out for out in outs), outs
    assert len(list((tmp_path / "build").glob("*.so"))) == 1


def test_a_process_that_exits_during_its_build_leaves_no_compiler_running_and_no_file(tmp_path):
    import time

    short = (
        "import torch, attnselect; q = torch.randn(1, 2, 4, 8); attnselect.attention(q, q, q); import time; "
        "time.sleep(3)"
    )  # the compiler runs by then (a build takes about 20 s)
    environment = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSELECT_")}
    environment["ATTNSELECT_CACHE_DIR"] = str(tmp_path)
    subprocess.run([sys.executable, "-c", short], env=environment, check=True, timeout=300)
    time.sleep(1)
    assert not list((tmp_path / "build").glob(".*")) and not list((tmp_path / "build").glob("*.so"))
    running = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(tmp_path) not in running  # the compiler driver, whose output is there
    assert "recent_calls.cpp" not in running  # and what it runs (cc1plus), which a kill of the driver alone leaves


def test_the_compiled_check_tells_calls_apart_as_the_python_one_does(monkeypatch):
    """What the compiled check finds, asked directly: only the call it was made from, in the state it was made in."""
    from torch.overrides import TorchFunctionMode

    if compiled_lookup.find is None:
        pytest.skip("the compiled check could not be built here (no C++ compiler: see the log)")

    class Sub(torch.Tensor):
        pass

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 9, 2, d, generator=g, dtype=torch.float64) for d in (24, 24, 16))
    attnselect.attention(q, k, v, scale=0.5)
    known = call_memo.known_calls()[0]

    def find(q, k, v, **options):
        return compiled_lookup.find(call_memo._RECENT_COMPILED, q, k, v, CallOptions(**{"scale": 0.5, **options}))

    assert find(q.clone(), k.clone(), v.clone()) is known
    changes = [
        lambda t: t.float(),
        lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),
        lambda t: t.detach().requires_grad_(),
        lambda t: torch.cat([t.flatten(), t.flatten()])[t.numel() :].view(t.shape),
        lambda t: t[:1],
        lambda t: t.to("meta"),
        lambda t: t.as_subclass(Sub),
    ]
    for change in changes:
        assert find(change(q), k, v) is None and find(q, k, change(v)) is None
    assert find(q, q, v) is None and find(q, k, v, causal=True) is None and find(q, k, v, scale=0.25) is None
    assert find(q, k, v, scale=True) is None and find(q, k, v, return_lse=1) is None  # equal, of another type
    assert find(q, k, v, sinks=torch.zeros(2, dtype=q.dtype)) is None
    assert find(q, k, v, cu_seqlens_q_padded=torch.zeros(3, dtype=torch.int32)) is None
    assert find(torch.nested.nested_tensor([q[0], q[1]]), k, v) is None
    assert find(q.to_sparse(), k, v) is None
    assert compiled_lookup.find(call_memo._RECENT_COMPILED, q, k, v, ("not", "options")) is None

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    for state in (torch.no_grad(), torch.inference_mode(), torch.autocast("cpu"), Mode(),
                  attnselect.overrides(pad=True)):  # fmt: skip
        with state:
            assert find(q, k, v) is None, state
    torch.use_deterministic_algorithms(True)
    try:
        assert find(q, k, v) is None
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("ATTNSELECT_PAD", "never")
    assert find(q, k, v) is None
    monkeypatch.delenv("ATTNSELECT_PAD")
    assert find(q, k, v) is known
