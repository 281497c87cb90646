"""``jaxpar._plan.collectives``: collective grouping: the group finder, its emission,
shard_map re-emission and the bidirectional collective matmul example.

Multi-device checks need 8 fake CPU devices (marked `cpu_devices(8)`): other test modules
may already have started JAX's backend in this process with fewer, and then they run in one
fresh pytest process that has them (tests/conftest.py). Each runs its check as a script, in
a namespace of its own.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from jaxpar import _compat, _ops
from jaxpar._analysis import Analysis
from jaxpar._emit import Emitter
from jaxpar._options import Options
from jaxpar._plan import collectives as C
from jaxpar._plan import order_units, plan_jaxpr
from jaxpar._program.graph import CollectivesUnit, build_graph

ROOT = Path(__file__).resolve().parents[1]
N = 8


def ring(shift: int, size: int = N) -> list[tuple[int, int]]:
    return [(i, (i + shift) % size) for i in range(size)]


def level(fn, *shapes):
    closed = jax.make_jaxpr(fn, axis_env=[("x", N), ("y", 2)])(
        *[jnp.ones(s, jnp.float32) for s in shapes])
    inner, _ = _compat.open_jaxpr(closed)
    return inner


def prim_indices(jaxpr, name):
    return [i for i, e in enumerate(jaxpr.eqns) if e.primitive.name == name]


# --------------------------------------------------------------------- group finder


def bidirectional(x):
    fwd, bwd = x, x
    out = x
    for _ in range(3):
        fwd = lax.ppermute(fwd, "x", ring(+1))
        out = out + jnp.tanh(fwd)
        bwd = lax.ppermute(bwd, "x", ring(-1))
        out = out + jnp.tanh(bwd)
    return out


def one_direction(x):
    for _ in range(3):
        x = lax.ppermute(x, "x", ring(+1)) * 2.0
    return x


def dependent_pair(x):
    a = lax.ppermute(x, "x", ring(+1))
    b = lax.ppermute(a, "x", ring(-1))  # reads a: a chain, never grouped
    return a + b


def with_psum_and_gather(x):
    a = lax.ppermute(x, "x", ring(+1))
    b = lax.ppermute(x, "x", ring(-1))
    s = lax.psum(a, "x")
    g = lax.all_gather(x, "x")
    return a + b + s, g


def independent_psums(x):
    return lax.psum(x, "x"), lax.psum(x * 2, "x")


def two_axes(x):
    return lax.ppermute(x, "x", ring(+1)), lax.ppermute(x, "y", [(0, 1), (1, 0)])


def general_perm(x):
    return (lax.ppermute(x, "x", [(0, 3), (3, 0)]),
            lax.ppermute(x, "x", ring(+2)))


CASES = [
    # (name, fn, expected groups as lists of ppermute positions, kwargs)
    ("bidirectional", bidirectional, [[0, 1], [2, 3], [4, 5]], {}),
    ("one_direction", one_direction, [], {}),
    ("dependent_pair", dependent_pair, [], {}),
    ("with_psum_and_gather", with_psum_and_gather, [[0, 1]], {}),
    ("independent_psums_not_groupable", independent_psums, [], {}),
    ("psum_after_pair", lambda x: lax.psum(bidirectional(x), "x"), [[0, 1], [2, 3], [4, 5]], {}),
    ("two_axes", two_axes, [], {}),
    ("general_perm", general_perm, [[0, 1]], {}),
]


@pytest.mark.parametrize("name,fn,expected,kwargs", CASES, ids=[c[0] for c in CASES])
def test_group_finder(name, fn, expected, kwargs):
    jaxpr = level(fn, (4,))
    perms = prim_indices(jaxpr, "ppermute")
    graph = build_graph(jaxpr)
    plan = C.group_collectives(jaxpr, graph, axis_sizes={"x": N, "y": 2}, **kwargs)
    assert [list(g.eqns) for g in plan.groups] == [[perms[k] for k in grp] for grp in expected]
    for group in plan.groups:  # members never depend on each other
        for i in group.eqns:
            assert not _reaches(graph, i, set(group.eqns) - {i})
    # Deterministic: same jaxpr (re-traced) gives the same plan.
    again = level(fn, (4,))
    assert C.group_collectives(again, axis_sizes={"x": N, "y": 2}) == plan
    order = order_units(graph, [], plan.groups)  # contracting the groups leaves a DAG
    assert sum(isinstance(unit, CollectivesUnit) for unit in order) == len(plan.groups)


def _reaches(graph, start, targets):
    seen, stack = set(), [start]
    while stack:
        for s in graph.succs[stack.pop()]:
            if s in targets:
                return True
            if s not in seen:
                seen.add(s)
                stack.append(s)
    return False


def test_bidirectional_shifts_and_report():
    jaxpr = level(bidirectional, (4,))
    plan = C.group_collectives(jaxpr, axis_sizes={"x": N})
    assert all(g.shifts == (1, -1) and g.bidirectional and g.axis_name == ("x",)
               for g in plan.groups)
    jaxpr = level(with_psum_and_gather, (4,))
    plan = C.group_collectives(jaxpr)
    reported = {c.primitive for c in plan.collectives}
    assert {"ppermute", "all_gather"} <= reported and reported & {"psum", "psum_invariant"}
    assert all(c.group is None for c in plan.collectives if c.primitive != "ppermute")


def test_psums_grouped_when_groupable_and_independent():
    jaxpr = level(independent_psums, (4,))
    names = {e.primitive.name for e in jaxpr.eqns} & {"psum", "psum_invariant"}
    plan = C.group_collectives(jaxpr, groupable=names)
    assert len(plan.groups) == 1 and len(plan.groups[0].eqns) == 2


def test_max_group_size_and_exclude():
    def four(x):
        return [lax.ppermute(x, "x", ring(s)) for s in (1, -1, 2, -2)]
    jaxpr = level(four, (4,))
    perms = prim_indices(jaxpr, "ppermute")
    plan = C.group_collectives(jaxpr, max_group_size=2)
    assert [g.eqns for g in plan.groups] == [tuple(perms[:2]), tuple(perms[2:])]
    plan = C.group_collectives(jaxpr, exclude=perms[1:])
    assert plan.groups == ()
    with pytest.raises(ValueError, match="max_group_size"):
        C.group_collectives(jaxpr, max_group_size=1)


@pytest.mark.parametrize("perm,size,shift", [
    (ring(1), 8, 1), (ring(-1), 8, -1), (ring(7), 8, -1), (ring(3), 8, 3), (ring(4), 8, 4),
    ([(0, 1), (1, 0)], 2, 1), ([(0, 3), (3, 0)], 8, None), ([(0, 1), (1, 3), (3, 0)], None, None),
])
def test_permutation_shift(perm, size, shift):
    assert C.permutation_shift(perm, size) == shift


def test_emission_in_scan_body_lowers_with_group_attributes():
    """The group call is one non-inlined call with the attributes, also inside scan."""
    original = jax.make_jaxpr(bidirectional, axis_env=[("x", N), ("y", 2)])(jnp.ones(4))
    plan = plan_jaxpr(original, Analysis(Options.create(target="gpu").resolve("gpu")))
    assert len(plan.collective_groups) == 3

    def run(x):
        return Emitter(plan, emit_streams=True).run(_compat.open_jaxpr(original)[1], x)[0]

    closed = jax.make_jaxpr(run, axis_env=[("x", N)])(jnp.ones(4))
    # jaxpar's region primitive (whose derivatives are groups again), lowered as the call.
    calls = [e for e in _compat.open_jaxpr(closed)[0].eqns
             if e.primitive.name == _ops.STREAM_REGION]
    assert len(calls) == 3
    assert all(_ops.eqn_frontend_attributes(e) == dict(C.COLLECTIVES_GROUP_ATTRIBUTES)
               for e in calls)


# --------------------------------------------------------------------- 8 devices


def run_8_devices(code: str, name: str) -> str:
    """Runs `code` as a script, in a namespace of its own with `examples/` and `tests/`
    importable, and returns what it printed. Its test is marked `cpu_devices(8)`."""
    assert len(jax.devices("cpu")) >= N, "the test is not marked cpu_devices(8)"
    source = textwrap.dedent(code)
    filename = f"<{name} script>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    printed = io.StringIO()
    paths = [str(ROOT / "examples"), str(ROOT / "tests")]
    sys.path[:0] = paths
    try:
        with contextlib.redirect_stdout(printed):
            exec(compile(source, filename, "exec"), {"__name__": "__main__"})
    finally:
        for path in paths:
            sys.path.remove(path)
    return printed.getvalue()


_GROUPED = """
import jax, jax.numpy as jnp, numpy as np
import jaxpar

