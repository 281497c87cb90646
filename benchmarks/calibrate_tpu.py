"""Measure jaxpar's TPU figures on this TPU (``jaxpar.targets.tpu_model.TpuProfile``).

Each figure is a slope or a difference between two loops that differ in one thing, timed
on the chip (medians of ``--repeats`` calls, each ``--trips`` trips long, so a call's own
dispatch is spread thin):

* ``trip_s``: a ``fori_loop`` whose body is one small elementwise update, per trip;
* ``slice_s``: a ``scan`` reading one scanned 100x100 float32 input, less ``trip_s``;
  ``slice_bandwidth`` from the same with 256x256 slices;
* ``write_s``: a ``scan`` writing one output slice a trip, less ``trip_s``;
* ``dot_s``: three dependent 100x100 matmuls a trip against one, per matmul;
* ``batched_dot_extra_s``: one 8-member batched matmul against one matmul, per member;
* ``transcendental_s_per_element``: eight ``sin`` of a 100x100 array against eight
  multiplies, per element;
* ``block_ratios``: a tiny scan (one input, one output) read by blocks of K trips
  (jaxpar's block form), its time per trip over rolled;
* ``copy_bandwidth``, ``peak_flops``: a 256 MiB copy; an 8192^3 bfloat16 matmul;

and, as evidence for ``LARGE_CARRY_BYTES`` (not a profile figure), a loop accumulating a
2 MiB carry rolled against unrolled by 2 and read by blocks of 8.

It writes the figures and every measurement as JSON (with the chip, jax version and
date) and prints the ``TpuProfile(...)`` literal that a TPU target module holds
(``jaxpar/targets/tpu.py``: ``TPU_V5E``).

Run (on a TPU; ``--quick`` runs tiny sizes anywhere, for a dry run)::

    python benchmarks/calibrate_tpu.py [--json calibration.json] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar.passes.unroll_scans import _block_emitter
from jaxpar.targets.tpu import TPU_V5E
from jaxpar.targets.tpu_model import TpuProfile


def per_trip(fn: Callable[..., Any], args: tuple[Any, ...], trips: int, repeats: int) -> float:
    """Seconds per trip of ``jax.jit(fn)(*args)`` (median of ``repeats`` calls)."""
    jitted = jax.jit(fn)
    jax.block_until_ready(jitted(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times) / trips


def blocked(body: Callable[..., Any], init: Any, xs: Any, factor: int) -> Any:
    """``lax.scan(body, init, xs)`` in jaxpar's block form (``unroll_scans``)."""
    closed = jax.make_jaxpr(lambda c, x: lax.scan(body, c, x))(init, xs)
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "scan"]
    (outs,) = _block_emitter(eqn, factor)([[init, xs]])
    return outs


