"""`jaxpar.inspect`: the Plan report's fields, reasons, rendering and serialisation."""

from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import pytest
from helpers.benchmarks import hetero_batch_benchmark, seed_002_small_args
from helpers.programs import (
    FOUR_BRANCHES_OPTIONS,
    LOOPS_OFF,
    four_branches,
    four_branches_args,
    pure_chain,
    pure_chain_args,
)
from jax import lax

import jaxpar
from jaxpar.passes import SUBGRAPH_KINDS

THIS_FILE = os.path.basename(__file__)


def local_two_scans(a, b):
    xs = jnp.ones((20, 100, 100)) * 0.01

    def step_tanh(carry, x):
        return jnp.tanh(carry @ x), None

    def step_sin(carry, x):
        return jnp.sin(x @ carry), None

    first, _ = lax.scan(step_tanh, a, xs)
    second, _ = lax.scan(step_sin, b, xs)
    return first, second


def scan_args():
    return jnp.ones((100, 100)), jnp.full((100, 100), 0.5)


def small_branches(a, b):
    return jnp.tanh(a @ a) + jnp.sin(b @ b)


def small_args():
    return jnp.ones((8, 8)), jnp.ones((8, 8)) * 0.5


def test_plan_fields():
    plan = jaxpar.inspect(local_two_scans, target="gpu", **LOOPS_OFF)(*scan_args())
    assert isinstance(plan, jaxpar.Plan)
    assert plan.function == "local_two_scans"
    assert plan.target == "gpu"
    assert plan.emitted is True
    assert plan.num_eqns >= 3
    assert plan.total_cost_us > 0
    assert plan.num_streams == 2
    assert plan.num_regions == 2
    (section,) = plan.sections
    assert isinstance(section, jaxpar.Section)
    assert section.location == "/"
    assert section.scheduling_group >= 1
    assert [r.stream for r in section.regions] == [1, 2]
    for region in section.regions:
        assert isinstance(region, jaxpar.Region)
        assert region.num_eqns >= 1
        assert region.num_eqns == len(region.eqn_indices)
        assert region.cost_us > 0
        assert dict(region.primitives).get("scan") == 1
        assert region.source_lines
        assert all(THIS_FILE in line for line in region.source_lines), region.source_lines
        assert any("local_two_scans" in line for line in region.source_lines)
    lines = {r.source_lines[0] for r in section.regions}
    assert len(lines) == 2  # each region points at its own scan
    assert sum(r.cost_us for r in section.regions) <= plan.total_cost_us + 1e-9
    regions_eqns = [set(r.eqn_indices) for r in section.regions]
    assert not regions_eqns[0] & regions_eqns[1]


def test_options_recorded_in_plan():
    plan = jaxpar.inspect(local_two_scans, target="gpu", max_streams=3, min_cost_us=1.5,
                          **LOOPS_OFF)(*scan_args())
    options = dict(plan.options)
    assert options["max_streams"] == 3
    assert options["min_cost_us"] == 1.5
    assert options["target"] == "gpu"


def test_too_cheap_for_small_independent_branches():
    plan = jaxpar.inspect(small_branches, target="gpu")(*small_args())
    assert plan.sections == ()
    reasons = {note.reason for note in plan.left_alone}
    assert "too cheap" in reasons, str(plan)
    note = next(n for n in plan.left_alone if n.reason == "too cheap")
    assert isinstance(note, jaxpar.LeftAlone)
    assert "dot_general" in note.primitives
    assert any(THIS_FILE in line for line in note.source_lines)
    assert "min_cost_us" in note.detail


def test_dependent_for_a_chain():
    plan = jaxpar.inspect(pure_chain, target="gpu")(*pure_chain_args())
    assert plan.sections == ()
    assert "dependent" in {note.reason for note in plan.left_alone}, str(plan)


def test_dependent_for_a_single_heavy_equation():
    plan = jaxpar.inspect(lambda x: jnp.tanh(x @ x), target="gpu", min_cost_us=0.0)(
        jnp.ones((64, 64)))
    assert "dependent" in {note.reason for note in plan.left_alone}, str(plan)


def test_str_is_readable():
    plan = jaxpar.inspect(local_two_scans, target="gpu", **LOOPS_OFF)(*scan_args())
    text = str(plan)
    assert text.startswith("jaxpar plan for `local_two_scans` (target=gpu")
    assert "stream 1: scan in " in text and "stream 2: scan in " in text
    assert "2 concurrent regions" in text
    assert f"{THIS_FILE}:" in text
    assert "object at 0x" not in text
    verbose = plan.text(verbose=True)
    assert "scan x1" in verbose and "section group=1: 2 concurrent regions" in verbose


