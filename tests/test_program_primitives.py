"""Every primitive name in ``jaxpar._program.primitives`` is one the running jax defines.

The families are built from JAX's primitive objects, so a misspelt attribute
leaves a name out silently: these tests make that loud, and check that the
version-specific ones exist on the releases they are claimed for.
"""

from __future__ import annotations

import jax
import pytest

from jaxpar import _compat, _ops, targets
from jaxpar._model import cost as _cost
from jaxpar._program import primitives as _primitives

_RELEASE = ".".join(str(part) for part in _compat.JAX_VERSION[:2])


def _families() -> dict[str, frozenset[str]]:
    return {name: value for name, value in vars(_primitives).items()
            if name.isupper() and isinstance(value, frozenset)}


def _singles() -> dict[str, str]:
    return {name: value for name, value in vars(_primitives).items()
            if name.isupper() and isinstance(value, str)}


@pytest.fixture(scope="module")
def real_names() -> frozenset[str]:
    return _ops.all_primitive_names()


def test_collector_sees_the_primitives_jax_exports(real_names: frozenset[str]) -> None:
    assert {jax.lax.add_p.name, jax.lax.scatter_add_p.name, jax.lax.while_p.name} <= real_names
    assert "scatter-add" in real_names and "scatter_add" not in real_names


def test_every_family_name_is_a_primitive(real_names: frozenset[str]) -> None:
    families = _families()
    assert {"COLLECTIVE", "RECURSIVE", "USER_PLACEMENT", "COST_FREE", "COST_ONE_KERNEL",
            "BATCH_FAITHFUL", "NEVER_SHARED"} <= set(families)
    for family, names in families.items():
        assert names, family
        assert names <= real_names, (family, sorted(names - real_names))
    for constant, name in _singles().items():
        assert name in real_names, constant


def test_a_wrong_name_is_caught(real_names: frozenset[str], monkeypatch: pytest.MonkeyPatch
                                ) -> None:
    """The check above fails for a name that is no primitive, such as ``clamp_p``."""
    monkeypatch.setattr(_primitives, "COST_ONE_KERNEL",
                        _primitives.COST_ONE_KERNEL | {"clamp_p"})
    with pytest.raises(AssertionError, match="clamp_p"):
        test_every_family_name_is_a_primitive(real_names)


def test_only_version_specific_primitives_are_missing() -> None:
    assert set(_primitives.MISSING) == set(_primitives.FAMILY_ATTRIBUTES)
    for family, missing in _primitives.MISSING.items():
        unexplained = set(missing) - set(_primitives.VERSION_SPECIFIC)
        assert not unexplained, (family, sorted(unexplained))
        for attribute in missing:
            assert _RELEASE not in _primitives.VERSION_SPECIFIC[attribute], (
                f"{attribute} is claimed for jax {_RELEASE} but this jax lacks it")


def test_version_specific_primitives_exist_where_claimed() -> None:
    for attribute, releases in _primitives.VERSION_SPECIFIC.items():
        if _RELEASE in releases:
            assert _primitives._lookup(attribute) is not None, attribute
        assert any(attribute in attrs for attrs in _primitives.FAMILY_ATTRIBUTES.values()), (
            f"{attribute} is listed as version-specific but no family uses it")


def test_cost_rules_are_keyed_by_real_names(real_names: frozenset[str]) -> None:
    assert set(_cost.cost_rules) <= real_names, sorted(set(_cost.cost_rules) - real_names)


@pytest.mark.parametrize("scatter", [jax.lax.scatter_add, jax.lax.scatter_mul,
                                     jax.lax.scatter_min, jax.lax.scatter_max])
def test_every_scatter_launches_one_kernel(scatter) -> None:
    """``scatter-mul``/``-min``/``-max`` are kernels like ``scatter-add`` (their rule was
    registered as ``scatter_mul`` etc., which no equation is called, so they cost as fused
    elementwise work)."""
    import jax.numpy as jnp

    numbers = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,))
    closed = jax.make_jaxpr(lambda x, i, u: scatter(x, i, u, numbers))(
        jnp.ones(8), jnp.zeros((3, 1), jnp.int32), jnp.ones(3))
    (eqn,) = closed.jaxpr.eqns
    cost = _cost.CostModel(targets.device_profile("gpu")).eqn_cost(eqn)
    assert cost.kernels == 1.0, eqn.primitive.name


def test_compat_finds_the_internal_primitives_it_names():
    """``_compat`` falls back to literal names so ``import jaxpar`` never fails on a jax
    that moves these objects; on the supported versions the objects must be found."""
    from jaxpar import _compat

    for attribute, name in (("xla_metadata_call_p", "xla_metadata_call"),
                            ("shard_map_p", "shard_map")):
        primitive = _compat.internal_primitive(attribute)
        assert primitive is not None, attribute
        assert primitive.name == name
