"""Where in the user's model an equation is, in the user's own words.

The short report names a place per row: the attribute path of the module whose
parameters the equation reads (``model.towers[1].linear1``: the path of the argument
leaf, as JAX names traced arguments, without the parameter's own name; a dict's keys as
written, ``rnn['fw_W']``; several, comma-separated), else the
layer path of JAX's name stack (``TwoTowers/query/dense0``, a Flax Linen module or a
``jax.named_scope``), else the line of the user's code that made it (``model.py:12``),
never a line inside Flax, Equinox or another installed package.

Example::

    places = Places(level_plan)         # one per report
    places.of(eqn)                      # "model.towers[1].linear1"
    places.ranked(eqns, (4, 7), seconds)  # the heaviest equations' places first

Sharp edges:
  * A parameter is followed through layout operations only (transpose, reshape,
    broadcast, convert, slice, concatenate): an equation that reads what a layer
    computed is placed by its scope or source line, not by the layer.
  * Into a nested jaxpr (a scan body, a cond branch, a ``jit``) a parameter is followed
    when the body's inputs are the equation's last operands, as for every such
    primitive but ``while``'s condition (which is never followed).
  * A plain argument (``x``, ``w1``) is not an attribute: only leaves with a path
    (``params['w1']``, ``model.dense.kernel``) name a place.
"""

from __future__ import annotations

import re
from collections.abc import Hashable, Sequence

from .. import _compat
from .._compat import JaxprEqn, JaxprLike, Var
from .._plan import LevelPlan
from .._program.primitives import PARAMETER_VIEWS
from ..passes import JAXPAR_SCOPES

# Name-stack scopes a library adds by itself: a layer's class, not the user's attribute.
_LIBRARY_SCOPE = re.compile(r"^eqx\.")
_MAX_PLACES = 16
# A Flax NNX argument as ``nnx.jit`` splits it: ``m.states[0]['dense']['kernel'].value``.
_NNX_STATES = re.compile(r"^(?P<head>[A-Za-z_]\w*)\.states\[\d+\]")
_VALUE = re.compile(r"\.(?:value|raw_value)$")
_NAME_ITEM = re.compile(r"\['(?P<name>[A-Za-z_]\w*)'\]")
_PART = re.compile(r"\.[A-Za-z_]\w*|\[[^\]]*\]")
_SEGMENT = re.compile(r"^(?P<prim>[^#]+)#(?P<eqn>\d+)\.(?P<param>\w+)(?:\[(?P<item>\d+)\])?$")


def attribute_path(name: str | None) -> str | None:
    """The module or container an argument leaf belongs to, as the user writes it:
    ``m.states[0]['towers'][1]['linear1']['kernel'].value`` -> ``m.towers[1].linear1``
    (an NNX state: attributes), ``model.tower_b.dense.weight`` -> ``model.tower_b.dense``,
    ``params['w1']`` -> ``params['w1']`` and ``p['rnn']['fw_W']`` -> ``p['rnn']`` (a dict:
    its keys as written); None for a plain argument (``x``) or an unnamed one."""
    if not name:
        return None
    nnx = bool(_VALUE.search(name))  # a Flax NNX variable: its state's keys are attributes
    text = _VALUE.sub("", _NNX_STATES.sub(r"\g<head>", name))
    if nnx:
        text = _NAME_ITEM.sub(r".\g<name>", text)
    head = re.match(r"[A-Za-z_]\w*", text)
    if head is None:
        return None
    parts = _PART.findall(text[head.end():])
    if "".join(parts) != text[head.end():] or not parts:
        return None
    kept = parts[:-1] if len(parts) >= 2 else parts  # the parameter's own name goes
    return head.group(0) + "".join(kept)


