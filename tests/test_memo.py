"""``jaxpar._memo.IdentityMemo``: values by identity, keys kept alive while the memo lives;
``WeakIdentityMemo``: the same with keys held weakly."""

from __future__ import annotations

import gc
import weakref

import jax
import jax.numpy as jnp

from jaxpar._memo import IdentityMemo, WeakIdentityMemo


class _Key:
    """Equal by value, weak-referenceable: what an id-keyed memo must not confuse."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)


def test_equal_but_distinct_objects_are_distinct_keys() -> None:
    memo: IdentityMemo[object, str] = IdentityMemo()
    a, b = [1, 2], [1, 2]
    memo.set(a, "a")
    assert memo.get(a) == "a"
    assert memo.get(b) is None and b not in memo
    memo.set(b, "b")
    assert (memo.get(a), memo.get(b), len(memo)) == ("a", "b", 2)


def test_two_jaxprs_traced_apart_are_two_entries() -> None:
    one = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)
    two = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)
    assert str(one) == str(two) and one is not two
    memo: IdentityMemo[object, int] = IdentityMemo()
    memo.set(one, 1)
    assert memo.get(one) == 1 and memo.get(two) is None


def test_keys_stay_alive_while_the_memo_lives() -> None:
    memo: IdentityMemo[_Key, int] = IdentityMemo()
    key = _Key(7)
    ref = weakref.ref(key)
    memo.set(key, 1, extra=("depth", 0))
    del key
    gc.collect()
    kept = ref()
    assert kept is not None  # so no new object can take its id while the entry exists
    assert memo.get(kept, extra=("depth", 0)) == 1
    del memo, kept
    gc.collect()
    assert ref() is None  # and freed with the memo: nothing global holds it


def test_a_freed_objects_id_is_never_answered_for_a_new_object() -> None:
    """Without the strong reference, a new object at a reused address would hit."""
    memo: IdentityMemo[_Key, int] = IdentityMemo()
    for n in range(200):
        key = _Key(n)
        assert memo.get(key) is None
        memo.set(key, n)
        del key
    assert len(memo) == 200


def test_extra_parts_split_one_object_into_entries() -> None:
    memo: IdentityMemo[object, str] = IdentityMemo()
    key = object()
    memo.set(key, "depth 0", extra=0)
    memo.set(key, "depth 1", extra=1)
    assert memo.get(key, extra=0) == "depth 0"
    assert memo.get(key, extra=1) == "depth 1"
    assert memo.get(key, extra=2) is None
    assert memo.get(key) is None and key not in memo  # no extra: another entry


def test_lookup_computes_once_and_remembers_none() -> None:
    memo: IdentityMemo[object, str | None] = IdentityMemo()
    key = object()
    calls: list[int] = []

    def compute() -> str | None:
        calls.append(1)
        return None

    assert memo.lookup(key, compute) is None
    assert memo.lookup(key, compute) is None
    assert calls == [1] and key in memo
    assert memo.get(key, "missing") is None  # a remembered None, not the default
    assert memo.get(object(), "missing") == "missing"


def test_get_all_and_set_all_agree_with_get_and_set() -> None:
    memo: IdentityMemo[_Key, int] = IdentityMemo()
    keys = [_Key(1), _Key(1), _Key(2)]  # the first two equal, yet distinct keys
    memo.set_all([(keys[0], 10), (keys[2], 30)])
    assert memo.get_all(keys) == [memo.get(k) for k in keys] == [10, None, 30]
    ref = weakref.ref(keys[2])
    del keys[2]
    gc.collect()
    assert ref() is not None  # set_all keeps its keys alive as set does
    assert memo.get_all([]) == [] and len(memo) == 2


def test_weak_identity_memo_forgets_a_dead_key_and_never_answers_for_another():
    class Unreferenceable:
        __slots__ = ()

    memo: WeakIdentityMemo[object, str] = WeakIdentityMemo()
    key, equal = _Key(1), _Key(1)
    assert memo.set(key, "found") and memo.get(key) == "found"
    assert memo.get(equal) is None  # equal, but another object
    assert not memo.set(Unreferenceable(), "never") and len(memo) == 1
    del key
    gc.collect()
    assert len(memo) == 0  # the entry went with its key
