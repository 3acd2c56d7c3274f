"""The compiled CPU reductions (``reducers/_kernels.c``) against numpy, and the fused path.

The histogram's grid and bins are checked against the torch path at every scale in
``test_host_binning.py`` and the quartiles in ``test_quartile_subsample.py``, both run once with
the kernels and once without (``reduction_path``); here: the one-pass summary, the order
statistics, strided input, the GIL, the switch, and ``FusedReductions`` against the reducers.
"""

from __future__ import annotations

import math
import pathlib
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

from torchinstruments_core._measure import Measurer
from torchinstruments_core._native_worker import NativeWorker
from torchinstruments_core.reducers import (
    HistogramReducer,
    MomentsReducer,
    PreparedTensor,
    QuantileReducer,
    _edges,
    _native,
    default_reducers,
    precision_reducers,
)
from torchinstruments_core.reducers._fused import FusedReductions
from torchinstruments_core.reducers._host import _blocked_summary, summarize
from torchinstruments_core.reducers._host_binning import host_grid
from torchinstruments_core.reducers.base import IndexCache
from torchinstruments_core.reducers.functional import DEFAULT_QUANTILES, quantile_plan

pytestmark = pytest.mark.skipif(_native.KERNELS is None, reason="the kernels are not built here")

_NO_RANKS = np.empty(0, dtype=np.int64)


