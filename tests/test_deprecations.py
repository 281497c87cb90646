"""``jaxpar._deprecations``: every name kept for compatibility has a row (its replacement,
the release it goes in), warns through the one helper, and goes when its release comes;
``jaxpar.__all__`` holds nothing jaxpar no longer uses."""

from __future__ import annotations

import ast
import importlib
import re
import warnings
from pathlib import Path

import jax.numpy as jnp
import pytest

import jaxpar
from jaxpar._deprecations import DEPRECATIONS, deprecated_attributes, warn_deprecated

PACKAGE = Path(jaxpar.__file__).parent


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


@pytest.mark.parametrize("row", DEPRECATIONS, ids=lambda row: row.name)
def test_a_deprecated_name_goes_in_its_release(row):
    # Reaching the release fails here until the name is gone (and its row with it).
    assert _release(jaxpar.__version__) < _release(row.goes_in), (
        f"{row.name} goes in {row.goes_in}: remove it and its row")
    assert row.use and row.use != row.name


def _resolve(dotted: str) -> object:
    """The object a dotted public name gives (``jaxpar.passes.LoopPass``)."""
    module, _, attribute = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attribute)


MODULE_ROWS = [row for row in DEPRECATIONS if row.name.startswith("jaxpar.")]


@pytest.mark.parametrize("row", MODULE_ROWS, ids=lambda row: row.name)
def test_a_deprecated_module_name_warns_naming_its_replacement(row):
    with pytest.warns(DeprecationWarning) as caught:
        value = _resolve(row.name)
    (warning,) = [w for w in caught if issubclass(w.category, DeprecationWarning)]
    assert str(warning.message) == (f"{row.name} is deprecated and goes in jaxpar "
                                     f"{row.goes_in}; use {row.use}")
    assert warning.filename == __file__  # the line that used the name
    module, _, attribute = row.name.rpartition(".")
    assert attribute not in importlib.import_module(module).__all__
    if row.use.startswith("jaxpar."):  # an alias or an adapter of a public name
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert callable(_resolve(row.use)) and callable(value)


def test_trace_error_still_imports_as_a_runtime_error():
    with pytest.warns(DeprecationWarning, match="jaxpar.TraceError is deprecated"):
        assert issubclass(jaxpar.TraceError, RuntimeError)
    assert "TraceError" not in jaxpar.__all__ and "TraceError" not in dir(jaxpar)
    assert not _used_outside_its_definition("TraceError")  # why it left __all__


def test_plan_views_warn_at_the_users_line_and_dict_keys_stay():
    plan = jaxpar.inspect(lambda a, b: jnp.sin(a) + jnp.cos(b), target="cpu")(
        jnp.ones(3), jnp.ones(3))
    for name in ("loops", "subgraphs"):
        with pytest.warns(DeprecationWarning, match=rf"Plan\.{name} is deprecated") as caught:
            getattr(plan, name)
        assert caught[0].filename == __file__
    data = plan.to_dict()
    silent = {row.name for row in DEPRECATIONS if not row.warns}
    # The keys a dict keeps (they cannot warn): each has its row.
    assert {f'Plan.to_dict()["{key}"]' for key in ("loops", "subgraphs")} <= silent
    assert {"loops", "subgraphs", "decisions"} <= set(data)


def test_the_helper_refuses_a_name_without_a_row():
    with pytest.raises(KeyError, match="not a warning row"):
        warn_deprecated("jaxpar.no_such_name")
    with pytest.raises(KeyError, match="not a warning row"):
        warn_deprecated('Plan.to_dict()["loops"]')  # a key: it cannot warn
    with pytest.raises(KeyError, match=r"\['Old'\] need rows"):
        deprecated_attributes("jaxpar.passes", {"Old": object()})
    getattr_ = deprecated_attributes("jaxpar.passes", {"LoopPass": 1})
    with pytest.raises(AttributeError, match="has no attribute 'Other'"):
        getattr_("Other")


def test_every_warning_in_the_package_goes_through_the_helper():
    # One helper: no module but _deprecations warns a DeprecationWarning itself.
    offenders = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                 if path.name != "_deprecations.py" and "DeprecationWarning" in path.read_text()]
    assert offenders == []


def _used_outside_its_definition(name: str) -> bool:
    """Whether jaxpar's source names ``name`` anywhere but its own class statement, the
    public-name tables of ``jaxpar/__init__.py`` and a re-export."""
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__init__.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Name) and node.id == name:
                return True
            if isinstance(node, ast.Attribute) and node.attr == name:
                return True
    return False


@pytest.mark.parametrize("name", [n for n in jaxpar.__all__
                                  if isinstance(getattr(jaxpar, n), type)
                                  and issubclass(getattr(jaxpar, n), (Exception, Warning))])
def test_every_public_error_and_warning_is_raised_somewhere(name):
    # An exception class jaxpar never raises (as TraceError was) has no place in __all__.
    assert _used_outside_its_definition(name), f"jaxpar.{name} is raised nowhere"
