"""Options of ``parallel_branches`` and ``inspect``, derived from two tables and validated
and resolved in one place.

The pass table (``PASS_TABLE``) and the target table (``TARGETS``) are the one declaration
of jaxpar's passes and targets; everything else about them is derived:

* ``PASS_TABLE`` has a row (``PassRow``) per pass, in the order the passes run: its
  name (its module's, ``jaxpar/passes/<name>.py``, whose ``run`` and ``State`` the
  ``passes.PASSES`` row binds), its option and the option's kind (``OptionKind``: a
  switch, or ``unroll``'s values), or else what turns it on (``runs_with`` other
  passes, ``always``, or the target alone), what it works on (``after``), its place
  in the memory budget's ladder (``rung``; ``_plan.budget.LADDER``) and what the walker
  does for it.
* ``TARGETS`` has a row (``TargetRow``) per target, and its columns are the options: the
  backends that mean the target (for ``target="auto"``) and the value each option
  takes there when it is ``"auto"``; a column the row leaves out is off (``False``,
  ``None``). A pass with no option of its own that a target turns on (``share_common``)
  is a column under its own name.

The defaults are target rows, not a column per target in each pass row, so that a
target's defaults read (and change) as one row, and a new pass that no target turns on
by default is its module and its row alone; a target that turns a new pass on names it
in its row, which is where that decision belongs.

Derived from the tables: ``Options`` (a field per option, after ``min_cost_us``),
``Settings.passes`` (the set of passes the options turn on, instead of a boolean each),
the defaults (``pass_defaults``), validation (by the row's ``OptionKind``), the budget's
ladder, the keywords of ``passes.apply_passes``, the one-pass functions' settings, and
at runtime ``parallel_branches``' keyword, ``Args:`` entry (from the row's summary) and
CLI flag for an option its written signature lacks (``_api.with_table_options``), and a
one-pass function ``jaxpar.passes.<name>`` where none is written.

Adding a pass (``tests/test_options_add_a_pass.py`` does these steps in a scratch copy):

1. ``jaxpar/passes/<name>.py`` defining ``run(level: Level, analysis: Analysis) ->
   LevelResult`` (``passes/_protocol.py``; ``passes/inline_twin_calls.py`` is a small
   one) and, for state of its own for a call, ``State``. A row whose module is missing,
   or has no ``run``, is an ``ImportError`` naming the file when jaxpar's passes load.
2. Its ``PassRow`` in ``PASS_TABLE``, where it runs in the order. With ``option=`` it is
   then an option of ``parallel_branches`` and ``inspect`` on every target (off for
   ``"auto"`` until a target row turns it on) and a flag of ``python -m jaxpar inspect``.
3. Optionally, its column in a target's row (``jaxpar/targets/<target>.py``) to turn it
   on by default there.
4. Its tests, ``tests/test_<name>.py``; then run ``tests/test_api_signatures.py`` and
   ``tests/test_docs.py``: they fail with the lines to paste into the signatures written
   out for type checkers (the two ``parallel_branches`` overloads, its definition and
   ``InspectOptions`` in ``_api.py``) and into docs/api.md.

Example::

    options = Options.create(max_streams=2, target="gpu")
    settings = options.resolve()   # Settings for "gpu": nothing "auto" left
    "batch_matmuls" in settings.passes                     # True: the gpu row's default

    # A new pass: jaxpar/passes/widen_loops.py (run) and its row in PASS_TABLE; it is
    # then an option (off by default, as no target row names it) the budget may leave out.
    PassRow("widen_loops", "what it does", option="widen_loops", rung=Rung.BATCHING)
    # Batching matmuls by default on TPUs: the tpu row, and nothing else.
    TargetRow("tpu", ("tpu",), {"batch_matmuls": True})

Sharp edges:
  * ``"auto"`` for the pass and collective switches means "the default for the
    target", decided when the function is traced, not when it is decorated.
    ``Options.resolve`` is the only place that reads it.
  * ``Options`` is made by ``_derived`` from the class written below and the tables:
    its pass fields are not in its class body (type checkers see them as ``Any``).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NamedTuple, TypeVar, dataclass_transform

import jax

from . import targets
from ._flags import (
    async_compute_limit,
    command_buffer_mode,
    command_buffer_mode_set,
    xla_flags_text,
)
from ._model.gpu import (
    CommandBufferMode,
    GpuProfile,
    gpu_profile,
    local_gpu_profile,
)
from ._spelling import check_known, did_you_mean
from .targets import TargetRow as TargetRow

# The targets' names for type checkers: "auto" and the rows of ``TARGETS`` (a test keeps
# them equal).
Target = Literal["auto", "gpu", "cpu", "tpu"]
Switch = bool | Literal["auto"]
Unroll = int | Literal["auto", "cost"] | None
UnrollSetting = int | Literal["cost"] | None
WhileUnroll = int | Literal["auto"] | None
UNROLL_BY_COST: Literal["cost"] = "cost"  # Settings.unroll: a factor per scan from the cost model

# ``command_buffers``: choose per function, keep the process's mode, or one mode.
COMMAND_BUFFER_CHOICES = ("auto", "keep", *(mode.value for mode in CommandBufferMode))


class OptionKind(enum.Enum):
    """The values an option of the pass table takes, and what they resolve to.

    ``SWITCH``: ``True``, ``False`` or ``"auto"``; on or off. ``UNROLL``: ``"auto"``,
    ``"cost"`` (a factor per scan from the cost model), an int >= 1 (a fixed factor) or
    None (leave scans alone); the pass is on unless it resolves to None, and the value
    is kept in the ``Settings`` field of the option's name. ``WHILE_UNROLL``: ``"auto"``,
    None (off) or an int >= 2 (copies of a ``while`` body per trip), kept likewise.
    """

    SWITCH = "Switch"
    UNROLL = "Unroll"
    WHILE_UNROLL = "WhileUnroll"

    @property
    def annotation(self) -> str:
        """The type an option of this kind has in ``Options`` and the signatures."""
        return self.value

    @property
    def values(self) -> str:
        """The values it takes, in words (the generated docs of a pass's option)."""
        return {OptionKind.SWITCH: 'True, False or ``"auto"``',
                OptionKind.UNROLL: '``"auto"``, ``"cost"`` (a factor per scan from the cost '
                                   'model), an int >= 1 or None (off)',
                OptionKind.WHILE_UNROLL: '``"auto"``, an int >= 2 or None (off)'}[self]

    @property
    def off(self) -> Any:
        """The value that turns the pass off (a target row's default for a column it
        leaves out)."""
        return False if self is OptionKind.SWITCH else None

    @property
    def carries_value(self) -> bool:
        """Whether ``Settings`` keeps the resolved value (in a field of the option's name),
        not only whether the pass is on."""
        return self is not OptionKind.SWITCH

    def check(self, name: str, value: Any) -> None:
        """Raises ``ValueError`` naming option ``name`` when ``value`` is not of this kind."""
        if self is OptionKind.SWITCH:
            if not (isinstance(value, bool) or value == "auto"):
                raise ValueError(f"{name} must be True, False or 'auto', got {value!r}")
        elif self is OptionKind.WHILE_UNROLL:
            if not (value is None or value == "auto" or (isinstance(value, int) and not
                                                         isinstance(value, bool) and value >= 2)):
                raise ValueError(f"{name} must be 'auto' (the target's default), None (leave "
                                 f"while loops alone) or an int >= 2 (runs of the body per "
                                 f"trip), got {value!r}")
        elif not (value is None or value in ("auto", UNROLL_BY_COST)
                  or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)):
            raise ValueError(f"{name} must be 'auto' (the target's default), 'cost' (a factor "
                             f"per scan from the cost model), None (leave scans alone) or an "
                             f"int >= 1, got {value!r}")

    def resolve(self, value: Any, default: Any) -> Any:
        """``value`` (checked) with ``"auto"`` read as the target's ``default``."""
        if isinstance(value, str) and value == "auto":
            value = default
        return bool(value) if self is OptionKind.SWITCH else value

    def is_on(self, resolved: Any) -> bool:
        return bool(resolved) if self is OptionKind.SWITCH else resolved is not None


