"""The ``python -m jaxpar`` command.

Example::

    python -m jaxpar demo
    python -m jaxpar inspect examples.two_scans:two_scans \
        --args "f32[100,100] f32[100,100] f32[50,100,100] f32[50,100,100]"
    python -m jaxpar inspect examples.inception_block:inception \
        --args-from examples.inception_block:make_args --min-cost-us 1 --html plan.html
    python -m jaxpar inspect ./model.py:step --args-from ./model.py:make_args --force-streams
    python -m jaxpar inspect ./model.py:step --args-from ./model.py:make_args --verbose
    python -m jaxpar --version

Every option of ``parallel_branches`` is a flag (``--max-streams 2``, ``--unroll none``,
``--fuse-scans false``), its help line the first sentence of the option's entry in
``parallel_branches``'s docstring; ``--target`` defaults to ``gpu`` here. ``--verbose``
prints every reason in full.

Sharp edges:
  * ``demo`` times on the machine at hand only where jaxpar's program differs from
    ``jax.jit``'s there. On a CPU (target "auto" resolves to "cpu") the rewrites that target
    GPUs are not made, the compiled programs are the same and the demo says so instead of
    printing a ratio that would be noise; the GPU figures it prints come from the
    deviceless compile's estimate and are labelled so.
"""

from __future__ import annotations

import argparse
import importlib
import inspect as _pyinspect
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from . import __version__

if TYPE_CHECKING:
    import jax

# jax is imported where a command needs it: ``python -m jaxpar --help`` and ``--version``
# answer without it (importing jax takes seconds, more with the CUDA plugin).

_DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
           "i8": "int8", "i32": "int32", "i64": "int64", "u8": "uint8", "u32": "uint32",
           "bool": "bool", "pred": "bool"}


def parse_arg_specs(text: str) -> list[jax.ShapeDtypeStruct]:
    """Parses ``"f32[100,100] i32[]"`` into ShapeDtypeStructs."""
    import jax
    specs = []
    for token in text.split():
        match = re.fullmatch(r"([a-z]+\d*)\[([\d,\s]*)\]", token)
        if not match or match.group(1) not in _DTYPES:
            raise ValueError(
                f"bad --args entry {token!r}: write DTYPE[DIMS], e.g. f32[100,100] or i32[] "
                f"(dtypes: {', '.join(sorted(_DTYPES))})")
        dims = tuple(int(d) for d in match.group(2).replace(" ", "").split(",") if d)
        specs.append(jax.ShapeDtypeStruct(dims, _DTYPES[match.group(1)]))
    return specs


def _import_file(file: str, path: str) -> Any:
    """Imports the Python file ``file`` (``mymod.py``, ``./pkg/mymod.py``) as a module."""
    import importlib.util
    from pathlib import Path

    location = Path(file).expanduser()
    if not location.is_file():
        raise ValueError(f"cannot import {file!r} from {path!r}: no such file")
    name = location.stem
    spec = importlib.util.spec_from_file_location(name, location)
    if spec is None or spec.loader is None:
        raise ValueError(f"cannot import {file!r} from {path!r}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)  # pickling and dataclasses look modules up by name
    sys.path.insert(0, str(location.resolve().parent))  # its own sibling imports
    try:
        spec.loader.exec_module(module)
    except Exception as error:
        raise ValueError(f"importing {file!r} from {path!r} raised "
                         f"{type(error).__name__}: {error}") from error
    return module


def load_function(path: str, what: str = "FUNCTION",
                  example: str = "examples.two_scans:two_scans") -> Callable[..., Any]:
    """Imports ``package.module:function`` or ``path/to/file.py:function``.

    Attributes may be dotted (``module:Class.method``).
    """
    module_name, sep, attr = path.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"bad {what.lower()} path {path!r}: write MODULE:{what} or "
                         f"FILE.py:{what}, e.g. {example}")
    obj: Any
    if module_name.endswith(".py") or os.sep in module_name or "/" in module_name:
        obj = _import_file(module_name, path)
    else:
        try:
            obj = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"cannot import module {module_name!r} from {path!r}: {error}. "
                             "Run from the directory that contains it, install it, or give "
                             "its file (path/to/module.py:NAME).") from error
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{path!r} is a {type(obj).__name__}, not a function")
    return obj


