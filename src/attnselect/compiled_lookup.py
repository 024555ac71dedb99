"""The recent-call check of :mod:`attnselect.call_memo` in C++ (``csrc/recent_calls.cpp``), built on this machine.

The Python check takes 2.8-3.6 us more host time per repeated call than this one on the H200 (benchmarks/
hot_path_parts.py), mostly in torch's Python entry points (the tensors' guard, their getters, the grad and
deterministic flags), whose fields this one reads directly. It needs a C++ compiler, Python's headers and torch's
(which torch's wheels ship).

The first decided call starts the build in a background thread (about 30 s on two cores) and keeps serving calls with
the Python check meanwhile. The library is kept in the cache directory (ATTNSELECT_CACHE_DIR, or ATTNSELECT_BUILD_DIR
for the library alone), named for its source, torch and Python, so later processes load it at once; processes that
start together build it once (the others wait for it in their own background thread). A process that exits before
its build ends stops its compiler and leaves no library: ``attnselect build`` builds it ahead of time (for a container
image, say, or before launching ranks). A build that fails is logged once and the Python check stays.
ATTNSELECT_COMPILE=0 never builds or loads it.

``find(entries, q, k, v, options)`` is None until the library is loaded; then it returns the known call of the first
entry the call matches, or None. ``entry(q, k, v, options, capturing, known)`` makes an entry from a call just decided
or found by key.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import torch

from attnselect import settings
from attnselect.store import cache_dir, locked

log = logging.getLogger("attnselect")
SOURCE = Path(__file__).parent / "csrc" / "recent_calls.cpp"
NAME = "attnselect_recent_calls"

find = None  # the compiled check, once loaded
entry = None
loaded: Path | None = None  # the library in use
_started = threading.Event()
_done = threading.Event()
_lock = threading.Lock()
_compiler: tuple | None = None  # (the build's compiler, the file it writes), while it runs
_exiting = False


@atexit.register
def _stop_compiler() -> None:
    """A process that exits before its build ends stops its compiler and removes its file: no work is left running."""
    global _exiting
    with _lock:
        _exiting = True  # a build thread that has not started its compiler yet does not start it
        if _compiler is not None and _compiler[0].poll() is None:
            # the driver's own children too (cc1plus, the linker): killing the driver alone leaves them running
            with contextlib.suppress(OSError):
                os.killpg(_compiler[0].pid, signal.SIGKILL)
            _compiler[0].wait()
            with contextlib.suppress(OSError):
                _compiler[1].unlink()


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
    """Where the library for this source, torch and Python is kept: ATTNSELECT_BUILD_DIR, else the cache directory's
    ``build`` folder."""
    directory = Path(os.environ.get("ATTNSELECT_BUILD_DIR") or cache_dir() / "build")
    identity = "\n".join(
        (SOURCE.read_text(), torch.__version__, str(torch.version.git_version), sys.version, sysconfig.get_platform())
    )
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return directory / f"{NAME}-{digest}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def compile_command(output: Path) -> list[str] | None:
    """The compiler command that builds the library into ``output``, or None where no C++ compiler is found."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None or sys.platform == "win32":
        return None
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    command = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    # torch's headers and libraries, where torch.utils.cpp_extension's include_paths() and library_paths() find them
    # (it is not imported: it needs setuptools, which a virtual environment may lack)
    root = Path(torch.__file__).parent
    headers = root / "include"
    command += [f"-I{path}" for path in (sysconfig.get_paths()["include"], headers, headers / "torch/csrc/api/include")]
    command += [str(SOURCE), "-o", str(output), f"-L{root / 'lib'}", f"-Wl,-rpath,{root / 'lib'}"]
    command += ["-lc10", "-ltorch_cpu", "-ltorch_python"]
    if sys.platform == "darwin":  # Python's own symbols resolve when the interpreter loads the library
        command += ["-undefined", "dynamic_lookup"]
    return command


def _build(library: Path, memo) -> None:
    """Build the library (one process at a time: the others wait, then load what it built) and load it."""
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        with locked(library):  # ranks started together build once: the others wait, then find it built
            built = library.exists() or _compile(library)
    except Exception as exc:  # an OSError, say: the build's failures never reach the calls
        log.warning("attnselect: cannot build the compiled check (%s): repeated calls use the Python check", exc)
        built = False
    if built:
        _load(library, memo)
    else:
        _done.set()


def _compile(library: Path) -> bool:
    """Compile into a temporary file renamed to ``library`` (atomic: a process loading it sees all of it or none)."""
    _remove_stale(library.parent)
    fd, name = tempfile.mkstemp(dir=library.parent, prefix=f".{NAME}-", suffix=library.suffix)
    os.close(fd)
    temporary = Path(name)
    try:
        command = compile_command(temporary)
        if command is None:
            log.info("attnselect: no C++ compiler found: repeated calls use the Python check (about 3 us more)")
            return False
        global _compiler
        with _lock:
            if _exiting:
                return False
            compiler = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
            )  # its own process group, stopped whole at exit
            _compiler = (compiler, temporary)
        _, errors = compiler.communicate()
        if compiler.returncode != 0:
            log.warning(
                "attnselect: building the compiled check failed, repeated calls use the Python check (about 3 us "
                "more); ATTNSELECT_COMPILE=0 stops trying. %s: %s",
                " ".join(command[:2]),
                errors.strip()[-2000:],
            )
            return False
        os.chmod(temporary, 0o755)  # mkstemp makes it private: a shared cache directory serves every user
        os.replace(temporary, library)
        temporary = None
        return True
    finally:
        if temporary is not None:
            with contextlib.suppress(OSError):
                temporary.unlink()


def _remove_stale(directory: Path) -> None:
    """Remove half-built libraries over an hour old (a process that exited while its build ran leaves one)."""
    for path in directory.glob(f".{NAME}-*"):
        with contextlib.suppress(OSError):
            if time.time() - path.stat().st_mtime > 3600:
                path.unlink()


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