def test_str_mentions_reasons_and_cpu_note():
    text = str(jaxpar.inspect(small_branches, target="gpu")(*small_args()))
    assert "too cheap" in text
    assert "streams: none" in text
    cpu_text = str(jaxpar.inspect(local_two_scans, target="cpu")(*scan_args()))
    assert "planned for cpu (target='cpu')" in cpu_text
    assert "jaxpar.inspect(f, target='gpu')" in cpu_text


def test_default_target_says_which_backend_it_planned_for():
    # On this CPU-only machine target "auto" plans for the CPU; the report must not
    # pass that off as a GPU plan, and must say how to get the GPU plan.
    plan = jaxpar.inspect(local_two_scans)(*scan_args())
    assert plan.target == jax.default_backend() == "cpu"
    text = str(plan)
    assert "planned for cpu (target='auto' on this machine's backend)" in text
    assert "target='gpu'" in text and "would run concurrently on a GPU" not in text
    assert "planned for" not in str(jaxpar.inspect(local_two_scans, target="gpu")(*scan_args()))


def test_cpu_plan_names_independent_parts_not_streams():
    # Off a GPU nothing is emitted: the report, short and verbose, and the picture's title
    # call a section's regions independent parts, never streams.
    plan = jaxpar.inspect(local_two_scans, target="cpu")(*scan_args())
    assert plan.num_regions == 2
    for text in (str(plan), plan.text(verbose=True)):
        assert "nothing is emitted" in text
        assert not re.search(r"^\s*stream \d+:", text, re.M), text
        assert "2 independent parts (work that could run side by side; no streams on cpu)" \
            in text
        assert re.search(r"^    part 1: ", text, re.M) and re.search(r"^    part 2: ", text, re.M)
    assert "2 independent parts, nothing emitted" in plan.to_svg()
    gpu = jaxpar.inspect(local_two_scans, target="gpu", **LOOPS_OFF)(*scan_args())
    assert re.search(r"^    stream 1: ", str(gpu), re.M) and "part 1:" not in str(gpu)


def test_too_cheap_note_gives_the_threshold_and_how_to_lower_it():
    plan = jaxpar.inspect(small_branches, target="gpu", min_cost_us=7.5)(*small_args())
    note = next(n for n in plan.left_alone if n.reason == "too cheap")
    assert "min_cost_us=7.5 us" in note.detail
    assert "smaller min_cost_us" in note.detail
    assert "min_cost_us=7.5 us" in plan.text(verbose=True)


def same_body_scans(a, b, xs):
    def step(carry, x):
        return jnp.tanh(carry @ x), None

    return lax.scan(step, a, xs)[0], lax.scan(step, b, xs)[0]


def same_body_args():
    return jnp.ones((64, 64)), jnp.ones((64, 64)) * 0.5, jnp.ones((40, 64, 64)) * 0.01


@pytest.mark.parametrize("program, args, kind", [
    (local_two_scans, scan_args(), "fused"),
    (same_body_scans, same_body_args(), "batched"),
])
def test_a_loop_jaxpar_made_is_not_left_alone(program, args, kind):
    plan = jaxpar.inspect(program, target="gpu")(*args)
    assert kind in {d.kind for d in plan.decisions}, str(plan)
    top_notes = [n for n in plan.left_alone if n.location == "/"]
    assert not any("scan" in n.primitives for n in top_notes), str(plan)
    (loop,) = [s for s in plan.steps if s.kind == "loop" and s.location == "/"]
    assert kind in {plan.decisions[k].kind for k in loop.loop_rewrites}
    # A scan jaxpar did not make is still reported when nothing overlaps it.
    def one_scan(a, xs):
        return lax.scan(lambda c, x: (jnp.tanh(c @ x), None), a, xs)[0]

    single = jaxpar.inspect(one_scan, target="gpu")(*same_body_args()[1:])
    assert any(n.reason == "dependent" and "scan" in n.primitives
               for n in single.left_alone), str(single)


def _every_source_line(plan):
    yield from (line for s in plan.sections for r in s.regions for line in r.source_lines)
    yield from (line for n in plan.left_alone for line in n.source_lines)
    yield from (line for s in plan.steps for line in s.source_lines)
    yield from (line for d in plan.decisions for line in d.sources)


