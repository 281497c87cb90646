"""When does XLA:GPU's latency-hiding scheduler overlap stream-annotated calls?

Small programs, each built from hand-placed stream regions (``_xla_stream_annotation``,
``inlineable="false"``, with and without ``_scheduling_group_id``), compiled deviceless
for an H200. For each it prints the order of the call-starts (S) and call-dones (D) in
ENTRY, whether each region is in flight beside other work (``jaxpar._compiled.estimate``), and the
scheduled kernel order. The findings are in docs/design.md, "When XLA overlaps stream
regions".

Run::

    JAX_PLATFORMS=cpu python benchmarks/lhs_overlap.py [--groups shared,none,separate]
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Sequence
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax
import jax.numpy as jnp
from jax import lax

from jaxpar._compat import stream_call
from jaxpar._compiled import compile_for_gpu, parse_schedule
from jaxpar._compiled.estimate import estimate_hlo

GROUPS = {"shared": ("1", "1"), "none": (None, None), "separate": ("1", "2")}
_X = jax.ShapeDtypeStruct((512, 512), jnp.float32)
Groups = tuple[str | None, str | None]


def region(fn: Callable[..., Any], stream: int, group: str | None) -> Callable[..., Any]:
    attributes = {"_xla_stream_annotation": str(stream), "inlineable": "false"}
    if group is not None:
        attributes["_scheduling_group_id"] = group
    return stream_call(fn, attributes)


def chain(x: jax.Array, w: jax.Array) -> jax.Array:
    for _ in range(3):
        x = jnp.tanh(x @ w)
    return x


def packed(x: jax.Array, w: jax.Array) -> jax.Array:
    h = chain(x, w)
    return jnp.concatenate([h.ravel(), h.T.ravel()])


def two_outputs(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    h = chain(x, w)
    return h, h.T


def _halves(p: jax.Array) -> tuple[jax.Array, jax.Array]:
    n = p.shape[0] // 2
    return p[:n], p[n:]


def joined_by_add(g: Groups) -> Any:
    return lambda a, b, c, w: region(chain, 1, g[0])(a, w) + region(chain, 2, g[1])(b, w)


def consumed_apart(g: Groups) -> Any:
    def f(a: Any, b: Any, c: Any, w: Any) -> Any:
        ra, rb = region(chain, 1, g[0])(a, w), region(chain, 2, g[1])(b, w)
        return jnp.sin(ra).sum() + jnp.cos(rb).sum()
    return f


def consumed_apart_barrier(g: Groups) -> Any:
    def f(a: Any, b: Any, c: Any, w: Any) -> Any:
        ra, rb = lax.optimization_barrier((region(chain, 1, g[0])(a, w),
                                           region(chain, 2, g[1])(b, w)))
        return jnp.sin(ra).sum() + jnp.cos(rb).sum()
    return f


def consumers_inside(g: Groups) -> Any:
    return lambda a, b, c, w: (region(lambda a, w: jnp.sin(chain(a, w)).sum(), 1, g[0])(a, w)
                               + region(lambda b, w: jnp.cos(chain(b, w)).sum(), 2, g[1])(b, w))


def tuple_outputs(barrier: bool) -> Callable[[Groups], Any]:
    def make(g: Groups) -> Any:
        def f(a: Any, b: Any, c: Any, w: Any) -> Any:
            outs = (*region(two_outputs, 1, g[0])(a, w), *region(two_outputs, 2, g[1])(b, w))
            if barrier:
                outs = lax.optimization_barrier(outs)
            return (jnp.sin(outs[0]).sum() + outs[1].sum() + jnp.cos(outs[3]).sum()
                    + outs[2].sum())
        return f
    return make


def packed_outputs(barrier: bool) -> Callable[[Groups], Any]:
    def make(g: Groups) -> Any:
        def f(a: Any, b: Any, c: Any, w: Any) -> Any:
            pa, pb = region(packed, 1, g[0])(a, w), region(packed, 2, g[1])(b, w)
            if barrier:
                pa, pb = lax.optimization_barrier((pa, pb))
            (a1, a2), (b1, b2) = _halves(pa), _halves(pb)
            return jnp.sin(a1).sum() + a2.sum() + jnp.cos(b2).sum() + b1.sum()
        return f
    return make


def beside_main_work(barrier: bool) -> Callable[[Groups], Any]:
    def make(g: Groups) -> Any:
        def f(a: Any, b: Any, c: Any, w: Any) -> Any:
            ra, m = region(chain, 1, g[0])(a, w), chain(b, w)
            if barrier:
                ra, m = lax.optimization_barrier((ra, m))
            return jnp.sin(ra).sum() + jnp.cos(m).sum()
        return f
    return make


def two_regions_and_main_work(g: Groups) -> Any:
    def f(a: Any, b: Any, c: Any, w: Any) -> Any:
        ra, rb, m = lax.optimization_barrier((region(chain, 1, g[0])(a, w),
                                              region(chain, 2, g[1])(b, w), chain(c, w)))
        return jnp.sin(ra).sum() + jnp.cos(rb).sum() + m.sum()
    return f


def main_work_joined_by_add(g: Groups) -> Any:
    return lambda a, b, c, w: (region(chain, 1, g[0])(a, w) + region(chain, 2, g[1])(b, w)
                               + chain(a + b, w))


PROGRAMS: dict[str, Callable[[Groups], Any]] = {
    "two regions, outputs added": joined_by_add,
    "two regions, outputs consumed apart": consumed_apart,
    "... joined by optimization_barrier": consumed_apart_barrier,
    "... consumers moved into the regions": consumers_inside,
    "two regions, two outputs each (tuple)": tuple_outputs(barrier=False),
    "... tuple outputs + barrier": tuple_outputs(barrier=True),
    "two regions, packed outputs sliced (jaxpar)": packed_outputs(barrier=False),
    "... packed outputs + barrier": packed_outputs(barrier=True),
    "one region beside main-stream work": beside_main_work(barrier=False),
    "... region and main work + barrier": beside_main_work(barrier=True),
    "two regions + main work, barrier": two_regions_and_main_work,
    "two regions + main work, all added": main_work_joined_by_add,
}


def kernel_order(text: str) -> str:
    body = text.split("\nENTRY", 1)[1].splitlines()[1:]
    names = []
    for line in body:
        if line.startswith("}"):
            break
        match = re.match(r"\s+(?:ROOT )?%(\S+) = .*?\s(fusion|custom-call|call-start|call-done)\(",
                         line)
        if match:
            names.append({"call-start": "S", "call-done": "D"}.get(match.group(2), "k"))
    return "".join(names)


def describe(make: Callable[[Groups], Any], groups: Groups) -> tuple[str, list[bool], str]:
    text = compile_for_gpu(make(groups), _X, _X, _X, _X)
    events = parse_schedule(text).entry_schedule.events
    order = " ".join(f"{'S' if e.phase == 'start' else 'D'}{e.stream_annotation}"
                     for e in events)
    overlaps = [r.overlaps for r in estimate_hlo(text).regions]
    return order, overlaps, kernel_order(text)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", default="shared,none,separate",
                        help=f"group settings to try, of {sorted(GROUPS)}")
    options = parser.parse_args(argv)
    settings = [s for s in options.groups.split(",") if s]
    print(f"jax {jax.__version__}; S/D = call-start/call-done (stream id); k = kernel")
    for name, make in PROGRAMS.items():
        for setting in settings:
            order, overlaps, kernels = describe(make, GROUPS[setting])
            print(f"{name:46} groups={setting:8} {order:14} overlap={overlaps} {kernels}",
                  flush=True)


if __name__ == "__main__":
    main()
