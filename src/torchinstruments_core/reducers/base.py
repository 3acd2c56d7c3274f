"""The reducer extension point: a ``Reducer`` turns one prepared tensor into a few device scalars.

A reducer never leaves the device: no ``.item()``, no ``.cpu()``. It returns a 1-D tensor with one
entry per name in ``metrics``, in the working dtype, and NaN for a value it cannot define (the
engine turns NaN into a null with a reason). ``PreparedTensor`` holds the work shared between
reducers (the flattened working-dtype copy, the finite mask and count, the finite range, and on
the CPU one blocked pass of host statistics), computed at most once per tensor.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, overload, runtime_checkable

import torch

from torchinstruments_core.reducers import _native
from torchinstruments_core.reducers._host import HostSummary, host_count, summarize

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

IndexCache = dict[tuple[torch.device, int, int], torch.Tensor | int]
"""``random_index``'s draws of one sample, by device, ``numel`` and size, and its seed."""

_SEED_KEY = (torch.device("cpu"), -1, -1)
"""Where a sample's seed is kept in its ``IndexCache``: no tensor has -1 entries."""

_MASK64 = 2**64 - 1

CHUNK_SIZE = 2**22
"""Elements per chunk: 16 MiB of float32 temporaries at most, and exact float32 chunk counts."""


def working_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype statistics are computed in: float64 for float64 input, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


_T = TypeVar("_T")


class _cached(Generic[_T]):
    """``functools.cached_property`` without its lock.

    On Python 3.11 that decorator holds one lock per property for every instance while the value
    is computed: a tensor reduced on the CPU's reduction worker made a hook preparing another
    tensor wait, and a child made by ``fork`` while the worker computed one waited forever. A
    ``PreparedTensor`` is used by one thread, so there is nothing to lock: the value is computed
    on first access and stored in the instance, where later reads find it.
    """

    def __init__(self, compute: Callable[[Any], _T]) -> None:
        self._compute = compute
        self._name = compute.__name__
        self.__doc__ = compute.__doc__

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> _cached[_T]: ...

    @overload
    def __get__(self, instance: object, owner: type | None = None) -> _T: ...

    def __get__(self, instance: object | None, owner: type | None = None) -> _T | _cached[_T]:
        if instance is None:
            return self
        value = self._compute(instance)
        instance.__dict__[self._name] = value
        return value


def seeded_cache(seed: int) -> IndexCache:
    """An empty ``IndexCache`` whose sample's CPU positions all come from ``seed`` (64 bits).

    ``cpu_seed`` then takes no draw of a generator: the seed is known before any tensor is
    measured, so the positions do not depend on which thread measures first.
    """
    return {_SEED_KEY: seed & _MASK64}


def cpu_seed(cache: IndexCache | None, generator: torch.Generator, numel: int, size: int) -> int:
    """The seed of the CPU positions of ``size`` entries of a ``numel``-entry tensor.

    Without a cache, a 62-bit draw of ``generator``; with one, the sample's seed (from
    ``seeded_cache``, else drawn at its first size; kept under ``_SEED_KEY``) mixed with
    ``numel`` and ``size``
    (``_native.mix_seed``). ``PreparedTensor.random_index`` draws its positions from it, and so
    does a job of the kernels' reduction queue, which finds the same ones.
    """
    drawn = None if cache is None else cache.get(_SEED_KEY)
    if not isinstance(drawn, int):
        # on the CPU whatever the default device is (``torch.set_default_device``)
        drawn = int(torch.randint(2**62, (), generator=generator, device="cpu"))
        if cache is None:
            return drawn
        cache[_SEED_KEY] = drawn
    return _native.mix_seed(drawn, numel, size)