def grouped(fn):
    '''The pipeline users get: every shard_map's ppermutes grouped (target="gpu").'''
    return jaxpar.parallel_branches(fn, target="gpu")
"""


@pytest.mark.cpu_devices(N)
def test_collective_matmul_values_and_grads_8_devices():
    out = run_8_devices(_GROUPED + """
import jaxpar, collective_matmul as cm
assert len(jax.devices()) == 8
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
plain = cm.make_collective_matmul(mesh)
decorated = jaxpar.parallel_branches(plain)
x = jax.random.normal(jax.random.key(0), (128, 32))
w = jax.random.normal(jax.random.key(1), (32, 64))
want = x @ w
loss = lambda f: (lambda x, w: (jnp.sin(f(x, w)) ** 2).sum())
want_grads = jax.grad(loss(jnp.matmul), argnums=(0, 1))(x, w)
want_plain = plain(x, w)
for name, f in [("plain", plain), ("decorated", decorated), ("grouped", grouped(plain))]:
    got = jax.jit(f)(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4, err_msg=name)
    np.testing.assert_allclose(got, want_plain, rtol=1e-6, atol=1e-5, err_msg=name)
    grads = jax.jit(jax.grad(loss(f), argnums=(0, 1)))(x, w)
    for g, e in zip(grads, want_grads):
        np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-3, err_msg=name)