def _time_rounds(plain: Callable[[], Any], rewritten: Callable[[], Any],
                 rounds: int) -> list[tuple[float, float]]:
    """(plain, rewritten) seconds per round, interleaved so drift hits both alike.

    Which one runs first alternates, so running second (warmer caches) favours neither.
    """
    import jax
    jax.block_until_ready(plain())
    jax.block_until_ready(rewritten())
    times = []
    for round_index in range(rounds):
        pair = []
        for fn in ((plain, rewritten) if round_index % 2 == 0 else (rewritten, plain)):
            start = time.perf_counter()
            jax.block_until_ready(fn())
            pair.append(time.perf_counter() - start)
        times.append((pair[0], pair[1]) if round_index % 2 == 0 else (pair[1], pair[0]))
    return times


def _compiled_text(fn: Callable[..., Any], args: Sequence[Any]) -> str:
    """The optimised HLO of ``fn`` for this backend, without names and source metadata."""
    text = fn.lower(*args).compile().as_text() or ""  # type: ignore[attr-defined]
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    kept, in_table = [], False
    for line in text.splitlines():  # drop the stack-frame tables (source files, lines)
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            in_table = True
        elif not line.strip():
            in_table = False
        elif not in_table and not line.startswith("HloModule"):
            kept.append(line)
    # Instruction and computation names follow the order and names JAX emitted: number
    # them by first appearance instead.
    names: dict[str, str] = {}
    text = re.sub(r"%[\w.-]+", lambda m: names.setdefault(m.group(0), f"%v{len(names)}"),
                  "\n".join(kept))
    return re.sub(r"\b([A-Za-z_][\w-]*)\.\d+\b", r"\1", text)


