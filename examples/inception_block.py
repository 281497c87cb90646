"""A multi-branch (inception-style) block: four independent convolution branches.

Run: python examples/inception_block.py
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jaxpar


def conv(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), "SAME",
                                    dimension_numbers=("NHWC", "HWIO", "NHWC"))


def inception(x, params):
    b1 = jax.nn.relu(conv(x, params["1x1"]))
    b3 = jax.nn.relu(conv(jax.nn.relu(conv(x, params["3x3_reduce"])), params["3x3"]))
    b5 = jax.nn.relu(conv(jax.nn.relu(conv(x, params["5x5_reduce"])), params["5x5"]))
    pool = lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")
    bp = jax.nn.relu(conv(pool, params["pool_proj"]))
    return jnp.concatenate([b1, b3, b5, bp], axis=-1)


def make_params(cin=64, seed=0):
    shapes = {"1x1": (1, 1, cin, 64), "3x3_reduce": (1, 1, cin, 96), "3x3": (3, 3, 96, 128),
              "5x5_reduce": (1, 1, cin, 16), "5x5": (5, 5, 16, 32), "pool_proj": (1, 1, cin, 32)}
    rng = np.random.default_rng(seed)  # NumPy: no kernel compiled per weight shape
    return {name: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.05)
            for name, shape in sorted(shapes.items())}


def make_input(seed=1):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((8, 28, 28, 64), np.float32))


def make_args():
    """For ``python -m jaxpar inspect --args-from``: the shapes of ``(x, params)``, no data."""
    return jax.eval_shape(lambda: (jnp.zeros((8, 28, 28, 64)), make_params()))


def story():
    """For ``python -m jaxpar demo``: (title, function, arguments)."""
    return "multi-branch (inception) block", inception, (make_input(), make_params())


def main():
    x, params = make_input(), make_params()
    fast = jaxpar.parallel_branches(inception, target="gpu")
    plan = jaxpar.inspect(fast)(x, params)
    print(plan)
    np.testing.assert_array_equal(fast(x, params), jax.jit(inception)(x, params))
    print("same values as jax.jit(inception)")
    print(f"what jaxpar changed: {plan.summary()}")


if __name__ == "__main__":
    main()
