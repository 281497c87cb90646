"""Adversarial tests of a decorated function's top-level call path (``_dispatch.fast``:
the C++ dispatch, ``route`` and the remembered splits of ``memo_split``) against
``jax.jit`` of the same function."""

from __future__ import annotations

import copy
import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jaxpar
from jaxpar._tune import TUNE_DIR_VARIABLE


def _by_type(x: Any, n: Any) -> Any:
    return x * 0 + {int: 1.0, float: 2.0, bool: 3.0}[type(n)]


def test_a_static_arguments_type_keys_the_remembered_split_as_it_keys_jax_jit() -> None:
    # 1 == 1.0 == True: the remembered split of the call with n=1 served n=1.0 and n=True
    # (a string beside them makes jaxpar split the call).
    x = jnp.arange(3.0)
    jitted = jax.jit(_by_type, static_argnums=1)
    decorated = jaxpar.parallel_branches(lambda x, n, label: _by_type(x, n), static_argnums=1)
    for n in (1, 1.0, True, 1):
        np.testing.assert_array_equal(decorated(x, n, "label"), jitted(x, n))
    by_name = jaxpar.parallel_branches(
        lambda x, label, *, n: _by_type(x, n), static_argnames="n")
    for n in (True, 1, 1.0):
        np.testing.assert_array_equal(by_name(x, "label", n=n), jitted(x, n))


def test_static_values_of_equal_hash_but_other_types_in_containers() -> None:
    # Inside a static argument's value, equality decides, as under jax.jit.
    x = jnp.arange(3.0)
    seen: list[Any] = []

    @functools.partial(jaxpar.parallel_branches, static_argnums=1)
    def f(x: Any, n: Any, label: str) -> Any:
        seen.append(n)
        return x * len(n)

    f(x, (1, 2), "a")
    f(x, (1.0, 2), "a")
    jitted_seen: list[Any] = []

    @functools.partial(jax.jit, static_argnums=1)
    def g(x: Any, n: Any) -> Any:
        jitted_seen.append(n)
        return x * len(n)

    g(x, (1, 2))
    g(x, (1.0, 2))
    assert len(seen) == len(jitted_seen) == 1


def test_objects_holding_a_decorated_function_can_be_deep_copied() -> None:
    # As with jax.jit and eqx.filter_jit: a config or model holding the function is
    # deep-copied (copy.deepcopy raised on the plan cache's lock, then on the compiled
    # programs' tracebacks).
    @dataclasses.dataclass
    class Config:
        step: Any

    decorated = jaxpar.parallel_branches(lambda x: x * 2)
    x = jnp.arange(3.0)
    for _ in range(2):  # before and after a call
        copied = copy.deepcopy(Config(decorated))
        np.testing.assert_array_equal(copied.step(x), x * 2)


def test_tune_measures_at_a_call_with_flax_nnx_objects(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Such calls ran in nnx.jit, whose trace holds no concrete call to measure: the tuner
    # never decided (no decision stored), and the call ran the plan as without tune=True.
    nnx = pytest.importorskip("flax.nnx")
    monkeypatch.setenv(TUNE_DIR_VARIABLE, str(tmp_path))

    class Cell(nnx.Module):
        def __init__(self) -> None:
            self.w = nnx.Param(jnp.ones(8))
            self.calls = nnx.BatchStat(jnp.zeros(()))

        def __call__(self, xs: Any) -> Any:
            self.calls[...] = self.calls[...] + 1
            return lax.scan(lambda c, x: (jnp.sin(c) * self.w[...] + x, c), jnp.zeros(8), xs)[0]

    budget = jaxpar.TuneBudget(seconds=0.01, min_repeats=1, max_repeats=2)
    tuned = jaxpar.parallel_branches(lambda cell, xs: cell(xs), tune=budget)
    cell, reference = Cell(), Cell()
    xs = jnp.linspace(0.0, 1.0, 40 * 8).reshape(40, 8)
    for _ in range(2):
        np.testing.assert_allclose(tuned(cell, xs),
                                   nnx.jit(lambda cell, xs: cell(xs))(reference, xs), rtol=1e-6)
    assert len(list(tmp_path.glob("*.json"))) == 1  # decided at the first call
    assert float(cell.calls[...]) == float(reference.calls[...]) == 2  # measuring left no trace
