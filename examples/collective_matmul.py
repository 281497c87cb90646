"""Bidirectional all-gather collective matmul with ``shard_map`` and ``ppermute``.

``y = x @ w`` with ``x`` sharded by rows and ``w`` by columns over the mesh axis
``"x"``: each device starts with its own row block of ``x``, then passes blocks
around the ring in *both* directions at once (forward ``+1`` and backward
``-1``), multiplying every block it receives by its column block of ``w``. With
``n`` devices that takes ``n // 2`` steps instead of ``n - 1``, and each step's
matmuls can overlap the next step's transfers.

On a GPU, XLA by default runs all asynchronous collectives on one stream with
at most one in flight, so the two directions of a step serialize (the user
story of jaxpar's issue 4). ``jaxpar.parallel_branches`` groups the two
``ppermute`` s of each step into one NCCL group; ``jaxpar._flags.xla_flags()``
lists the XLA flags that help further.

Run it on 8 fake CPU devices::

    python examples/collective_matmul.py

Sharp edges:
  * ``main`` asks JAX for 8 CPU devices before the backend starts; if something
    already started JAX in this process, run with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` instead.
  * The mesh axis must have an even size and the row count of ``x`` must divide
    by it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar

AXIS = "x"


def ring(size: int, shift: int) -> list[tuple[int, int]]:
    """The ``ppermute`` pairs that send every block ``shift`` places along the ring."""
    return [(i, (i + shift) % size) for i in range(size)]


def collective_matmul_shard(x_block: jax.Array, w_block: jax.Array, *, size: int) -> jax.Array:
    """Per-device body: ``all_gather(x_block) @ w_block`` without an all-gather.

    Args:
      x_block: this device's ``[m, k]`` row block of ``x``.
      w_block: this device's ``[k, n_local]`` column block of ``w``.
      size: the number of devices on ``AXIS`` (even).

    Returns:
      The ``[size * m, n_local]`` column block of ``x @ w``.
    """
    m = x_block.shape[0]
    me = lax.axis_index(AXIS)
    out = jnp.zeros((size * m, w_block.shape[1]), jnp.result_type(x_block, w_block))

    def place(out: jax.Array, block: jax.Array, source: jax.Array) -> jax.Array:
        return lax.dynamic_update_slice(out, block @ w_block, (source * m, 0))

    out = place(out, x_block, me)
    forward = backward = x_block
    for step in range(1, size // 2 + 1):
        forward = lax.ppermute(forward, AXIS, ring(size, +1))  # now holds x[me - step]
        out = place(out, forward, (me - step) % size)
        if step < size // 2:  # the last step's two blocks are the same one
            backward = lax.ppermute(backward, AXIS, ring(size, -1))  # holds x[me + step]
            out = place(out, backward, (me + step) % size)
    return out


def make_collective_matmul(mesh: Mesh):
    """``x @ w`` on ``mesh`` (1-D, axis ``"x"``): x sharded by rows, w and y by columns."""
    size = mesh.shape[AXIS]
    if size % 2:
        raise ValueError(f"the mesh axis {AXIS!r} must have an even size, got {size}")
    body = functools.partial(collective_matmul_shard, size=size)
    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(AXIS, None), P(None, AXIS)),
                           out_specs=P(None, AXIS))

    def collective_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
        return mapped(x, w)

    return collective_matmul


def story(devices: int = 8):
    """For ``python -m jaxpar demo``: (title, function, arguments), or None without devices."""
    if len(jax.devices()) < devices:
        return None
    mesh = Mesh(np.array(jax.devices()[:devices]), (AXIS,))
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.device_put(jax.random.normal(keys[0], (devices * 16, 64)),
                       NamedSharding(mesh, P(AXIS, None)))
    w = jax.device_put(jax.random.normal(keys[1], (64, devices * 8)),
                       NamedSharding(mesh, P(None, AXIS)))
    return ("bidirectional collective matmul on 8 devices",
            make_collective_matmul(mesh), (x, w))


def gpu_story(mesh: Mesh):
    """For ``python -m jaxpar demo``'s GPU preview: ``story``'s function and argument specs
    built on ``mesh`` (deviceless GPUs, ``jaxpar._compiled.make_gpu_mesh``)."""
    devices = mesh.shape[AXIS]
    x = jax.ShapeDtypeStruct((devices * 16, 64), jnp.float32,
                             sharding=NamedSharding(mesh, P(AXIS, None)))
    w = jax.ShapeDtypeStruct((64, devices * 8), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, AXIS)))
    return make_collective_matmul(mesh), (x, w)


def main(devices: int = 8) -> None:
    """Runs the collective matmul on ``devices`` fake CPU devices and checks it."""
    if not jax.config.jax_platforms:
        jax.config.update("jax_platforms", "cpu")
    try:
        jax.config.update("jax_num_cpu_devices", devices)
    except RuntimeError:  # the backend already started: rely on XLA_FLAGS
        pass
    if len(jax.devices()) < devices:
        raise SystemExit(f"need {devices} devices; run with "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={devices}")
    mesh = Mesh(np.array(jax.devices()[:devices]), (AXIS,))
    matmul = make_collective_matmul(mesh)
    fast = jaxpar.parallel_branches(matmul)
    keys = jax.random.split(jax.random.key(0), 2)
    x = jax.random.normal(keys[0], (devices * 16, 64), jnp.float32)
    w = jax.random.normal(keys[1], (64, devices * 8), jnp.float32)
    x = jax.device_put(x, NamedSharding(mesh, P(AXIS, None)))
    w = jax.device_put(w, NamedSharding(mesh, P(None, AXIS)))
    expected = x @ w
    for name, fn in (("shard_map", matmul), ("parallel_branches", fast)):
        got = jax.jit(fn)(x, w)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-4)
        print(f"{name}: matches x @ w, shape {got.shape}")


if __name__ == "__main__":
    main()
