"""User controls: keyword arguments, the :func:`overrides` context manager, ATTNSELECT_* variables.

Precedence: a keyword argument, then the innermost ``overrides`` block, then the environment.
Unknown values raise an :class:`~attnselect.errors.InvalidInputError` naming their source.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import logging
import os
from contextvars import ContextVar
from dataclasses import dataclass

from attnselect.errors import ForcedChoiceError, InvalidInputError
from attnselect.memos import RAW_ENVIRON as _RAW_ENVIRON
from attnselect.memos import environment_reader

POLICIES = ("rules", "measure")
PAD_MODES = ("auto", "always", "never")
MEMO_SIZE = 4096  # distinct (problem, target, controls) decisions kept in memory; the oldest go first
# The variables that control a decision, each in the memo keys: a memoized call cannot skip a change of one
ENV_VARS = (
    "ATTNSELECT_POLICY",
    "ATTNSELECT_BACKEND",
    "ATTNSELECT_PAD",
    "ATTNSELECT_DISABLE",
    "ATTNSELECT_DEBUG",
    "ATTNSELECT_DEBUG_LEVEL",
    "ATTNSELECT_STRICT",
    "ATTNSELECT_SELF_CHECK",
    "ATTNSELECT_ALLOWLIST",
)
# Where a user's calibration is read (attnselect.choose.calibration), which ranks: in the memo keys too, apart, as its
# raw value (:func:`cache_dir_key`), so a job that sets it alone keeps no_environment()'s one-call key
CACHE_DIR_VARIABLE = "ATTNSELECT_CACHE_DIR"
_NO_SCOPE = (None, None, None, None)
_SCOPE: ContextVar[tuple] = ContextVar("attnselect_overrides", default=_NO_SCOPE)


def strict() -> bool:
    """ATTNSELECT_STRICT=1: a kernel that fails at run time raises instead of falling back."""
    value = os.environ.get("ATTNSELECT_STRICT", "0").strip()
    if value not in ("0", "1"):
        raise InvalidInputError(f"ATTNSELECT_STRICT: got {value!r}, expected '0' or '1'")
    return value == "1"


scope = _SCOPE.get  # () -> the (policy, backend, pad, disable) set by enclosing overrides() blocks (in memo keys)


SELF_CHECK_MODES = ("0", "1", "all")


def self_check_mode() -> str:
    """ATTNSELECT_SELF_CHECK: '0' (off), '1' (default: signatures the correctness grid has not checked on this GPU
    and these versions) or 'all' (attnselect.self_check)."""
    value = _self_check_variable()
    value = "1" if value is None else value.strip()
    if value not in SELF_CHECK_MODES:
        raise InvalidInputError(f"ATTNSELECT_SELF_CHECK: got {value!r}, expected one of {SELF_CHECK_MODES}")
    return value


@contextlib.contextmanager
def overrides(*, policy: str | None = None, backend: str | None = None, pad=None, disable=None):
    """Controls for every attnselect call in the block, like ``torch.nn.attention.sdpa_kernel``.

    ``with attnselect.overrides(backend="sdpa_flash", pad=True): ...`` forces a backend and
    padding; ``disable=["flex"]`` excludes backends. A call's own keyword arguments still win,
    the block wins over ATTNSELECT_* variables, and nested blocks override field by field.
    Values are checked on entry. Memoized decisions are keyed on the block, so nothing is stale.
    """
    if isinstance(pad, bool):
        pad = "always" if pad else "never"
    if disable is not None:
        disable = names([x.strip() for x in disable.split(",") if x.strip()] if isinstance(disable, str) else disable,
                        "disable")  # as resolve() reads a comma-separated string  # fmt: skip
    inner = tuple(o if n is None else n for n, o in zip((policy, backend, pad, disable), _SCOPE.get()))
    resolve(policy=inner[0], backend=inner[1], pad=inner[2], disable=inner[3], env=(None,) * len(ENV_VARS))
    token = _SCOPE.set(inner)
    try:
        yield
    finally:
        _SCOPE.reset(token)


_RAW_NAMES = tuple(name.encode() for name in ENV_VARS)
# ``no_environment()``: True where no ATTNSELECT_* variable is set, in one C-level call (a dict's keys view follows
# the dict); else False.
no_environment = functools.partial(_RAW_ENVIRON.keys().isdisjoint, _RAW_NAMES) if _RAW_ENVIRON is not None else bool


_self_check_variable = environment_reader("ATTNSELECT_SELF_CHECK")
# ``cache_dir_key()``: ATTNSELECT_CACHE_DIR's raw value (bytes on POSIX) or None, one dict lookup
cache_dir_key = (
    functools.partial(_RAW_ENVIRON.get, CACHE_DIR_VARIABLE.encode())
    if _RAW_ENVIRON is not None
    else functools.partial(os.environ.get, CACHE_DIR_VARIABLE)
)


def raw_environment() -> tuple:
    """The raw values of the ATTNSELECT_* variables (bytes on POSIX): a cheap snapshot for memo keys."""
    if _RAW_ENVIRON is not None:
        return tuple(map(_RAW_ENVIRON.get, _RAW_NAMES))
    return tuple(map(os.environ.get, ENV_VARS))


def environment() -> tuple:
    """The ATTNSELECT_* variables attnselect reads, as a hashable snapshot (part of the memo key)."""
    return tuple(
        value if value is None or isinstance(value, str) else os.fsdecode(value) for value in raw_environment()
    )


@dataclass(frozen=True)
class Overrides:
    """The effective controls of one selection."""

    policy: str = "rules"
    backend: str | None = None
    pad: str = "auto"
    disable: frozenset = frozenset()


def names(values, argument: str) -> tuple:
    """A sorted tuple of backend names from any iterable of strings (hashable, reusable)."""
    try:
        given, values = values, tuple(values)
    except TypeError:
        raise InvalidInputError(f"{argument}: got {values!r}, expected a list of backend names") from None
    if isinstance(given, dict) or not all(isinstance(v, str) for v in values):  # a dict's keys are not a choice
        raise InvalidInputError(f"{argument}: got {given!r}, expected a list of backend names")
    return tuple(sorted(set(values)))


def resolve(
    *, policy=None, backend=None, pad=None, disable=None, env: tuple = (), scoped: tuple = _NO_SCOPE
) -> Overrides:
    """Merge keyword arguments, an :func:`overrides` scope and the environment snapshot ``env``."""
    from attnselect.backends.base import all_backends

    env_policy, env_backend, env_pad, env_disable = [
        s if s is not None else e for s, e in zip(scoped, (env or environment())[:4])
    ]
    _warn_unknown_variables()
    for value, argument in ((policy, "policy"), (backend, "backend"), (pad, "pad")):
        if isinstance(value, str) and not value:  # a variable set empty is unset; an argument given empty: a mistake
            raise InvalidInputError(f"{argument}: got '', expected None (the default) or a name")
    policy, source = _pick(policy, env_policy, "policy", "ATTNSELECT_POLICY")
    if not isinstance(policy, (str, type(None))) or (policy or "rules") not in POLICIES:
        raise InvalidInputError(f"{source}: got {policy!r}, expected one of {POLICIES}")
    if isinstance(pad, bool):
        pad = "always" if pad else "never"
    pad, source = _pick(pad, env_pad, "pad", "ATTNSELECT_PAD")
    if not isinstance(pad, (str, type(None))) or (pad or "auto") not in PAD_MODES:
        raise InvalidInputError(f"{source}: got {pad!r}, expected True, False or one of {PAD_MODES}")
    known = [b.name for b in all_backends()]
    backend, source = _pick(backend, env_backend, "backend", "ATTNSELECT_BACKEND")
    if not isinstance(backend, (str, type(None))):
        raise InvalidInputError(f"{source}: got {backend!r}, expected a backend name")
    if backend and backend not in known:
        raise ForcedChoiceError(f"{source}: got {backend!r}, expected one of {known}")
    disable, source = _pick(disable, env_disable, "disable", "ATTNSELECT_DISABLE")
    if isinstance(disable, str):
        disable = [x.strip() for x in disable.split(",") if x.strip()]
    elif disable is not None:
        disable = names(disable, source)
    unknown = sorted(set(disable or ()) - set(known))
    if unknown:
        raise InvalidInputError(f"{source}: got unknown backend(s) {unknown}, expected names from {known}")
    strict()  # read only when a kernel fails; checked here so a bad value fails before any kernel runs
    return Overrides(
        policy=policy or "rules", backend=backend or None, pad=pad or "auto", disable=frozenset(disable or ())
    )


@functools.cache
def _warn_unknown_variables() -> None:
    """One warning, at the process's first decision, for ATTNSELECT_* variables attnselect does not read (a
    misspelt one would otherwise change nothing, silently)."""
    read = (*ENV_VARS, CACHE_DIR_VARIABLE)
    unknown = sorted(n for n in os.environ if n.startswith("ATTNSELECT_") and n not in read)
    if unknown:
        close = {n: difflib.get_close_matches(n, ENV_VARS, n=1) for n in unknown}
        logging.getLogger("attnselect").warning(
            "attnselect: ignoring unknown variable(s) %s; attnselect reads %s",
            ", ".join(f"{n} (did you mean {c[0]}?)" if c else n for n, c in close.items()), ", ".join(ENV_VARS),
        )  # fmt: skip


def _pick(value, env_value, argument: str, variable: str):
    """(value, where it came from): the keyword argument if given, else the variable."""
    return (value, argument) if value is not None else (env_value, variable)