class Places:
    """The places of one report's equations (``of``), from the attribute paths of the
    parameters each reads; a place is made once per equation source."""

    __slots__ = ("_found", "_owner", "_top")

    def __init__(self, plan: LevelPlan):
        self._owner: dict[Var, tuple[str, ...]] = {}
        self._found: dict[Hashable, str] = {}
        self._top = plan.jaxpr
        inner, _ = _compat.open_jaxpr(plan.jaxpr)
        for var, name in zip(inner.invars, _compat.argument_names(plan.jaxpr), strict=False):
            path = attribute_path(name)
            if path is not None:
                self._owner[var] = (path,)
        if self._owner:
            self._follow(inner.eqns)

    def _follow(self, eqns: Sequence[JaxprEqn]) -> None:
        """Marks the results of layout operations on parameters, into nested jaxprs."""
        owner = self._owner
        for eqn in eqns:
            read = self._read(eqn)
            if not read:
                continue
            if eqn.primitive.name in PARAMETER_VIEWS:
                for out in eqn.outvars:
                    owner[out] = read
            for param, _, sub in _compat.eqn_subjaxprs(eqn):
                inner, _ = _compat.open_jaxpr(sub)
                skip = len(eqn.invars) - len(inner.invars)
                if param == "cond_jaxpr" or skip < 0:
                    continue
                marked = False
                for var, operand in zip(inner.invars, eqn.invars[skip:], strict=True):
                    if not _compat.is_literal(operand) and operand in owner:
                        owner[var] = owner[operand]
                        marked = True
                if marked:
                    self._follow(inner.eqns)

    def _read(self, eqn: JaxprEqn) -> tuple[str, ...]:
        return tuple(dict.fromkeys(path for v in eqn.invars if not _compat.is_literal(v)
                                   for path in self._owner.get(v, ())))

    def of(self, eqn: JaxprEqn) -> str:
        """The place of ``eqn``: a scope the user named, the modules whose parameters it
        reads, the user's source line; ``(backward)`` marks a transposed equation."""
        # jaxpar's own scopes (a scan read by blocks, a while running copies of its
        # body) are no place in the user's program.
        scope = "/".join(part for part in _compat.name_scope(eqn).split("/")
                         if part.removesuffix(" (backward)") not in JAXPAR_SCOPES)
        if scope and not all(_LIBRARY_SCOPE.match(part)
                             for part in scope.removesuffix(" (backward)").split("/")):
            return scope
        read = self._read(eqn)
        back = " (backward)" if _compat.backward(eqn) else ""
        if read:  # the parameters it reads, each as the user names it
            return ", ".join(path + back for path in read)
        try:
            key: Hashable = _compat.source_key(eqn)
        except Exception:  # no source information, or one that cannot be a key
            key = None
        found = self._found.get(key) if key is not None else None
        if found is None:
            user = _compat.user_source(eqn)
            found = re.sub(r" \(.*\)$", "", user) + back if user else scope or "<unknown>"
            if key is not None:
                self._found[key] = found
        return found

    def ranked(self, eqns: Sequence[JaxprEqn], indices: Sequence[int],
               seconds: Sequence[float] | None = None) -> tuple[str, ...]:
        """The distinct places of ``eqns[indices]``, the heaviest equations' first."""
        order = (sorted(indices, key=lambda i: (-seconds[i], i)) if seconds is not None
                 else list(indices))
        found: dict[str, None] = {}
        for i in order:
            for place in self.of(eqns[i]).split(", "):
                found.setdefault(place, None)
            if len(found) >= _MAX_PLACES:
                break
        return tuple(found)

    def level_eqns(self, path: str) -> Sequence[JaxprEqn] | None:
        """The equations of level ``path`` (``"/"``, ``"/scan#3.jaxpr"``) of the planned
        program; None where the path leads nowhere."""
        jaxpr: JaxprLike = self._top
        for segment in path.strip("/").split("/"):
            if not segment:
                continue
            match = _SEGMENT.match(segment)
            eqns = _compat.open_jaxpr(jaxpr)[0].eqns
            if match is None or int(match.group("eqn")) >= len(eqns):
                return None
            value = eqns[int(match.group("eqn"))].params.get(match.group("param"))
            if match.group("item") is not None:
                item = int(match.group("item"))
                value = value[item] if isinstance(value, (tuple, list)) and item < len(
                    value) else None
            if value is None or not _compat.is_jaxpr_like(value):
                return None
            jaxpr = value
        return _compat.open_jaxpr(jaxpr)[0].eqns
