"""Comparing results: the same tree structure, shapes and dtypes, and values bit-exact or
within a tolerance.

Example::

    from helpers.trees import assert_same_values

    assert_same_values(jaxpar.parallel_branches(f, target=target)(*args), f(*args), target)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def _check_structure(a: Any, b: Any) -> tuple[list[Any], list[Any]]:
    leaves_a, tree_a = jax.tree_util.tree_flatten(a)
    leaves_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b, f"tree structures differ: {tree_a} vs {tree_b}"
    return leaves_a, leaves_b


def assert_tree_equal(a: Any, b: Any) -> None:
    """Same structure, shapes, dtypes and bit-identical values."""
    leaves_a, leaves_b = _check_structure(a, b)
    for i, (x, y) in enumerate(zip(leaves_a, leaves_b, strict=True)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, f"leaf {i}: shape {x.shape} vs {y.shape}"
        assert x.dtype == y.dtype, f"leaf {i}: dtype {x.dtype} vs {y.dtype}"
        np.testing.assert_array_equal(x, y, err_msg=f"leaf {i}")


def assert_tree_close(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Same structure, shapes and dtypes; values within `rtol`/`atol`."""
    leaves_a, leaves_b = _check_structure(a, b)
    for i, (x, y) in enumerate(zip(leaves_a, leaves_b, strict=True)):
        x, y = np.asarray(x), np.asarray(y)
        assert x.shape == y.shape, f"leaf {i}: shape {x.shape} vs {y.shape}"
        assert x.dtype == y.dtype, f"leaf {i}: dtype {x.dtype} vs {y.dtype}"
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=f"leaf {i}")


# On this CPU, target="gpu" output runs its regions as non-inlined calls, which changes XLA's
# fusion boundaries and so float32 rounding in the last bits (the StableHLO is the same ops).
STREAMED_ON_CPU_TOLERANCE: dict[str, float] = {"rtol": 1e-5, "atol": 1e-6}


def assert_same_values(got: Any, want: Any, target: str) -> None:
    """Bit-exact where nothing is annotated; last-bits close where regions became calls."""
    if target == "gpu":
        assert_tree_close(got, want, **STREAMED_ON_CPU_TOLERANCE)
    else:
        assert_tree_equal(got, want)