def test_source_lines_hide_jaxpar_frames_and_are_relative(monkeypatch, tmp_path):
    # Batching stacks the scans' operands with equations jaxpar makes itself.
    monkeypatch.chdir(os.path.dirname(os.path.abspath(__file__)))
    plan = jaxpar.inspect(same_body_scans, target="gpu")(*same_body_args())
    lines = list(_every_source_line(plan))
    jaxpar_dir = os.path.dirname(os.path.abspath(jaxpar.__file__))
    assert lines and not any(jaxpar_dir in line or "jaxpar/" in line for line in lines), lines
    assert "<added by jaxpar>" in lines  # the stacking, said plainly
    ours = [line for line in lines if THIS_FILE in line]
    assert ours and all(line.startswith(f"{THIS_FILE}:") for line in ours), ours
    monkeypatch.chdir(tmp_path)  # elsewhere: the full path
    plan = jaxpar.inspect(same_body_scans, target="gpu")(*same_body_args())
    assert any(line.startswith(os.path.abspath(__file__)) for line in _every_source_line(plan))


def test_inspect_does_not_print(capsys):
    jaxpar.inspect(local_two_scans, target="gpu", **LOOPS_OFF)(*scan_args())
    captured = capsys.readouterr()
    assert captured.out == ""


@pytest.mark.parametrize(
    ("program", "args", "options"),
    [(local_two_scans, scan_args(), {"target": "gpu"}),
     (four_branches, four_branches_args(), FOUR_BRANCHES_OPTIONS),
     (small_branches, small_args(), {"target": "gpu"}),
     (pure_chain, pure_chain_args(), {}),
     (local_two_scans, scan_args(), {"target": "cpu", "unroll": None, "fuse_scans": False})],
    ids=["two_scans", "four_branches", "too_cheap", "chain", "cpu"])
def test_to_dict_is_json_and_round_trips(program, args, options):
    plan = jaxpar.inspect(program, **options)(*args)
    data = plan.to_dict()
    text = json.dumps(data)
    assert json.loads(text) == data
    assert data["num_streams"] == plan.num_streams
    assert data["function"] == plan.function
    assert len(data["sections"]) == len(plan.sections)
    assert len(data["left_alone"]) == len(plan.left_alone)
    for section, section_data in zip(plan.sections, data["sections"], strict=True):
        assert section_data == json.loads(json.dumps(section.to_dict()))
        assert [r["stream"] for r in section_data["regions"]] == [r.stream for r in
                                                                   section.regions]
    # The same call gives an equal plan.
    assert jaxpar.inspect(program, **options)(*args).to_dict() == data
    assert jaxpar.inspect(program, **options)(*args) == plan


def test_accepts_shape_dtype_struct():
    concrete = jaxpar.inspect(local_two_scans, target="gpu", **LOOPS_OFF)(*scan_args())
    specs = [jax.ShapeDtypeStruct((100, 100), jnp.float32)] * 2
    abstract = jaxpar.inspect(local_two_scans, target="gpu", **LOOPS_OFF)(*specs)
    assert abstract.to_dict() == concrete.to_dict()


def test_accepts_mixed_abstract_and_concrete_pytrees():
    def f(params, x):
        return jnp.tanh(x @ params["w"]) + jnp.sin(x @ params["v"])

    params = {"w": jax.ShapeDtypeStruct((64, 64), jnp.float32), "v": jnp.ones((64, 64))}
    plan = jaxpar.inspect(f, target="gpu", min_cost_us=0.0, force_streams=True)(
        params, x=jnp.ones((8, 64)))
    assert plan.num_streams == 2


def test_inspect_of_decorated_uses_its_options():
    g = jaxpar.parallel_branches(four_branches, max_streams=1, **FOUR_BRANCHES_OPTIONS)
    plan = jaxpar.inspect(g)(*four_branches_args())
    assert plan.target == "gpu"
    assert dict(plan.options)["max_streams"] == 1
    assert dict(plan.options)["min_cost_us"] == 2.0
    assert plan.function == "four_branches"


def test_inspect_of_decorated_options_are_overridable():
    g = jaxpar.parallel_branches(four_branches, max_streams=1, **FOUR_BRANCHES_OPTIONS)
    plan = jaxpar.inspect(g, max_streams=2, target="cpu")(*four_branches_args())
    assert plan.target == "cpu"
    assert plan.emitted is False
    options = dict(plan.options)
    assert options["max_streams"] == 2
    assert options["min_cost_us"] == 2.0  # not overridden: kept from the decorator
    gpu_plan = jaxpar.inspect(g, max_streams=2)(*four_branches_args())
    assert gpu_plan.num_streams == 2


