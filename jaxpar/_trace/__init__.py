"""Pipeline stage 1, tracing: a user function and its arguments to a closed jaxpr.

Arguments are pytrees; their leaves split into traced leaves and static values, as
``eqx.filter_jit`` splits them, and the static values key the cache by value. The jaxpr
is traced from abstract values only, so one trace serves every call with the same
signature. Outputs split the same way. This face re-exports what the later stages use.
Its modules, each on one subject (a module imports only the ones listed before it; read
``arguments`` first):

  names        how messages name a function, a value and an argument leaf
  static_keys  static objects keyed by a snapshot of their state; the warning
  arguments    StaticArgs, Layout, Signature: a call's arguments split into leaves
  outputs      OutputStatics: a call's outputs split into arrays and the rest
  messages     what jaxpar says refusing a function, or when tracing one fails
  tracing      trace: a function at a signature to a closed jaxpr

Example::

    layout, leaves = split_arguments(f, (x, 3), {}, StaticArgs.resolve(f, 1, None))
    sig = Signature(layout, tuple(abstract(leaf) for leaf in leaves))
    traced = trace(f, sig)        # traced.jaxpr takes the leaves; 3 is a constant
"""

from __future__ import annotations

from .arguments import (
    Layout,
    Scalars,
    Signature,
    StaticArg,
    StaticArgs,
    abstract,
    has_python_scalars,
    split_arguments,
)
from .messages import (
    TraceError,
    check_function,
    error_text,
    needs_python_values,
    raised_while_tracing,
)
from .names import function_name, short_repr
from .outputs import OutputStatics, packed_outputs, split_outputs
from .static_keys import StateKeyed, StaticArgumentWarning, key_static_object
from .tracing import Traced, trace, tracing_for_a_plan

__all__ = [
    "Layout",
    "OutputStatics",
    "Scalars",
    "Signature",
    "StateKeyed",
    "StaticArg",
    "StaticArgs",
    "StaticArgumentWarning",
    "TraceError",
    "Traced",
    "abstract",
    "check_function",
    "error_text",
    "function_name",
    "has_python_scalars",
    "key_static_object",
    "needs_python_values",
    "packed_outputs",
    "raised_while_tracing",
    "short_repr",
    "split_arguments",
    "split_outputs",
    "trace",
    "tracing_for_a_plan",
]