class Rung(enum.Enum):
    """A kind of rewrite the memory budget leaves out, in the order it leaves them out
    (``_plan.budget.LADDER``, after stream sections): a pass row names its rung."""

    UNROLLING = "unrolling"
    BATCHING = "batching"
    LOOP_FUSION = "loop fusion"


@dataclasses.dataclass(frozen=True, slots=True)
class PassRow:
    """One row of the pass table: a pass and how it is turned on.

    Attributes:
      name: the pass's name: its module (``jaxpar/passes/<name>.py``, with ``run`` and,
        for a pass with state of its own for a call, ``State``), its test file, its
        decisions' ``pass_name``.
      summary: one line for the docs and ``inspect``.
      option: the ``parallel_branches`` option that turns it on (the pass's name, or
        ``"unroll"`` for ``unroll_scans``); None: it has none.
      kind: the option's values (``OptionKind``).
      runs_with: with no option: on whenever one of these passes is on.
      always: with no option: on whatever the settings.
        (No option, ``runs_with`` or ``always``: on where the target's row turns it on,
        under its own name, as ``share_common``.)
      rung: where the memory budget leaves it out (``Rung``); None: never.
      after: the passes whose rewrites this one works on: run alone, it changes nothing.
      prices_launches, remembers_search: what the walker does for it (``passes.Pass``).
    """

    name: str
    summary: str
    option: str | None = None
    kind: OptionKind = OptionKind.SWITCH
    runs_with: tuple[str, ...] = ()
    always: bool = False
    rung: Rung | None = None
    after: tuple[str, ...] = ()
    prices_launches: bool = False
    remembers_search: bool = False

    @property
    def by_target(self) -> bool:
        """Whether only the target turns it on (a target column of its own name)."""
        return self.option is None and not self.runs_with and not self.always

    @property
    def switch(self) -> str | None:
        """The name its setting goes by (``apply_passes``' keyword, ``pass_defaults``'
        key, its target column): its option, its own name when only the target turns it
        on, None when other passes do (or it is always on)."""
        return self.option if self.option is not None else self.name if self.by_target \
            else None

    def enabled(self, settings: Settings) -> bool:
        """Whether ``settings`` run the pass."""
        return self.always or self.name in settings.passes \
            or any(name in settings.passes for name in self.runs_with)