def _arrays(dtype: type[np.floating]) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    sizes = [1, 2, 15, 16, 17, 255, 4097, 65_536 + 33, 300_001]
    arrays = [rng.standard_normal(size).astype(dtype) for size in sizes]
    arrays.append(np.maximum(rng.standard_normal(100_003), 0).astype(dtype))  # half zeros
    arrays.append(np.zeros(1000, dtype=dtype))
    arrays.append(np.array([-0.0, 0.0, -0.0], dtype=dtype))
    arrays.append((rng.standard_normal(50_000) * 1e-30 + 5.0).astype(dtype))
    arrays.append(np.arange(70_000, dtype=dtype))
    return arrays


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_one_pass_summary_equals_numpy(dtype: type[np.floating]) -> None:
    """Extremes and zero count exactly numpy's; the sums within 1e-12 of ``math.fsum``'s.

    The sums are accumulated in double, so they are closer to the exact sums than the blocked
    float32 sums of the numpy path, which stay within 1e-6.
    """
    for array in _arrays(dtype):
        native = summarize(torch.from_numpy(array))
        blocked = _blocked_summary(torch.from_numpy(array))
        assert native is not None
        assert blocked is not None
        assert (native.lo, native.hi) == (float(array.min()), float(array.max()))
        assert native.zeros == int(np.count_nonzero(array == 0)) == blocked.zeros
        exact = math.fsum(array.astype(np.float64).tolist())
        squares = math.fsum(np.square(array.astype(np.float64)).tolist())
        assert native.total == pytest.approx(exact, rel=1e-12, abs=1e-9)
        assert native.squares == pytest.approx(squares, rel=1e-12, abs=1e-9)
        assert blocked.total == pytest.approx(exact, rel=1e-6, abs=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_entry_anywhere_stops_the_pass(dtype: torch.dtype, bad: float) -> None:
    """A NaN or an infinity at the first, a middle, the last lane's or the tail's entry."""
    for numel in (1, 16, 33, 100_003):
        for position in {0, numel // 2, numel - 1, max(numel - 17, 0)}:
            values = torch.randn(numel, dtype=dtype)
            values[position] = bad
            reduced = _native.reduce(values, None, 0, _NO_RANKS, 64)
            assert reduced.status == _native.STATUS_NONFINITE
            assert summarize(values) is None


def test_finite_float32_entries_whose_float32_sum_overflows_are_summarized() -> None:
    """Sums in double hold what a float32 sum cannot: the tensor is known all finite."""
    values = torch.full((1000,), 3e38)
    summary = summarize(values)
    assert summary is not None
    assert summary.total == pytest.approx(3e41)
    prepared = PreparedTensor(values, torch.Generator())
    assert prepared.all_finite is True
    assert MomentsReducer().reduce(prepared)[0].item() == pytest.approx(3e38)


def _patterns(numel: int) -> list[np.ndarray]:
    rng = np.random.default_rng(numel)
    ramp = np.arange(numel, dtype=np.float64)
    organ = np.concatenate([ramp[: numel // 2], ramp[: numel - numel // 2][::-1]])
    return [
        rng.standard_normal(numel),
        np.maximum(rng.standard_normal(numel), 0),  # ties: half zeros
        np.round(rng.standard_normal(numel) * 2),  # a few values, many ties
        ramp,
        ramp[::-1].copy(),
        np.full(numel, 7.0),
        organ,
        # one value but for a few outliers: the selection's one-bucket path, level after level
        np.where(rng.random(numel) < 0.001, rng.standard_normal(numel), 1.0),
        # neighbouring floats of float32, which differ in their lowest bits only
        np.nextafter(np.float32(1.0), np.float32(2.0), dtype=np.float32)
        ** rng.integers(0, 64, size=numel).astype(np.float32),
        rng.standard_normal(numel) * 1e-30,  # subnormal in float32
        np.exp(20 * rng.standard_normal(numel)),  # many binades
    ]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("numel", [1, 2, 3, 100, 2047, 2048, 2049, 8192, 40_000])
def test_order_statistics_equal_numpys_sort(dtype: type[np.floating], numel: int) -> None:
    """The entries at any ranks are those of ``np.sort``, with a gather index and without.

    Around 2,048 keys a bucket is counted in one table below and eight from there on
    (``SELECT_MANY``): both sides of it, at the first split and the ones after.
    """
    rng = np.random.default_rng(11)
    for pattern in _patterns(numel):
        array = pattern.astype(dtype)
        tensor = torch.from_numpy(array)
        ranks = np.unique(rng.integers(0, numel, size=7)).astype(np.int64)
        ranks = np.unique(np.concatenate([ranks, [0, numel - 1]])).astype(np.int64)
        found = _native.order_statistics(tensor, None, numel, ranks)
        assert found == np.sort(array)[ranks].astype(np.float64).tolist()
        index = torch.from_numpy(rng.integers(0, numel, size=numel))
        gathered = np.sort(array[index.numpy()])
        assert _native.order_statistics(tensor, index, numel, ranks) == gathered[ranks].tolist()
        # every rank (a small tensor) or two hundred of them: a bucket of many wanted ranks
        many = np.arange(numel) if numel <= 100 else np.unique(rng.integers(0, numel, size=200))
        many = many.astype(np.int64)
        found = _native.order_statistics(tensor, None, numel, many)
        assert found == np.sort(array)[many].astype(np.float64).tolist()
        assert _native.order_statistics(tensor, None, numel, many[:0]) == []  # no rank wanted


def test_a_strided_tensor_reduces_as_its_contiguous_copy() -> None:
    """A 1-D view with a step is copied for the kernels: the same summary, bins and ranks."""
    base = torch.randn(2 * 70_001)
    strided, dense = base[::2], base[::2].contiguous()
    ranks = np.array([0, 5, 100], dtype=np.int64)
    index = torch.randint(70_001, (512,))
    one = _native.reduce(strided, index, 512, ranks, 32)
    other = _native.reduce(dense, index, 512, ranks, 32)
    assert one[:-1] == other[:-1]
    assert one.counts is not None
    assert other.counts is not None
    assert np.array_equal(one.counts, other.counts)


def test_a_kernel_call_lets_other_threads_run() -> None:
    """The GIL is released for the whole reduction: Python keeps running beside it.

    With the GIL held, the counting loop below could not run a single iteration while the
    call lasts (tens of milliseconds for 32 M entries).
    """
    values = torch.randn(2**25)
    ranks = np.array([0, 1000], dtype=np.int64)
    index = torch.randint(values.numel(), (8192,))
    started, done = threading.Event(), threading.Event()
    elapsed: list[float] = []

    def reduce() -> None:
        started.set()
        begin = time.perf_counter()
        for _ in range(3):
            _native.reduce(values, index, 8192, ranks, 64)
        elapsed.append(time.perf_counter() - begin)
        done.set()

    thread = threading.Thread(target=reduce)
    thread.start()
    started.wait()
    spins = 0
    while not done.is_set():
        spins += 1
    thread.join()
    assert elapsed[0] > 0.01
    assert spins > 1000


def test_the_environment_switch_leaves_the_kernels_unused() -> None:
    """``TORCHINSTRUMENTS_NATIVE=0`` at import: numpy and torch reduce, with the same results."""
    code = (
        "import torch\n"
        "from torchinstruments_core.reducers import _native\n"
        "from torchinstruments_core._measure import Measurer\n"
        "from torchinstruments_core.reducers import default_reducers, HistogramReducer\n"
        "m = Measurer(default_reducers(), HistogramReducer(), background=False)\n"
        "print(_native.KERNELS is None, m._fused is None)\n"
    )
    import os

    for value, expected in (("0", "True True"), ("1", "False False")):
        environment = {**os.environ, _native.ENVIRONMENT_SWITCH: value}
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=environment
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == expected


def test_kernels_built_from_other_sources_are_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A module of another buffer layout (a failed rebuild leaves the old one): a warning, None.

    The installed module is of this package's layout.
    """
    import types

    from torchinstruments_core import reducers
    from torchinstruments_core.reducers import _compiled

    assert _native.KERNELS is not None
    assert _native.KERNELS.LAYOUT == _compiled.LAYOUT
    assert _compiled.load() is _native.KERNELS
    stale = types.ModuleType("torchinstruments_core.reducers._kernels")  # no LAYOUT: layout 1
    stale.__file__ = "/old/_kernels.abi3.so"
    monkeypatch.setitem(sys.modules, stale.__name__, stale)
    monkeypatch.setattr(reducers, "_kernels", stale, raising=False)
    with pytest.warns(
        RuntimeWarning, match=rf"/old/_kernels.abi3.so .*layout 1, .*needs {_compiled.LAYOUT}"
    ):
        assert _compiled.load() is None


class _Moments(MomentsReducer):
    """A subclass: it may compute something else, so it is not fused."""


@dataclass(frozen=True)
class _Custom:
    metrics: tuple[str, ...] = ("one",)

    def reduce(self, tensor: PreparedTensor) -> torch.Tensor:
        return torch.ones(1)


def test_only_the_built_in_reducers_are_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Exactly these classes, at most one of each, a plain histogram reducer, the kernels built."""
    histogram = HistogramReducer()
    assert FusedReductions.plan(default_reducers(), histogram) is not None
    assert FusedReductions.plan([QuantileReducer(exact=True)], HistogramReducer(bins=7))
    assert FusedReductions.plan([], histogram) is not None
    assert FusedReductions.plan([_Moments(), QuantileReducer()], histogram) is None
    assert FusedReductions.plan([MomentsReducer(), _Custom()], histogram) is None
    twice = [QuantileReducer(), QuantileReducer(sample_size=9)]
    assert FusedReductions.plan(twice, histogram) is None
    assert FusedReductions.plan(precision_reducers(), histogram) is None
    monkeypatch.setattr(_native, "KERNELS", None)
    assert FusedReductions.plan(default_reducers(), histogram) is None


def _tensors() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(5)
    big = torch.randn(64, 1024, generator=generator)
    return [
        torch.randn(1, generator=generator),
        torch.randn(100, generator=generator),
        torch.relu(torch.randn(8, 64, 192, generator=generator)),
        big.t(),  # strided
        big[:, ::3],  # a strided view
        big.to(torch.bfloat16),
        torch.randn(30_000, dtype=torch.float64, generator=generator),
        torch.full((5000,), 3.0),  # constant: the grid widens
        torch.randn(20_000, generator=generator) * 1e-3 + 40.0,  # mean large against spread
        # the median's neighbours span more than float32 holds: the lerp halves them
        torch.tensor([-3e38, 3e38] * 100),
    ]


@pytest.mark.parametrize(
    "reducers",
    [
        default_reducers(),
        (QuantileReducer(), MomentsReducer()),
        (QuantileReducer(sample_size=30_000),),
        (QuantileReducer(exact=True), MomentsReducer()),
        (MomentsReducer(),),
    ],
)
@pytest.mark.parametrize("with_histogram", [True, False])
def test_the_fused_path_gives_the_reducers_values_bit_for_bit(
    reducers: tuple[MomentsReducer | QuantileReducer, ...], with_histogram: bool
) -> None:
    """Every value of one kernel call equals what the reducers compute one by one.

    Both read the same kernels; the subsample positions come from the same draws (a sample's
    tensors of one size share one), so a measurer with the fused path and one without give
    the same rows for a sequence of tensors.
    """
    fused = Measurer(reducers, HistogramReducer(bins=37), background=False)
    plain = Measurer(reducers, HistogramReducer(bins=37), background=False)
    assert fused._fused is not None
    plain._fused = None
    for measurer in (fused, plain):
        measurer.new_sample()
    moments = any(isinstance(reducer, MomentsReducer) for reducer in reducers)
    for tensor in _tensors():
        # the kernel call gives the values, unless the moments' squares need scaling (the
        # reducers then run on both sides, and the comparison would prove nothing of it)
        huge = float(tensor.abs().max()) > 1e30
        prepared = PreparedTensor(tensor, torch.Generator().manual_seed(1))
        taken = fused._fused.reduce(prepared, with_histogram) is not None
        assert taken == (not (huge and moments))
        one = fused.measure(tensor, with_histogram=with_histogram)
        other = plain.measure(tensor, with_histogram=with_histogram)
        assert one.reason is None
        assert other.reason is None
        # the kernel call's values are host floats (nothing to transfer), the reducers' tensors
        assert all(isinstance(r.values, list) for r in one.results) == taken
        assert isinstance(one.n_finite, float) == taken
        assert all(isinstance(r.values, torch.Tensor) for r in other.results)
        assert [_listed(r.values) for r in one.results] == [
            _listed(r.values) for r in other.results
        ]
        assert [r.metrics for r in one.results] == [r.metrics for r in other.results]
        assert one.n_finite is not None
        assert other.n_finite is not None
        assert int(one.n_finite) == int(other.n_finite) == tensor.numel()
        if with_histogram:
            assert one.histogram is not None
            assert other.histogram is not None
            assert isinstance(one.histogram, list) == taken
            assert _listed(one.histogram) == _listed(other.histogram)
            assert one.histogram_float64 == other.histogram_float64
        else:
            assert one.histogram is None


def _count_transfers(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many tensors each sample's host transfer is handed, from now on (a list it fills)."""
    from torchinstruments_core import _sample
    from torchinstruments_core._transfer import HostTransfer

    handed: list[int] = []

    class Transfer(HostTransfer):
        def __init__(self, tensors: list[torch.Tensor], events: list[torch.cuda.Event]) -> None:
            handed.append(len(tensors))
            super().__init__(tensors, events)

    monkeypatch.setattr(_sample, "HostTransfer", Transfer)
    return handed


def test_host_float_extras_beside_host_floats_hand_the_transfer_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step tensor's extra metrics as host floats, on a measurement of the kernels' floats.

    They are appended as they are (``_add_extra``): the record's transfer is handed no tensor,
    and the rows equal those of the same values given as 0-d tensors (stacked, transferred).
    """
    from torchinstruments_core._records import Signal
    from torchinstruments_core._sample import Sample, Site
    from torchinstruments_core._step_records import _add_extra

    handed = _count_transfers(monkeypatch)
    tensor = torch.randn(3000, generator=torch.Generator().manual_seed(4))
    ratio = torch.tensor(1 / 3, dtype=torch.float32).item()

    def rows(extra: float | torch.Tensor) -> list[tuple[str, float | None]]:
        measurer = Measurer(default_reducers(), HistogramReducer(bins=16), background=False)
        measurement = measurer.measure(tensor, with_histogram=False)
        assert isinstance(measurement.n_finite, float)  # the kernels' host floats
        _add_extra((("update_to_weight", extra), ("gradient_rms_ratio", 2.5)), measurement)
        sample = Sample(1, 0, 0.0, None)
        sample.add(Site("layer", 0, Signal.UPDATE, "weight"), measurement)
        record = sample.build(sample.start_transfer(), run_id="run", rank=0)
        return [(row.metric, row.value) for row in record.rows]

    floats = rows(ratio)
    assert handed == [0]
    assert floats == rows(torch.tensor(ratio))
    assert handed == [0, 1]  # the stacked tensor of the two extras
    assert ("update_to_weight", ratio) in floats
    assert ("gradient_rms_ratio", 2.5) in floats


@pytest.mark.skipif(not _native.QUEUE, reason="the kernels have no queue here")
def test_a_step_tensor_read_in_place_is_queued_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    """``measure(step=True, in_place=True)`` of a dense float CPU tensor queues it directly.

    Neither the hand-over nor a copy: the job reads the tensor itself (one that requires a
    gradient, detached), and its values equal those of the same tensor measured from a copy
    (``in_place=False``) in the same sample. A strided tensor and a bfloat16 one take the
    hand-over (which copies them), a sparse CSR one its reason as before; once the queue is
    closed the job runs in the caller; a measurer that reduces in the hooks measures inline.
    """
    handed: list[int] = []
    hand_over = Measurer._hand_over

    def counted(self: Measurer, plain: torch.Tensor, *args: object, **kwargs: object) -> object:
        handed.append(plain.numel())
        return hand_over(self, plain, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Measurer, "_hand_over", counted)
    measurer = Measurer(default_reducers(), HistogramReducer(bins=16), background=True)
    generator = torch.Generator().manual_seed(6)
    first = torch.randn(100, generator=generator)  # its job starts the queue (``submit``)
    assert measurer.measure(first, with_histogram=False, step=True, in_place=True).settle() is None
    submitted: list[int] = []
    submit = NativeWorker.submit

    def submitting(self: NativeWorker, nbytes: int, make: Any) -> int | None:
        submitted.append(nbytes)
        return submit(self, nbytes, make)

    monkeypatch.setattr(NativeWorker, "submit", submitting)
    tensor = torch.randn(20_000, generator=generator).requires_grad_()
    direct = measurer.measure(tensor, with_histogram=True, step=True, in_place=True)
    assert handed == submitted == []  # queued in ``submit_ready``'s one call
    assert direct.worker is not None  # queued, not reduced here
    copied = measurer.measure(tensor.detach(), with_histogram=True, step=True)
    assert direct.settle() is None
    assert copied.settle() is None
    assert direct.reason is None
    assert [r.values for r in direct.results] == [r.values for r in copied.results]
    assert direct.histogram == copied.histogram
    assert direct.summary is not None
    for odd in (torch.randn(200, 30, generator=generator).t(), torch.randn(900).bfloat16()):
        measurement = measurer.measure(odd, with_histogram=False, step=True, in_place=True)
        assert measurement.settle() is None
        assert measurement.reason is None
    assert handed == [6000, 900]
    with warnings.catch_warnings():  # torch's "in beta" warning
        warnings.simplefilter("ignore", UserWarning)
        sparse = torch.randn(4, 4, generator=generator).to_sparse_csr()  # no ``is_contiguous``
    measured = measurer.measure(sparse, with_histogram=False, step=True, in_place=True)
    assert measured.reason == "sparse_tensor"
    measurer.close()  # the queue stopped: the job runs in the caller
    closed = measurer.measure(tensor, with_histogram=True, step=True, in_place=True)
    assert submitted[-1] == 0
    assert closed.settle() is None
    assert [r.values for r in closed.results] == [r.values for r in copied.results]
    inline = Measurer(default_reducers(), HistogramReducer(bins=16), background=False)
    measurement = inline.measure(tensor, with_histogram=True, step=True, in_place=True)
    assert measurement.worker is None  # reduced in the call
    assert [r.values for r in measurement.results] == [r.values for r in copied.results]


def test_a_sample_of_host_floats_and_tensors_builds_the_rows_of_tensors_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sample mixing the kernels' host floats with tensors reads each in its place.

    One sample holds a fused float32 measurement given an extra metric (a 0-d tensor, as a
    step record's), a measurement by the reducers (tensors), and a fused float64 one. Its rows
    and histograms equal those of the same sample built from tensors alone, and the transfer
    is handed the tensors only: the extra metric's, the reducers' and nothing of the kernels'.
    """
    from torchinstruments_core._records import HistogramRecord, Signal, StatRow
    from torchinstruments_core._sample import Sample, Site
    from torchinstruments_core._step_records import _add_extra

    handed = _count_transfers(monkeypatch)
    generator = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(3000, generator=generator),
        torch.relu(torch.randn(1000, generator=generator)),
        torch.randn(20_000, generator=generator, dtype=torch.float64),
    ]

    def built(fused: bool) -> tuple[list[StatRow], list[HistogramRecord]]:
        measurer = Measurer(default_reducers(), HistogramReducer(bins=16), background=False)
        plain = Measurer(default_reducers(), HistogramReducer(bins=16), background=False)
        plain._fused = None
        first = measurer if fused else plain
        measurements = [
            first.measure(tensors[0], with_histogram=True),
            plain.measure(tensors[1], with_histogram=True),
            first.measure(tensors[2], with_histogram=True),
        ]
        # the kernels found the edges of what they reduced; the reducers' are searched
        found = [m.histogram_edges is not None for m in measurements]
        assert found == [fused, False, fused]
        _add_extra((("update_to_weight", torch.tensor(0.125)),), measurements[0])
        sample = Sample(1, 0, 0.0, None)
        for path, measurement in zip("abc", measurements, strict=True):
            sample.add(Site("layer", 0, Signal.OUTPUT, path), measurement)
        record = sample.build(sample.start_transfer(), run_id="run", rank=0)
        return list(record.rows), list(record.histograms)

    rows, histograms = built(fused=True)
    # the extra metric, and the reducers' count, two results and histogram
    assert handed == [1 + 4]
    assert (rows, histograms) == built(fused=False)
    assert handed[1] == 1 + 3 * 4  # the same, and each measurement's four tensors
    assert len(histograms) == 3
    assert any(row.metric == "update_to_weight" and row.value == 0.125 for row in rows)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.tensor([1.0, math.nan, 3.0]),
        torch.tensor([1.0, math.inf]),
        torch.full((10,), 1e30),  # squares that need scaling
        torch.full((10,), 1e-150, dtype=torch.float64),  # squares below float64's normals
    ],
)
def test_the_fused_path_leaves_odd_tensors_to_the_reducers(tensor: torch.Tensor) -> None:
    """Non-finite entries and squares that need scaling give nothing; the reducers then run."""
    fusion = FusedReductions.plan(default_reducers(), HistogramReducer())
    assert fusion is not None
    assert fusion.reduce(PreparedTensor(tensor, torch.Generator()), True) is None
    measurer = Measurer(default_reducers(), HistogramReducer(), background=False)
    measured = measurer.measure(tensor, with_histogram=True)
    assert measured.reason is None
    expected = MomentsReducer().reduce(PreparedTensor(tensor, torch.Generator()))
    assert _listed(measured.results[0].values) == expected.tolist()


@pytest.mark.parametrize("magnitude", [1e-20, 1e-30, 1e-40])
def test_tiny_float32_entries_take_the_fused_path_with_the_reducers_values(
    magnitude: float,
) -> None:
    """Entries whose squares underflow float32 take the fused path, with the reducers' values.

    Adam's second moment of a bias before a BatchNorm, say: the kernels square and sum each
    entry in float64, so the fused path gives their moments, the same as the reducers', and
    accurate against float64.
    """
    generator = torch.Generator().manual_seed(3)
    tensor = (torch.randn(1000, generator=generator, dtype=torch.float64) + 0.5) * magnitude
    tensor = tensor.float()
    fusion = FusedReductions.plan(default_reducers(), HistogramReducer())
    assert fusion is not None
    fused = fusion.reduce(PreparedTensor(tensor, torch.Generator()), True)
    assert fused is not None
    expected = MomentsReducer().reduce(PreparedTensor(tensor, torch.Generator())).tolist()
    assert fused.results[0] == expected
    exact = np.asarray(tensor.tolist(), dtype=np.float64)
    spacing = float(torch.finfo(torch.float32).smallest_normal * torch.finfo(torch.float32).eps)
    reference = [exact.mean(), exact.std(), exact.min(), exact.max()]
    reference += [np.sqrt(np.mean(exact**2)), np.abs(exact).max(), np.sqrt(np.sum(exact**2))]
    found = [fused.results[0][i] for i in (0, 1, 2, 3, 6, 7, 8)]
    np.testing.assert_allclose(found, reference, rtol=2e-6, atol=2 * spacing)


def _listed(values: torch.Tensor | list[float] | None) -> list[float]:
    """A result's values as floats: a tensor's read back, the kernels' host floats as they are."""
    assert values is not None
    return values if isinstance(values, list) else list(values.tolist())


def _grids(dtype: type[np.floating], rng: np.random.Generator) -> list[tuple[float, float]]:
    """Ranges at every scale, across zero, narrow, and at the ends of the float range."""
    finfo = np.finfo(dtype)
    largest, tiny = float(finfo.max), float(finfo.smallest_subnormal)
    ranges = [(-largest, largest), (largest, largest), (-largest, -largest), (0.0, tiny)]
    ranges += [(-0.0, 0.0), (3.0, 3.0), (1e8, 1e8 + 16), (-1.0, 1.0), (tiny, 3 * tiny)]
    top = 38 if dtype is np.float32 else 307
    for _ in range(300):
        exponent = rng.uniform(-top, top)
        low = rng.standard_normal() * 10**exponent
        with np.errstate(over="ignore"):
            high = dtype(low + abs(rng.standard_normal()) * 10 ** (exponent + rng.uniform(-12, 3)))
        if np.isfinite(high):
            ranges.append((float(dtype(low)), float(high)))
    return ranges


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_edges_bisected_in_c_are_numpys(
    dtype: type[np.floating], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every edge the kernels find is the one numpy's search finds, at every scale and bins.

    Wide float64 ranges across zero span more than an int64 of float keys: the bisection
    must not overflow there.
    """
    rng = np.random.default_rng(21)
    float64 = dtype is np.float64
    grids: list[tuple[int, tuple[float, float, float]]] = []
    for lo, hi in _grids(dtype, rng):
        for bins in (1, 2, 7, 64, 1000):
            grid = host_grid(lo, hi, bins, dtype)
            if np.isfinite(grid.lo) and np.isfinite(grid.hi):
                grids.append((bins, (float(grid.lo), float(grid.hi), float(grid.scale))))
    found = [_native.edges(*grid, bins, float64=float64) for bins, grid in grids]
    monkeypatch.setattr(_native, "KERNELS", None)
    expected = [_edges.histograms_edges([grid], bins, float64=float64)[0] for bins, grid in grids]
    assert found == expected


@pytest.mark.parametrize("quartiles", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_edges_found_with_the_counts_are_the_searched_ones(
    dtype: torch.dtype, quartiles: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``profile`` writes a histogram's edges after its counts: the ones its grid's search gives.

    Tensors at every scale (squares left to the host at the largest), constant ones and single
    entries, with 1 to 1,000 bins, with and without exact quartiles before the histogram;
    ``histograms_edges`` searches numpy's way without the kernels.
    """
    generator = torch.Generator().manual_seed(5)
    tensors = [
        torch.randn(3000, generator=generator, dtype=dtype) * 10.0**exponent
        for exponent in (-30, -3, 0, 3, 30)
    ]
    tensors += [torch.full((50,), 3.0, dtype=dtype), torch.zeros(1, dtype=dtype)]
    tensors += [torch.tensor([-0.0, 0.0, 1e-40], dtype=dtype), torch.arange(7, dtype=dtype)]
    found: list[tuple[int, tuple[float, float, float], list[float]]] = []
    for tensor in tensors:
        for bins in (1, 2, 7, 64, 1000):
            size = tensor.numel() if quartiles else 0
            plan = quantile_plan(size, DEFAULT_QUANTILES) if quartiles else None
            profiled = _native.profile(tensor, None, _native.profile_shape(size, plan, bins))
            assert profiled.status in (_native.STATUS_OK, _native.STATUS_MOMENTS_ON_HOST)
            values = profiled.values.tolist()
            at = _native.MOMENTS + (len(plan.levels) if plan is not None else 0)
            lo, hi, scale = values[at : at + 3]
            edges = values[at + bins + 4 :]
            assert len(edges) == bins + 1
            found.append((bins, (lo, hi, scale), edges))
    monkeypatch.setattr(_native, "KERNELS", None)
    float64 = dtype == torch.float64
    for bins, grid, edges in found:
        assert edges == _edges.histograms_edges([grid], bins, float64=float64)[0]


def test_a_view_at_an_odd_byte_offset_is_left_to_numpy() -> None:
    """A float32 view whose address is not a multiple of 4 is not read by the kernels.

    The compiled loops may assume aligned floats; numpy reads the view, with the values of
    its aligned copy.
    """
    memory = bytearray(np.random.default_rng(0).integers(0, 60, 4004, dtype=np.uint8).tobytes())
    odd = torch.frombuffer(memory, dtype=torch.float32, offset=1, count=1000)
    assert odd.data_ptr() % 4 != 0
    assert not _native.usable(odd)
    assert _native.usable(odd.clone())
    assert not _native.usable(torch._efficientzerotensor(10))
    for reducer in (*default_reducers(), HistogramReducer()):
        one = reducer.reduce(PreparedTensor(odd, torch.Generator().manual_seed(1)))
        other = reducer.reduce(PreparedTensor(odd.clone(), torch.Generator().manual_seed(1)))
        assert one.tolist() == pytest.approx(other.tolist(), rel=1e-6)


def test_the_drawn_positions_are_numpys_in_range_and_uniform(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernels' draws equal numpy's (the same quartiles with and without the kernels).

    Every position is in ``[0, numel)``, for a tensor of more entries than a double counts
    exactly too, and a million draws over ten positions fill each within six standard
    deviations of its share.
    """
    cases = [(12_345, 16_384, 8192), (2**62 - 1, 7, 10_000), (0, 1, 5), (99, 2**62 + 12_345, 1000)]
    drawn = [_native.draw_positions(*case) for case in cases]
    monkeypatch.setattr(_native, "KERNELS", None)
    assert all(
        torch.equal(one, _native.draw_positions(*case))
        for one, case in zip(drawn, cases, strict=True)
    )
    for (_, numel, size), positions in zip(cases, drawn, strict=True):
        assert positions.dtype == torch.int64
        assert positions.shape == (size,)
        assert 0 <= int(positions.min()) <= int(positions.max()) < numel
    monkeypatch.undo()
    counts = torch.bincount(_native.draw_positions(1, 10, 1_000_000), minlength=10)
    assert counts.numel() == 10
    assert (counts - 100_000).abs().max() < 6 * math.sqrt(100_000 * 0.9)
    assert not torch.equal(_native.draw_positions(1, 10, 50), _native.draw_positions(2, 10, 50))


def test_a_cpu_subsample_is_drawn_on_the_cpu_whatever_the_default_device() -> None:
    """``torch.set_default_device`` (here the meta device, per thread) moves no draw off the CPU."""
    tensor = torch.randn(50_000)
    expected = PreparedTensor(tensor, torch.Generator().manual_seed(4)).random_index(1000)
    with torch.device("meta"):
        index = PreparedTensor(tensor, torch.Generator().manual_seed(4)).random_index(1000)
        drawn = _native.draw_positions(7, 100, 10)
    assert index.device.type == drawn.device.type == "cpu"
    assert torch.equal(index, expected)
    assert torch.equal(drawn, _native.draw_positions(7, 100, 10))


def test_a_cpu_subsample_comes_from_one_seed_of_the_private_generator() -> None:
    """``random_index`` on the CPU takes one draw of its generator and the positions from it."""
    generator = torch.Generator().manual_seed(4)
    index = PreparedTensor(torch.randn(50_000), generator).random_index(1000)
    seed = int(torch.randint(2**62, (), generator=torch.Generator().manual_seed(4)))
    assert torch.equal(index, _native.draw_positions(seed, 50_000, 1000))
    after = torch.Generator().manual_seed(4)
    torch.randint(2**62, (), generator=after)
    assert torch.equal(generator.get_state(), after.get_state())


def test_a_sample_takes_one_seed_of_the_generator_for_all_its_sizes() -> None:
    """With a cache (one sample), the CPU draws of every size come from one generator draw.

    Each size's positions are ``draw_positions`` of the sample's seed mixed with the size
    (``mix_seed``): different sizes, unrelated positions; the generator moved once.
    """
    generator = torch.Generator().manual_seed(4)
    cache: IndexCache = {}
    drawn = {
        (numel, size): PreparedTensor(torch.randn(numel), generator, cache).random_index(size)
        for numel, size in [(50_000, 1000), (60_000, 1000), (50_000, 2000), (9, 9000)]
    }
    seed = int(torch.randint(2**62, (), generator=torch.Generator().manual_seed(4)))
    for (numel, size), index in drawn.items():
        expected = _native.draw_positions(_native.mix_seed(seed, numel, size), numel, size)
        assert torch.equal(index, expected)
    assert not torch.equal(drawn[50_000, 1000], drawn[60_000, 1000])
    assert not torch.equal(drawn[50_000, 1000], drawn[50_000, 2000][:1000])
    after = torch.Generator().manual_seed(4)
    torch.randint(2**62, (), generator=after)
    assert torch.equal(generator.get_state(), after.get_state())
    # the seed is kept as an int (no torch call to read it), under a key no tensor has
    assert [v for k, v in cache.items() if k[1] < 0] == [seed]
    with torch.device("meta"):  # a default device elsewhere: drawn and kept on the CPU alike
        again: IndexCache = {}
        same = PreparedTensor(
            torch.randn(50_000, device="cpu"), torch.Generator().manual_seed(4), again
        )
        index = same.random_index(1000)
    assert index.device.type == "cpu"
    assert torch.equal(index, drawn[50_000, 1000])


def test_mixed_seeds_are_splitmix64_and_differ_by_every_value() -> None:
    """``mix_seed`` is SplitMix64's output for counter ``value`` of stream ``seed``, chained."""
    mask = 2**64 - 1

    def splitmix(seed: int, counter: int) -> int:
        z = (seed + (counter + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    assert _native.mix_seed(7, 3) == splitmix(7, 3)
    assert _native.mix_seed(7, 3, 5) == splitmix(splitmix(7, 3), 5)
    assert _native.mix_seed(2**62 - 1, 2**62, 8192) < 2**64
    seeds = {_native.mix_seed(1, numel, size) for numel in range(1, 40) for size in range(1, 40)}
    assert len(seeds) == 39 * 39


def test_the_kernels_refuse_sizes_out_of_range() -> None:
    """A histogram of no bins or a negative subsample raises, instead of writing anywhere."""
    assert _native.KERNELS is not None
    values = torch.randn(10)
    with pytest.raises(ValueError, match="bins"):
        _native.histogram(values, -1.0, 1.0, 0)
    with pytest.raises(ValueError, match="out of range"):
        _native.reduce(values, None, -1, np.empty(0, dtype=np.int64), 0)
    kernels = _native.KERNELS
    with pytest.raises(ValueError, match="out of range"):
        kernels.draw(1, 0, 5, torch.empty(5, dtype=torch.int64).data_ptr())
    plan = quantile_plan(10, DEFAULT_QUANTILES)
    numbers = np.empty(5 + plan.ranks.size + 4)
    # 7 bins pack into 11 values, and their 8 edges follow: 31 float32 values, 124 bytes
    short = np.empty(_native.MOMENTS + 3 + 11 + 8 - 1, dtype=np.float32)
    with pytest.raises(ValueError, match="values holds 120 bytes, not 124"):
        kernels.profile(values.data_ptr(), 10, 0, 0, 10, plan.ranks, plan.table, 7, numbers, short)
    bad_plans = {
        "partial item": (plan.ranks.astype(np.int32)[:1], plan.table),
        "not ascending": (plan.ranks[::-1].copy(), plan.table),
        "within the subsample": (plan.ranks + 10, plan.table),
        "not one of the ranks": (plan.ranks, plan.table + 10.0),
    }
    enough = np.empty(_native.MOMENTS + 3 + 11 + 8, dtype=np.float32)
    for problem, (ranks, table) in bad_plans.items():
        with pytest.raises(ValueError, match=problem):
            kernels.profile(values.data_ptr(), 10, 0, 0, 10, ranks, table, 7, numbers, enough)
    with pytest.raises(ValueError, match="larger than the tensor"):
        kernels.profile(values.data_ptr(), 10, 0, 0, 11, plan.ranks, plan.table, 7, numbers, enough)
    with pytest.raises(ValueError, match="numbers"):
        kernels.profile(
            values.data_ptr(), 10, 0, 0, 10, plan.ranks, plan.table, 7, numbers[1:], short
        )


def _gpt2_run(folder: pathlib.Path) -> None:
    """Three sampled steps of a random-weight Hugging Face GPT-2 into a run directory."""
    transformers = pytest.importorskip("transformers")
    from torchinstruments_core import inject_observer

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config)
    tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    observer = inject_observer(model, output_dir=folder, background_reductions=True)
    for step in range(3):
        observer.begin_step(step, sample=True)
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        observer.end_step()
    observer.remove()


def test_a_hugging_face_run_directory_is_the_same_with_and_without_the_kernels(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GPT-2's history.parquet and TensorBoard histograms, read back, agree across the paths.

    Extremes, fractions and quartiles equal, histograms bucket for bucket, sums within their
    rounding: the run a user gets does not depend on whether the extension was built.
    """
    import polars as pl
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _gpt2_run(tmp_path / "kernels")
    monkeypatch.setattr(_native, "KERNELS", None)
    _gpt2_run(tmp_path / "numpy")
    keys = ["sample_id", "layer", "call_index", "signal", "tensor_path", "metric"]
    one, other = (
        pl.read_parquet(tmp_path / name / "history.parquet").sort(keys)
        for name in ("kernels", "numpy")
    )
    assert one.height == other.height > 500
    assert one.select(keys).equals(other.select(keys))
    assert one["unavailable_reason"].null_count() == one.height
    exact = ["min", "max", "max_abs", "zero_fraction", "nonfinite_fraction", "p25", "p50", "p75"]
    chosen = pl.col("metric").is_in(exact)
    assert one.filter(chosen)["value"].to_list() == other.filter(chosen)["value"].to_list()
    # sums within their rounding, against the tensor's scale (a LayerNorm's mean is about 0)
    site = ["sample_id", "layer", "call_index", "signal", "tensor_path"]
    scale = one.filter(pl.col("metric") == "max_abs").select(*site, scale=pl.col("value"))
    summed = [frame.filter(~chosen).join(scale, on=site).sort(keys) for frame in (one, other)]
    difference = (summed[0]["value"] - summed[1]["value"]).abs().to_numpy()
    bound = 1e-5 * summed[1]["value"].abs().to_numpy() + 1e-6 * summed[1]["scale"].to_numpy()
    assert (difference <= bound).all()
    histograms = []
    for name in ("kernels", "numpy"):
        events = EventAccumulator(
            str(tmp_path / name / "tensorboard"), size_guidance={"histograms": 0}
        )
        events.Reload()
        tags = events.Tags()["histograms"]
        assert len(tags) >= 8
        histograms.append(
            {
                tag: [
                    (e.step, e.histogram_value.bucket_limit, e.histogram_value.bucket)
                    for e in events.Histograms(tag)
                ]
                for tag in tags
            }
        )
    assert histograms[0] == histograms[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("numel", [0, 1, 15, 16, 17, 4097, 300_001])
def test_the_ratio_sum_is_the_float64_sum_of_the_quotients(dtype: torch.dtype, numel: int) -> None:
    """``ratio_sum``: sum of g**2 / max(v / c, floor), within 1e-12 of ``math.fsum``'s.

    Entries of ``v`` under the floor (zeros among them) are divided by the floor, as torch's
    ``clamp(min=floor)`` does.
    """
    generator = torch.Generator().manual_seed(numel)
    gradient = torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)
    second = torch.rand(numel, generator=generator, dtype=torch.float64).pow(8).to(dtype)
    second[::7] = 0.0
    correction, floor = 1 - 0.999**3, 1e-9
    exact = [
        float(g) ** 2 / max(float(v) / correction, floor)
        for g, v in zip(gradient.tolist(), second.tolist(), strict=True)
    ]
    got = _native.ratio_sum(gradient, second, correction, floor)
    assert got == pytest.approx(math.fsum(exact), rel=1e-12, abs=0.0)


def test_the_ratio_sum_keeps_a_nan_and_an_infinity() -> None:
    """A NaN in the second moment or an infinite gradient makes the sum non-finite."""
    gradient, second = torch.ones(40), torch.ones(40)
    second[33] = math.nan
    assert math.isnan(_native.ratio_sum(gradient, second, 0.5, 1e-16))
    second[33] = 1.0
    gradient[2] = math.inf
    assert _native.ratio_sum(gradient, second, 0.5, 1e-16) == math.inf


def test_the_ratio_sum_refuses_arguments_out_of_range() -> None:
    """A correction that is not positive, a negative floor or an unknown dtype raises."""
    kernels = _native.KERNELS
    assert kernels is not None
    values = torch.ones(8)
    pointer = values.data_ptr()
    for correction, floor, dtype in [
        (0.0, 0.0, 0),
        (math.nan, 0.0, 0),
        (1.0, -1.0, 0),
        (1.0, 0, 2),
    ]:
        with pytest.raises(ValueError, match="out of range"):
            kernels.ratio_sum(pointer, pointer, 8, dtype, correction, floor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("numel", [1, 15, 16, 17, 4097, 300_001])
def test_the_difference_is_torch_s_and_its_squares_the_float64_sum(
    dtype: torch.dtype, numel: int
) -> None:
    """``difference_squares``: ``before`` becomes torch's ``after - before``, bit for bit.

    The sum of the differences' squares is within 1e-12 of ``math.fsum``'s. Entries that
    cancel (equal), subnormal differences and large ones alike; the tail after the last whole
    block of lanes too (the odd sizes).
    """
    generator = torch.Generator().manual_seed(numel + 7)
    before = torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype)
    after = before + torch.randn(numel, generator=generator, dtype=torch.float64).to(dtype) * 1e-3
    after[::5] = before[::5]  # no change
    before[1::11], after[1::11] = 0.0, torch.finfo(dtype).tiny / 4  # subnormal
    after[3::13] = 1e30 if dtype == torch.float32 else 1e150
    expected = torch.sub(after, before)
    squares = math.fsum(float(d) ** 2 for d in expected.tolist())
    got = _native.difference_squares(after, before)
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    assert torch.equal(before.view(bits), expected.view(bits))
    assert got == pytest.approx(squares, rel=1e-12, abs=0.0)


def test_the_difference_keeps_a_nan_and_an_infinity() -> None:
    """A NaN or an infinite difference makes the sum NaN or infinite, as torch's norm."""
    after, before = torch.ones(40), torch.zeros(40)
    after[33] = math.nan
    assert math.isnan(_native.difference_squares(after, before.clone()))
    after[33] = math.inf
    assert _native.difference_squares(after, before.clone()) == math.inf
    after[34] = -math.inf  # -inf - 0: its square is infinite too
    assert _native.difference_squares(after, before.clone()) == math.inf
    before[33] = math.inf  # inf - inf: NaN
    assert math.isnan(_native.difference_squares(after, before))


def test_the_difference_is_formed_only_in_dense_tensors_alike() -> None:
    """``differs_here``: both usable and contiguous, of one dtype and size; the C checks."""
    plain = torch.randn(64)
    assert _native.differs_here(plain, torch.randn(64))
    assert not _native.differs_here(plain, torch.randn(64, dtype=torch.float64))
    assert not _native.differs_here(plain, torch.randn(65))
    assert not _native.differs_here(torch.randn(8, 8).t(), torch.randn(8, 8))
    assert not _native.differs_here(plain.bfloat16(), torch.randn(64).bfloat16())
    assert not _native.differs_here(torch.empty(0), torch.empty(0))  # no memory: torch's
    kernels = _native.KERNELS
    assert kernels is not None
    pointer = plain.data_ptr()
    for numel, dtype in [(-1, 0), (8, 2)]:
        with pytest.raises(ValueError, match="out of range"):
            kernels.difference_squares(pointer, pointer, pointer, numel, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("numel", [0, 1, 15, 16, 17, 4097, 300_001])
def test_the_shifted_squares_are_the_float64_sum(dtype: torch.dtype, numel: int) -> None:
    """``shifted_squares``: the sum of (x - shift)**2, within 1e-12 of ``math.fsum``'s."""
    generator = torch.Generator().manual_seed(numel)
    values = (torch.randn(numel, generator=generator, dtype=torch.float64) * 1e-3 + 7.0).to(dtype)
    shift = 7.0 + 1e-5
    exact = math.fsum((float(x) - shift) ** 2 for x in values.tolist())
    assert _native.shifted_squares(values, shift) == pytest.approx(exact, rel=1e-12, abs=0.0)
    strided = values.repeat_interleave(2)[::2]  # a strided view: read from a contiguous copy
    assert _native.shifted_squares(strided, shift) == _native.shifted_squares(values, shift)
    kernels = _native.KERNELS
    assert kernels is not None
    with pytest.raises(ValueError, match="out of range"):  # no dtype 2
        kernels.shifted_squares(values.data_ptr(), numel, 2, shift)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_moments_of_a_large_mean_are_finished_in_the_kernels(dtype: torch.dtype) -> None:
    """A mean large against the spread, a constant, one entry: the kernels finish the moments.

    Their second pass (squares about the mean) gives the float64 mean, std, rms and l2 norm of
    the entries, rounded to the dtype (the one pass's squares less the squared total cancelled:
    these were left to the host); only squares that need scaling (entries near the dtype's
    smallest normal) still are.
    """
    generator = torch.Generator().manual_seed(3)
    tensors = [
        torch.randn(50_000, generator=generator, dtype=torch.float64) * 1e-4 + 1.0,
        torch.randn(192, generator=generator, dtype=torch.float64) * 1e-6 - 250.0,
        torch.full((1000,), 0.1, dtype=torch.float64),
        torch.tensor([2.5], dtype=torch.float64),
    ]
    for tensor in (t.to(dtype) for t in tensors):
        profiled = _native.profile(tensor, None, _native.profile_shape(0, None, 0))
        assert profiled.status == _native.STATUS_OK
        mean, std, lo, hi, _, _, rms, max_abs, l2 = profiled.values[: _native.MOMENTS].tolist()
        exact = np.asarray(tensor.tolist(), dtype=np.float64)
        assert mean == pytest.approx(exact.mean(), rel=1e-6 if dtype == torch.float32 else 1e-14)
        assert std == pytest.approx(exact.std(), rel=1e-5, abs=1e-12 * abs(exact.mean()))
        assert rms == pytest.approx(np.sqrt(np.mean(exact**2)), rel=1e-6)
        assert l2 == pytest.approx(np.sqrt(np.sum(exact**2)), rel=1e-6)
        assert (lo, hi, max_abs) == (exact.min(), exact.max(), np.abs(exact).max())
        if exact.min() == exact.max():  # no spread but the float64 mean's rounding
            assert std <= 1e-14 * abs(mean)
    tiny = torch.randn(1000, generator=generator).to(dtype) * torch.finfo(dtype).tiny
    profiled = _native.profile(tiny, None, _native.profile_shape(0, None, 0))
    assert profiled.status == _native.STATUS_MOMENTS_ON_HOST
