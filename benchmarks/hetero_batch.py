"""Different members, batched kernels: kernel launches per run, deviceless H200.

A user asked how to run two scans with *different* step functions as fast as the
hand-written ``vmap`` of two identical ones. This script compiles each program three ways
for an H200, deviceless (the CUDA PJRT plugin, no GPU): ``plain`` ``jax.jit``, jaxpar with
``batch_matmuls=False`` (what jaxpar did before the pass) and jaxpar's GPU defaults, and
counts the kernels one run launches: every ``fusion``/``custom-call`` of the program, each
loop body times its known trip count.

Programs (``--size full``; ``quick`` and ``smoke`` shrink the steps and widths):

* ``seed_002``: the seed's two scans with different bodies, 100x100 float32, 10,000
  steps: ``X@X@X@X@X; val+X`` and ``Y=tanh(X); Y@X@Y@X@Y; 0.5*val+Y``;
* ``seed_002_identical`` and ``seed_002_hand_vmap``: the reference, two identical bodies,
  and the seed author's hand-written ``vmap`` of them;
* ``rnn_pair``: two recurrent cells with different activations and operand orders
  (``relu(x @ c) @ x`` beside ``x @ sigmoid(c @ x)``);
* ``transposed_pair``: a ``[64, 100]`` state through ``h @ x`` in one body and
  ``einsum('ij,bi->jb', x, h)`` (the same product, operands swapped, result transposed)
  in the other;
* ``crossed_pair``: three matmuls per body, operand order crossed: ``c @ x @ x @ x``
  beside ``x @ x @ x @ c``;
* ``crossed_cells``: three matmuls per body with activations between, ``h @ x`` in one
  body and ``x @ h`` in the other;
* ``hetero_ensemble``: four MLPs of one width with four different activations;
* ``experts``: a mixture of 4 same-width experts with different activations, gated;
* ``multi_head``: four attention heads written as branches, each with its own mask.

Run::

    JAX_PLATFORMS=cpu python benchmarks/hetero_batch.py [--size full|quick|smoke]
        [--programs a,b] [--json PATH]

Sharp edges:
  * Loops nested in loop bodies are not multiplied out (none of these programs has one).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
from jax import lax

import jaxpar
from jaxpar._compiled import parse_schedule, plugin_status
from jaxpar._compiled.gpu_compile import compiled_program, lower_for_gpu

SIZES = ("full", "quick", "smoke")
VARIANTS = ("plain", "jaxpar_before", "jaxpar")


# ------------------------------------------------------ two scans with different bodies


def seed_body(val: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return val + x @ x @ x @ x @ x, None


def seed_other_body(val: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    y = jnp.tanh(x)
    return 0.5 * val + y @ x @ y @ x @ y, None


def seed_002(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
    """The seed's question: two scans with different bodies."""
    return lax.scan(seed_body, a, xs1)[0], lax.scan(seed_other_body, b, xs2)[0]


