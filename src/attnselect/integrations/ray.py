"""Ray: carry the driver's attnselect settings to Ray workers.

Ray workers do not inherit environment variables exported in the driver's process or shell
(they inherit the raylet's); ``runtime_env["env_vars"]`` is the channel that reaches them
(docs.ray.io, "Environment Dependencies"). Use it per job or per task::

    ray.init(runtime_env=attnselect.integrations.ray.runtime_env())
    task.options(runtime_env=attnselect.integrations.ray.runtime_env(existing)).remote()

Needs no Ray import itself; install Ray with ``pip install 'attnselect[ray]'``.
"""

from __future__ import annotations

import copy
import os

from attnselect.errors import InvalidInputError

#: Variables forwarded besides every ATTNSELECT_*: TransformerEngine's debug switches, so a TE
#: and attnselect debugging session behaves the same on the workers.
FORWARDED = ("NVTE_DEBUG", "NVTE_DEBUG_LEVEL")


def runtime_env(base: dict | None = None) -> dict:
    """A Ray runtime_env whose ``env_vars`` carry every set ATTNSELECT_* variable (and NVTE_DEBUG,
    NVTE_DEBUG_LEVEL) of this process, merged into ``base`` without dropping any of its keys.

    Where ``base["env_vars"]`` already sets one of them, ``base`` wins. ``base`` is not modified.
    """
    if base is not None and not isinstance(base, dict):
        raise InvalidInputError(f"base: got {type(base).__name__}, expected a dict (a Ray runtime_env) or None")
    given = (base or {}).get("env_vars")
    if given is not None and not (
        isinstance(given, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in given.items())
    ):
        raise InvalidInputError(
            f"base['env_vars']: got {given!r}, expected a dict of str to str (Ray's runtime_env env_vars)"
        )
    merged = copy.deepcopy(base) if base else {}
    carried = {name: value for name, value in os.environ.items() if name.startswith("ATTNSELECT_") or name in FORWARDED}
    merged["env_vars"] = {**carried, **(merged.get("env_vars") or {})}
    return merged