# The passes, in the order they run at each level.
PASS_TABLE: tuple[PassRow, ...] = (
    PassRow("share_common", "equal equations computed once", rung=Rung.LOOP_FUSION,
            remembers_search=True),
    PassRow("inline_twin_calls", "independent nested jit calls running one body are inlined "
            "for batching", runs_with=("batch_branches", "batch_matmuls"), remembers_search=True),
    PassRow("make_loops_static", "counting whiles with static bounds become scans", always=True),
    PassRow("batch_scans", "independent identical scans become one vmapped scan",
            option="batch_scans", rung=Rung.BATCHING),
    PassRow("fuse_scans", "independent scans run side by side in one scan", option="fuse_scans",
            rung=Rung.LOOP_FUSION),
    PassRow("batch_branches", "identical independent subgraphs become one vmapped subgraph",
            option="batch_branches", rung=Rung.BATCHING, prices_launches=True,
            remembers_search=True),
    PassRow("batch_matmuls", "same-shaped matmuls at one launch depth in different members "
            "become one op", option="batch_matmuls", rung=Rung.BATCHING, prices_launches=True,
            remembers_search=True),
    PassRow("bound_fusions",
            "a barrier where a chain has read 32 batched members' results (XLA compile time)",
            runs_with=("batch_scans", "batch_branches", "batch_matmuls"),
            after=("batch_scans", "batch_branches", "batch_matmuls")),
    PassRow("associative_scans", "a scan whose carries follow linear recurrences runs as "
            "lax.associative_scan", option="associative_scans", rung=Rung.BATCHING),
    PassRow("hoist_scan_inputs", "a scan body's heavy work that reads no carry runs for all "
            "steps before the loop", option="hoist_scan_inputs", rung=Rung.BATCHING),
    PassRow("unroll_scans", "an unroll factor per static scan", option="unroll",
            kind=OptionKind.UNROLL, rung=Rung.UNROLLING),
    PassRow("unroll_while_loops", "k guarded runs of a while body per trip",
            option="unroll_while", kind=OptionKind.WHILE_UNROLL, rung=Rung.UNROLLING),
)


# The target table: each built-in target's row, from its module (``jaxpar.targets``), read once
# here; a target registered later is read at each call (``Options.target_rows``, ``check_target``).
TARGETS: tuple[TargetRow, ...] = targets.rows()

# The target switches that are not passes (the planner's).
PLAN_SWITCHES = ("group_collectives",)