def test_inspect_does_not_plan_into_the_decorated_cache():
    g = jaxpar.parallel_branches(four_branches, **FOUR_BRANCHES_OPTIONS)
    jaxpar.inspect(g)(*four_branches_args())
    assert g.analyses == 0


def test_nested_location_is_reported():
    def in_scan(x, y):
        def body(carry, _):
            a, b = carry
            return (jnp.tanh(jnp.tanh(a @ a) @ a), jnp.tanh(jnp.tanh(b @ b) @ b)), None

        return lax.scan(body, (x, y), None, length=2)[0]

    plan = jaxpar.inspect(in_scan, **FOUR_BRANCHES_OPTIONS)(*four_branches_args()[:2])
    (section,) = plan.sections
    assert "scan" in section.location and section.location != "/"
    assert plan.num_eqns > len(jax.make_jaxpr(in_scan)(*four_branches_args()[:2]).eqns)


def test_inspect_keeps_function_metadata():
    planner = jaxpar.inspect(local_two_scans)
    assert planner.__name__ == "local_two_scans"


def test_batched_matmul_groups_name_their_members_depth_and_price():
    """Two scans with different bodies: each batched group names its ops, the member each
    comes from (source line and step function), its launch depth and the cost model's numbers."""
    bench = hetero_batch_benchmark()
    plan = jaxpar.inspect(bench.seed_002, target="gpu")(*seed_002_small_args())
    groups = [d for d in plan.decisions if d.kind == "batched matmuls"]
    assert sorted(d.depth for d in groups) == [1, 2, 3, 4], str(plan)
    lines = [line for line in plan.text(verbose=True).splitlines()
             if "batched matmuls in scan body [" in line]
    assert len(lines) == len(groups)
    for d, line in zip(groups, lines, strict=True):
        assert len(d.members) == 2
        assert sorted(i for member in d.members for i in member) == sorted(d.eqns)
        assert f"launch depth {d.depth}]" in line
        first, second = (f"#{member[0]}" for member in d.members)
        # Member by member: its op, its equation and its step function, in order.
        assert line.index(f"1) dot_general {first} at ") < line.index("(seed_body)") \
            < line.index(f"2) dot_general {second} at ") < line.index("(seed_other_body)")
        assert d.saving_us is not None and d.saving_us > 0
        assert f"worth {d.saving_us:+.3g} us" in line
    loaded = json.loads(json.dumps(plan.to_dict()))
    loaded_groups = [g for g in loaded["decisions"] if g["kind"] == "batched matmuls"]
    assert [g["depth"] for g in loaded_groups] == [d.depth for d in groups]
    assert [g["members"] for g in loaded_groups] == [
        [list(m) for m in d.members] for d in groups]
    (loop,) = loaded["steps"]
    assert loop["batched_groups"] == [k for k, d in enumerate(plan.decisions)
                                      if d.kind == "batched matmuls"]


def test_plan_loops_and_subgraphs_are_deprecated_views_of_decisions():
    """``Plan.decisions`` holds every decision of the passes; the old ``loops`` and
    ``subgraphs`` (one release more) warn and split it by kind, as ``to_dict`` does."""
    bench = hetero_batch_benchmark()
    plan = jaxpar.inspect(bench.seed_002, target="gpu")(*seed_002_small_args())
    kinds = {str(d.kind) for d in plan.decisions}
    assert {"fused", "batched matmuls"} <= kinds, str(plan)
    with pytest.warns(DeprecationWarning, match=r"Plan\.loops .*Plan\.decisions"):
        loops = plan.loops
    with pytest.warns(DeprecationWarning, match=r"Plan\.subgraphs .*Plan\.decisions"):
        subgraphs = plan.subgraphs
    assert loops == tuple(d for d in plan.decisions if d.kind not in SUBGRAPH_KINDS)
    assert subgraphs == tuple(d for d in plan.decisions if d.kind in SUBGRAPH_KINDS)
    assert loops and subgraphs and len(loops) + len(subgraphs) == len(plan.decisions)
    as_dict = plan.to_dict()
    assert as_dict["loops"] == [d for d in as_dict["decisions"]
                                if d["kind"] not in SUBGRAPH_KINDS]
    assert as_dict["subgraphs"] == [d for d in as_dict["decisions"]
                                    if d["kind"] in SUBGRAPH_KINDS]


