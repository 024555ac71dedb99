"""The package's shape: no import cycles between its modules (lazy imports count), its floors, a test file each."""

from __future__ import annotations

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "attnselect"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = ("attnselect", *path.relative_to(SRC).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The attnselect modules ``name`` imports anywhere in its source (a name imported from a package counts as
    its submodule where one exists)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return cycles


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert "attnselect.spec.problem" in graph["attnselect.backends.base"]  # the scan sees imports
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _longest_chain(graph: dict[str, set[str]]) -> list[str]:
    """The longest chain of imports, top module first (the graph has no cycles)."""
    memo: dict[str, list[str]] = {}

    def chain(name: str) -> list[str]:
        if name not in memo:
            memo[name] = [name, *max((chain(m) for m in sorted(graph[name])), key=len, default=[])]
        return memo[name]

    return max((chain(name) for name in sorted(graph)), key=len)


# Floors: the modules on the longest chain of imports (a package's __init__ counts as a module). The layers are
# spec -> backends (their registry below the kernels) -> choose -> dispatch -> api -> integrations and the CLI.
MAX_FLOORS = 12


def test_the_package_stands_on_at_most_twelve_floors():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    chain = _longest_chain(graph)
    assert len(chain) <= MAX_FLOORS, " -> ".join(chain)


def test_the_chain_finder_finds_the_longest_chain():
    assert _longest_chain({"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"c"}}) == ["a", "b", "c"]


def _walk_of_q(monkeypatch) -> list[str]:
    """The modules a dense call's ``q`` passes through in ``attnselect.attention`` (a decision, not memoized; the
    self-check off), in order: a stay is a run of frames of one module that hold ``q``, entered by a call or by a
    return to the caller."""
    import sys

    import torch

    import attnselect

    monkeypatch.setenv("ATTNSELECT_SELF_CHECK", "0")
    q, k, v = torch.randn(1, 64, 4, 32), torch.randn(1, 64, 4, 32), torch.randn(1, 64, 4, 16)
    attnselect.clear_cache()

    def holds(frame) -> bool:
        if frame is None or not frame.f_globals.get("__name__", "").startswith("attnselect"):
            return False
        values = frame.f_locals.values()
        return any(x is q or (isinstance(x, (tuple, list)) and any(y is q for y in x)) for x in values)

    stays: list[str] = []

    def visit(frame) -> None:
        if not stays or stays[-1] != frame.f_globals["__name__"]:
            stays.append(frame.f_globals["__name__"])

    def profile(frame, event, arg) -> None:
        if event == "call" and holds(frame):
            visit(frame)
        elif event == "return" and holds(frame) and holds(frame.f_back):
            visit(frame.f_back)

    sys.setprofile(profile)
    try:
        attnselect.attention(q, k, v, causal=True)
    finally:
        sys.setprofile(None)
    return stays


def test_q_climbs_back_up_at_most_four_times_on_its_way_through_attention(monkeypatch):
    """The architecture review (2026-12-02) counted 9 climbs back up (a stay on a higher floor than the one before)
    for ``q`` through attention(); the layout step asked for at most half. Each climb left is a return to the
    caller (api.py orchestrates the slow path), none a call up into a higher module."""
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    floor = {name: len(_longest_chain({n: graph[n] for n in graph if n in _below(name, graph)})) for name in graph}
    stays = _walk_of_q(monkeypatch)
    climbs = [i for i in range(1, len(stays)) if floor[stays[i]] > floor[stays[i - 1]]]
    assert stays[0] == "attnselect.api" and len(climbs) <= 4, " -> ".join(stays)
    assert all(stays[i] in stays[: i - 1] for i in climbs), " -> ".join(stays)  # each a return to a caller


def _below(name: str, graph: dict[str, set[str]]) -> set[str]:
    """``name`` and every module it imports, directly or not."""
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(graph[n])
    return seen


TESTS = pathlib.Path(__file__).resolve().parent
# Private modules tested through the test file of the family that shares them (the backends built on them).
MIRROR_EXCEPTIONS = {
    "backends/_flash_attn.py": "tests/backends/test_flash_attn.py",
    "backends/_sdpa.py": "tests/backends/test_sdpa.py",
}


def _mirror(module: pathlib.Path) -> pathlib.Path:
    """tests/<package>/test_<module>.py for src/attnselect/<package>/<module>.py."""
    return TESTS / module.parent / f"test_{module.name}"


def test_every_module_has_its_mirrored_test_file():
    modules = sorted(path.relative_to(SRC) for path in SRC.rglob("*.py") if path.name != "__init__.py")
    assert pathlib.Path("choose/selection.py") in modules  # the walk sees the modules
    missing = []
    for module in modules:
        family = MIRROR_EXCEPTIONS.get(module.as_posix())
        test_file = TESTS.parent / family if family else _mirror(module)
        if not test_file.is_file():
            missing.append(f"src/attnselect/{module.as_posix()}: {test_file.relative_to(TESTS.parent).as_posix()}")
    assert missing == [], "modules without their test file:\n" + "\n".join(missing)
    stale = [name for name in MIRROR_EXCEPTIONS if not (SRC / name).is_file() or _mirror(pathlib.Path(name)).is_file()]
    assert stale == [], f"exceptions for modules that are gone or have their own test file: {stale}"
