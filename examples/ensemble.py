"""An ensemble of MLPs: every member is independent of the others.

On a GPU jaxpar can compile the ensemble with concurrent CUDA graphs (its members'
kernels then run side by side), put members on streams of their own, or batch members
of one width into one vmapped member (``batch_branches``), each where its GPU model
says that pays. What it does with each ensemble is printed: computed from the plan,
not claimed.

Run: python examples/ensemble.py
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np

import jaxpar


def mlp(params, x):
    for w, b in params[:-1]:
        x = jax.nn.gelu(x @ w + b)
    w, b = params[-1]
    return x @ w + b


def ensemble(members, x):
    """Mean prediction of the members; each member is independent of the others."""
    return jnp.mean(jnp.stack([mlp(params, x) for params in members]), axis=0)


def make_members(widths=(128, 192, 256, 96), features=64, outputs=10, seed=0):
    # NumPy's generator: drawing each weight with jax.random eagerly compiles a kernel
    # per shape, which took most of this example's time.
    rng = np.random.default_rng(seed)
    members = []
    for width in widths:
        sizes = [features, width, width, outputs]
        members.append([(jnp.asarray(rng.standard_normal((m, n), np.float32) / np.sqrt(m)),
                         jnp.asarray(np.zeros(n, np.float32)))
                        for m, n in itertools.pairwise(sizes)])
    return members


def main():
    members = make_members()
    x = jnp.asarray(np.random.default_rng(1).standard_normal((64, 64), np.float32))
    fast = jaxpar.parallel_branches(ensemble, target="gpu")
    plan = jaxpar.inspect(fast)(members, x)
    print(plan)
    np.testing.assert_allclose(fast(members, x), jax.jit(ensemble)(members, x),
                               rtol=1e-5, atol=1e-6)
    grads = jax.jit(jax.grad(lambda m: jnp.sum(fast(m, x) ** 2)))(members)
    want = jax.jit(jax.grad(lambda m: jnp.sum(ensemble(m, x) ** 2)))(members)
    for got, expected in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(want),
                             strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    print("same values and gradients as jax.jit(ensemble)")
    print(f"what jaxpar changed (different widths): {plan.summary()}")

    # Members of one width: candidates for one vmapped member over stacked weights.
    same = make_members(widths=(128,) * 4)
    plan = jaxpar.inspect(fast)(same, x)
    print(plan)
    np.testing.assert_allclose(fast(same, x), jax.jit(ensemble)(same, x), rtol=1e-5, atol=1e-5)
    print("same values as jax.jit(ensemble)")
    print(f"what jaxpar changed (one width): {plan.summary()}")


if __name__ == "__main__":
    main()