def check_tables(passes: Sequence[PassRow], targets: Sequence[TargetRow],
                 general: Iterable[str] = ()) -> None:
    """Raises ``ValueError`` for tables that contradict themselves: a name twice, a pass
    named by ``runs_with`` that is not a row or by ``after`` that is not one above, an
    option among
    ``general`` (``Options``' own), a target column no option has or a value its kind
    refuses."""
    general = set(general)
    names = [row.name for row in passes]
    switches = [row.switch for row in passes if row.switch is not None]
    for what, values in (("pass", names), ("option", switches),
                         ("target", [row.name for row in targets]),
                         ("backend", [b for row in targets for b in row.backends])):
        twice = sorted({value for value in values if values.count(value) > 1})
        if twice:
            raise ValueError(f"jaxpar's tables name the {what}(s) {twice} twice")
    for index, row in enumerate(passes):
        unknown = [n for n in row.runs_with if n not in names]
        unknown += [n for n in row.after if n not in names[:index]]
        if unknown:
            raise ValueError(f"pass table row {row.name!r}: {unknown} must be rows (above it, "
                             "for after)")
        if row.option in general:
            raise ValueError(f"pass table row {row.name!r}: option {row.option!r} is one "
                             "of Options' own")
        if row.option is not None and (row.runs_with or row.always):
            raise ValueError(f"pass table row {row.name!r}: a pass with an option is on as "
                             "the option says (no runs_with or always)")
    columns = {row.switch: row.kind for row in passes if row.switch is not None}
    columns.update({name: OptionKind.SWITCH for name in PLAN_SWITCHES})
    for target in targets:
        for column, value in target.defaults.items():
            if column not in columns:
                raise ValueError(f"target table row {target.name!r}: no option "
                                 f"{column!r}{did_you_mean(column, columns)}; the columns "
                                 f"are {', '.join(columns)}")
            columns[column].check(f"target {target.name!r}'s {column}", value)
            if value == "auto":
                raise ValueError(f"target table row {target.name!r}: {column} is the "
                                 "default itself, not 'auto'")


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryBudget:
    """How many more bytes than the plain program jaxpar's program may need at its peak
    (``_plan.budget``): the more of ``fraction`` of the plain program's footprint (its
    arguments, outputs and temporaries) and ``extra_bytes``."""

    fraction: float = 0.10
    extra_bytes: float = float(2**20)

    def allowed(self, plain_bytes: float) -> float:
        return max(self.fraction * plain_bytes, self.extra_bytes)


# The default budget's floor: this share of the device's memory, never under 1 MiB. A
# tenth of a small program's footprint (a few hundred KiB) refused what costs a device
# nothing: a bidirectional RNN of 64 steps, batch 32, width 128 needs 3 MiB more to fuse
# its loops, 0.002% of an H200. 1/4096 is 3.7 MiB of a 16 GB GPU (T4, V100), 4 MiB of a
# TPU v5e's 16 GiB, 33 MiB of an H200's 141 GB: a thousand functions each at the floor,
# all live at once, would hold a quarter of the device.
DEVICE_SHARE = 1 / 4096
LEAST_EXTRA_BYTES = float(2**20)


def memory_floor(device_bytes: float) -> float:
    """The default budget's floor on a device with ``device_bytes`` of memory."""
    return max(LEAST_EXTRA_BYTES, DEVICE_SHARE * device_bytes)


# The default budget of a device without figures (a ``Settings`` built by hand): 10% of
# the plain program's footprint or 1 MiB, whichever is more.
DEFAULT_BUDGET = MemoryBudget()


class ResolveInputs(NamedTuple):
    """What ``Options.resolve`` read: the target, ``XLA_FLAGS``' async compute limit and
    CUDA-graph mode (the user's), the GPU profile (target ``"gpu"``), and the mode planned
    in, compiled in (a mode named by the options) and whether jaxpar chooses one."""

    target: str
    async_limit: int
    user_mode: CommandBufferMode
    profile: GpuProfile | None
    mode: CommandBufferMode
    compile_mode: CommandBufferMode | None
    choose: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ModePolicy:
    """The CUDA-graph mode policy of one analysis: which of XLA's modes (``_model.gpu.
    CommandBufferMode``) the plan is priced in, chosen among, compared with and compiled in.

    Off the GPU it is ``ModePolicy()``: nothing priced, nothing chosen. Hashable, as part
    of ``Settings`` (the rewrite cache's key).

    Attributes:
      priced: the mode stream sections and the batching passes' launches are priced in
        (the user's mode, the one the ``command_buffers`` option names, or the candidate
        being planned); None: priced in none (targets other than ``"gpu"``).
      choose: plan in each mode jaxpar can choose and keep the one the GPU model estimates
        fastest (``_plan.modes``); ``priced`` is then the user's mode, the one to beat.
      user: the mode the user's program runs in without jaxpar (the process's, from
        ``XLA_FLAGS``, or ``Options.resolve``'s argument); None off the GPU.
      compile: the mode the ``command_buffers`` option sets for this function's compile;
        None keeps the process's.
    """

    priced: CommandBufferMode | None = None
    choose: bool = False
    user: CommandBufferMode | None = None
    compile: CommandBufferMode | None = None


