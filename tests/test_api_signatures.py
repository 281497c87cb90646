"""The public signatures of ``parallel_branches`` (its two overloads and its definition)
and ``inspect`` (``InspectOptions``) against ``Options``: the same names, types and
defaults, so that an option added to the tables, or a call option added to
``CALL_OPTIONS``, fails here until every signature takes it (a pass table option with the
line to paste and where: ``helpers.table_options``). At runtime the table's options are
``parallel_branches``' keywords whatever is written (``_api.with_table_options``)."""

from __future__ import annotations

import dataclasses
import inspect as pyinspect
import types
import typing
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import pytest
from helpers.table_options import missing_from_signatures, written_keywords

from jaxpar import _api, _cli
from jaxpar._api import CALL_OPTIONS, JIT_OPTIONS, InspectOptions, parallel_branches
from jaxpar._options import PASS_TABLE, TARGETS, Options, PassRow, Switch, Target

FIELDS = {field.name: field for field in dataclasses.fields(Options)}  # type: ignore[arg-type]


def _text(annotation: Any) -> str:
    """An annotation as written (a string under ``from __future__ import annotations``, a
    ``ForwardRef`` in a ``TypedDict``)."""
    return str(getattr(annotation, "__forward_arg__", annotation))


def drift(parameters: dict[str, tuple[str, Any]], call_types: dict[str, str], *,
          tune: bool, defaults: bool) -> list[str]:
    """What ``parameters`` (keyword -> (annotation, default)) lack, add or write otherwise
    than ``Options`` (its fields' types and defaults), ``CALL_OPTIONS`` (as
    ``call_types`` types them), and with ``tune`` (``parallel_branches``) ``tune``, ``measure`` and
    ``jax.jit``'s options (``JIT_OPTIONS``)."""
    expected = {*FIELDS, *CALL_OPTIONS, *(("tune", "measure", *JIT_OPTIONS) if tune else ())}
    # A pass table option a signature lacks: missing_from_signatures says what to paste.
    table = {row.option for row in PASS_TABLE}
    found = [f"lacks {name}" for name in sorted(expected - set(parameters) - table)]
    found += [f"takes {name}, which Options lacks" for name in sorted(set(parameters) - expected)]
    for name, (annotation, default) in sorted(parameters.items()):
        want = FIELDS[name].type if name in FIELDS else call_types.get(name)
        if name in expected and want is not None and annotation != want:
            found.append(f"{name}: {annotation} where Options has {want}")
        if defaults and name in FIELDS and default != FIELDS[name].default:
            found.append(f"{name}={default!r} where Options has {FIELDS[name].default!r}")
    return found


def _keywords(function: Callable[..., Any]) -> dict[str, tuple[str, Any]]:
    return {p.name: (_text(p.annotation), p.default)
            for p in pyinspect.signature(function).parameters.values()
            if p.kind is pyinspect.Parameter.KEYWORD_ONLY}


CALL_TYPES = {name: annotation for name, (annotation, _) in
              _keywords(parallel_branches).items() if name in (*CALL_OPTIONS, *JIT_OPTIONS)}
SIGNATURES = {"definition": parallel_branches,
              **{f"overload {i}": f for i, f in enumerate(typing.get_overloads(parallel_branches))}}


@pytest.mark.parametrize("which", sorted(SIGNATURES))
def test_every_signature_of_parallel_branches_takes_the_options(which: str) -> None:
    # As written (the definition's runtime ``__signature__`` adds what it lacks).
    keywords = written_keywords(SIGNATURES[which])
    assert drift(keywords, CALL_TYPES, tune=True, defaults=which == "definition") == []


def test_the_written_signatures_take_every_pass_table_option() -> None:
    missing = missing_from_signatures()
    assert not missing, "a pass table option is not in a written signature:\n\n" + \
        "\n\n".join(missing)


