"""``jaxpar/_ops/equations.py``: what an equation carries where jaxpar's own primitives
count too; and the ``_ops`` face."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
from helpers.lowered import all_equations
from helpers.metadata import answers as shortcut_answers
from helpers.metadata import placed_by_jax
from jax.experimental.xla_metadata import set_xla_metadata

import jaxpar
from jaxpar import _compat, _ops


def _placed(x: jax.Array) -> jax.Array:
    """``placed_by_jax`` and a call jaxpar places on a stream."""
    return placed_by_jax(x) + jaxpar.on_stream(1)(lambda v: v @ v)(x)


def test_has_frontend_attributes_is_the_truth_of_eqn_frontend_attributes() -> None:
    answers = shortcut_answers(_placed, _ops.has_frontend_attributes,
                               _ops.eqn_frontend_attributes)
    assert [a for a in answers if a[0] != a[1]] == []
    assert sum(a for a, _ in answers) >= 4  # metadata, both calls' attributes, the stream
    assert sum(not a for a, _ in answers) >= 4  # and plain equations


@dataclasses.dataclass(frozen=True)
class _Region:
    """A region as the emitter's ``Region`` is, to ``stream_region_p``."""

    attributes: tuple[tuple[str, str], ...]
    packs_results: ClassVar[bool] = False

    def derived(self, role: str) -> _Region:
        del role
        return self


def test_a_region_carries_its_own_attributes_after_the_scope_s() -> None:
    region = _Region((("_xla_stream_annotation", "2"), ("note", "region")))

    def scoped(v: jax.Array) -> jax.Array:
        with set_xla_metadata(note="outer", other="scope"):
            return _ops.bind_stream_region(lambda a: [a @ a], [v], region)[0]

    (eqn,) = [e for e in all_equations(jax.make_jaxpr(scoped)(jnp.ones((8, 8))))
              if e.primitive is _ops.stream_region_p]
    assert _compat.jax_frontend_attributes(eqn) == {"note": "outer", "other": "scope"}
    assert _ops.eqn_frontend_attributes(eqn) == {
        "note": "region", "other": "scope", "_xla_stream_annotation": "2"}
    assert _ops.has_frontend_attributes(eqn)


def test_all_primitive_names_holds_jaxpar_s_own() -> None:
    names = _ops.all_primitive_names()
    assert {_ops.STREAM_REGION, _ops.PROGRAM, jax.lax.add_p.name} <= names
    assert _ops.STREAM_REGION not in _compat.jax_primitive_names()


def test_the_face_exports_every_name_the_package_uses() -> None:
    """``jaxpar._ops`` re-exports every name the rest of jaxpar reads, each listed in
    ``__all__``, and every listed name resolves; nothing in the package reads
    ``jax._src`` (that is ``_compat``'s)."""
    package = Path(jaxpar.__file__).parent
    used: set[str] = set()
    for path in package.rglob("*.py"):
        if "_ops" not in path.parts:
            used.update(re.findall(r"\b_ops\.(\w+)", path.read_text()))
    assert {"bind_stream_region", "has_frontend_attributes", "bind_program"} <= used
    modules = {path.stem for path in (package / "_ops").glob("*.py")}  # named in prose
    assert sorted(used - set(_ops.__all__) - modules) == []
    assert [name for name in _ops.__all__ if not hasattr(_ops, name)] == []
    assert [p.name for p in (package / "_ops").glob("*.py") if "jax._src" in p.read_text()] == []
