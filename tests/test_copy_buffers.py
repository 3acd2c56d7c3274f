"""``CopyBuffers``: the parameters' copies' memory, reused only while nobody else holds it."""

from __future__ import annotations

import pytest
import torch

from torchinstruments_core._copy_buffers import COPY_BUFFER_BYTES, CopyBuffers
from torchinstruments_core._torch_private import storage_holders

pytestmark = pytest.mark.skipif(
    storage_holders(torch.empty(0)) is None, reason="this torch build cannot count holders"
)


def test_a_copy_is_equal_and_apart_from_its_source() -> None:
    """A copy holds the source's values, and writing either leaves the other alone."""
    buffers = CopyBuffers()
    source = torch.arange(12.0).reshape(3, 4)
    copy = buffers.copy(source)
    assert torch.equal(copy, source)
    assert copy.shape == source.shape
    assert copy.dtype == source.dtype
    assert copy.is_contiguous()
    copy.neg_()
    assert torch.equal(source, torch.arange(12.0).reshape(3, 4))
    assert buffers.kept == source.numel() * source.element_size()


def test_memory_let_go_is_reused_and_memory_held_is_not() -> None:
    """A buffer is handed out again once its copy is gone, never while it or a view lives."""
    buffers = CopyBuffers()
    source = torch.randn(64, 32)
    first = buffers.copy(source)
    address = first.data_ptr()
    view = first[1:].view(-1)
    del first
    second = buffers.copy(source * 2)  # the view still holds the first buffer
    assert second.data_ptr() != address
    assert torch.equal(view, source[1:].reshape(-1))
    del view
    third = buffers.copy(source * 3)
    assert third.data_ptr() == address
    assert torch.equal(third, source * 3)
    assert torch.equal(second, source * 2)
    assert buffers.kept == 2 * source.numel() * source.element_size()


def test_copies_of_one_shape_in_one_step_get_buffers_of_their_own() -> None:
    """Two parameters of one dtype and shape, copied in one step, get two buffers."""
    buffers = CopyBuffers()
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    copy_a, copy_b = buffers.copy(a), buffers.copy(b)
    assert copy_a.data_ptr() != copy_b.data_ptr()
    assert torch.equal(copy_a, a)
    assert torch.equal(copy_b, b)


def test_the_limit_bounds_what_is_kept() -> None:
    """Past ``limit``, a copy is fresh memory the pool does not keep; free buffers go first.

    The least recently used free buffer is let go to make room for a new one.
    """
    entry = 32 * 32 * 4
    buffers = CopyBuffers(limit=2 * entry)
    a, b, c = (torch.randn(32, 32) for _ in range(3))
    copies = [buffers.copy(a), buffers.copy(b)]
    assert buffers.kept == 2 * entry
    beyond = buffers.copy(c)  # both buffers are lent: fresh memory
    assert torch.equal(beyond, c)
    assert buffers.kept == 2 * entry
    oldest, newest = copies[0].data_ptr(), copies[1].data_ptr()
    copies.clear()
    shape = buffers.copy(torch.randn(16, 64))  # another shape: the oldest free one goes
    assert buffers.kept == 2 * entry
    again = buffers.copy(a)
    assert again.data_ptr() == newest != oldest
    assert shape.data_ptr() != newest
    nothing = CopyBuffers(limit=0)
    assert torch.equal(nothing.copy(a), a)
    assert nothing.kept == 0
    assert CopyBuffers().limit == COPY_BUFFER_BYTES == 64 * 2**20


def test_nothing_is_let_go_for_a_copy_that_would_not_fit() -> None:
    """Free buffers are let go only where they make the room: none while too much is lent.

    The least recently used are looked at first, up to the first one lent out.
    """
    entry = 32 * 32 * 4
    buffers = CopyBuffers(limit=3 * entry)
    a, b, c = (torch.randn(32, 32) for _ in range(3))
    lent, let_go, held = buffers.copy(a), buffers.copy(b), buffers.copy(c)
    free = let_go.data_ptr()
    del let_go
    assert buffers.kept == 3 * entry
    wide = torch.randn(64, 32)  # two entries of room: only one buffer is free
    assert torch.equal(buffers.copy(wide), wide)
    assert buffers.kept == 3 * entry
    assert buffers.copy(b).data_ptr() == free  # still kept
    del lent, held
    again = buffers.copy(wide)  # now two free buffers make the room
    assert torch.equal(again, wide)
    assert buffers.kept == 3 * entry  # one of 32 x 32 and the wide one


def test_what_the_pool_does_not_keep_is_an_ordinary_clone() -> None:
    """A strided tensor, a tensor larger than the limit: cloned, strides kept, nothing kept."""
    buffers = CopyBuffers(limit=1024)
    strided = torch.randn(8, 8).t()
    copy = buffers.copy(strided)
    assert torch.equal(copy, strided)
    assert copy.stride() == strided.stride()
    large = torch.randn(1024)
    assert torch.equal(buffers.copy(large), large)
    assert buffers.kept == 0


def test_clear_keeps_nothing_and_leaves_lent_copies_intact() -> None:
    """After ``clear`` nothing is kept; a copy still held keeps its values."""
    buffers = CopyBuffers()
    source = torch.randn(10, 10)
    copy = buffers.copy(source)
    buffers.clear()
    assert buffers.kept == 0
    other = buffers.copy(torch.zeros(10, 10))
    assert other.data_ptr() != copy.data_ptr()
    assert torch.equal(copy, source)


def test_without_a_count_every_copy_is_fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch cannot count a storage's holders, nothing is kept: each copy is a clone."""
    from torchinstruments_core import _copy_buffers

    monkeypatch.setattr(_copy_buffers, "_COUNTS", False)
    buffers = CopyBuffers()
    source = torch.randn(8, 8)
    first = buffers.copy(source)
    second = buffers.copy(source)
    assert torch.equal(first, source)
    assert first.data_ptr() != second.data_ptr()
    assert buffers.kept == 0


def test_a_lent_buffer_is_unwritten_memory_of_the_shape_and_held_while_it_lives() -> None:
    """``lend``: a buffer of the tensor's dtype and shape, apart from it, lent like a copy.

    The kernels' queue fills it (``_step_tensors.queue_copies``); while it lives it is not
    lent again, and once let go it is. A strided or non-CPU tensor gets none.
    """
    buffers = CopyBuffers()
    source = torch.randn(32, 16, dtype=torch.float64)
    lent = buffers.lend(source)
    assert lent is not None
    assert lent.shape == source.shape
    assert lent.dtype == source.dtype
    assert lent.is_contiguous()
    assert lent.data_ptr() != source.data_ptr()
    address = lent.data_ptr()
    again = buffers.lend(source)
    assert again is not None
    assert again.data_ptr() != address  # the first is still lent
    del lent
    third = buffers.lend(source)
    assert third is not None
    assert third.data_ptr() == address
    assert buffers.lend(torch.randn(16, 32).t()) is None
    assert buffers.kept == 2 * source.numel() * source.element_size()