def measure(trips: int, repeats: int, quick: bool) -> dict[str, Any]:
    m: dict[str, Any] = {}
    small = jnp.ones((8, 128))
    n = 100
    x100 = jnp.full((trips, n, n), 0.01)
    m["trip"] = per_trip(lambda c: lax.fori_loop(0, trips, lambda i, c: c * 0.999 + 1.0, c),
                         (small,), trips, repeats)
    m["slice_100"] = per_trip(lambda c, xs: lax.scan(lambda c, x: (c * 0.9 + x, None), c, xs)[0],
                              (jnp.ones((n, n)), x100), trips, repeats)
    big = 256 if not quick else 16
    m["slice_256"] = per_trip(lambda c, xs: lax.scan(lambda c, x: (c * 0.9 + x, None), c, xs)[0],
                              (jnp.ones((big, big)), jnp.full((trips, big, big), 0.01)),
                              trips, repeats)
    m["write"] = per_trip(lambda c: lax.scan(lambda c, _: (c * 0.999 + 1.0, c[0, 0]), c, None,
                                             length=trips), (small,), trips, repeats)
    w = jnp.eye(n) * 0.9
    m["dot1"] = per_trip(lambda c, w: lax.fori_loop(0, trips, lambda i, c: jnp.tanh(c @ w), c),
                         (jnp.ones((n, n)), w), trips, repeats)
    m["dot3"] = per_trip(
        lambda c, w: lax.fori_loop(0, trips, lambda i, c: jnp.tanh(c @ w @ w @ w), c),
        (jnp.ones((n, n)), w), trips, repeats)
    wb = jnp.broadcast_to(w, (8, n, n))
    m["bdot8"] = per_trip(
        lambda c, w: lax.fori_loop(
            0, trips, lambda i, c: jnp.tanh(jnp.einsum("bij,bjk->bik", c, w)), c),
        (jnp.ones((8, n, n)), wb), trips, repeats)

    def sins(c: Any) -> Any:
        for _ in range(8):
            c = jnp.sin(c)
        return c

    def muls(c: Any) -> Any:
        for _ in range(8):
            c = c * 0.999
        return c

    m["sin8"] = per_trip(lambda c: lax.fori_loop(0, trips, lambda i, c: sins(c), c),
                         (jnp.ones((n, n)),), trips, repeats)
    m["mul8"] = per_trip(lambda c: lax.fori_loop(0, trips, lambda i, c: muls(c), c),
                         (jnp.ones((n, n)),), trips, repeats)

    def tiny(c: Any, x: Any) -> Any:
        return jnp.sin(c) * 0.9 + x, c.sum()

    carry, xs = jnp.ones((64,)), jnp.full((trips, 64), 0.01)
    m["tiny_rolled"] = per_trip(lambda c, xs: lax.scan(tiny, c, xs), (carry, xs), trips, repeats)
    m["tiny_blocks"] = {}
    for factor in (2, 8, 16, 25, 40, 80):
        if trips % factor:
            continue
        m["tiny_blocks"][factor] = per_trip(
            lambda c, xs, k=factor: blocked(tiny, c, xs, k), (carry, xs), trips, repeats)
    rows = 1024 if not quick else 32
    acc = jnp.zeros((rows, 512))
    vecs = jnp.full((trips, rows), 0.001)

    def accumulate(a: Any, v: Any) -> Any:
        return a + jnp.outer(v, jnp.ones(512)), None

    m["carry_2mib_rolled"] = per_trip(lambda a, v: lax.scan(accumulate, a, v)[0], (acc, vecs),
                                      trips, repeats)
    m["carry_2mib_unroll2"] = per_trip(
        lambda a, v: lax.scan(accumulate, a, v, unroll=2)[0], (acc, vecs), trips, repeats)
    m["carry_2mib_blocks8"] = per_trip(lambda a, v: blocked(accumulate, a, v, 8)[0],
                                       (acc, vecs), trips, repeats)
    side = 8192 if not quick else 128
    a = jnp.ones((side, side), jnp.bfloat16)
    m["matmul_s"] = per_trip(lambda a: a @ a, (a,), 1, repeats)
    m["matmul_flops"] = 2.0 * side ** 3
    copy = jnp.ones((2 ** 26 if not quick else 2 ** 12,), jnp.float32)
    m["copy_s"] = per_trip(lambda c: c + 1.0, (copy,), 1, repeats)
    m["copy_bytes"] = 2.0 * copy.size * 4
    return m


def profile_of(m: dict[str, Any], chip: str, when: str, jax_version: str | None = None
               ) -> TpuProfile:
    trip = m["trip"]
    slice_s = max(m["slice_100"] - trip, 0.0)
    extra_bytes = (256 * 256 - 100 * 100) * 4
    slice_bandwidth = extra_bytes / max(m["slice_256"] - m["slice_100"], 1e-12)
    rolled = m["tiny_rolled"]
    ratios = tuple(sorted((int(k), round(t / rolled, 3)) for k, t in m["tiny_blocks"].items()))
    return TpuProfile(
        chip=chip, measured=f"measured on {chip} (jax {jax_version or jax.__version__}, {when})",
        trip_s=trip, slice_s=slice_s, slice_bandwidth=slice_bandwidth,
        write_s=max(m["write"] - trip, 0.0), dot_s=max((m["dot3"] - m["dot1"]) / 2, 0.0),
        batched_dot_extra_s=max((m["bdot8"] - m["dot1"]) / 7, 0.0),
        transcendental_s_per_element=max((m["sin8"] - m["mul8"]) / (8 * 100 * 100), 0.0),
        block_ratios=ratios, block_limit=TPU_V5E.block_limit,
        copy_bandwidth=m["copy_bytes"] / m["copy_s"], peak_flops=m["matmul_flops"] / m["matmul_s"],
        hbm_bandwidth=TPU_V5E.hbm_bandwidth, hbm_bytes=TPU_V5E.hbm_bytes)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", help="write the figures and measurements here")
    parser.add_argument("--trips", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a dry run)")
    ns = parser.parse_args(argv)
    trips = 80 if ns.quick else ns.trips
    device = jax.devices()[0]
    chip = "TPU v5e" if device.device_kind == "TPU v5 lite" else device.device_kind
    when = datetime.date.today().isoformat()
    started = time.perf_counter()
    m = measure(trips, ns.repeats, ns.quick)
    profile = profile_of(m, chip, when)
    out = {"device_kind": device.device_kind, "platform": device.platform,
           "jax": jax.__version__, "date": when, "trips": trips,
           "seconds": time.perf_counter() - started, "measurements": m,
           "profile": dataclasses.asdict(profile)}
    print(json.dumps(out, indent=1, default=str))
    print(f"TPU profile ({profile.measured}):\n{profile!r}")
    if ns.json:
        with open(ns.json, "w") as handle:
            json.dump(out, handle, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
