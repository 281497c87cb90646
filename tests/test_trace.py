"""``jaxpar/_trace/``: the face re-exports every name the rest of jaxpar imports from the
stage, and the stage's modules import only the ones before them."""

from __future__ import annotations

import ast
from pathlib import Path

import jaxpar
from jaxpar import _trace

PACKAGE = Path(jaxpar.__file__).parent
# The face's list, in import order: a module imports only the ones before it.
ORDER = ("names", "static_keys", "arguments", "outputs", "messages", "tracing")


def _imported_from(module: str, path: Path) -> set[str]:
    """Names ``path`` imports from ``module`` (``from .<module> import ...`` at any depth)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level and node.module == module:
            names.update(alias.name for alias in node.names)
    return names


def test_the_face_exports_every_name_the_package_uses() -> None:
    used: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        if "_trace" not in path.parts:
            used |= _imported_from("_trace", path)
    assert {"split_arguments", "trace", "Signature", "StaticArgumentWarning"} <= used
    assert sorted(used - set(_trace.__all__)) == []
    assert [name for name in _trace.__all__ if not hasattr(_trace, name)] == []


def test_each_module_imports_only_the_ones_listed_before_it() -> None:
    assert sorted(ORDER) == sorted(p.stem for p in (PACKAGE / "_trace").glob("*.py")
                                   if p.stem != "__init__")
    later = {name: set(ORDER[k + 1:]) | {name} for k, name in enumerate(ORDER)}
    offenders = [f"{name} imports {other}" for name in ORDER for other in ORDER
                 if other in later[name]
                 and _imported_from(other, PACKAGE / "_trace" / f"{name}.py")]
    assert offenders == []
