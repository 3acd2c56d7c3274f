"""``CopyBuffers``: the memory of a recorded step's parameter copies, kept for the next one.

A recorded optimizer step copies each observed parameter before the update (``_step_tensors``).
On the CPU each of those copies is fresh memory: glibc maps a large allocation anew and unmaps
it when freed, so every 4 KiB page of a copy faults when first written (about 1.6 µs a page on
a 2-vCPU EPYC guest: a 12 MB copy 5.4 ms, into memory written before 0.5 ms). On a small model
that is a tenth of its step. ``CopyBuffers`` keeps the copies' memory from one recorded step
to the next instead, up to ``limit`` bytes (``COPY_BUFFER_BYTES``, 64 MiB, by default): what
the observer holds between samples grows by at most that much. The peak during a recorded
step does not change where it copies the parameters the one before copied (every copy exists
then anyway); one that copies fewer (a frozen layer, an expert without a gradient) holds the
buffers it does not use beside its copies, at most ``limit`` in all.

A kept buffer is handed out again only when nothing but the pool holds its memory: its
storage's use count (``_torch_private.storage_holders``) is back to what it was when the buffer
was made. The reductions that read an update where it is, the step record's tensors and any
view of them all count, so a buffer still read somewhere is never written. Where torch cannot
count (builds before 2.8 without CUDA), every copy is fresh, as without the pool. Other
devices' allocators cache their blocks already: only CPU copies are kept. A lock makes the
pool safe for optimizers stepped on several threads at once.
"""

from __future__ import annotations

import torch

from torchinstruments_core._locks import lock
from torchinstruments_core._torch_private import storage_holders

COPY_BUFFER_BYTES = 64 * 2**20
"""The most memory ``CopyBuffers`` keeps between recorded steps, by default."""

_COUNTS = storage_holders(torch.empty(0)) is not None


def _holders(tensor: torch.Tensor) -> int:
    count = storage_holders(tensor)
    assert count is not None  # ``CopyBuffers.copy`` keeps nothing where torch cannot count
    return count


class CopyBuffers:
    """Contiguous CPU tensors to copy parameters into, reused while nobody else holds them.

    Buffers are kept per dtype and shape (a model's parameters come back with the same ones
    every recorded step), the least recently used first to go when a new one would pass
    ``limit``; a copy that finds no free buffer and no room is fresh memory, let go as usual.

    Args:
        limit: The most bytes kept; 0 keeps nothing.
    """

    __slots__ = ("_buffers", "_kept", "_lock", "limit")

    def __init__(self, limit: int = COPY_BUFFER_BYTES) -> None:
        self.limit = limit
        self._lock = lock()
        # per (dtype, shape): [buffer, its storage's use count when only the pool holds it]
        self._buffers: dict[tuple[torch.dtype, torch.Size], list[tuple[torch.Tensor, int]]] = {}
        self._kept = 0

    @property
    def kept(self) -> int:
        """The bytes of the buffers kept now, lent out or not."""
        return self._kept

    def copy(self, values: torch.Tensor) -> torch.Tensor:
        """A copy of ``values``, in a kept buffer where one is free or there is room for one."""
        buffer = self.lend(values)
        return values.clone() if buffer is None else buffer.copy_(values)

    def lend(self, values: torch.Tensor) -> torch.Tensor | None:
        """A kept buffer of ``values``' dtype and shape, unwritten, for a copy of them.

        ``None`` where none is free and there is no room for one, for a tensor that is not a
        contiguous CPU one, and where torch cannot count a storage's holders: the caller
        clones instead. The buffer is lent while the returned tensor (or a view) lives.
        """
        if not _COUNTS or values.device.type != "cpu" or not values.is_contiguous():
            return None
        key = (values.dtype, values.shape)
        with self._lock:
            buffer = self._free(key)
            if buffer is None:
                buffer = self._make(key, values.numel() * values.element_size())
            # an alias of its own, not the pool's tensor, made before the lock is let go:
            # while it lives, the count says lent
            return None if buffer is None else buffer.detach()

    def clear(self) -> None:
        """Keep nothing: a buffer lent out stays with its holders until they let it go."""
        with self._lock:
            self._buffers.clear()
            self._kept = 0

    def _free(self, key: tuple[torch.dtype, torch.Size]) -> torch.Tensor | None:
        entries = self._buffers.pop(key, [])
        found = next((i for i, (b, alone) in enumerate(entries) if _holders(b) == alone), None)
        if found is not None:
            # the most recently used last, of its kind and of the kinds: ``_stale`` looks at
            # the others first
            entries.append(entries.pop(found))
        if entries:
            self._buffers[key] = entries
        return None if found is None else entries[-1][0]

    def _make(self, key: tuple[torch.dtype, torch.Size], nbytes: int) -> torch.Tensor | None:
        if nbytes > self.limit:
            return None
        over = self._kept + nbytes - self.limit
        if over > 0:
            stale = self._stale(over)
            if stale is None:  # nothing is let go for a copy that would not fit anyway
                return None
            for old_key, old in stale:
                entries = self._buffers[old_key]
                entries[:] = [entry for entry in entries if entry[0] is not old]
                if not entries:
                    del self._buffers[old_key]
                self._kept -= old.numel() * old.element_size()
        buffer = torch.empty(key[1], dtype=key[0])
        self._buffers.setdefault(key, []).append((buffer, _holders(buffer)))
        self._kept += nbytes
        return buffer

    def _stale(
        self, needed: int
    ) -> list[tuple[tuple[torch.dtype, torch.Size], torch.Tensor]] | None:
        """The least recently used free buffers that hold ``needed`` bytes, or ``None``.

        Looked at from the least recently used on, up to the first one lent out: a model larger
        than ``limit`` lends every kept buffer before it asks for more, and a copy then costs
        one look, not one a kept buffer.
        """
        found: list[tuple[tuple[torch.dtype, torch.Size], torch.Tensor]] = []
        freed = 0
        for key, entries in self._buffers.items():
            for buffer, alone in entries:
                if _holders(buffer) != alone:
                    return None
                found.append((key, buffer))
                freed += buffer.numel() * buffer.element_size()
                if freed >= needed:
                    return found
        return None