def test_at_runtime_the_signature_and_docstring_are_the_table_s() -> None:
    # The shipped table: the written signature is the runtime one, every option has its
    # own Args entry (the CLI's help reads them).
    assert _keywords(parallel_branches) == written_keywords(parallel_branches)
    helps = _cli.option_help()
    assert all(row.option in helps for row in PASS_TABLE if row.option is not None)
    # A row added: a keyword and an entry made from it, after the last pass option.
    widen = PassRow("widen_loops", "independent loops widened", option="widen_loops")
    fresh = types.FunctionType(parallel_branches.__code__, parallel_branches.__globals__)
    fresh.__kwdefaults__ = parallel_branches.__kwdefaults__
    fresh.__annotations__ = parallel_branches.__annotations__
    fresh.__doc__ = parallel_branches.__doc__
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_api, "PASS_TABLE", (*PASS_TABLE, widen))
        made = _api.with_table_options(fresh)
    names = list(pyinspect.signature(made).parameters)
    assert names[names.index("associative_scans") + 1:][:2] == ["widen_loops",
                                                                 "group_collectives"]
    parameter = pyinspect.signature(made).parameters["widen_loops"]
    assert (parameter.default, parameter.annotation) == ("auto", "Switch")
    entry = ('      widen_loops: independent loops widened (the pass ``widen_loops``): True, '
             'False or\n        ``"auto"``; ``"auto"``: off on every target.\n'
             '      group_collectives:')
    assert entry in str(made.__doc__)


def test_parallel_branches_has_its_two_overloads() -> None:
    overloads = typing.get_overloads(parallel_branches)
    assert [_text(pyinspect.signature(f).return_annotation) for f in overloads] == [
        "F", "Callable[[F], F]"]


def test_inspect_takes_the_options_and_the_call_options() -> None:
    (options,) = [p for p in pyinspect.signature(_api.inspect).parameters.values()
                  if p.kind is pyinspect.Parameter.VAR_KEYWORD]
    assert _text(options.annotation) == "Unpack[InspectOptions]"
    assert InspectOptions.__total__ is False  # each overrides the decorated function's
    keywords = {name: (_text(t), None) for name, t in InspectOptions.__annotations__.items()}
    assert drift(keywords, CALL_TYPES, tune=False, defaults=False) == []


def test_the_target_type_names_the_target_table() -> None:
    assert typing.get_args(Target) == ("auto", *(row.name for row in TARGETS))


def test_a_signature_that_drifts_fails() -> None:
    # The decorator overload as it was before the table: no ``memory``.
    def old(fun: None = None, *, max_streams: int = ..., target: Target = ...,  # type: ignore[assignment]
            min_cost_us: float = ..., fuse_scans: Switch = ..., batch_scans: Switch = ...,  # type: ignore[assignment]
            batch_branches: Switch = ..., batch_matmuls: Switch = ..., unroll: Any = ...,  # type: ignore[assignment]
            group_collectives: Switch = ..., force_streams: bool = ..., tune: bool = ...,  # type: ignore[assignment]
            command_buffers: str = ..., static_argnums: Any = ..., static_argnames: Any = ...,  # type: ignore[assignment]
            ) -> None: ...

    found = drift(_keywords(old), CALL_TYPES, tune=True, defaults=False)
    assert "lacks memory" in found
    assert "unroll: Any where Options has Unroll" in found
    # A call option added to the tuple and not to the signatures (the next: donation).
    with_donation = {**_keywords(parallel_branches), "frobnicate": ("int", 0)}
    assert drift(with_donation, CALL_TYPES, tune=True, defaults=True) == [
        "takes frobnicate, which Options lacks"]
    # A default that differs from Options'.
    wrong = {**_keywords(parallel_branches), "max_streams": ("int", 8)}
    assert drift(wrong, CALL_TYPES, tune=True, defaults=True) == [
        "max_streams=8 where Options has 4"]


def test_inspect_and_the_decorator_accept_each_option_by_name() -> None:
    # Behaviour, not only the text: each option reaches Options through both doors.
    values = {"max_streams": 2, "target": "cpu", "min_cost_us": 1.0, "fuse_scans": False,
              "batch_scans": True, "batch_branches": False, "batch_matmuls": True,
              "unroll": 3, "unroll_while": 4, "hoist_scan_inputs": True,
              "associative_scans": True,
              "group_collectives": False, "force_streams": True,
              "command_buffers": "keep", "memory": "any"}
    assert set(values) == set(FIELDS)
    decorated = parallel_branches(lambda x: x, **values)  # type: ignore[arg-type]
    assert decorated.options == Options.create(**values)
    plan = _api.inspect(lambda x: x + 1, **values)(jnp.ones(3))  # type: ignore[arg-type]
    assert dict(plan.options) == Options.create(**values).to_dict()