def timing_report(plain: Callable[..., Any], rewritten: Callable[..., Any],
                  args: Sequence[Any], rounds: int = 7) -> str:
    """One line on how ``rewritten`` compares with ``plain`` on this machine, noise included.

    Where both compile to the same program here (the rewrites target GPUs, so on a CPU
    they often change nothing), there is nothing to time and the line says so instead of
    printing a ratio that is only noise.
    """
    import jax
    backend = jax.default_backend()
    if _compiled_text(plain, args) == _compiled_text(rewritten, args):
        return (f"on this {backend}: the same compiled program as jax.jit (jaxpar's rewrites "
                "here target GPUs), so there is no speed difference to time")
    times = _time_rounds(lambda: plain(*args), lambda: rewritten(*args), rounds)
    ratios = sorted(new / old for old, new in times)
    low, mid, high = ratios[len(ratios) // 4], statistics.median(ratios), \
        ratios[(3 * len(ratios)) // 4]
    verdict = ("within the noise" if low <= 1.0 <= high
               else "faster" if high < 1.0 else "slower")
    return (f"time on this {backend}: plain {statistics.median(t for t, _ in times) * 1e3:.2f}"
            f" ms, jaxpar x{mid:.3f} (middle half of {rounds} rounds: x{low:.3f}-x{high:.3f}, "
            f"{verdict})")


def _same(expected: Any, got: Any) -> bool:
    import jax
    import numpy as np
    return all(np.allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
               for a, b in zip(jax.tree_util.tree_leaves(expected),
                               jax.tree_util.tree_leaves(got), strict=True))


def _demo_story(title: str, fn: Callable[..., Any], args: Sequence[Any], out: Any,
                gpu_story: Callable[[Any], Any] | None = None) -> bool:
    import jax

    from ._api import inspect, parallel_branches
    print(f"\n== {title} ==", file=out)
    # The plan (inspect's one pair of figures), then, with the CUDA plugin, gpu_preview:
    # the same pair beside the compile's, and which one decided.
    preview, skipped = _demo_preview(fn, args, gpu_story)
    print(preview.plan if preview is not None else inspect(fn, target="gpu")(*args), file=out)
    plain = jax.jit(fn)
    here = jax.jit(parallel_branches(fn))  # target "auto": this machine's backend
    for_gpu = jax.jit(parallel_branches(fn, target="gpu"))
    expected = plain(*args)
    same = _same(expected, here(*args)) and _same(expected, for_gpu(*args))
    print(f"same values as jax.jit: {'yes' if same else 'NO'}", file=out)
    print(timing_report(plain, here, args), file=out)
    if preview is not None or skipped:
        print(preview if preview is not None else skipped, file=out)
    return same


# The demo's multi-device story runs on this machine's devices; a deviceless preview needs
# the program built on a deviceless GPU mesh instead.
MULTI_DEVICE_PREVIEW = (
    "(no GPU preview here: a multi-device program is previewed when built on a deviceless "
    "mesh, jaxpar.gpu_preview(fn, *args, mesh=jaxpar.make_gpu_mesh('h200', 8)), "
    "with its arguments sharded on that mesh)")


def _demo_preview(fn: Callable[..., Any], args: Sequence[Any],
                  gpu_story: Callable[[Any], Any] | None = None) -> tuple[Any, str]:
    """``gpu_preview`` of one story, or None and why it was skipped. A multi-device story
    is previewed where its example rebuilds it on a deviceless mesh (``gpu_story(mesh)``:
    the function and its argument specs)."""
    import jax

    from ._compiled.gpu_compile import plugin_status
    from ._compiled.preview import gpu_preview
    ok, _ = plugin_status()
    if not ok:  # said once, in the demo's second line (``demo_intro``)
        return None, ""
    # Weak types kept: the preview then traces the program inspect(fn)(*args) traces.
    specs = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                       weak_type=bool(getattr(a, "weak_type", False))), args)
    mesh = None
    if any(len(leaf.sharding.device_set) > 1 for leaf in jax.tree_util.tree_leaves(args)
           if hasattr(leaf, "sharding")):
        if gpu_story is None:
            return None, MULTI_DEVICE_PREVIEW
        from ._compiled.gpu_compile import make_gpu_mesh

        mesh = make_gpu_mesh("h200", len(jax.tree_util.tree_leaves(args)[0].sharding.device_set))
        fn, specs = gpu_story(mesh)
    try:
        if mesh is not None:
            return gpu_preview(fn, *specs, gpu="h200", mesh=mesh), ""
        return gpu_preview(fn, *specs, gpu="h200"), ""
    except RuntimeError as error:
        return None, f"(GPU preview skipped: {error})"


