"""``jaxpar.passes._batch_members``: how the batching passes cut members into batches.

``member_chunks`` bounds what a batched form adds to XLA's compile (at most
``MAX_BATCH_MEMBERS`` members a batch, of at most two sizes); the passes' own tests
(test_batch_branches.py, test_batch_scans.py, test_batch_matmuls.py) check the emitted
batches' values.
"""

from __future__ import annotations

import pytest

from jaxpar.passes import _batch_members


@pytest.mark.parametrize("count", [0, 1, 2, 31, 32, 33, 70, 1000])
def test_member_chunks_bound_the_batches_in_order(count: int) -> None:
    """At most MAX_BATCH_MEMBERS members a batch, in their order, of at most two sizes:
    the distinct kernels a batched form adds stay bounded however many members."""
    limit = _batch_members.MAX_BATCH_MEMBERS
    chunks = _batch_members.member_chunks(list(range(count)))
    assert [m for chunk in chunks for m in chunk] == list(range(count))
    assert all(len(chunk) <= limit for chunk in chunks)
    assert len({len(chunk) for chunk in chunks}) <= 2
    assert len(chunks) == max(1, -(-count // limit))
    assert _batch_members.member_chunks(list(range(70)), limit=32) == [
        list(range(24)), list(range(24, 47)), list(range(47, 70))]
