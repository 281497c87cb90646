"""``IdentityMemo``: values remembered by the identity of an object, for one call.

Jaxprs, equations and parameter dicts are immutable, and the passes of one call see the
same objects round after round, so a pass remembers what it found about one by its
identity (two equal jaxprs traced apart are still two entries). ``id(x)`` alone is no key:
once ``x`` is freed a new object may reuse its id. The memo keeps every key object alive
while it lives, as JAX's ``weakref_lru_cache`` (``jax/_src/util.py``) ties its entries to
its first argument, so a hit is always the object asked about. Every identity memo in
jaxpar is one of these (or, for a cache that outlives a call, a ``WeakIdentityMemo``,
which holds its keys weakly); none is written by hand (``tests/test_architecture.py``).

Example::

    from jaxpar._memo import IdentityMemo
    costs: IdentityMemo[Jaxpr, float] = IdentityMemo()
    cost = costs.get(jaxpr)
    if cost is None:
        cost = ...
        costs.set(jaxpr, cost)
    # or, when None is a value worth remembering:
    why = refusals.lookup(jaxpr, lambda: find_refusal(jaxpr), extra=depth)

Sharp edges:
  * The memo holds its keys strongly, for its whole life: keep it scoped to one call
    (an ``Analysis``, a pass's run), never module-global. A cache that outlives a call
    must hold jaxprs weakly (``jax.extend.core.Jaxpr`` and ``ClosedJaxpr`` accept weak
    references; ``JaxprEqn``, slotted without ``__weakref__``, and ``dict`` do not, so
    the memos keyed by equations and parameter dicts could not be weak).
  * ``extra`` adds hashable parts to the key (a rule depth, a region's index): the entry
    is found only for the same object *and* equal extra parts.
  * ``get`` answers ``default`` (None) for a miss; where None is a remembered value, use
    ``lookup`` or ``in``.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Generic, TypeVar, overload

K = TypeVar("K")
V = TypeVar("V")
D = TypeVar("D")


class IdentityMemo(Generic[K, V]):
    """Values by the identity of a key object (and optional hashable extra parts).

    Holds a strong reference to each key object, so an id in it is never reused.
    """

    __slots__ = ("_alive", "_values")

    def __init__(self) -> None:
        self._values: dict[Hashable, V] = {}
        self._alive: dict[int, K] = {}

    @overload
    def get(self, key: K, *, extra: Hashable = None) -> V | None: ...

    @overload
    def get(self, key: K, default: D, *, extra: Hashable = None) -> V | D: ...

    def get(self, key: K, default: object = None, *, extra: Hashable = None) -> object:
        """The value remembered for ``key`` (with ``extra``), or ``default``."""
        return self._values.get(id(key) if extra is None else (id(key), extra), default)

    def set(self, key: K, value: V, *, extra: Hashable = None) -> None:
        """Remember ``value`` for ``key`` (with ``extra``), keeping ``key`` alive."""
        self._alive[id(key)] = key
        self._values[id(key) if extra is None else (id(key), extra)] = value

    def lookup(self, key: K, compute: Callable[[], V], *, extra: Hashable = None) -> V:
        """The value remembered for ``key`` (with ``extra``); on a miss, ``compute()``,
        remembered."""
        slot = id(key) if extra is None else (id(key), extra)
        values = self._values
        if slot in values:
            return values[slot]
        value = compute()
        self._alive[id(key)] = key
        values[slot] = value
        return value

    def get_all(self, keys: Iterable[K]) -> list[V | None]:
        """``[self.get(key) for key in keys]`` in one call: for the passes that look up
        every equation of a level."""
        get = self._values.get
        return [get(id(key)) for key in keys]

    def set_all(self, items: Iterable[tuple[K, V]]) -> None:
        """``self.set(key, value)`` for each ``(key, value)``, in one call."""
        alive, values = self._alive, self._values
        for key, value in items:
            alive[id(key)] = key
            values[id(key)] = value

    def __contains__(self, key: object) -> bool:
        """Whether a value is remembered for ``key`` (without extra parts)."""
        return id(key) in self._values

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"IdentityMemo({len(self._values)} entries)"


class WeakIdentityMemo(Generic[K, V]):
    """Values by the identity of a key object held weakly, for a cache that outlives a
    call (JAX's ``weakref_lru_cache`` holds its functions so): an entry goes when its key
    dies, and a hit is always the object asked about (a dead key's id, reused, misses).

    Keys must accept weak references: ``set`` answers False, remembering nothing, where
    one does not (a callable object whose class has ``__slots__`` without ``__weakref__``).
    """

    __slots__ = ("__weakref__", "_entries")

    def __init__(self) -> None:
        self._entries: dict[int, tuple[weakref.ref[Any], V]] = {}

    def get(self, key: K) -> V | None:
        """The value remembered for ``key``, or None."""
        found = self._entries.get(id(key))
        return found[1] if found is not None and found[0]() is key else None

    def set(self, key: K, value: V) -> bool:
        """Remember ``value`` for ``key`` while ``key`` lives; False where it cannot be
        weakly referenced."""
        try:
            ref = weakref.ref(key, functools.partial(_forget, weakref.ref(self), id(key)))
        except TypeError:
            return False
        self._entries[id(key)] = (ref, value)
        return True

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"WeakIdentityMemo({len(self._entries)} entries)"


def _forget(memo_ref: weakref.ref[WeakIdentityMemo[Any, Any]], key_id: int,
            ref: weakref.ref[Any]) -> None:
    """A key died: its entry goes (unless its id already names a newer key)."""
    memo = memo_ref()
    if memo is None:
        return
    found = memo._entries.get(key_id)
    if found is not None and found[0] is ref:
        del memo._entries[key_id]
