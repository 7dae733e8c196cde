"""The package's layout is its architecture: layers as folders, imports pointing one way.

Module-level imports only (a function may import lazily what its layer may not hold at import,
e.g. the tools' vLLM engine pieces). Layers: `devices` (the device layer) at the bottom, then
`core` (the cache), `channel`, `integration` (vLLM), the facade modules at the top of the
package, and `tools` over everything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import prefix_cache

PACKAGE = Path(prefix_cache.__file__).parent
#: What each layer's modules may import at module level, besides the layer itself.
ALLOWED = {
    "devices": {"errors"},
    "core": {"config", "errors", "devices"},
    "channel": {"errors", "devices"},
    "integration": {"config", "errors", "devices", "core", "channel", "manager", "__init__"},
    "tools": {"*"},
}
#: The C modules import nothing: any layer may call them (the CPU backend's pool write calls
#: the core's loops; the CUDA backend's copy-engine issuer is its own).
LEAVES = {"prefix_cache.core._core", "prefix_cache.devices.cuda._dma"}
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
        for node in ast.parse(path.read_text()).body:  # module level only
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


def test_each_layer_imports_only_the_layers_below_it() -> None:
    wrong = []
    for module, targets in _imports().items():
        layer = _layer(module)
        allowed = ALLOWED.get(layer)
        if allowed is None or "*" in allowed:
            continue
        wrong += [f"{module} -> {t}" for t in targets
                  if _layer(t) != layer and _layer(t) not in allowed and t not in LEAVES]
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_circle() -> None:
    graph = _imports()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
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
    assert not circles, f"import circles: {circles}"
