"""The package's layout is its architecture: layers as folders, imports pointing one way.

Every import counts, at module level or inside a function. Layers, bottom to top: `errors`, the
device layer (`devices`), `config`, the cache (`core`, which holds the scheduler-output adapter:
it reads vLLM's field names by attribute and imports nothing of vLLM's), `channel`, the facade
(`manager`), vLLM's integration (`integration`), the package's names (`__init__`) and the worker
names (`vllm_runners`), the tools, and the CLI (`__main__`). A module imports its own layer and
the layers below it, never one above; and no set of modules imports itself round a circle.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import prefix_cache

PACKAGE = Path(prefix_cache.__file__).parent
#: Layers from the bottom: a module may import its own layer and the ones before it.
LAYERS = ("errors", "devices", "config", "core", "channel", "manager", "integration",
          "__init__", "vllm_runners", "tools", "__main__")
#: The C modules import nothing: any layer may call them (the CPU backend's pool write calls
#: the core's loops; the CUDA backend's copy-engine issuer, done events and kernel launch are its
#: own, and the shm channel's put steps are the channel's).
LEAVES = {"prefix_cache.core._core", "prefix_cache.devices.cuda._dma",
          "prefix_cache.devices.cuda._events", "prefix_cache.devices.cuda._launch",
          "prefix_cache.channel._shm"}
#: Modules directly under prefix_cache/: the package's face.
FACE = {"__init__", "__main__", "config", "errors", "manager", "vllm_runners"}


def _modules() -> dict[str, Path]:
    """Every module of the package by name, the device layer's (a linked folder) included."""
    found = {}
    for root, prefix in ((PACKAGE, ()), ((PACKAGE / "devices").resolve(), ("devices",))):
        for path in sorted(root.rglob("*.py")):
            parts = (*prefix, *path.relative_to(root).with_suffix("").parts)
            found[".".join(("prefix_cache", *(p for p in parts if p != "__init__")))] = path
    return found


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    modules = _modules()
    for name, path in modules.items():
        targets = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):  # function-level imports too
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                base = node.module
                for alias in node.names:  # `from package import module` names the module
                    full = f"{base}.{alias.name}"
                    targets.add(full if full in modules or full in LEAVES else base)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t.startswith("prefix_cache") and t != name}
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_at_most_eight_modules_sit_directly_under_the_package() -> None:
    face = {p.stem for p in PACKAGE.glob("*.py")}
    assert face == FACE and len(face) <= 8


#: What the tools' commands share, one subpackage a concern: never a command of their own.
TOOL_INTERNALS = ("metrics", "pipelines", "profiling", "reporting")


def test_the_tools_folder_holds_the_commands_and_what_they_share_sits_below() -> None:
    """At most 14 modules at `tools/` (the commands), the rest in the subpackages, which never
    import a command: the arrows run from the commands down."""
    tools = PACKAGE / "tools"
    assert len(list(tools.glob("*.py"))) <= 14
    assert {p.name for p in tools.iterdir() if p.is_dir() and p.name != "__pycache__"} \
        == set(TOOL_INTERNALS)
    commands = {f"prefix_cache.tools.{p.stem}" for p in tools.glob("*.py") if p.stem != "__init__"}
    internal = tuple(f"prefix_cache.tools.{sub}." for sub in TOOL_INTERNALS)
    up = sorted(f"{module} -> {target}" for module, targets in _imports().items()
                if module.startswith(internal) for target in targets & commands)
    assert not up, "tools' internals importing a command:\n" + "\n".join(up)


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """The arrows of `graph` that point to a higher layer."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    return sorted(f"{module} -> {target}" for module, targets in graph.items()
                  for target in targets
                  if target not in LEAVES and rank[_layer(target)] > rank[_layer(module)])


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return circles


def test_every_layer_is_known() -> None:
    assert {_layer(module) for module in _imports()} <= set(LAYERS)


def test_no_import_points_up() -> None:
    upward = _upward(_imports())
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def test_no_import_circle() -> None:
    circles = _circles(_imports())
    assert not circles, f"import circles: {circles}"


def _through_the_face() -> list[str]:
    """`from prefix_cache import X` in the package's modules: each imports what it uses from
    the module that defines it, never through the package's names (`__init__`)."""
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "prefix_cache" \
                    and node.level == 0:
                found.append(f"{name}: from prefix_cache import "
                             f"{', '.join(alias.name for alias in node.names)}")
    return found


def test_no_module_imports_through_the_package_face() -> None:
    through = _through_the_face()
    assert not through, "imports through prefix_cache/__init__:\n" + "\n".join(through)


@functools.cache
def _defined(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments, imports;
    conditional ones included); with a module `__getattr__`, the names its strings spell too
    (`vllm_runners` resolves its workers' names on first use)."""
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for target in targets for t in ast.walk(target)
                         if isinstance(t, ast.Name))
    if "__getattr__" in names:
        names.update(node.value for node in ast.walk(tree) if isinstance(node, ast.Constant)
                     and isinstance(node.value, str) and node.value.isidentifier())
    return names


def _dangling() -> list[str]:
    """`from prefix_cache.X import Y` anywhere in the package, the tests, the examples and the
    benchmarks (in functions too, which no import at start runs) where Y is neither a module
    of X nor a name X defines."""
    modules = _modules()
    found = []
    paths = [*modules.values(), *(path for folder in ("tests", "examples", "benchmarks")
                                  for path in sorted((PACKAGE.parent / folder).glob("*.py")))]
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.startswith("prefix_cache")):
                continue
            if node.module not in modules:
                found.append(f"{path.name}: no module {node.module}")
                continue
            defined = None
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in modules or full in LEAVES or alias.name == "*":
                    continue
                defined = _defined(modules[node.module]) if defined is None else defined
                if alias.name not in defined:
                    found.append(f"{path.name}: from {node.module} import {alias.name}")
    return found


def test_every_import_of_the_package_names_what_exists() -> None:
    dangling = _dangling()
    assert not dangling, "imports of names that do not exist:\n" + "\n".join(dangling)


def test_the_rules_catch_an_arrow_up_and_a_circle() -> None:
    """The facade importing vLLM's integration, and two tools importing each other (as
    manager -> integration.adapter and bench <-> pipeline_bench once did)."""
    assert _upward({"prefix_cache.manager": {"prefix_cache.integration.adapter"}})
    assert _circles({"prefix_cache.tools.bench": {"prefix_cache.tools.pipeline_bench"},
                     "prefix_cache.tools.pipeline_bench": {"prefix_cache.tools.bench"}})
