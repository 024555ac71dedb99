"""The persistent decision cache: what the measure policy measured, kept across processes and runs.

A JSON file ``decisions.json`` in the user cache directory (platformdirs), or in
ATTNSELECT_CACHE_DIR. Entries are keyed by the problem's bucket, the policy and a target
fingerprint (GPU name, compute capability, CUDA, torch, cuDNN, cudnn-frontend and flash-attn
versions), so a change of any of them ignores old entries. Writes are atomic (a temporary
file renamed over the old one) under an exclusive file lock, so ranks sharing the file
never lose each other's entries. A corrupt or unreadable file gives one warning (one per file and
process, whatever is wrong with it) and is rebuilt on the next write, without the entries its readers
found malformed; a directory that cannot be read or written falls back to memory with one warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch

from attnselect.memos import cache_dir, warn_once

log = logging.getLogger("attnselect")
FORMAT = 1
LOCK_TIMEOUT_S = 30.0  # a lock held longer is taken as stuck: the write falls back to memory with one warning
_memory: dict = {}
_seen: dict = {}  # path -> the entries last read from it
_malformed: dict = {}  # (path, key) -> the entry a reader found malformed (as JSON): dropped at the next write


def cache_file() -> Path:
    return cache_dir() / "decisions.json"


def fingerprint(target) -> dict:
    return {
        "name": target.name,
        "capability": list(target.capability) if target.capability else None,
        "cuda": torch.version.cuda,
        "torch": target.torch_version,
        "cudnn": target.cudnn_version,
        "packages": dict(target.packages),
    }


def entry_key(problem, policy: str, target) -> str:
    return json.dumps({"problem": problem.to_dict(), "policy": policy, "target": fingerprint(target)}, sort_keys=True)


def lookup(key: str) -> dict | None:
    if key in _memory:
        return _memory[key]
    return _read(cache_file()).get(key)


def entries() -> dict:
    """Every entry: the file's (one read) and this process's own."""
    return {**_read(cache_file()), **_memory}


def keep(key: str, value: dict) -> None:
    """Add one entry for this process only (a decision another rank measured and wrote)."""
    _memory[key] = value


def remember(key: str, value: dict, combine=None) -> None:
    """Add one entry: to the file when it can be written, else to this process's memory. ``combine(old, new)``
    merges it with the entry already there (read under the lock), instead of replacing it."""
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with locked(path):
            entries = {k: v for k, v in _read(path).items() if not _is_malformed(path, k, v)}
            entries[key] = combine(entries.get(key), value) if combine else value
            fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".decisions-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump({"format": FORMAT, "entries": entries}, f)
                os.replace(temporary, path)
            except BaseException:
                with contextlib.suppress(OSError):  # a write that failed leaves nothing behind
                    os.unlink(temporary)
                raise
    except OSError as exc:
        _cannot_use(path.parent, exc)
        _memory[key] = combine(_memory.get(key), value) if combine else value


def _cannot_use(directory: Path, exc: OSError) -> None:
    """One warning per cache directory and process that cannot be read or written, whichever fails first."""
    warn_once(
        f"directory:{directory}",
        "attnselect: cannot use the decision cache in %s (%s); keeping decisions in memory for this process",
        directory,
        exc,
    )


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        if not (isinstance(data, dict) and data.get("format") == FORMAT and isinstance(data.get("entries"), dict)):
            raise ValueError(f"not an attnselect decision cache of format {FORMAT}")
        entries = {key: value for key, value in data["entries"].items() if isinstance(value, dict)}
        if len(entries) != len(data["entries"]):
            _warn(path, "attnselect: ignoring %d malformed entries of the decision cache %s; it will be rebuilt",
                  len(data["entries"]) - len(entries), path)  # fmt: skip
        _seen[str(path)] = entries
        return entries
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as exc:
        if isinstance(exc, NotADirectoryError) or (
            isinstance(exc, PermissionError) and not os.access(path.parent, os.W_OK | os.X_OK)
        ):
            _cannot_use(path.parent, exc)  # the directory: writes fail alike, under the same warning
        else:  # the file alone: rewritten at the next write
            _warn(path, "attnselect: ignoring the unreadable decision cache %s (%s); it will be rebuilt", path, exc)
        return {}


def _warn(path: Path, message: str, *args) -> None:
    """One warning per cache file and process, whatever is wrong with it."""
    warn_once(f"decision cache:{path}", message, *args)


def malformed(key: str, exc: Exception, what: str) -> None:
    """A cache entry whose content a reader could not use: ignored, with the file's one warning naming ``what`` the
    entry held, and dropped from the file at its next write (unless another process has rewritten it since)."""
    path = cache_file()
    entry = _seen.get(str(path), {}).get(key)
    if entry is not None:
        _malformed[str(path), key] = _canonical(entry)
    _warn(path, "attnselect: ignoring a malformed entry of the decision cache %s (%s: %s: %s); it will be rebuilt",
          path, what, type(exc).__name__, exc)  # fmt: skip


def _is_malformed(path: Path, key: str, entry) -> bool:
    flagged = _malformed.get((str(path), key))
    return flagged is not None and flagged == _canonical(entry)


def _canonical(entry) -> str | None:
    try:
        return json.dumps(entry, sort_keys=True)
    except (TypeError, ValueError, RecursionError):
        return None


@contextlib.contextmanager
def locked(path: Path):
    """Hold ``path``'s lock file (``path`` with the suffix ``.lock``) against other processes (POSIX; elsewhere
    nothing is held: writers replace files atomically)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: atomic replacement still keeps the file whole
        yield
        return
    with open(path.with_suffix(".lock"), "a") as lock:
        waited = time.monotonic()
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - waited > LOCK_TIMEOUT_S:
                    raise TimeoutError(
                        f"{lock.name} has been held by another process for {LOCK_TIMEOUT_S:.0f} s; remove it if no "
                        "attnselect process is running"
                    ) from None
                time.sleep(0.01)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