def test_a_flax_two_tower_plan_names_its_towers():
    """A Flax Linen user can tell which tower a line means: layer paths from
    JAX's name stack, no site-packages path, no equation numbers or jaxpr paths, relu by
    name, one short line per decision (the reasoning behind verbose=True)."""
    linen = pytest.importorskip("flax.linen")

    class Tower(linen.Module):
        @linen.compact
        def __call__(self, x):
            for i in range(2):
                x = linen.relu(linen.Dense(64, name=f"dense{i}")(x))
            return x

    class TwoTowers(linen.Module):
        @linen.compact
        def __call__(self, a, b):
            return jnp.sum(Tower(name="query")(a)) + jnp.sum(Tower(name="doc")(b))

    model = TwoTowers()
    a = b = jnp.ones((8, 64))
    params = model.init(jax.random.key(0), a, b)
    grad = jax.grad(lambda p, a, b: model.apply(p, a, b))
    plan = jaxpar.inspect(grad, target="gpu", force_streams=True, min_cost_us=0.0)(params, a, b)
    text = str(plan)
    assert "TwoTowers/query/dense0" in text and "TwoTowers/doc/dense0" in text
    assert "(backward)" in text  # the transposed layers are told apart from the forward
    assert "custom_jvp_call" not in text
    assert "site-packages" not in text and "#" not in text and "/scan#" not in text
    assert " at /" not in text
    assert all(len(line) <= 400 for line in text.splitlines()), max(map(len, text.splitlines()))
    verbose = plan.text(verbose=True)
    assert "site-packages" not in verbose and "flax/linen/linear.py:" in verbose
    assert len(verbose) > len(text)


def test_source_paths_of_installed_packages_are_shortened():
    from jaxpar._compat import _display_path, _site_packages

    folders = _site_packages()
    assert folders
    assert _display_path(folders[0] + "somepkg/module.py") == "somepkg/module.py"


@pytest.mark.parametrize("path, shown", [
    ("/", ""),
    ("/scan#19.jaxpr", "in scan body"),
    ("/pjit#2.jaxpr/cond#0.branches[1]", "in jit > cond branch 1"),
    ("/while#3.body_jaxpr", "in while body"),
])
def test_level_paths_are_readable(path, shown):
    from jaxpar._report.render import readable_location

    assert readable_location(path) == shown


def test_summary_says_what_changed():
    fused = jaxpar.inspect(local_two_scans, target="gpu")(*scan_args())
    assert "fused: 1 (2 loops -> 1)" in fused.summary()
    assert "no stream regions" in fused.summary() or "stream regions in" in fused.summary()
    forced = jaxpar.inspect(local_two_scans, target="gpu", **LOOPS_OFF)(*scan_args())
    assert forced.summary() == "2 stream regions in 1 sections"
    untouched = jaxpar.inspect(pure_chain, target="gpu")(*pure_chain_args())
    assert untouched.summary().startswith("nothing: jax.jit's program")


def test_known_wrappers_are_named_in_reports():
    from jaxpar._compat import display_name

    closed = jax.make_jaxpr(lambda x: jax.nn.relu(x) + jax.jit(jnp.sin)(x))(jnp.ones(3))
    names = [display_name(eqn) for eqn in closed.jaxpr.eqns]
    assert "relu" in names and "jit(sin)" in names, names
    assert "custom_jvp_call" not in names


def scans_on_one_line(a, b, c, xs):
    """Three scans written on one source line: the first feeds the other two, which run
    the same body independently (batched); the first is left as it is."""
    def run(carry):
        return lax.scan(lambda h, x: (jnp.tanh(h @ x), None), carry, xs)[0]

    first = run(a)
    return run(first + b), run(first * c)


def test_rewrites_are_drawn_on_the_loops_they_made_not_on_a_shared_line():
    """The report reads where each rewrite's equations went (``PassDecision.produced``);
    matching by source line put the batched scans' mark on the first scan of the line."""
    a, b, xs = same_body_args()
    plan = jaxpar.inspect(scans_on_one_line, target="gpu", unroll=None)(a, b, b * 2.0, xs)
    (batched,) = [k for k, d in enumerate(plan.decisions) if d.kind == "batched"]
    assert plan.decisions[batched].produced
    loops = [s for s in plan.steps if s.kind == "loop" and s.location == "/"]
    assert [s.loop_rewrites for s in loops] == [(), (batched,)], str(plan)