def _load_examples() -> list[Any]:
    """The example scripts of a source checkout, which hold the user stories."""
    import importlib.util
    from pathlib import Path

    folder = Path(__file__).resolve().parents[1] / "examples"
    modules = []
    for name in ("two_scans", "inception_block", "collective_matmul"):
        path = folder / f"{name}.py"
        if not path.exists():
            raise FileNotFoundError(
                f"{path} not found: `python -m jaxpar demo` runs the examples of a source "
                "checkout; install with `pip install -e .` from the repository")
        spec = importlib.util.spec_from_file_location(f"jaxpar_demo_{name}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules.append(module)
    return modules


def demo_intro() -> str:
    """What each story of the demo prints, as it will print it on this machine."""
    from . import targets
    from ._compiled.gpu_compile import plugin_status
    here = targets.of_this_machine()
    ok, why = plugin_status()
    # A target whose row turns no pass on (the CPU's) runs jax.jit's program by default.
    timing = ("a timing on this machine where jaxpar's program differs from jax.jit's here"
              + (f" (on a {here.name.upper()} it does not: the rewrites target GPUs, and the "
                 "story says so instead of timing noise)"
                 if here is not None and not here.row.defaults else ""))
    preview = ("the GPU preview: a deviceless H200 compile of both programs, its estimate "
               "beside the plan's and which one decided" if ok
               else f"no GPU preview ({why})")
    return ("Each story prints jaxpar's GPU plan with its planning model's estimate, "
            f"whether jaxpar's program computes jax.jit's values, {timing}, and {preview}.")


def demo(out: Any = sys.stdout) -> int:
    """Runs the user stories end to end and reports."""
    import jax
    try:  # eight fake CPU devices for the collective story, before the backend starts
        platforms = os.environ.get("JAX_PLATFORMS", "")
        if not platforms or "cpu" in platforms:
            jax.config.update("jax_num_cpu_devices", 8)
    except RuntimeError:
        pass
    print(f"jaxpar demo on jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{len(jax.devices())} devices", file=out)
    print(demo_intro(), file=out)
    ok = True
    for module in _load_examples():
        story = module.story()
        if story is None:
            print(f"\n(skipped {module.__name__}: needs 8 devices)", file=out)
            continue
        title, fn, args = story
        ok &= _demo_story(title, fn, args, out, getattr(module, "gpu_story", None))
    print("\nall results equal the plain versions" if ok else "\nMISMATCH", file=out)
    return 0 if ok else 1


def load_args(path: str) -> tuple[Any, ...]:
    """Calls the factory ``MODULE:FACTORY``: its result is the positional arguments.

    A tuple is the arguments; anything else (an array, a dict, a pytree) is the only
    argument. Leaves may be arrays or ``jax.ShapeDtypeStruct``s.
    """
    factory = load_function(path, "FACTORY", "examples.inception_block:make_args")
    try:
        made = factory()
    except Exception as error:
        raise ValueError(f"--args-from {path}: calling {path}() raised "
                         f"{type(error).__name__}: {error}") from error
    return made if isinstance(made, tuple) else (made,)


def option_value(text: str) -> Any:
    """A command-line option value: true/false, none, an int, a float, a comma list, or text."""
    lowered = text.strip().lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    if "," in text:
        return tuple(option_value(part) for part in text.split(",") if part.strip())
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def switch_value(text: str) -> bool:
    """The value of an on/off flag given one (``--force-streams false``)."""
    lowered = text.strip().lower()
    if lowered in ("true", "yes", "1"):
        return True
    if lowered in ("false", "no", "0"):
        return False
    raise argparse.ArgumentTypeError(
        f"expected true or false, got {text!r} (write the flag alone for true, and put it "
        "after the function)")


def _option_flags() -> dict[str, _pyinspect.Parameter]:
    """Every keyword-only option of ``parallel_branches``, by name."""
    from ._api import parallel_branches
    return {name: p for name, p in _pyinspect.signature(parallel_branches).parameters.items()
            if p.kind is _pyinspect.Parameter.KEYWORD_ONLY}


# An entry of the docstring's ``Args:``: one name, or several sharing one text.
_ARG_LINE = re.compile(r"^ {6}(?P<names>\w+(?:, \w+)*):(?: (?P<text>.*))?$")


def option_help() -> dict[str, str]:
    """Each option's help line, from ``parallel_branches``'s docstring (its ``Args:``
    entry, first sentence, without reST marks): one source for the API and the flags."""
    from ._api import parallel_branches

    doc = parallel_branches.__doc__ or ""
    section = doc.split("\n    Args:\n", 1)[-1].split("\n    Returns:", 1)[0]
    entries: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in section.splitlines():
        match = _ARG_LINE.match(line)
        if match:
            current = [match.group("text") or ""]
            for name in match.group("names").split(", "):
                entries[name] = current
        elif current is not None and line.startswith(" " * 8):
            current.append(line.strip())
    return {name: _first_sentence(" ".join(parts).strip().replace("``", ""))
            for name, parts in entries.items()}


def _first_sentence(text: str, limit: int = 200) -> str:
    """Up to the first ``. `` or ``; `` outside brackets; where that is longer than
    ``limit``, up to the first ``: `` outside them."""
    cuts: dict[str, int] = {}
    depth = 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and text[i + 1:i + 2] in (" ", ""):
            if char in ".;" and "end" not in cuts:
                cuts["end"] = i
            elif char == ":" and "colon" not in cuts:
                cuts["colon"] = i
    end = cuts.get("end", len(text))
    if end > limit and cuts.get("colon", end) < end:
        end = cuts["colon"]
    return text[:end]


def output_path_problem(path: str, suffixes: tuple[str, ...]) -> str | None:
    """Why ``path`` cannot receive an output file with one of ``suffixes``, or None."""
    from pathlib import Path

    target = Path(path).expanduser()
    if not target.name.lower().endswith(suffixes):
        return f"the file name must end in {' or '.join(suffixes)}"
    folder = target.parent
    if not folder.is_dir():
        return f"folder {str(folder)!r} does not exist; create it first"
    if not os.access(folder, os.W_OK):
        return f"folder {str(folder)!r} is not writable"
    return None


_EPILOG = """\
examples:
  python -m jaxpar demo
  python -m jaxpar inspect examples.two_scans:two_scans \\
      --args "f32[100,100] f32[100,100] f32[50,100,100] f32[50,100,100]"
  python -m jaxpar inspect ./model.py:step --args-from ./model.py:make_args \\
      --force-streams --html plan.html --trace plan.json

Every option of parallel_branches is a flag (--max-streams 2, --unroll none,
--fuse-scans false); --target defaults to gpu here. --verbose prints every reason
in full."""


def _version() -> str:
    from importlib.metadata import version  # the installed jax's, without importing it

    return f"jaxpar {__version__} (jax {version('jax')})"


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command; output cut short by a closed pipe (``| head``) ends quietly."""
    try:
        code = _main(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader went away: stop writing. Point stdout at devnull so the
        # interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


class _Parser(argparse.ArgumentParser):
    """A parser that takes options only in full (``--unrol 4`` is not ``--unroll 4``, as
    argparse's ``allow_abbrev`` would have it) and refuses a misspelt one with the
    closest known option. Its subcommands' parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        # Before argparse's own checks, which would report a misspelt required option as
        # missing rather than misspelt.
        self._refuse_unknown_options(sys.argv[1:] if args is None else list(args))
        return super().parse_known_args(args, namespace)

    def _refuse_unknown_options(self, args: list[str]) -> None:
        known = self._option_string_actions  # argparse's table: every option string
        # A parser with subcommands reads only the options before the command's name.
        commands = self._subparsers is not None
        for token in args:
            if token == "--" or (commands and not token.startswith("-")):
                return
            name = token.split("=", 1)[0]
            if name.startswith("--") and name not in known:
                from ._spelling import did_you_mean

                self.error(f"unknown option {name}{did_you_mean(name, known)}; options "
                           "are taken in full, not abbreviated")


def _main(argv: Sequence[str] | None) -> int:
    parser = _Parser(
        prog="python -m jaxpar", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="jaxpar: rewrites a JAX program for a GPU or a TPU. By default, for a "
                    "GPU it fuses, batches and unrolls independent loops and batches "
                    "independent members (an ensemble's, a mixture's experts) where its "
                    "cost model says that pays, within a memory budget; stream regions only "
                    "where the GPU pricing says they pay (none until a GPU calibrates it). "
                    "For a TPU it batches independent scans with identical bodies and reads "
                    "small loops by blocks. `inspect` says what it does to a function and "
                    "why.",
        epilog=_EPILOG)
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the user stories: GPU plans, equality checks, "
                   "timings where the programs differ here, GPU previews with the CUDA plugin")
    insp = sub.add_parser("inspect", help="print what jaxpar does to MODULE:FUNCTION, and why",
                          description="Prints the plan of MODULE:FUNCTION at the given "
                                      "arguments: the estimate against jax.jit, the memory, "
                                      "what was done to each loop and member, what was "
                                      "refused and why, what was left alone.")
    insp.add_argument("function", help="MODULE:FUNCTION or FILE.py:FUNCTION, e.g. "
                                       "examples.two_scans:two_scans or ./model.py:step. "
                                       "The module or file is imported: its top-level "
                                       "code runs, as under `python -m`, so keep a "
                                       "script's work under `if __name__ == \"__main__\":`")
    given = insp.add_mutually_exclusive_group(required=True)
    given.add_argument("--args", help='argument shapes, e.g. "f32[100,100] i32[]"')
    given.add_argument("--args-from", metavar="MODULE:FACTORY",
                       help="a function of no arguments returning the arguments: a tuple of "
                            "pytrees of arrays or jax.ShapeDtypeStructs (one non-tuple value "
                            "is the only argument)")
    insp.add_argument("--verbose", action="store_true",
                      help="print every decision's full reasoning, cost figures and source "
                           "lines (plan.text(verbose=True))")
    insp.add_argument("--json", action="store_true", help="print the plan as JSON")
    insp.add_argument("--html", metavar="PATH.html",
                      help="also save the plan picture as a standalone HTML page")
    insp.add_argument("--trace", metavar="PATH.json",
                      help="also save the estimated timeline as a Chrome trace (Perfetto)")
    options = insp.add_argument_group(
        "options of parallel_branches", "values: numbers, true/false, auto, none, or a "
        "comma list; see docs/guide.md")
    given_argv = list(sys.argv[1:] if argv is None else argv)
    # The flags come from parallel_branches's signature and their help from its
    # docstring (importing jax): only for inspect.
    flags = _option_flags() if "inspect" in given_argv else {}
    helps = option_help() if flags else {}
    for name, param in flags.items():
        default = "gpu" if name == "target" else param.default
        switch = isinstance(param.default, bool)  # --force-streams alone means true
        what = helps.get(name, "an option of parallel_branches (docs/api.md)")
        options.add_argument(f"--{name.replace('_', '-')}", dest=f"option_{name}",
                             type=switch_value if switch else option_value, metavar="VALUE",
                             nargs="?" if switch else None,
                             const=True if switch else None,
                             default="gpu" if name == "target" else argparse.SUPPRESS,
                             help=(f"{what} (default: {default!r}"
                                   + ("; alone: true)" if switch else ")")).replace("%", "%%"))
    ns = parser.parse_args(given_argv)
    if ns.command == "demo":
        return demo()
    from ._api import inspect
    from ._trace import error_text, raised_while_tracing

    for flag, path, suffixes in (("--html", ns.html, (".html", ".htm")),
                                 ("--trace", ns.trace, (".json",))):
        if path:  # checked before the (slow) analysis, not after printing the plan
            problem = output_path_problem(path, suffixes)
            if problem:
                parser.error(f"{flag} {path}: {problem}")
    sys.path.insert(0, "")
    chosen = {name[len("option_"):]: value for name, value in vars(ns).items()
              if name.startswith("option_")}
    try:
        fn = load_function(ns.function)
        args = load_args(ns.args_from) if ns.args_from else tuple(parse_arg_specs(ns.args))
        planner = inspect(fn, **chosen)
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    given_text = f"--args-from {ns.args_from}" if ns.args_from else f"--args {ns.args!r}"
    try:
        plan = planner(*args)
    except Exception as error:
        if not (isinstance(error, TypeError) or raised_while_tracing(error)):
            raise
        parser.error(f"{ns.function} does not take {given_text}: "
                     f"{type(error).__name__}: {error_text(error)}")
    if ns.json:
        import json

        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(plan.text(verbose=ns.verbose))
    for path in (ns.html, ns.trace):
        if path:
            try:
                plan.save(path)
            except (ValueError, OSError) as error:
                parser.error(f"cannot save {path}: {error}")
            print(f"saved {path}", file=sys.stderr)
    return 0