cm.main()
print("OK")
""", "collective matmul")
    assert "OK" in out and "parallel_branches: matches x @ w" in out


@pytest.mark.cpu_devices(N)
def test_shard_map_rebind_round_trip_8_devices():
    out = run_8_devices("""
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P
from jaxpar import _compat
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
def find_shard_map(jaxpr):
    for e in _compat.open_jaxpr(jaxpr)[0].eqns:
        if _compat.is_shard_map(e):
            return e
        for _, _, sub in _compat.eqn_subjaxprs(e):
            found = find_shard_map(sub)
            if found is not None:
                return found
    return None
def body(a, b):
    p = lax.ppermute(a, "x", [(i, (i + 1) % 4) for i in range(4)])
    return p * b, lax.psum(a, "x")
for axis_names, specs in [({"x", "y"}, ((P("x", "y"), P("x", "y")), (P("x", "y"), P(None, "y")))),
                          ({"x"}, ((P("x"), P("x")), (P("x"), P())))]:
    kw = {} if axis_names == {"x", "y"} else {"axis_names": axis_names}
    for check in (True, False):
        sm = jax.shard_map(body, mesh=mesh, in_specs=specs[0], out_specs=specs[1],
                           check_vma=check, **kw)
        x = jnp.arange(64.0).reshape(8, 8) / 7
        w = jnp.arange(64.0).reshape(8, 8) / 11
        if axis_names == {"x"}:
            sm = jax.jit(sm)
        eqn = find_shard_map(jax.make_jaxpr(sm)(x, w))
        info = _compat.shard_map_info(eqn)
        assert info.check == check and info.manual_axes == frozenset(axis_names)
        assert info.axis_size("x") == 4 and info.axis_size(("x", "y")) == 8
        run = lambda x, w: _compat.rebind_shard_map(
            eqn, lambda *a: _compat.jaxpr_eval(info.body, *a), [x, w])
        for got, want in zip(jax.jit(run)(x, w), jax.jit(sm)(x, w)):
            np.testing.assert_array_equal(got, want)
        again = find_shard_map(jax.make_jaxpr(run)(x, w))
        assert _compat.shard_map_info(again).in_specs == info.in_specs
        assert _compat.shard_map_info(again).check == check
print("OK")
""", "shard_map rebind")
    assert "OK" in out


def _deviceless_ready() -> str | None:
    if _compat.JAX_VERSION[:2] != (0, 10):
        return f"the deviceless collective check is pinned to jax 0.10.x, not {jax.__version__}"
    try:
        from jaxpar._compiled import plugin_status
    except ImportError:
        return "jaxpar._compiled is not available"
    ok, message = plugin_status()
    return None if ok else message


# The collective matmul on 8 deviceless H200s, bf16 blocks big enough to be worth overlapping.
_H200_COLLECTIVE_MATMUL = """
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxpar._compiled import compile_for_gpu, make_gpu_mesh, parse_schedule
import collective_matmul as cm
mesh = make_gpu_mesh("h200", 8)
f = cm.make_collective_matmul(mesh)
x = jax.ShapeDtypeStruct((8 * 512, 1024), jnp.bfloat16, sharding=NamedSharding(mesh, P("x", None)))
w = jax.ShapeDtypeStruct((1024, 8 * 512), jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "x")))
"""


@pytest.mark.cpu_devices(N)
def test_deviceless_h200_both_directions_in_flight():
    reason = _deviceless_ready()
    if reason:
        pytest.skip(reason)
    out = run_8_devices(_GROUPED + _H200_COLLECTIVE_MATMUL + """
