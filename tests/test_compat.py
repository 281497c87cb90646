"""``jaxpar/_compat/``: the shortcuts the hot paths take must agree with the full
answers they stand for, on the jax this runs."""

from __future__ import annotations

import ast
import contextlib
import re
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from helpers.lowered import all_equations
from helpers.metadata import answers as shortcut_answers
from helpers.metadata import placed_by_jax
from jax.experimental.xla_metadata import set_xla_metadata

import jaxpar
from jaxpar import _compat


def test_has_jax_frontend_attributes_is_the_truth_of_jax_frontend_attributes() -> None:
    answers = shortcut_answers(placed_by_jax, _compat.has_jax_frontend_attributes,
                               _compat.jax_frontend_attributes)
    assert [a for a in answers if a[0] != a[1]] == []
    assert sum(a for a, _ in answers) >= 3  # the metadata, both calls' attributes
    assert sum(not a for a, _ in answers) >= 4  # and plain equations


def _lines(x: jax.Array) -> jax.Array:
    for _ in range(3):
        x = jnp.tanh(x @ x)  # one source line, three equations each
    with jax.named_scope("scoped"):
        y = jnp.sin(x)
    return x + y


def test_equal_source_keys_have_equal_summaries() -> None:
    x = jnp.ones((4, 4))
    for program in (jax.make_jaxpr(_lines)(x),
                    jax.make_jaxpr(jax.grad(lambda v: _lines(v).sum()))(x)):
        summaries: dict[Any, str] = {}
        eqns = list(all_equations(program))
        for eqn in eqns:
            summary = _compat.source_summary(eqn)
            assert summaries.setdefault(_compat.source_key(eqn), summary) == summary
        assert 1 < len(summaries) < len(eqns)  # keys repeat, and tell sources apart


def _mixed(x: jax.Array, w: jax.Array, n: jax.Array) -> Any:
    """Plain primitives, literals, a scan, a nested jit, a cond, an effect, a constant
    and an integer counter: equations the stager stages and ones it leaves to a bind."""
    y = jnp.tanh(x @ w) * 2.0 + 1
    y = jax.lax.scan(lambda c, _: (jnp.sin(c) @ w, None), y, None, length=3)[0]
    y = jax.jit(lambda a: a.T @ a)(y)
    y = jax.lax.cond(n > 0, jnp.cos, jnp.sin, y)
    jax.debug.print("{}", n)
    return y + jnp.arange(8.0), (n + 1).astype(jnp.float32)


def _staged(stage: Any, fn: Any, *args: Any, scope: Any = None) -> Any:
    """``jax.jit`` of ``fn``'s jaxpr staged again equation by equation with ``stage``
    (lowered in ``scope``, a context manager, where given)."""
    closed = jax.make_jaxpr(fn)(*args)

    def again(*a: Any) -> list[Any]:
        env = dict(zip(closed.jaxpr.constvars, closed.consts, strict=True))
        env.update(zip(closed.jaxpr.invars, a, strict=True))
        staging = stage()
        for eqn in closed.jaxpr.eqns:
            ins = [v.val if isinstance(v, _compat.Literal) else env[v] for v in eqn.invars]
            env.update(zip(eqn.outvars, staging(eqn, ins), strict=True))
        return [v.val if isinstance(v, _compat.Literal) else env[v]
                for v in closed.jaxpr.outvars]

    with scope or contextlib.nullcontext():
        return jax.jit(again).lower(*args)


def test_eqn_stager_stages_what_a_bind_stages(monkeypatch) -> None:
    """The stager's program, source locations included, is the one binds make; it
    stages the plain equations itself and binds the others (an effect, a staging rule)."""
    args = (jnp.ones((8, 8)), jnp.full((8, 8), 0.5), jnp.int32(3))

    class Binder:
        def __call__(self, eqn: Any, invals: Any) -> list[Any]:
            return _compat.bind_eqn(eqn, invals)

    binds: list[list[str]] = []
    real = _compat.bind_eqn
    def recorded(eqn: Any, *a: Any) -> list[Any]:
        binds[-1].append(eqn.primitive.name)
        return real(eqn, *a)

    # The binder calls the package's name; the stager its module's.
    monkeypatch.setattr(_compat, "bind_eqn", recorded)
    monkeypatch.setattr(_compat.tracing, "bind_eqn", recorded)

    def lowered(stage: Any) -> str:
        binds.append([])
        return _staged(stage, _mixed, *args).as_text(debug_info=True)

    # One line, so the two lowerings' call sites (in their locations) are the same.
    bound, staged = [lowered(stage) for stage in (Binder, _compat.EqnStager)]
    assert staged == bound
    primitives = [e.primitive.name for e in jax.make_jaxpr(_mixed)(*args).jaxpr.eqns]
    assert len(binds[0]) == len(primitives)
    assert {"dot_general", "tanh", "mul", "add"} <= set(primitives) - set(binds[1])
    effectful = {e.primitive.name for e in jax.make_jaxpr(_mixed)(*args).jaxpr.eqns if e.effects}
    assert effectful and effectful | {"jit"} <= set(binds[1])  # effects; jit's staging rule
    assert len(binds[1]) < len(primitives) / 2


def test_eqn_stager_binds_in_an_xla_metadata_scope() -> None:
    """A bind merges an enclosing ``set_xla_metadata`` scope into each equation's
    context; the stager then binds too, so the scope's tag reaches every operation."""
    args = (jnp.ones((8, 8)), jnp.full((8, 8), 0.5), jnp.int32(3))

    class Binder:
        def __call__(self, eqn: Any, invals: Any) -> list[Any]:
            return _compat.bind_eqn(eqn, invals)

    bound, staged = [_staged(stage, _mixed, *args, scope=set_xla_metadata(note="outer"))
                     .as_text() for stage in (Binder, _compat.EqnStager)]
    assert 'note = "outer"' in bound and staged == bound


def _names_used_outside_the_package(*roots: Path) -> set[str]:
    """Every ``_compat.<name>`` and ``from ..._compat import <name>`` in jaxpar's other
    modules (and in the ``.py`` files under ``roots``)."""
    used: set[str] = set()
    for path in [*Path(jaxpar.__file__).parent.rglob("*.py"),
                 *(p for root in roots for p in root.rglob("*.py"))]:
        if "_compat" in path.parts:
            continue
        text = path.read_text()
        used.update(re.findall(r"\b_compat\.(\w+)", text))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("_compat"):
                used.update(alias.name for alias in node.names)
    return used


def test_the_face_exports_every_name_the_package_uses() -> None:
    """``jaxpar._compat`` re-exports from its submodules every name the rest of jaxpar
    reads, each listed in ``__all__``, and every listed name resolves."""
    used = _names_used_outside_the_package()
    assert {"open_jaxpr", "JaxprEqn", "register_call_primitive"} <= used  # sees uses
    assert sorted(used - set(_compat.__all__)) == []
    assert [name for name in _compat.__all__ if not hasattr(_compat, name)] == []
    assert len(set(_compat.__all__)) == len(_compat.__all__)


def test_the_face_exports_only_names_in_use() -> None:
    """Every name in ``__all__`` is read by jaxpar's other modules or by the tests: a name
    nothing reads is a seam to JAX kept for no one (remove it, or its definition)."""
    used = _names_used_outside_the_package(Path(__file__).parent)
    assert sorted(set(_compat.__all__) - used) == []
