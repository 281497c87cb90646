"""What the written-out places of the pass table's options lack, each as the line to add
and where: the signatures of ``parallel_branches`` (two overloads and the definition, for
type checkers) and ``inspect`` (``InspectOptions``), and docs/api.md.

A pass added to ``_options.PASS_TABLE`` is an option at runtime with no other file
touched (``_api.with_table_options``); these places are text a person writes, and a test
failing with these messages says what to paste.

Example::

    for message in missing_from_signatures():   # [] when every place has every option
        print(message)
    # jaxpar/_api.py, overload 0 of parallel_branches: add the line
    #     widen_loops: Switch = ...,
    # after its parameter unroll_while (the option of the pass widen_loops)
"""

from __future__ import annotations

import inspect as pyinspect
import re
import typing
from collections.abc import Callable
from typing import Any

from jaxpar import _api
from jaxpar._options import PASS_TABLE, PassRow


def written_keywords(function: Callable[..., Any]) -> dict[str, tuple[str, Any]]:
    """``function``'s keyword-only parameters as its code writes them (not its runtime
    ``__signature__``): name -> (annotation text, default)."""
    code = function.__code__
    names = code.co_varnames[code.co_argcount:code.co_argcount + code.co_kwonlyargcount]
    defaults = function.__kwdefaults__ or {}
    return {name: (str(function.__annotations__.get(name, "")), defaults.get(name))
            for name in names}


def _previous(option: str) -> str:
    """The parameter before ``option`` in ``parallel_branches``' runtime signature (where
    the table's options are in their places)."""
    names = list(pyinspect.signature(_api.parallel_branches).parameters)
    return names[names.index(option) - 1]


def _option_rows() -> list[PassRow]:
    return [row for row in PASS_TABLE if row.option is not None]


def _places() -> list[tuple[str, set[str], str]]:
    """Each written place: its name, the options it has, and how a line of it reads
    (``{option}``, ``{annotation}``)."""
    overloads = typing.get_overloads(_api.parallel_branches)
    return [
        *((f"overload {i} of parallel_branches", set(written_keywords(f)),
           "{option}: {annotation} = ...,") for i, f in enumerate(overloads)),
        ("the definition of parallel_branches", set(written_keywords(_api.parallel_branches)),
         '{option}: {annotation} = "auto",'),
        ("InspectOptions", set(_api.InspectOptions.__annotations__), "{option}: {annotation}"),
    ]


def missing_from_signatures() -> list[str]:
    """For each pass table option a written signature lacks: the line to add to
    jaxpar/_api.py and after which parameter."""
    found = []
    for place, have, line in _places():
        for row in _option_rows():
            if row.option not in have:
                text = line.format(option=row.option, annotation=row.kind.annotation)
                found.append(f"jaxpar/_api.py, {place}: add the line\n    {text}\nafter its "
                             f"parameter {_previous(str(row.option))} (the option of the pass "
                             f"{row.name})")
    return found


def missing_from_docs(api_text: str) -> list[str]:
    """For each pass table option docs/api.md lacks (in ``parallel_branches``' heading,
    or as an entry under it): what to add and where."""
    heading = re.search(r"^### `jaxpar\.parallel_branches\((.*)\)`$", api_text, re.M)
    if heading is None:
        return ["docs/api.md has no heading ### `jaxpar.parallel_branches(...)`"]
    section = re.split(r"^### ", api_text[heading.end():], maxsplit=1, flags=re.M)[0]
    found = []
    for row in _option_rows():
        previous = _previous(str(row.option))
        if f'{row.option}="auto"' not in heading.group(1):
            found.append(f'docs/api.md, the heading ### `jaxpar.parallel_branches(...)`: add '
                         f'`{row.option}="auto", ` after `{previous}=...`')
        if not re.search(rf"^- `{row.option}`:", section, re.M):
            found.append(f"docs/api.md, under the heading of jaxpar.parallel_branches: add "
                         f"the line\n- `{row.option}`: {row.summary} (the pass "
                         f"`{row.name}`).\nafter the entry of `{previous}`")
    return found
