"""The source tree's shape: no import cycles (imports inside functions included), small modules, and
a README whose layout section names every package there is."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PACKAGE = SRC / "taogate"
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The taogate modules ``name`` imports anywhere in its file, each resolved to the module named
    (``from pkg import sub`` names ``pkg.sub`` when that is a module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif target in known:
                    out.add(target)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_no_cycles_between_packages() -> None:
    # A package (or top-level module) importing one that imports it back, through any modules, is an
    # import running back up the layers, even when no two modules import each other.
    modules = _modules()
    known = set(modules)

    def room(name: str) -> str:
        return name.split(".")[1] if name.count(".") >= 1 else name

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(room(name), set())
        edges.update(room(m) for m in _imports(name, path, known) if room(m) != room(name))
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_lazy_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_is_too_long() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these by concept (over {MAX_LINES} lines)"


def test_the_readme_layout_names_every_package() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"^\s*(?:[│├└─ ]*)([a-z0-9_]+)/", section, flags=re.MULTILINE))
    packages = {p.parent.name for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE}
    assert packages <= named, f"missing from README's layout: {sorted(packages - named)}"
    top = {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    listed = set(re.findall(r"\b([a-z_]+\.py)\b", section))
    assert top <= listed, f"top-level modules missing from README's layout: {sorted(top - listed)}"
