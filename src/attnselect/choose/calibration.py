"""Calibrations: what each installed backend costs on one GPU with one set of library versions, measured.

A calibration (written by ``attnselect calibrate`` on the user's GPU, or shipped as package data per GPU from
``benchmarks/calibrate.py``: ``attnselect/data/calibration_<arch>_<gpu model>.json``, one file per GPU model, as
the user's) holds, per backend:

- ``host_us``: the host's time to issue one call (forward, or forward and backward), by layout, padding and phase
  (:func:`host_key`: ``"dense inference"``, ``"thd+pad training"``; packed, on a packing already seen), at a size
  where the GPU waits for the host; ``new_packing_us`` likewise for packed calls on a new packing each call (its
  runner's per-packing work and, at sizes not seen, its decision), where measured for every packed backend;
  ``replayed_host_us`` likewise for the calls of a backend whose runner replays its forward (FA4:
  ``Backend.calls_before_replay``), on a shape (or packing) it has called before, where measured (:func:`replayed`);
  ``host``: ``cpu``, the CPU they were measured on (:func:`host_of`; not recorded before 2026-12-07), which
  ``explain`` names where it may not be this machine's (:func:`host_note`);
- ``gpu``: the GPU's time of a call over a ladder of work sizes, by candidate key
  (:func:`curve_key`: layout, the call's head dims, ``+pad`` for the padded candidate, phase), as [work, us] points
  (:func:`attnselect.choose.predict.work`; format 2 estimates a packed call's from its tokens, format 1 took every
  sequence at the longest, so a format-1 file is refused);
- ``first_call_ms``: what the first call of a new configuration costs on top of a later one (a JIT compile, a
  graph build), the process's one-off start-up left out, by layout, padding and phase (:func:`host_key`; one figure
  for every key in calibrations before those were told apart); ``new_size_ms`` likewise for a new size of a
  configuration that has run (cuDNN builds a graph per shape), where measured;
- ``skipped``: backends it leaves out on purpose (never the fastest, or a compile per shape): they rank after the
  calibrated ones.

It holds for the GPU and versions it ran on (:func:`fingerprint`): another GPU, another torch, cuDNN, attnselect or
any backend package version, and it is not used (the rules table orders the candidates, and ``explain`` says why).
One the user ran (in the cache directory) takes precedence over the packaged one. A file that is not a calibration
of this format is ignored with one warning, and so is a user's calibration made for other versions (an upgrade of
torch, cuDNN or attnselect); ``explain`` says why in either case.
"""

from __future__ import annotations

import copy
import functools
import json
import logging
import math
import platform
import re
from importlib import resources
from pathlib import Path

import torch

from attnselect.memos import cache_dir, environment_reader, generation, register_cache, warn_once
from attnselect.spec.target import Target
from attnselect.version import __version__

log = logging.getLogger("attnselect")
FORMAT = 2
PACKAGED = "attnselect/data/{name}"  # a packaged calibration's source, as warnings name it
MIN_QUERIES = 16  # fewer queries (decoding) is another kernel regime than the calibrated prefill ladder
CURVE_KEY = re.compile(r"(dense|thd) ([1-9][0-9]*)/([1-9][0-9]*)(\+pad)? (inference|training)")
HOST_KEY = re.compile(r"(dense|thd)(\+pad)? (inference|training)")


def fingerprint(target: Target) -> dict:
    """The machine a calibration ran on: the GPU, torch, cuDNN and attnselect, which it must share with a machine to
    hold there, and the versions of the backends' packages, each of which must match for that backend's times to
    hold (:func:`package_changed`): a calibration made with FlashAttention-4 installed serves the same machine
    without it."""
    return {
        "name": target.name,
        "capability": list(target.capability) if target.capability else None,
        "torch": target.torch_version,
        "cudnn": target.cudnn_version,
        "packages": {distribution: version for distribution, version in sorted(target.packages) if version},
        "attnselect": _version(),  # its host times include attnselect's own work per call
    }


