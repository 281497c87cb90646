"""The one per-thread channel between a call of jaxpar's and the traces it starts.

A call and the traces it starts run in one thread, but JAX sits between them (``jax.jit``
traces the function it was given; jaxpar traces a function to plan it), so what a trace
must know about its caller travels here, in one ``threading.local``:

* ``stream_depth``: how many bodies of a user's ``on_stream`` call are being traced;
* ``options_owner``: the call state whose trace a jit compiles with its plan's XLA options
  (no ``XlaOptionsNotAppliedWarning`` is due for it);
* ``traced_consts``: the ids of call states whose last trace closed over another trace's
  tracers (``jax.jit`` must not reuse it);
* ``plan_depth``: how many functions jaxpar is tracing to plan them (a decorated function
  called inside is part of that function's program);
* ``local_axes``: the ``jax.vmap`` axes the function being planned is mapped over on this
  device (a ``psum`` over them communicates nothing);
* ``traced_anew``: set by the traced functions of the flat jits and ``nnx.jit``: the call on
  this thread traced a signature anew, which the call's path then registers with the
  measuring tuner (``_dispatch.fast.measure_new_trace``), once per signature.

Example::

    CHANNEL.plan_depth += 1
"""

from __future__ import annotations

import threading
from typing import Any


class _Channel(threading.local):
    def __init__(self) -> None:
        self.stream_depth = 0
        self.options_owner: Any = None
        self.traced_consts: set[int] = set()
        self.plan_depth = 0
        self.local_axes: frozenset[Any] = frozenset()
        self.traced_anew = False


CHANNEL = _Channel()
