"""Seed 002: two independent `lax.scan`s with different step functions.

jaxpar fuses them into one loop that runs both bodies each trip and unrolls it, or,
where its model rates that faster, unrolls each on its own (with unroll="auto" a fused
body, twice the kernels, is unrolled half as far; for these bodies the two loops apart
are faster, and the plan says so with both figures). What it did is printed from the plan.

Run: python examples/two_scans.py
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxpar


def step1(carry, x):
    return jnp.tanh(carry @ x @ x) * 0.5, None


def step2(carry, x):
    return jnp.sin(x @ carry) + 0.5 * carry, None


def two_scans(a, b, xs1, xs2):
    out1, _ = lax.scan(step1, a, xs1)
    out2, _ = lax.scan(step2, b, xs2)
    return out1, out2


def make_args(n=100, steps=1000, seed=0):
    rng = np.random.default_rng(seed)  # NumPy: no kernel compiled per shape
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32) * 0.1)
                 for shape in [(n, n), (n, n), (steps, n, n), (steps, n, n)])


def story(steps=1000):
    """For ``python -m jaxpar demo``: (title, function, arguments)."""
    return "two scans with different bodies", two_scans, make_args(steps=steps)


def main():
    args = make_args()
    fast = jaxpar.parallel_branches(two_scans, target="gpu")
    plan = jaxpar.inspect(fast)(*args)
    print(plan)
    for got, want in zip(fast(*args), jax.jit(two_scans)(*args), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    print("same values as jax.jit(two_scans)")
    print(f"what jaxpar changed: {plan.summary()}")


if __name__ == "__main__":
    main()