@functools.cache
def host_of() -> str:
    """This machine's CPU model, as a calibration records where its host times were measured (they differ between
    hosts of one GPU model: docs/limits.md): /proc/cpuinfo's model name (x86), else its implementer and part (Arm),
    else what :mod:`platform` says."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                name, _, value = line.partition(":")
                fields.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    if fields.get("model name"):
        return fields["model name"]
    if fields.get("CPU implementer") and fields.get("CPU part"):
        return f"{platform.machine()} implementer {fields['CPU implementer']} part {fields['CPU part']}"
    return platform.processor() or platform.machine() or "unknown"


def is_packaged(source: str, target: Target) -> bool:
    """Whether ``source`` (:func:`for_target`'s) is the calibration packaged for ``target``'s GPU model."""
    return source == PACKAGED.format(name=file_name(target.arch, target.name))


def host_note(data: dict, source: str, target: Target) -> str | None:
    """What ``explain`` says of the host times of ``data``, the calibration from ``source`` that ranks ``target``'s
    calls, where they may not be this machine's: the packaged calibration's (measured on the machine that made it),
    and a user's recorded on another CPU model (a cache directory shared between machines). Hosts of one GPU model
    differ: the packaged H200 calibration puts FA4's host time at 94.6 us, and on another H200 host FA4 ran
    host-bound calls at about twice that (docs/limits.md), enough to turn a choice where the host bounds the call.
    None where they were recorded on this CPU model (or not recorded, in a user's own)."""
    recorded = data.get("host", {}).get("cpu")
    if is_packaged(source, target):
        where = f"on {recorded}" if recorded else "on the machine that made it"
        return (f"host times as the packaged calibration measured them, {where}; hosts of one GPU model differ "
                "(docs/limits.md): `attnselect calibrate` measures this one's")  # fmt: skip
    here = host_of()
    if recorded and recorded != here:
        return (f"host times as measured on {recorded}; this machine's CPU is {here}: `attnselect calibrate` "
                "measures this one's")  # fmt: skip
    return None


def _version() -> str:
    """attnselect's own version (the same from a checkout as from a wheel)."""
    return __version__


def curve_key(layout: str, head_dim_qk: int, head_dim_v: int, padded: bool, training: bool) -> str:
    """The key of a candidate's GPU curve: e.g. ``"dense 192/128+pad training"``."""
    return _key(layout, f" {head_dim_qk}/{head_dim_v}", padded, training)


def host_key(layout: str, padded: bool, training: bool) -> str:
    """The key of a backend's host time: e.g. ``"thd+pad training"`` (padding adds copies the host issues)."""
    return _key(layout, "", padded, training)


def _key(layout: str, dims: str, padded: bool, training: bool) -> str:
    kind = "thd" if layout == "thd" else "dense"
    return f"{kind}{dims}{'+pad' if padded else ''} {'training' if training else 'inference'}"


def outside(problem) -> str | None:
    """What the calibrations measure, where ``problem`` is not such a call (None where it is): its prediction would
    come from curves of other calls, so the rules table ranks it."""
    return None if problem.seqlen_q >= MIN_QUERIES and covers_kind(problem) else COVERS


def covers_kind(problem) -> bool:
    """Whether the calibrations measure calls of ``problem``'s kind, its sizes aside (:func:`outside` is this and the
    query count): the same for a packed problem at every packing."""
    return (
        problem.dtype in (torch.bfloat16, torch.float16)
        and problem.mask in ("none", "causal", "causal_bottom_right")
        and not (problem.dropout_p or problem.softcap or problem.sinks or problem.fp8)
        and not problem.return_max_logit
        and problem.context_parallel_size == 1
    )


COVERS = (
    f"dense and packed bf16/fp16 calls of {MIN_QUERIES} or more queries, no mask or causal, without dropout, "
    "softcap, sinks, fp8, max logit or context parallelism"
)


def user_path(target: Target) -> Path:
    """Where ``attnselect calibrate`` stores a GPU's calibration: one file per GPU model (an H100 and an H200 may
    share a cache directory)."""
    return cache_dir() / file_name(target.arch, target.name)


def file_name(arch: str, gpu: str) -> str:
    """A calibration's file name, the user's and the packaged one alike: its arch and GPU model, e.g.
    ``calibration_sm90_nvidia-h200.json`` (GPUs of one arch differ in clocks and memory bandwidth, so each has its
    own)."""
    model = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    return f"calibration_{arch}_{model}.json"


def for_target(target: Target) -> tuple[dict | None, str]:
    """The calibration that holds on ``target`` and where it comes from, or (None, why there is none; empty on the
    CPU). Read once per target and cache directory until :func:`attnselect.clear_cache` (``attnselect calibrate``
    clears it after writing), as the decisions made from it are."""
    if not target.is_cuda:  # the CPU's order is the rules table's, and explain does not dwell on it
        return None, ""
    key = (target, _cache_dir_variable())
    held = _HELD.get(key)
    if held is None:
        cleared = generation()
        held = _HELD[key] = _read_for(target)
        if generation() != cleared:  # cleared while reading: what was read may predate a new file
            _HELD.pop(key, None)
    return held


_cache_dir_variable = environment_reader("ATTNSELECT_CACHE_DIR")
_HELD: dict[tuple, tuple[dict | None, str]] = {}
register_cache(_HELD.clear)


def _read_for(target: Target) -> tuple[dict | None, str]:
    found = []
    for source, text, problem, users in _texts(target):
        data, problem = _parsed(text, source) if text is not None else (None, problem)
        if data is None:
            found.append(f"{source} was ignored ({problem})")
            continue
        if machine(data["fingerprint"]) != machine(fingerprint(target)):
            found.append(f"{source} is for {_describe(data['fingerprint'])}")
            if users:  # the user's own calibration, left behind by an upgrade: said once, not only by explain
                warn_once(f"calibration {source} versions", "attnselect: not using the calibration %s: it was made "
                          "for %s, this machine has %s (the rules table orders the candidates; `attnselect "
                          "calibrate` makes one for these versions)", source, _describe(data["fingerprint"]),
                          _describe(fingerprint(target)))  # fmt: skip
            continue
        return data, source
    if found:
        return None, "; ".join(found) + ": `attnselect calibrate` on this GPU makes one for these versions"
    return None, f"no calibration for the {target.name} ({target.arch}): `attnselect calibrate` on it makes one"


def machine(fp: dict) -> dict:
    """A fingerprint's machine keys: GPU, torch, cuDNN, attnselect (a backend's package is matched per backend)."""
    return {key: value for key, value in fp.items() if key != "packages"}


def package_changed(data: dict, distribution: str, target: Target) -> str | None:
    """Why a backend that needs ``distribution`` cannot use the calibration ``data`` on ``target``: the package's
    version differs from the one calibrated (None where it is the same)."""
    calibrated, installed = data["fingerprint"]["packages"].get(distribution), target.version(distribution)
    if calibrated == installed:
        return None
    return f"{distribution} {installed} is installed, the calibration measured {calibrated or 'none'}"


def _texts(target: Target):
    """(source, its text or None, why it could not be read, whether it is the user's) of the user's calibration, then
    the packaged one, where present."""
    name = file_name(target.arch, target.name)
    for source, read, users in ((str(user_path(target)), lambda: user_path(target).read_text(), True),
                                (PACKAGED.format(name=name), lambda: _packaged(name), False)):  # fmt: skip
        text, problem = _read(source, read)
        if text is not None or problem is not None:
            yield source, text, problem, users


def packaged(target: Target) -> dict | None:
    """A copy of the calibration packaged for ``target``'s GPU model, or None where none is (or it is not of this
    format)."""
    name = file_name(target.arch, target.name)
    text, _ = _read(PACKAGED.format(name=name), lambda: _packaged(name))
    return copy.deepcopy(parse(text, PACKAGED.format(name=name))) if text is not None else None


def _packaged(name: str) -> str:
    return resources.files("attnselect").joinpath("data", name).read_text()


def _read(source: str, read) -> tuple[str | None, str | None]:
    """(the file's text, None); (None, None) where there is no file; (None, why) where it cannot be read (one
    warning)."""
    try:
        return read(), None
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as exc:
        warn_once(f"calibration {source}", "attnselect: ignoring the calibration %s (%s)", source, exc)
        return None, f"{type(exc).__name__}: {exc}"


def parse(text: str, source: str) -> dict | None:
    """A calibration from its JSON text, checked against the format; None (one warning per source) otherwise."""
    return _parsed(text, source)[0]


@functools.cache
def _parsed(text: str, source: str) -> tuple[dict | None, str | None]:
    """:func:`parse`, and what makes the text not a calibration of this format (None where nothing does)."""
    try:
        data = json.loads(text)
        problem = _problem(data)
    except (ValueError, OverflowError, RecursionError, TypeError) as exc:  # json.JSONDecodeError included
        problem = f"{type(exc).__name__}: {str(exc)[:200]}"
    if problem:
        warn_once(f"calibration {source}", "attnselect: ignoring the calibration %s (%s)", source, problem)
        return None, problem
    new_packing = data["new_packing_us"]
    missing = [f"{backend} {key}" for backend, times in data["host_us"].items() for key in times
               if key.startswith("thd") and key not in new_packing.get(backend, {})]  # fmt: skip
    if new_packing and missing:  # some candidates' packed host times a new packing's, others' a seen one's: unfair
        warn_once(f"calibration {source} new packings", "attnselect: the calibration %s has no new packing's host "
                  "time for %s: its packed calls are predicted with a seen packing's host times alone", source,
                  ", ".join(missing))  # fmt: skip
        data["new_packing_us"] = {}
    return data, None


def _problem(data) -> str | None:
    """What makes ``data`` not a calibration of this format (None: nothing)."""
    found = data.get("format") if isinstance(data, dict) else None
    if type(found) is int and found < FORMAT:
        return (f"a calibration of format {found}, an older attnselect's (its packed work differs): "
                f"`attnselect calibrate` makes one of format {FORMAT}")  # fmt: skip
    if type(found) is not int or found != FORMAT:
        return f"not a calibration of format {FORMAT}"
    fp = data.get("fingerprint")
    if not (isinstance(fp, dict) and set(fp) == {"name", "capability", "torch", "cudnn", "packages", "attnselect"}):
        return "its fingerprint is not a dict of name, capability, torch, cudnn, packages and attnselect"
    skipped = data.setdefault("skipped", [])
    if not (isinstance(skipped, list) and all(isinstance(b, str) for b in skipped)):
        return "skipped is not a list of backend names"
    if not isinstance(fp["packages"], dict):
        return "its fingerprint's packages are not a dict"
    machine_host = data.setdefault("host", {})  # where its host times were measured (older files: not recorded)
    if not (isinstance(machine_host, dict) and all(isinstance(v, str) for v in machine_host.values())):
        return "host is not a dict of strings (the CPU its host times were measured on)"
    host, gpu = data.get("host_us"), data.get("gpu")
    for name in ("first_call_ms", "new_size_ms"):
        costs = data.setdefault(name, {})
        if not (isinstance(costs, dict) and all(_is_time(ms) or _is_keyed(ms) for ms in costs.values())):
            return f"{name} is not a dict of times, or of times by layout, padding and phase"
    if not isinstance(host, dict):
        return "host_us is not a dict"
    for backend, times in host.items():
        if not (isinstance(times, dict) and all(HOST_KEY.fullmatch(k) and _is_time(t) for k, t in times.items())):
            return f"host_us[{backend!r}] is not a dict of times by layout, padding and phase"
    for name, fits, what in (
        ("replayed_host_us", lambda key: key.endswith(" inference"), "layout and padding, in inference"),
        ("new_packing_us", lambda key: key.startswith("thd"), "packed layout, padding and phase"),
    ):
        problem = _optional_times_problem(data, name, fits, what)
        if problem:
            return problem
    if not isinstance(gpu, dict):
        return "gpu is not a dict"
    for backend, curves in gpu.items():
        if not isinstance(curves, dict):
            return f"gpu[{backend!r}] is not a dict"
        for key, points in curves.items():
            if not CURVE_KEY.fullmatch(key):
                return f"gpu[{backend!r}]: {key!r} is not a curve key (layout d_qk/d_v[+pad] phase)"
            if not (isinstance(points, list) and points and all(_is_point(p) for p in points)):
                return f"gpu[{backend!r}][{key!r}] is not a list of [work, us] points"
            if [p[0] for p in points] != sorted({p[0] for p in points}):
                return f"gpu[{backend!r}][{key!r}]: its work sizes do not increase"
    return None


def _optional_times_problem(data: dict, name: str, fits, what: str) -> str | None:
    """What makes ``data[name]`` (absent: empty) not a dict of host times by backend and host key that ``fits``."""
    table = data.setdefault(name, {})
    if not isinstance(table, dict):
        return f"{name} is not a dict"
    for backend, times in table.items():
        if not (isinstance(times, dict) and all(HOST_KEY.fullmatch(k) and fits(k) and _is_time(t)
                                                for k, t in times.items())):  # fmt: skip
            return f"{name}[{backend!r}] is not a dict of times by {what}"
    return None


def replayed(data: dict, backend: str, kind: str) -> float | None:
    """The host time of ``backend``'s call of ``kind`` (:func:`host_key`) on a shape it replays, by the calibration
    ``data``, where it and the time of the calls before the replay (``host_us``) are calibrated and the replay is the
    faster; None otherwise."""
    again = data.get("replayed_host_us", {}).get(backend, {}).get(kind)
    first = data.get("host_us", {}).get(backend, {}).get(kind)
    return float(again) if again is not None and first is not None and again < first else None


def first_call_ms(costs: dict, backend: str, layout: str, padded: bool, training: bool) -> float:
    """What ``backend``'s first call costs beyond a later one (ms) by ``costs``, a calibration's ``first_call_ms``
    (a new configuration) or ``new_size_ms`` (a new size of one that has run): at the call's layout, padding and
    phase where measured there; else the most it cost at any of them (a cost not measured is taken as dear as the
    dearest measured); 0.0 where not measured at all."""
    cost = costs.get(backend, 0.0)
    if not isinstance(cost, dict):
        return cost
    return cost.get(host_key(layout, padded, training), max(cost.values(), default=0.0))


def _is_keyed(value) -> bool:
    return isinstance(value, dict) and all(HOST_KEY.fullmatch(k) and _is_time(t) for k, t in value.items())


def _is_time(value) -> bool:
    if type(value) is int:
        return 0 <= value < 2**53
    return type(value) is float and math.isfinite(value) and value >= 0


def _is_point(point) -> bool:
    return isinstance(point, list) and len(point) == 2 and all(_is_time(x) for x in point) and point[0] > 0


def _describe(fp: dict) -> str:
    packages = ", ".join(f"{d} {v}" for d, v in fp["packages"].items())
    return (f"{fp['name']}, torch {fp['torch']}, cuDNN {fp['cudnn']}" + (f", {packages}" if packages else "")
            + f", attnselect {fp['attnselect']}")  # fmt: skip


register_cache(_parsed.cache_clear)