class PassNames(frozenset[str]):
    """``Settings.passes``, ``.explicit``: frozensets whose ``repr`` is sorted, the same in
    every process (string hashes are salted; processes and stored decisions compare it)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"frozenset({{{', '.join(map(repr, sorted(self)))}}})" if self else "frozenset()"


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """What one analysis runs with: ``Options`` resolved for a target and XLA's flags.

    Hashable (it keys the rewrite cache); nothing in it is ``"auto"``.

    Attributes:
      target: ``"gpu"``, ``"cpu"`` or ``"tpu"``.
      max_streams: the user's cap on streams per section.
      streams_per_section: ``min(max_streams, XLA's async compute limit)``.
      min_seconds: ``min_cost_us`` in seconds.
      passes: the passes the options (or the target) turn on, by name (any set given
        is made a ``PassNames``, a ``frozenset``); a pass row that ``runs_with`` others
        or runs ``always`` runs without being named (``PassRow.enabled``).
      unroll: ``unroll_scans``'s factor: a fixed one, ``"cost"`` (a factor per scan from
        the cost model) or None (the pass is off).
      unroll_while: ``unroll_while_loops``' runs of a ``while`` body per trip (None: off).
      group_collectives: launch independent collectives together.
      force_streams: keep stream sections the GPU pricing rejects (priced all the same,
        so the report shows the verdict).
      gpu: the GPU's figures (``_model.gpu``) on target ``"gpu"``; None elsewhere.
      modes: the CUDA-graph mode policy (``ModePolicy``): the mode sections and launches
        are priced in, whether jaxpar chooses one, the user's, the one compiled in.
      memory: how many more bytes than the plain program jaxpar's program may need
        (``_plan.budget``: a share of the plain program's footprint); None: any.
      explicit: the passes the user turned on by name (``batch_scans=True``, an
        ``unroll`` factor): kept whatever the memory budget says, with their cost shown.
    """

    target: str
    max_streams: int = 4
    streams_per_section: int = 2
    min_seconds: float = 5e-6
    passes: frozenset[str] = PassNames()
    unroll: UnrollSetting = None
    unroll_while: int | None = None
    group_collectives: bool = False
    force_streams: bool = False
    gpu: GpuProfile | None = None
    modes: ModePolicy = ModePolicy()
    memory: MemoryBudget | None = DEFAULT_BUDGET
    explicit: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        for name in ("passes", "explicit"):
            if type(getattr(self, name)) is not PassNames:
                object.__setattr__(self, name, PassNames(getattr(self, name)))

    def priced_in(self, mode: CommandBufferMode | None) -> Settings:
        """These settings with sections and launches priced in ``mode`` (a candidate
        mode, or None: priced in none)."""
        return dataclasses.replace(self, modes=dataclasses.replace(self.modes, priced=mode))

    def without(self, names: Iterable[str]) -> Settings:
        """These settings with the passes ``names`` off (a value an option of theirs
        carries too); the same object when none of them is on."""
        dropped = self.passes & frozenset(names)
        if not dropped:
            return self
        values = {row.option: row.kind.off for row in PASS_TABLE
                  if row.name in dropped and row.option is not None and row.kind.carries_value}
        return dataclasses.replace(self, passes=self.passes - dropped, **values)

    def pass_switches(self) -> dict[str, Any]:
        """The keyword arguments of ``passes.apply_passes`` (its public names): each pass
        row's ``switch``, True or False (or the value its option carries)."""
        return {row.switch: (getattr(self, row.switch) if row.kind.carries_value
                             else row.name in self.passes)
                for row in PASS_TABLE if row.switch is not None}

    @classmethod
    def of_switches(cls, target: str, api: str = "apply_passes", **switches: Any) -> Settings:
        """The settings ``pass_switches`` returns ``switches`` for on ``target`` (an unset
        switch is off, ``"auto"`` the target's default); nothing read from the machine.

        Raises:
          TypeError: an unknown switch (with the closest valid one).
          ValueError: an unknown ``target``, a bad value for a switch with values.
        """
        row_of_target = target_row(target)
        check_known(switches, (row.switch for row in PASS_TABLE if row.switch is not None),
                    api)
        passes: set[str] = set()
        values: dict[str, Any] = {}
        for row in PASS_TABLE:
            if row.switch is None or row.switch not in switches:
                continue
            value = switches[row.switch]
            if row.kind.carries_value:
                row.kind.check(row.switch, value)
            value = row.kind.resolve(value, row_of_target.default(row.switch, row.kind))
            if row.kind.carries_value:
                values[row.switch] = value
            if row.kind.is_on(value):
                passes.add(row.name)
        return cls(target=row_of_target.name, passes=frozenset(passes), **values)


_T = TypeVar("_T")


@dataclass_transform(frozen_default=True)
def _derived(declared: type[_T]) -> type[_T]:
    """``declared`` as a frozen dataclass with the options of the tables added."""
    return _derive(declared, PASS_TABLE, None)


def _derive(declared: type[_T], passes: Sequence[PassRow],
            rows: Sequence[TargetRow] | None) -> type[_T]:
    """A frozen dataclass of ``declared``'s fields and methods with a field per option of
    ``passes`` (after ``min_cost_us``, default ``"auto"``), reading ``passes`` and
    ``rows`` (its ``pass_table`` and ``targets``; None: the registry's, read at each
    call)."""
    own = dict(declared.__annotations__)
    general = [name for name, kind in own.items() if not kind.startswith("ClassVar")]
    check_tables(passes, targets.rows() if rows is None else rows, general)
    namespace = {key: value for key, value in vars(declared).items()
                 if key not in ("__dict__", "__weakref__", "__annotations__")}
    annotations: dict[str, Any] = {}
    for name, annotation in own.items():
        annotations[name] = annotation
        if name == "min_cost_us":
            for row in passes:
                if row.option is not None:
                    annotations[row.option] = row.kind.annotation
                    namespace[row.option] = "auto"
    namespace.update(__annotations__=annotations, pass_table=tuple(passes),
                     targets=None if rows is None else tuple(rows), declared=declared)
    made = type(declared.__name__, declared.__bases__, namespace)
    return dataclasses.dataclass(frozen=True, slots=True)(made)


@_derived
class Options:
    """Validated options; hashable, so they can key the rewrite cache.

    Besides the fields below, a field per option of the pass table (``pass_table``),
    after ``min_cost_us``, each ``"auto"`` by default: the passes' switches and
    ``unroll`` (``names()`` lists every field).
    """

    max_streams: int = 4
    target: Target = "auto"
    min_cost_us: float = 5.0
    group_collectives: Switch = "auto"
    force_streams: bool = False
    command_buffers: str = "auto"
    memory: str | float = "auto"

    # The tables the pass options come from (``_derive``), and the class they were
    # added to (``for_tables`` adds other tables' to it). ``targets`` is None for the
    # shipped class: the registered targets', read at each call (``target_rows``).
    pass_table: ClassVar[tuple[PassRow, ...]]
    targets: ClassVar[tuple[TargetRow, ...] | None]
    declared: ClassVar[type]

    if TYPE_CHECKING:  # the pass options: fields ``_derive`` adds
        def __getattr__(self, name: str) -> Any: ...

    @classmethod
    def for_tables(cls, passes: Sequence[PassRow], targets: Sequence[TargetRow]
                   ) -> type[Options]:
        """``Options`` derived from other tables (a test's, with a row added)."""
        return _derive(cls.declared, passes, targets)

    @classmethod
    def target_rows(cls) -> tuple[TargetRow, ...]:
        """Its target table: the registered targets' rows now (``jaxpar.targets``), or
        the table it was made for (``for_tables``)."""
        return targets.rows() if cls.targets is None else cls.targets

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def create(cls, **kwargs: Any) -> Options:
        check_known(kwargs, cls.names())
        if isinstance(kwargs.get("command_buffers"), CommandBufferMode):
            kwargs["command_buffers"] = kwargs["command_buffers"].value
        options = cls(**kwargs)
        options.validate()
        return options

    def validate(self) -> None:
        if isinstance(self.max_streams, bool) or not isinstance(self.max_streams, int):
            raise TypeError(f"max_streams must be an int >= 1, got {self.max_streams!r}")
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}; use 1 to keep "
                             "everything on one stream")
        check_target(self.target, targets=self.target_rows())
        if (isinstance(self.min_cost_us, bool) or not isinstance(self.min_cost_us, (int, float))
                or not math.isfinite(self.min_cost_us) or self.min_cost_us < 0):
            raise ValueError(f"min_cost_us must be a finite number >= 0 (microseconds), "
                             f"got {self.min_cost_us!r}")
        for row in self.pass_table:
            if row.option is not None:
                row.kind.check(row.option, getattr(self, row.option))
        for name in PLAN_SWITCHES:
            OptionKind.SWITCH.check(name, getattr(self, name))
        if not isinstance(self.force_streams, bool):
            raise TypeError(f"force_streams must be True or False, got {self.force_streams!r}")
        memory_budget(self.memory)
        if not isinstance(self.command_buffers, str) \
                or self.command_buffers not in COMMAND_BUFFER_CHOICES:
            raise ValueError(
                f"command_buffers must be one of {', '.join(map(repr, COMMAND_BUFFER_CHOICES))}, "
                f"got {self.command_buffers!r}: 'auto' lets jaxpar choose XLA's CUDA-graph mode "
                "for this function (unless XLA_FLAGS sets one), 'keep' keeps the process's "
                "mode, a mode name compiles this function in that mode")

    def resolve_target(self, target: str | None = None) -> str:
        """``target`` (default ``self.target``) checked, ``"auto"`` read as this machine's
        target: the registered target that covers its device most specifically
        (``targets.of_this_machine``), or for a table of its own (``for_tables``) the row
        of ``jax.default_backend()``; ``"cpu"`` where none does."""
        rows = self.target_rows()
        target = check_target(self.target if target is None else target, targets=rows)
        if target != "auto":
            return target
        if self.targets is None:
            found = targets.of_this_machine()
            return "cpu" if found is None else found.name
        backend = jax.default_backend()
        return next((row.name for row in rows if backend in row.backends), "cpu")

    def resolve(self, target: str | None = None, async_limit: int | None = None,
                command_buffers: CommandBufferMode | str | None = None,
                gpu: GpuProfile | str | None = None) -> Settings:
        """The settings of one analysis: every ``"auto"`` read here, and only here.

        Args:
          target: the target to plan for; default ``self.target`` (``"auto"`` is this
            machine's default backend).
          async_limit: XLA's cap on async calls in flight; default from ``XLA_FLAGS``
            (``_flags.async_compute_limit()``).
          command_buffers: the user's CUDA-graph mode (a ``CommandBufferMode`` or its name),
            kept like a mode ``XLA_FLAGS`` sets; default from ``XLA_FLAGS``
            (``_flags.command_buffer_mode()``). The ``command_buffers`` option decides
            whether jaxpar plans in it, chooses another, or compiles in a given one.
          gpu: the GPU to plan for on target ``"gpu"`` (a ``GpuProfile`` or a name
            ``_model.gpu.gpu_profile`` takes); default this machine's GPU, or the generic
            ``"gpu"`` profile without one (``_model.gpu.local_gpu_profile()``).
        """
        return self.settings_from(self.resolve_inputs(target, async_limit, command_buffers,
                                                      gpu))

    def resolve_inputs(self, target: str | None = None, async_limit: int | None = None,
                       command_buffers: CommandBufferMode | str | None = None,
                       gpu: GpuProfile | str | None = None) -> ResolveInputs:
        """What ``resolve`` reads from its arguments and the process (the target,
        ``XLA_FLAGS``, the GPU profile), checked: ``settings_from`` of it is ``resolve``'s
        answer. A decorated function reads it on every call and builds its settings once
        per distinct value (``ParallelBranches``)."""
        target = self.resolve_target(target)
        flags = xla_flags_text()
        limit = async_compute_limit(flags) if async_limit is None else async_limit
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ValueError(f"async_limit must be an int >= 1, got {limit!r}")
        user_mode = (command_buffer_mode(flags) if command_buffers is None
                     else CommandBufferMode.parse(command_buffers))
        profile = None
        mode, compile_mode, choose = user_mode, None, False
        if targets.graph_modes(target):
            profile = local_gpu_profile() if gpu is None else gpu_profile(gpu)
            if self.command_buffers not in ("auto", "keep"):
                mode = compile_mode = CommandBufferMode.parse(self.command_buffers)
            else:
                # A mode the user set (XLA_FLAGS, or the caller's argument) is kept.
                explicit = command_buffers is not None or command_buffer_mode_set(flags)
                choose = (self.command_buffers == "auto" and not explicit
                          and not self.force_streams)
        return ResolveInputs(target, limit, user_mode, profile, mode, compile_mode, choose)

    def settings_from(self, inputs: ResolveInputs) -> Settings:
        """The ``Settings`` of these options for ``inputs`` (``resolve_inputs``)."""
        target, limit, user_mode, profile, mode, compile_mode, choose = inputs
        defaults = target_row(target, self.target_rows())
        passes: set[str] = set()
        # The passes the user turned on by name (an option given, not "auto" or "cost"):
        # the memory budget never leaves them out (``_plan.budget``).
        explicit: set[str] = set()
        values: dict[str, Any] = {}
        for row in self.pass_table:
            if row.option is not None:
                given = getattr(self, row.option)
                value = row.kind.resolve(given, defaults.default(row.option, row.kind))
                if row.kind.carries_value:
                    values[row.option] = value
                on = row.kind.is_on(value)
                if on and given not in ("auto", "cost"):
                    explicit.add(row.name)
            else:
                on = row.by_target and bool(defaults.default(row.name))
            if on:
                passes.add(row.name)
        return Settings(
            target=target, max_streams=self.max_streams,
            streams_per_section=min(self.max_streams, limit),
            min_seconds=self.min_cost_us * 1e-6, passes=frozenset(passes),
            group_collectives=OptionKind.SWITCH.resolve(
                self.group_collectives, defaults.default("group_collectives")),
            force_streams=self.force_streams,
            # Sections are priced against the compiled GPU program (force_streams keeps
            # those the pricing rejects, with its verdict); other targets emit no streams,
            # so their plans only show independence.
            gpu=profile,
            modes=ModePolicy(priced=mode, choose=choose, user=user_mode,
                             compile=compile_mode)
            if targets.graph_modes(target) else ModePolicy(),
            memory=memory_budget(self.memory, defaults.memory_bytes if profile is None
                                 else profile.memory_bytes),
            explicit=frozenset(explicit), **values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


def memory_budget(memory: Any, device_bytes: float = 0.0) -> MemoryBudget | None:
    """The ``Settings.memory`` of a ``memory`` argument: ``"auto"`` (the default budget:
    10% of the plain program's footprint or the floor of a device with ``device_bytes``
    of memory more, whichever is more: ``memory_floor``, at least 1 MiB), ``"any"`` (no
    budget) or a number of bytes jaxpar's program may need beyond the plain program's.

    Raises:
      ValueError: none of those.
    """
    if memory == "auto":
        return MemoryBudget(extra_bytes=memory_floor(device_bytes))
    if memory == "any":
        return None
    if isinstance(memory, (int, float)) and not isinstance(memory, bool) \
            and math.isfinite(memory) and memory >= 0:
        return MemoryBudget(fraction=0.0, extra_bytes=float(memory))
    raise ValueError(f"memory must be 'auto' (at most 10% more memory than the plain "
                     f"program, or 1/4096 of the device's memory and at least 1 MiB, whichever "
                     f"is more), 'any' (no budget) or a number of bytes >= 0 jaxpar may add, "
                     f"got {memory!r}")


def check_target(target: Any, concrete: bool = False,
                 targets: Sequence[TargetRow] | None = None) -> str:
    """``target`` if it is one jaxpar knows (``concrete``: not ``"auto"``): a row of
    ``targets``, default the targets registered now (``jaxpar.targets``).

    Raises:
      ValueError: naming the valid targets (and the closest to ``target``).
    """
    rows = registered_rows() if targets is None else targets
    valid = tuple(row.name for row in rows)
    valid = valid if concrete else ("auto", *valid)
    if not isinstance(target, str) or target not in valid:
        close = did_you_mean(target, valid) if isinstance(target, str) else ""
        raise ValueError(f"target must be one of {', '.join(map(repr, valid))}, "
                         f"got {target!r}{close}")
    return target


def target_row(target: str, targets: Sequence[TargetRow] | None = None) -> TargetRow:
    """The row of ``target`` (not ``"auto"``) in ``targets`` (default the registered ones).

    Raises:
      ValueError: an unknown target, naming the valid ones.
    """
    rows = registered_rows() if targets is None else targets
    check_target(target, concrete=True, targets=rows)
    return next(row for row in rows if row.name == target)


def registered_rows() -> tuple[TargetRow, ...]:
    """The target table now: each registered target's row (``jaxpar.targets.rows``)."""
    return targets.rows()


def pass_defaults(target: str) -> dict[str, Any]:
    """The pass settings jaxpar uses by default on ``target``.

    Args:
        target: ``"gpu"``, ``"cpu"`` or ``"tpu"``.

    Returns:
        ``{"fuse_scans": bool, "batch_scans": bool, "batch_branches": bool, "batch_matmuls": bool,
        "unroll": "cost" | int | None, "unroll_while": int | None, "share_common": bool}``
        (a key per pass row's ``switch``), ready to pass to
        ``apply_passes(closed, **pass_defaults(target), target=target)``.

    Raises:
        ValueError: unknown ``target``.
    """
    check_target(target, concrete=True)
    return Options().resolve(target, async_limit=2,
                             command_buffers=CommandBufferMode.LHS).pass_switches()


DISABLE_VARIABLE = "JAXPAR_DISABLE"


def disabled_by_environment() -> bool:
    """Whether ``JAXPAR_DISABLE`` is set (``1``, ``true``, ``yes`` or ``on``): decorated
    functions then run as plain ``jax.jit`` of the original function."""
    return os.environ.get(DISABLE_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")