def seed_002_identical(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
    """The reference: two scans with the same body."""
    return lax.scan(seed_body, a, xs1)[0], lax.scan(seed_body, b, xs2)[0]


def seed_002_hand_vmap(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
    """The seed author's test3: one vmapped scan over stacked inputs (identical bodies)."""
    out = jax.vmap(lambda c, xs: lax.scan(seed_body, c, xs)[0])(jnp.stack([a, b]),
                                                              jnp.stack([xs1, xs2]))
    return out[0], out[1]


def seed_args(n: int, steps: int) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    return (jax.random.normal(keys[0], (n, n)) / n, jax.random.normal(keys[1], (n, n)) / n,
            jax.random.normal(keys[2], (steps, n, n)) / n,
            jax.random.normal(keys[3], (steps, n, n)) / n)


# --------------------------------------------------------------------------- own pairs


def readme_two_scans(a: jax.Array, b: jax.Array, xs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The README's example: two scans with different bodies over the same inputs."""
    r1, _ = lax.scan(lambda c, x: (jnp.tanh(c @ x), None), a, xs)
    r2, _ = lax.scan(lambda c, x: (jnp.sin(x @ c) + c, None), b, xs)
    return r1, r2


def readme_args(n: int, steps: int) -> tuple[jax.Array, ...]:
    return (jnp.eye(n) * 0.5, jnp.eye(n) * 0.5, jnp.ones((steps, n, n)) * 0.01)


def _relu_cell(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return 0.9 * c + jnp.sin(jax.nn.relu(x @ c) @ x), None


def _sigmoid_cell(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return c + 0.1 * jax.nn.gelu(x @ jax.nn.sigmoid(c @ x)), None


def rnn_pair(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
    """Two recurrent cells: different activations, operands in different orders."""
    return lax.scan(_relu_cell, a, xs1)[0], lax.scan(_sigmoid_cell, b, xs2)[0]


def _row_cell(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return jnp.tanh(h @ x) @ x * 0.5, None


def _column_cell(h: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    yt = jnp.einsum("ij,bi->jb", x, h)  # (h @ x).T: the same product, operands swapped
    return h + 0.5 * jnp.cos(jax.nn.relu(yt).T @ x), None


def transposed_pair(h1: Any, h2: Any, xs1: Any, xs2: Any) -> Any:
    """A [b, n] state through ``h @ x`` beside the same products written transposed."""
    return lax.scan(_row_cell, h1, xs1)[0], lax.scan(_column_cell, h2, xs2)[0]


def _right_chain(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return 0.9 * c + jnp.tanh(c @ x @ x @ x), None


def _left_chain(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    return c + 0.1 * jnp.sin(x @ x @ x @ c), None


def crossed_pair(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
    """Three matmuls per body, operand order crossed: ``c @ x @ x @ x`` beside
    ``x @ x @ x @ c``."""
    return lax.scan(_right_chain, a, xs1)[0], lax.scan(_left_chain, b, xs2)[0]


def _right_cell(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    h = jax.nn.relu(jnp.tanh(c @ x) @ x)
    return 0.9 * c + jnp.sin(h @ x), None


def _left_cell(c: jax.Array, x: jax.Array) -> tuple[jax.Array, None]:
    h = jax.nn.sigmoid(x @ jnp.tanh(x @ c))
    return c + 0.1 * jax.nn.gelu(x @ h), None


def crossed_cells(a: Any, b: Any, xs1: Any, xs2: Any) -> Any:
    """Three matmuls per body with activations between, operand order crossed: ``h @ x``
    in one body, ``x @ h`` in the other."""
    return lax.scan(_right_cell, a, xs1)[0], lax.scan(_left_cell, b, xs2)[0]


def state_args(batch: int, n: int, steps: int) -> tuple[jax.Array, ...]:
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    return (jax.random.normal(keys[0], (batch, n)) / n, jax.random.normal(keys[1], (batch, n)) / n,
            jax.random.normal(keys[2], (steps, n, n)) / n ** 0.5,
            jax.random.normal(keys[3], (steps, n, n)) / n ** 0.5)


# --------------------------------------------------------------------------- straight line

_ACTIVATIONS: tuple[Callable[[jax.Array], jax.Array], ...] = (
    jax.nn.relu, jax.nn.gelu, jnp.tanh, jax.nn.silu)


def hetero_ensemble(members: Sequence[Sequence[jax.Array]], x: jax.Array) -> jax.Array:
    """Four MLPs of one width, each with its own activation, on the same input."""
    outs = []
    for act, weights in zip(_ACTIVATIONS, members, strict=True):
        h = x
        for w in weights[:-1]:
            h = act(h @ w)
        outs.append(h @ weights[-1])
    return sum(outs) / len(outs)


def ensemble_args(batch: int, width: int, depth: int) -> tuple[Any, ...]:
    keys = iter(jax.random.split(jax.random.PRNGKey(2), 4 * (depth + 1) + 1))
    members = [[jax.random.normal(next(keys), (width, width)) / width ** 0.5
                for _ in range(depth + 1)] for _ in _ACTIVATIONS]
    return members, jax.random.normal(next(keys), (batch, width))


def experts(params: dict[str, Any], x: jax.Array) -> jax.Array:
    """A mixture of 4 same-width experts (different activations), softmax-gated."""
    gate = jax.nn.softmax(x @ params["gate"], axis=-1)
    out = jnp.zeros_like(x)
    for e, (act, (w_in, w_out)) in enumerate(zip(_ACTIVATIONS, params["experts"],
                                                 strict=True)):
        out = out + gate[:, e:e + 1] * (act(x @ w_in) @ w_out)
    return out


def experts_args(batch: int, width: int, hidden: int) -> tuple[Any, ...]:
    keys = iter(jax.random.split(jax.random.PRNGKey(3), 10))
    params = {"gate": jax.random.normal(next(keys), (width, 4)) / width ** 0.5,
              "experts": [(jax.random.normal(next(keys), (width, hidden)) / width ** 0.5,
                           jax.random.normal(next(keys), (hidden, width)) / hidden ** 0.5)
                          for _ in range(4)]}
    return params, jax.random.normal(next(keys), (batch, width))


def multi_head(params: dict[str, Any], x: jax.Array) -> jax.Array:
    """Four attention heads as branches: causal, local window, global, and strided."""
    t = x.shape[0]
    i, j = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    masks = (j <= i, jnp.abs(i - j) < 4, jnp.ones((t, t), bool), (i - j) % 2 == 0)
    heads = []
    for mask, (wq, wk, wv) in zip(masks, params["heads"], strict=True):
        q, k, v = x @ wq, x @ wk, x @ wv
        scores = jnp.where(mask, q @ k.T / q.shape[-1] ** 0.5, -1e9)
        heads.append(jax.nn.softmax(scores, axis=-1) @ v)
    return jnp.concatenate(heads, axis=-1) @ params["out"]


def multi_head_args(tokens: int, width: int, head: int) -> tuple[Any, ...]:
    keys = iter(jax.random.split(jax.random.PRNGKey(4), 14))
    params = {"heads": [tuple(jax.random.normal(next(keys), (width, head)) / width ** 0.5
                              for _ in range(3)) for _ in range(4)],
              "out": jax.random.normal(next(keys), (4 * head, width)) / (4 * head) ** 0.5}
    return params, jax.random.normal(next(keys), (tokens, width))


_SEED_SIZES = {"full": {"n": 100, "steps": 10_000}, "quick": {"n": 100, "steps": 1_000},
               "smoke": {"n": 8, "steps": 5}}
_STATE_SIZES = {"full": {"batch": 64, "n": 100, "steps": 10_000},
                "quick": {"batch": 64, "n": 100, "steps": 1_000},
                "smoke": {"batch": 3, "n": 8, "steps": 5}}
PROGRAMS: dict[str, tuple[Callable[..., Any], Callable[..., tuple[Any, ...]],
                          dict[str, dict[str, int]]]] = {
    "seed_002": (seed_002, seed_args, _SEED_SIZES),
    "seed_002_identical": (seed_002_identical, seed_args, _SEED_SIZES),
    "seed_002_hand_vmap": (seed_002_hand_vmap, seed_args, _SEED_SIZES),
    "rnn_pair": (rnn_pair, seed_args, _SEED_SIZES),
    "transposed_pair": (transposed_pair, state_args, _STATE_SIZES),
    "crossed_pair": (crossed_pair, seed_args, _SEED_SIZES),
    "crossed_cells": (crossed_cells, seed_args, _SEED_SIZES),
    "hetero_ensemble": (hetero_ensemble, ensemble_args, {
        "full": {"batch": 256, "width": 256, "depth": 3},
        "quick": {"batch": 128, "width": 256, "depth": 3},
        "smoke": {"batch": 2, "width": 8, "depth": 2}}),
    "experts": (experts, experts_args, {
        "full": {"batch": 256, "width": 256, "hidden": 512},
        "quick": {"batch": 128, "width": 256, "hidden": 512},
        "smoke": {"batch": 3, "width": 8, "hidden": 16}}),
    "multi_head": (multi_head, multi_head_args, {
        "full": {"tokens": 256, "width": 256, "head": 64},
        "quick": {"tokens": 128, "width": 256, "head": 64},
        "smoke": {"tokens": 8, "width": 8, "head": 4}}),
    "readme_two_scans": (readme_two_scans, readme_args, {
        "full": {"n": 256, "steps": 100}, "quick": {"n": 64, "steps": 100},
        "smoke": {"n": 8, "steps": 5}}),
}


def program_args(name: str, size: str) -> tuple[Any, ...]:
    """The arguments of program ``name`` at ``size``."""
    _, make, sizes = PROGRAMS[name]
    return make(**sizes[size])


def variants(fn: Callable[..., Any]) -> dict[str, Callable[..., Any]]:
    """The three ways each program is compiled, keyed like ``VARIANTS``."""
    return {"plain": fn,
            "jaxpar_before": jaxpar.parallel_branches(fn, target="gpu", batch_matmuls=False),
            "jaxpar": jaxpar.parallel_branches(fn, target="gpu")}


# --------------------------------------------------------------------------- counting


def launches_per_run(hlo_text: str) -> dict[str, Any]:
    """Kernels one run launches (loop bodies times their known trip counts), and the loops."""
    schedule = parse_schedule(hlo_text)
    total = schedule.kernels
    for loop in schedule.while_loops:
        trips = loop.known_trip_count
        if trips is None:  # the condition runs every trip, and the trips are unknown
            raise ValueError(f"loop {loop.name} has no known trip count: launches unknown")
        total += (trips - 1) * loop.body_kernels
    return {"launches": total, "loops": len(schedule.while_loops),
            "trips": [loop.known_trip_count for loop in schedule.while_loops],
            "kernels_per_trip": [loop.body_kernels for loop in schedule.while_loops],
            "matmul_kernels": schedule.dot_kernels}


def count(fn: Callable[..., Any], args: Sequence[Any]) -> dict[str, Any]:
    """``launches_per_run`` of ``fn``'s deviceless H200 compile, with its temporary bytes
    (``temp_bytes``, the compile's ``memory_analysis()``)."""
    specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    program = compiled_program(lower_for_gpu(fn, *specs, gpu="h200"))
    return {**launches_per_run(program.hlo), "temp_bytes": program.temp_bytes}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="full")
    parser.add_argument("--programs", help="comma-separated subset of: " + ", ".join(PROGRAMS))
    parser.add_argument("--json", help="write the results here")
    ns = parser.parse_args(argv)
    ok, message = plugin_status()
    if not ok:
        raise SystemExit(f"no deviceless GPU compile: {message}")
    names = ns.programs.split(",") if ns.programs else list(PROGRAMS)
    unknown = [n for n in names if n not in PROGRAMS]
    if unknown:
        raise SystemExit(f"unknown program(s) {unknown}; choose from {list(PROGRAMS)}")
    results: dict[str, Any] = {"size": ns.size, "jax": jax.__version__, "programs": {}}
    print(f"kernel launches per run, deviceless H200, jax {jax.__version__}, size {ns.size}")
    print(f"{'program':20s} {'plain':>10s} {'jaxpar before':>14s} {'jaxpar':>10s}  "
          f"{'temp MiB plain -> jaxpar':>24s}  loops")
    for name in names:
        fn = PROGRAMS[name][0]
        args = jax.eval_shape(lambda name=name: program_args(name, ns.size))
        entry = {variant: count(f, args) for variant, f in variants(fn).items()}
        results["programs"][name] = entry
        print(f"{name:20s} {entry['plain']['launches']:>10,d} "
              f"{entry['jaxpar_before']['launches']:>14,d} {entry['jaxpar']['launches']:>10,d}"
              f"  {entry['plain']['temp_bytes'] / 2**20:>10.3f} -> "
              f"{entry['jaxpar']['temp_bytes'] / 2**20:>10.3f}"
              f"  {entry['jaxpar']['loops']} x {entry['jaxpar']['kernels_per_trip']}")
    if ns.json:
        with open(ns.json, "w") as handle:
            json.dump(results, handle, indent=2)
    return results


if __name__ == "__main__":
    main()
