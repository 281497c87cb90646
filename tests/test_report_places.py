"""The short report names places in the user's model (``jaxpar._report.places``).

A Flax NNX row once said ``flax/nnx/nn/linear.py:422`` (the library's line), an
Equinox row ``eqx.nn.Linear`` (not which tower), and the short text showed equation
numbers and unlabelled signed figures. Rows now name the attribute path of the
module whose parameters they read (``m.towers[1].linear1``), figures say what they
are, and what was left alone is named, the heaviest few, unless ``verbose`` lists all.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

import jaxpar
from jaxpar._report.places import attribute_path
from jaxpar._report.render import first_clause, saving_text

WIDTH = 256
# A signed number that no word introduces ("+3.1", "-0.4"); the memory line's
# "budget +1.0 MiB" says what it is.
_BARE_SIGNED = re.compile(r"(?<![\w.])[+-]\d")


def _assert_short_text_for_people(text: str) -> None:
    assert "site-packages" not in text and "flax/" not in text and "equinox/" not in text
    assert not re.search(r"\bequations? #?\d", text), text
    assert " #" not in text, text
    for line in text.splitlines():
        if "memory:" not in line:
            assert not _BARE_SIGNED.search(line), line


def _stream_places(plan: jaxpar.Plan) -> list[tuple[str, ...]]:
    return [region.places for section in plan.sections for region in section.regions]


@pytest.mark.parametrize("name, path", [
    ("m.states[0]['towers'][1]['linear1']['kernel'].value", "m.towers[1].linear1"),
    ("state['towers'][0]['linear2']['bias'].value", "state.towers[0].linear2"),
    ("model.tower_b.dense.weight", "model.tower_b.dense"),
    # A dict's keys as the user writes them (the issue-45 user read "rnn.fw_W + rnn.fw_U"
    # as arithmetic).
    ("params['w1']", "params['w1']"),
    ("rnn['fw_W']", "rnn['fw_W']"),
    ("p['params']['Dense_0']['kernel']", "p['params']['Dense_0']"),
    ("x", None),
    (None, None),
])
def test_argument_names_become_attribute_paths(name, path):
    assert attribute_path(name) == path


def test_short_clauses_name_no_equation_and_figures_say_what_they_are():
    assert first_clause("equations 0 and 9 are matmuls sharing an operand, which XLA "
                        "merges (DotMerger); a cut") == (
        "two equations are matmuls sharing an operand, which XLA merges")
    assert first_clause("the branch encloses equation 12 (a callback)") == (
        "the branch encloses an equation")
    assert saving_text(3.14, done=True) == "saves est. 3.14 us per run"
    assert saving_text(-0.4, done=False) == "would cost est. 0.4 us per run"


def _nnx_ensemble(width: int = WIDTH):
    nnx = pytest.importorskip("flax.nnx")

    class Tower(nnx.Module):
        def __init__(self, rngs):
            self.linear1 = nnx.Linear(width, width, rngs=rngs)
            self.linear2 = nnx.Linear(width, width, rngs=rngs)

        def __call__(self, x):
            return self.linear2(nnx.relu(self.linear1(x)))

    class Ensemble(nnx.Module):
        def __init__(self, rngs):
            self.towers = nnx.List([Tower(rngs), Tower(rngs)])
            self.head = nnx.Linear(2 * width, 4, rngs=rngs)

        def __call__(self, x):
            return self.head(jnp.concatenate([tower(x) for tower in self.towers], -1))

    return nnx, Ensemble(nnx.Rngs(0))


def test_flax_nnx_ensemble_rows_name_the_towers_attribute_paths():
    nnx, model = _nnx_ensemble()
    x = jnp.ones((64, WIDTH))
    plan = jaxpar.inspect(lambda m, x: m(x), target="gpu", force_streams=True,
                          min_cost_us=0.0, batch_matmuls=False)(model, x)
    text = plan.text()
    _assert_short_text_for_people(text)
    streams = _stream_places(plan)
    assert sorted(places[0].split(".")[1] for places in streams) == ["towers[0]",
                                                                   "towers[1]"], text
    assert "m.towers[0].linear" in text and "m.towers[1].linear" in text
    assert "linear.py" in plan.text(verbose=True)  # the library's line, in the long form

    # The explicit form: the state's path names the same attributes.
    graphdef, state = nnx.split(model)
    plan = jaxpar.inspect(lambda state, x: nnx.merge(graphdef, state)(x), target="gpu",
                          force_streams=True, min_cost_us=0.0, batch_matmuls=False)(state, x)
    _assert_short_text_for_people(plan.text())
    assert "state.towers[1].linear" in plan.text(), plan.text()


def test_flax_nnx_rows_fold_what_was_left_alone():
    # Wide enough that batching the towers' matmuls needs more memory than the budget.
    _, model = _nnx_ensemble(512)
    plan = jaxpar.inspect(lambda m, x: m(x), target="gpu")(model, jnp.ones((64, 512)))
    assert len(plan.left_alone) >= 2, plan.text(verbose=True)
    text = plan.text()
    _assert_short_text_for_people(text)
    count = len(plan.left_alone)
    lines = text.splitlines()
    start = lines.index(f"  left alone ({count}), the heaviest first:")
    # The heaviest few are named, by place and reason; the rest counted by reason.
    named = [line for line in lines[start + 1:start + 4] if not line.startswith("    and ")]
    assert len(named) == min(count, 3), text
    heaviest = max(plan.left_alone, key=lambda note: note.cost_us)
    assert named[0].startswith(f"    {heaviest.reason}: ") and "(in " in named[0], text
    if count > 3:
        assert lines[start + 4].startswith(f"    and {count - 3} more ("), text
    verbose = plan.text(verbose=True).splitlines()
    start = verbose.index("  left alone:")
    assert len([line for line in verbose[start + 1:] if line.startswith("    ")]) == count
    # Places travel with the plan's dictionary too.
    assert any(note["places"] for note in plan.to_dict()["left_alone"])
    # The matmul batching figure says what it is.
    assert re.search(r"(would save|would cost|saves|costs) est\. [\d.]+ us per run", text), text


def test_equinox_two_tower_rows_name_the_tower_not_only_the_layer_class():
    eqx = pytest.importorskip("equinox")

    class Tower(eqx.Module):
        linear1: eqx.nn.Linear
        linear2: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.linear1 = eqx.nn.Linear(WIDTH, WIDTH, key=k1)
            self.linear2 = eqx.nn.Linear(WIDTH, WIDTH, key=k2)

        def __call__(self, x):
            return self.linear2(jax.nn.relu(self.linear1(x)))

    class TwoTowers(eqx.Module):
        tower_a: Tower
        tower_b: Tower

        def __init__(self, key):
            ka, kb = jax.random.split(key)
            self.tower_a, self.tower_b = Tower(ka), Tower(kb)

        def __call__(self, x, y):
            return self.tower_a(x) + self.tower_b(y)

    model = TwoTowers(jax.random.key(0))
    x, y = jnp.ones((64, WIDTH)), jnp.full((64, WIDTH), 2.0)
    plan = jaxpar.inspect(lambda model, x, y: jax.vmap(model)(x, y), target="gpu",
                          force_streams=True, min_cost_us=0.0, batch_matmuls=False,
                          batch_branches=False)(model, x, y)
    text = plan.text()
    _assert_short_text_for_people(text)
    assert sorted(places[0].rsplit(".", 1)[0] for places in _stream_places(plan)) == [
        "model.tower_a", "model.tower_b"], text
    assert "model.tower_a.linear1" in text and "model.tower_b.linear1" in text


def test_flax_linen_rows_keep_the_layer_path_and_label_their_figures():
    linen = pytest.importorskip("flax.linen")

    class TwoTowers(linen.Module):
        @linen.compact
        def __call__(self, x):
            left = linen.Dense(WIDTH, name="left")(x)
            right = linen.Dense(WIDTH, name="right")(jnp.sin(x))
            return left * right

    x = jnp.ones((64, WIDTH))
    variables = TwoTowers().init(jax.random.key(0), x)
    plan = jaxpar.inspect(TwoTowers().apply, target="gpu")(variables, x)
    text = plan.text()
    _assert_short_text_for_people(text)
    assert "TwoTowers/left" in text and "TwoTowers/right" in text, text