import re
lowered = jax.jit(grouped(f)).trace(x, w).lower().as_text()
assert lowered.count('_collectives_group = ""') == 3, lowered
text = compile_for_gpu(grouped(f), x, w, mesh=mesh,
                       compiler_options={"xla_gpu_dot_merger_threshold_mb": 0})
# Each group: one async-start whose called computation holds both directions.
comps = {}
for block in re.split(r"\\n(?=\\S)", text):
    head = re.match(r"(?:ENTRY )?%?([\\w.\\-]+)", block)
    if head:
        comps[head.group(1)] = block
starts = re.findall(r"async-start\\([^)]*\\), calls=%([\\w.\\-]+)", text)
group_bodies = [comps[c] for c in starts if "collectives_group" in c]
assert len(group_bodies) == 3, starts
for body in group_bodies:
    pairs = re.findall(r"source_target_pairs=\\{([^ ]*)\\}", body)
    assert "{0,1}" in pairs[0] + pairs[1] and "{0,7}" in pairs[0] + pairs[1], pairs
# At least one matmul runs while a permute is in flight.
entry = comps[[k for k in comps if k.startswith("main") or "ENTRY" in comps[k]][-1]]
entry = next(b for b in comps.values() if b.startswith("ENTRY"))
in_flight, overlapped = 0, False
for line in entry.splitlines():
    if re.search(r"= .*(collective-permute-start|async-start)\\(", line):
        in_flight += 1
    elif re.search(r"= .*(collective-permute-done|async-done)\\(", line):
        in_flight -= 1
    elif "gemm" in line and in_flight > 0:
        overlapped = True
assert overlapped
print("OK")
""", "deviceless both directions")
    assert "OK" in out


@pytest.mark.cpu_devices(N)
def test_deviceless_h200_every_group_overlaps_a_compute_region():
    """The GPU pricing drops the compute regions beside the groups (XLA already overlaps
    that compute in jax.jit's program, and merges the per-step matmuls); force_streams
    keeps them, and XLA then starts each one while its group is in flight."""
    reason = _deviceless_ready()
    if reason:
        pytest.skip(reason)
    out = run_8_devices(_GROUPED + _H200_COLLECTIVE_MATMUL + """
plan = jaxpar.inspect(grouped(f))(x, w)
groups = [c for c in plan.collectives if c.grouped]
assert len(groups) == 3 and all(c.directions == "forward, backward" for c in groups), plan
assert not plan.sections and not any(c.overlapped_by for c in groups), plan
assert sum("already overlaps this compute" in n.detail for n in plan.left_alone) == 3, plan
forced = jaxpar.parallel_branches(f, target="gpu", force_streams=True)
plan = jaxpar.inspect(forced)(x, w)
groups = [c for c in plan.collectives if c.grouped]
assert all(c.overlapped_by for c in groups) and all(s.pays is False for s in plan.sections), plan
schedule = parse_schedule(compile_for_gpu(forced, x, w, mesh=mesh))
events = schedule.entry_schedule.events
# Every collectives group has a compute region started while it is in flight.
open_groups, overlapped = {}, 0
for e in events:
    if e.collective == "collectives-group" and e.phase == "start":
        open_groups[e.name] = False
    elif e.kind == "compute" and e.phase == "start":
        open_groups = dict.fromkeys(open_groups, True)
    elif e.collective == "collectives-group" and e.phase == "done":
        overlapped += open_groups.pop(e.start)
assert overlapped == 3, [(e.kind, e.collective, e.phase, e.name) for e in events]
print("OK")
""", "deviceless overlap")
    assert "OK" in out


def test_only_a_ppermute_has_a_direction_in_the_report() -> None:
    """A reduction or gather has no permutation: the report names no direction for it
    (it read "psum over 'x' (general)", the word for a ppermute that is no ring shift)."""
    from jaxpar._report.types import Collective

    def entry(primitives: tuple[str, ...], shifts: tuple[int | None, ...]) -> Collective:
        return Collective("/shard_map#0.jaxpr", primitives, "x", shifts, len(shifts) > 1,
                          (), ())

    assert entry(("psum",), (None,)).directions == ""
    assert entry(("all_gather",), (None,)).directions == ""
    assert entry(("ppermute",), (None,)).directions == "general"
    assert entry(("ppermute", "ppermute"), (1, -1)).directions == "forward, backward"
    assert entry(("ppermute", "psum"), (2, None)).directions == "shift +2"
    assert entry(("psum",), (None,)).to_dict()["directions"] == ""