class PreparedTensor:
    """A dense, non-empty floating tensor, flattened to its working dtype, with shared derivations.

    Args:
        tensor: A dense floating-point tensor with at least one element, never modified.
            ``values`` is ``tensor`` itself when it is a plain 1-D tensor in its working dtype
            that does not require grad, else a detached flat view or copy of it.
        generator: Random source for subsampling, on the tensor's device. A private generator keeps
            the model's own random stream untouched.
        index_cache: Where ``random_index`` keeps its draws, shared by the tensors of one sample
            (the engine clears it when a sample starts); ``None`` draws anew every time.
    """

    def __init__(
        self,
        tensor: torch.Tensor,
        generator: torch.Generator,
        index_cache: IndexCache | None = None,
    ) -> None:
        self.source_dtype = tensor.dtype
        dtype = working_dtype(tensor.dtype)
        if type(tensor) is torch.Tensor and tensor.dtype == dtype and not tensor.requires_grad:
            # flat already (the worker's copies): no torch call, no GIL hand-over; else one
            values = tensor if tensor.dim() == 1 else tensor.reshape(-1)
        else:
            values = tensor.detach().reshape(-1).to(dtype)
        # a lazily negated view (``z.conj().imag``) has no numpy view for the host passes
        self.values = values.resolve_neg() if values.is_neg() else values
        self.numel = self.values.numel()
        self.generator = generator
        self._index_cache = index_cache

    def random_index(self, size: int) -> torch.Tensor:
        """``size`` uniform positions in ``[0, numel)``, drawn with replacement from ``generator``.

        On the CPU the generator gives a seed and ``_native.draw_positions`` the positions from
        it (a third of ``torch.randint``'s time there); elsewhere ``torch.randint`` draws them.
        With a cache, the sample has one seed (kept in the cache as a Python int, under
        ``numel`` -1, which no tensor has: the engine's caches come with it, ``seeded_cache``;
        else the generator gives it at the first size) and each size's draw a seed mixed from
        it and the size (``_native.mix_seed``, SplitMix64): no torch call a size, each about
        50 us in a hook, where the model's kernels have left the caches cold.

        Tensors of the same sample and the same ``numel`` share one draw: each tensor's subsample
        is still uniform and independent of its values, which is all an error bound needs, and a
        step draws once per tensor size instead of once per tensor. On an accelerator the
        positions come sorted, so that a gather walks memory forward. On the CPU they stay in
        the order drawn: sorting the default 8,192 positions costs about 0.25 ms there, far
        more than random order adds to the gather even from a 128 MiB tensor (0.065 against
        0.056 ms), and a random order makes every strided slice of the subsample a random
        subsample too.
        """
        key = (self.device, self.numel, size)
        cached = None if self._index_cache is None else self._index_cache.get(key)
        if isinstance(cached, torch.Tensor):
            return cached
        if self.device.type == "cpu":
            # the positions from a 64-bit seed (``_seed``) by ``draw_positions``, on the CPU
            # whatever torch's default device is (``torch.set_default_device``)
            index = _native.draw_positions(self._seed(size), self.numel, size)
        else:
            index = torch.randint(self.numel, (size,), generator=self.generator, device=self.device)
            index = index.sort().values
        if self._index_cache is not None:
            self._index_cache[key] = index
        return index

    def _seed(self, size: int) -> int:
        """The seed of the CPU positions of ``size`` entries of this tensor (``random_index``)."""
        return cpu_seed(self._index_cache, self.generator, self.numel, size)

    @property
    def device(self) -> torch.device:
        """Device the tensor and every reduction live on."""
        return self.values.device

    @_cached
    def finite(self) -> torch.Tensor:
        """Boolean mask of the finite entries."""
        return torch.isfinite(self.values)

    @_cached
    def n_finite(self) -> torch.Tensor:
        """Number of finite entries, a 0-d int64 tensor (exact past 2**24 elements)."""
        if self.all_finite:  # only ever true on the CPU
            return host_count(self.numel)
        return torch.count_nonzero(self.finite)

    @_cached
    def host_summary(self) -> HostSummary | None:
        """Sum, sum of squares, min, max and zero count, when on the CPU and every sum is finite.

        One pass, block by block (``_host.summarize``). ``None`` on accelerators, where reading
        a value would make the host wait; for a wrapper tensor subclass given directly, which
        has no numpy view (the engine passes plain tensors: a ``DTensor`` as its local
        tensor); and where a block's sum is not finite: a NaN or an infinity then
        sends the reducers down the masked path, and entries so large that their sum
        overflows down the unmasked one.
        """
        if self.device.type != "cpu":
            return None
        try:
            return summarize(self.values)
        except RuntimeError:  # ".numpy() is not supported for tensor subclasses": torch ops then
            return None

    @_cached
    def all_finite(self) -> bool | None:
        """Whether every entry is finite, when that is free to know (CPU); ``None`` on accelerators.

        On the CPU finite block sums prove every entry finite (a NaN or an infinity makes a sum
        NaN or infinite); they come with ``host_summary``'s pass. Only a sum that is not finite,
        from a non-finite entry or from overflow, pays for the finite mask. Asking an accelerator
        would synchronize the host with the device, so reducers there take the masked path.
        """
        if self.device.type != "cpu":
            return None
        if self.host_summary is not None:
            return True
        return bool(torch.count_nonzero(self.finite) == self.numel)

    @_cached
    def finite_range(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Min and max of the finite entries, 0-d tensors; ``(inf, -inf)`` when there are none.

        Besides the finite mask (one byte per entry), masked work goes chunk by chunk, so its
        temporaries stay within ``CHUNK_SIZE`` entries.
        """
        if self.all_finite:  # only ever true on the CPU
            summary = self.host_summary
            if summary is not None:
                dtype = self.values.dtype
                return torch.tensor(summary.lo, dtype=dtype), torch.tensor(summary.hi, dtype=dtype)
            lo, hi = torch.aminmax(self.values)  # finite entries whose sum overflows
            return lo, hi
        los: list[torch.Tensor] = []
        his: list[torch.Tensor] = []
        for start in range(0, self.numel, CHUNK_SIZE):
            chunk = self.values[start : start + CHUNK_SIZE]
            mask = self.finite[start : start + CHUNK_SIZE]
            los.append(torch.where(mask, chunk, math.inf).amin())
            his.append(torch.where(mask, chunk, -math.inf).amax())
        return torch.stack(los).amin(), torch.stack(his).amax()

    def chunks(self, chunk_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
        """Views of ``chunk_size`` values with their finite mask (``None`` when known finite).

        Raises:
            ValueError: If ``chunk_size`` is not positive.
        """
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        mask = None if self.all_finite else self.finite
        for start in range(0, self.numel, chunk_size):
            stop = start + chunk_size
            yield self.values[start:stop], None if mask is None else mask[start:stop]


@runtime_checkable
class Reducer(Protocol):
    """Computes named statistics of a tensor on its device."""

    @property
    def metrics(self) -> tuple[str, ...]:
        """The metric names, in the order of the returned values."""
        ...

    def reduce(self, tensor: PreparedTensor) -> torch.Tensor:
        """Return a 1-D tensor of ``len(metrics)`` values on ``tensor.device``.

        It may be a view of ``tensor.values`` (a slice): the observer copies such a result
        before anything can change the tensor it views, which may be the model's or the
        optimizer's own (a gradient, read where it is).
        """
        ...
