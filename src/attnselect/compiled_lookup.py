"""The recent-call check of :mod:`attnselect.call_memo` in C++ (``csrc/recent_calls.cpp``), built on this machine.

The Python check costs about 2.5 us of host time per repeated call, mostly in torch's Python entry points (the
tensors' guard, their getters, the grad and deterministic flags); the C++ one reads the same fields directly, in
about 0.5 us (benchmarks/hot_path_parts.py). It needs a C++ compiler and torch's headers, which torch's wheels ship.

The first decided call starts the build in a background thread (about 30 s on two cores) and keeps serving calls with
the Python check meanwhile; the library is kept in the cache directory (ATTNSELECT_CACHE_DIR), named for its source,
torch and Python, so later processes load it at once. A build that fails is logged once and the Python check stays.
ATTNSELECT_COMPILE=0 never builds or loads it.

``find(entries, q, k, v, options)`` is None until the library is loaded; then it returns the known call of the first
entry the call matches, or None. ``entry(q, k, v, options, capturing, known)`` makes an entry from a call just decided
or found by key.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path

import torch

from attnselect import settings

log = logging.getLogger("attnselect")
SOURCE = Path(__file__).parent / "csrc" / "recent_calls.cpp"
NAME = "attnselect_recent_calls"

find = None  # the compiled check, once loaded
entry = None
loaded: Path | None = None  # the library in use
_started = threading.Event()
_done = threading.Event()
_lock = threading.Lock()


def start(memo) -> None:
    """Load the compiled check if it was built before, else build it in the background (once per process). ``memo``:
    the module whose ``raw_stream`` and ``stream_capturing`` it reads the CUDA capture state with (call_memo)."""
    if _started.is_set():
        return
    with _lock:
        if _started.is_set():
            return
        _started.set()
    setting = os.environ.get("ATTNSELECT_COMPILE", "1").strip()
    if setting not in ("0", "1"):
        log.warning("attnselect: ATTNSELECT_COMPILE=%r is not '0' or '1': building the compiled check", setting)
    if setting == "0":
        log.info("attnselect: ATTNSELECT_COMPILE=0: repeated calls use the Python check")
        _done.set()
        return
    library = library_path()
    if library.exists():
        _load(library, memo)
        return
    threading.Thread(target=_build, args=(library, memo), name="attnselect-build", daemon=True).start()


def ready(timeout: float | None = None) -> bool:
    """Wait up to ``timeout`` seconds for the build started by :func:`start`; whether the compiled check is in use."""
    _done.wait(timeout)
    return find is not None


def library_path() -> Path:
    """Where the library for this source, torch and Python is kept."""
    from attnselect.store import cache_dir

    identity = "\n".join(
        (SOURCE.read_text(), torch.__version__, str(torch.version.git_version), sys.version, sysconfig.get_platform())
    )
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_dir() / "build" / f"{NAME}-{digest}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def compile_command(output: Path) -> list[str] | None:
    """The compiler command that builds the library into ``output``, or None where no C++ compiler is found."""
    from torch.utils.cpp_extension import include_paths, library_paths

    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None or sys.platform == "win32":
        return None
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    command = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    command += [f"-I{path}" for path in (sysconfig.get_paths()["include"], *include_paths())]
    command += [str(SOURCE), "-o", str(output)]
    for path in library_paths():
        command += [f"-L{path}", f"-Wl,-rpath,{path}"]
    command += ["-lc10", "-ltorch_cpu", "-ltorch_python"]
    if sys.platform == "darwin":  # Python's own symbols resolve when the interpreter loads the library
        command += ["-undefined", "dynamic_lookup"]
    return command


def _build(library: Path, memo) -> None:
    temporary = None
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=library.parent, prefix=f".{NAME}-", suffix=library.suffix)
        os.close(fd)
        command = compile_command(Path(temporary))
        if command is None:
            log.info("attnselect: no C++ compiler found: repeated calls use the Python check (about 2 us more)")
            return
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            log.warning(
                "attnselect: building the compiled check failed, repeated calls use the Python check (about 2 us "
                "more); ATTNSELECT_COMPILE=0 stops trying. %s: %s",
                " ".join(command[:2]),
                done.stderr.strip()[-2000:],
            )
            return
        os.replace(temporary, library)  # atomic: processes building at once each put a whole library there
        temporary = None
    except OSError as exc:
        log.warning("attnselect: cannot build the compiled check (%s): repeated calls use the Python check", exc)
        return
    finally:
        if temporary is not None:  # not built: the Python check stays
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        if not library.exists():
            _done.set()
    _load(library, memo)


def _load(library: Path, memo) -> None:
    global find, entry, loaded
    try:
        spec = importlib.util.spec_from_file_location(NAME, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sources = settings.state_sources()
        if sources is None:
            raise ImportError("os.environ has no raw mapping here")
        module.configure(*sources, memo)
        entry, find, loaded = module.entry, module.find, library
        log.info("attnselect: repeated calls use the compiled check (%s)", library)
    except (ImportError, OSError, AttributeError, TypeError) as exc:
        log.warning("attnselect: cannot load the compiled check %s (%s): repeated calls use the Python check", library,
                    exc)  # fmt: skip
    finally:
        _done.set()
