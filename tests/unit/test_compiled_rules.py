"""What the modules the compiled build takes (pyproject's mypyc hook) must not do, read from their
source: each is valid Python that mypyc compiles into something that fails only at run time."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Bases a compiled class may have as it is (compiled themselves, or built in and supported).
_PLAIN_BASES = {"object", "Exception", "ValueError", "Protocol", "Generic", "NamedTuple", "StrEnum", "Enum"}


def _compiled() -> list[Path]:
    hook = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"]
    spec = hook["hooks"]["mypyc"]
    excluded = {ROOT / p.lstrip("/") for p in spec["exclude"]}
    out: list[Path] = []
    for entry in spec["include"]:
        path = ROOT / entry.lstrip("/")
        out.extend(sorted(path.rglob("*.py")) if path.is_dir() else [path])
    return [p for p in out if p not in excluded]


def _compiled_names() -> set[str]:
    """The names of the classes the compiled modules define."""
    return {
        node.name
        for path in _compiled()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }


def test_the_hook_names_modules_that_exist() -> None:
    paths = _compiled()
    assert len(paths) > 50 and all(p.is_file() for p in paths)


def test_an_except_variable_is_bound_to_one_type_per_function() -> None:
    """mypyc keeps one typed variable per name and function: ``except A as exc`` then ``except B as
    exc`` raises a TypeError when a B arrives (mypyc/mypyc#620)."""
    found = []
    for path in _compiled():
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            bound: dict[str, set[str]] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                    bound.setdefault(node.name, set()).add(ast.unparse(node.type))
            found += [f"{path.name}:{fn.lineno} {n} {sorted(t)}" for n, t in bound.items() if len(t) > 1]
    assert found == []


def test_a_class_with_a_python_base_says_how_it_compiles() -> None:
    """A compiled class whose base is a Python class (logging's, uvicorn's, asyncio's, ours left
    Python) carries ``mypyc_attr``: ``native_class=False`` keeps it a Python class with compiled
    methods, ``allow_interpreted_subclasses`` lets Python subclass it. Unmarked, such a class lost
    its base's class attributes and crashed the interpreter in a garbage collection."""
    compiled = _compiled_names()
    unmarked = []
    for path in _compiled():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {ast.unparse(b.value if isinstance(b, ast.Subscript) else b) for b in node.bases}
            foreign = {b for b in bases if b.rpartition(".")[2] not in compiled | _PLAIN_BASES}
            marked = any("mypyc_attr" in ast.unparse(d) for d in node.decorator_list)
            if foreign and not marked:
                unmarked.append(f"{path.name}:{node.lineno} {node.name}({', '.join(sorted(foreign))})")
    assert unmarked == []


def test_no_final_tuple_is_unpacked_with_a_star() -> None:
    """``(0.0, *DELAYS)`` of a ``Final`` tuple compiles to a read of a constant mypyc never set: a
    NameError at run time (mypy 2.4; met when the KV-event subscriber was compiled)."""
    found = []
    for path in _compiled():
        tree = ast.parse(path.read_text())
        finals = {
            node.target.id
            for node in tree.body
            if isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and "Final" in ast.unparse(node.annotation)
        }
        found += [
            f"{path.name}:{node.lineno} *{node.value.id}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Starred) and isinstance(node.value, ast.Name) and node.value.id in finals
        ]
    assert found == []


def _field_defaults(cls: ast.ClassDef) -> list[tuple[str, str | None, bool]]:
    """(name, default's source or None, in __init__) of each field of a dataclass."""
    out = []
    for st in cls.body:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            value, init = st.value, True
            if isinstance(value, ast.Call) and ast.unparse(value.func) == "field":
                kw = {k.arg: k.value for k in value.keywords}
                init = ast.unparse(kw["init"]) != "False" if "init" in kw else True
                value = kw.get("default")
            out.append((st.target.id, None if value is None else ast.unparse(value), init))
    return out


def test_a_dataclass_that_writes_its_init_out_takes_and_sets_every_field() -> None:
    """A dataclass's generated ``__init__`` stays interpreted in the compiled build (mypyc compiles
    what the class body says, and ``dataclass`` writes that method at import): built per request,
    those cost a tenth of a request's instructions. The ones built per request say ``init=False``
    and write it out; it must take the fields ``dataclass`` would, in order and with the same
    defaults (so ``replace`` and keyword calls keep working), and set each field, those left out of
    ``__init__`` to their default."""
    wrong, checked = [], 0
    for path in _compiled():
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef) or not any(
                "dataclass(" in ast.unparse(d) and "init=False" in ast.unparse(d) for d in cls.decorator_list
            ):
                continue
            init = next(f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "__init__")
            args = init.args.args[1:]
            defaults = [None] * (len(args) - len(init.args.defaults)) + init.args.defaults
            took = [
                (a.arg, None if d is None else ast.unparse(d), True)
                for a, d in zip(args, defaults, strict=True)
            ]
            fields = _field_defaults(cls)
            sets = [
                (ast.unparse(s.targets[0]).removeprefix("self."), ast.unparse(s.value))
                for s in init.body
                if isinstance(s, ast.Assign)
            ]
            expected_sets = [(n, n if i else d) for n, d, i in fields]
            if took != [f for f in fields if f[2]] or sets != expected_sets or init.args.kwonlyargs:
                wrong.append(f"{path.name}:{cls.lineno} {cls.name}")
            checked += 1
    assert wrong == []
    assert checked >= 11
