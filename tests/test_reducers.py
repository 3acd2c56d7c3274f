"""The on-device reductions, checked against independent float64 numpy references."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from torchinstruments_core import ConfigurationError, inject_observer
from torchinstruments_core.reducers import (
    DEFAULT_METRICS,
    HistogramReducer,
    MomentsReducer,
    PreparedTensor,
    QuantileReducer,
    Reducer,
    default_reducers,
)
from torchinstruments_core.reducers._host import HOST_BLOCK, host_count, host_values, summarize
from torchinstruments_core.reducers._scaling import power_of_two_scale
from torchinstruments_core.reducers.base import IndexCache
from torchinstruments_core.reducers.functional import (
    MOMENT_METRICS,
    count_sorted,
    histogram,
    moments,
    quantiles,
)
from torchinstruments_core.reducers.histogram import MAX_HISTOGRAM_BINS
from torchinstruments_core.testing import RecordingSink

# every test once with the compiled CPU kernels and once through numpy and torch
pytestmark = pytest.mark.usefixtures("reduction_path")

if TYPE_CHECKING:
    from collections.abc import Callable

CASES = ["normal", "zeros", "nonfinite", "all_nan", "single", "constant"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
LEVELS = (0.25, 0.5, 0.75)


def _make(case: str, dtype: torch.dtype, numel: int = 10_007) -> torch.Tensor:
    """A test tensor of one of the named shapes of data."""
    generator = torch.Generator().manual_seed(1234)
    if case == "zeros":
        return torch.zeros(numel, dtype=dtype)
    if case == "all_nan":
        return torch.full((numel,), math.nan, dtype=dtype)
    if case == "single":
        return torch.tensor([2.5], dtype=dtype)
    if case == "constant":
        return torch.full((numel,), -3.0, dtype=dtype)
    values = torch.randn(numel, generator=generator, dtype=torch.float64) * 3 + 1
    if case == "nonfinite":
        values[::13] = math.nan
        values[1::17] = math.inf
        values[2::19] = -math.inf
        values[3::23] = 0.0
    return values.to(dtype).reshape(-1, 1)


def _prepare(tensor: torch.Tensor, seed: int = 0) -> PreparedTensor:
    return PreparedTensor(tensor, torch.Generator(tensor.device).manual_seed(seed))


def _prepare_device_path(tensor: torch.Tensor, seed: int = 0) -> PreparedTensor:
    """A CPU tensor that takes the accelerator code path: finiteness unknown, masks everywhere.

    ``all_finite`` is what tells the reducers whether host shortcuts are free; an accelerator
    answers ``None``, and so does this tensor.
    """
    prepared = _prepare(tensor, seed)
    prepared.__dict__["all_finite"] = None  # the cached_property's slot
    return prepared


def _parts(packed: torch.Tensor, bins: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The edges, counts and non-finite count of ``functional.histogram``'s packed result."""
    return packed[: bins + 1], packed[bins + 1 : 2 * bins + 1], packed[-1]


def _as_float64(tensor: torch.Tensor) -> np.ndarray:
    return tensor.detach().to(torch.float64).reshape(-1).cpu().numpy()


def _tolerance(dtype: torch.dtype) -> float:
    """Relative and absolute tolerance: float64 is computed in float64, the rest in float32."""
    return 1e-12 if dtype == torch.float64 else 2e-5


def _reference_moments(array: np.ndarray) -> list[float]:
    finite = array[np.isfinite(array)]
    fractions = [float(np.mean(array == 0)), float(np.mean(~np.isfinite(array)))]
    if finite.size == 0:
        return [math.nan] * 4 + fractions + [math.nan] * 3
    # divided by the largest magnitude first, so the float64 squares neither overflow nor vanish
    top = float(np.abs(finite).max()) or 1.0
    rms = float(np.sqrt(np.mean((finite / top) ** 2)) * top)
    l2_norm = float(np.sqrt(np.sum((finite / top) ** 2)) * top)
    stats = [finite.mean(), finite.std(), finite.min(), finite.max()]
    return [float(value) for value in stats] + [
        *fractions,
        rms,
        float(np.abs(finite).max()),
        l2_norm,
    ]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_moments_match_numpy(case: str, dtype: torch.dtype) -> None:
    """Every moment equals the float64 numpy value, NaN where undefined, in the working dtype."""
    tensor = _make(case, dtype)
    result = moments(_prepare(tensor))
    expected_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert result.dtype == expected_dtype
    assert result.shape == (len(MOMENT_METRICS),)
    expected = _reference_moments(_as_float64(tensor))
    tolerance = _tolerance(dtype)
    np.testing.assert_allclose(result.numpy(), expected, tolerance, tolerance, equal_nan=True)


def test_all_nan_moments_are_nan_but_fractions_are_real() -> None:
    """Without finite values the statistics are NaN while both fractions are still numbers."""
    values = moments(_prepare(_make("all_nan", torch.float32))).tolist()
    result = dict(zip(MOMENT_METRICS, values, strict=True))
    assert result["zero_fraction"] == 0.0
    assert result["nonfinite_fraction"] == 1.0
    for name in ("mean", "std", "min", "max", "rms", "max_abs"):
        assert math.isnan(result[name]), name


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_quantiles_match_numpy(case: str, dtype: torch.dtype) -> None:
    """Quantiles of the finite entries equal numpy's linear ones; NaN when there are none.

    Exact: 8,191 entries are fewer than the default subsample, so every one is used.
    """
    tensor = _make(case, dtype, numel=8191)
    result = quantiles(_prepare(tensor), LEVELS)
    array = _as_float64(tensor)
    finite = array[np.isfinite(array)]
    expected = np.quantile(finite, LEVELS) if finite.size else [math.nan] * len(LEVELS)
    tolerance = _tolerance(dtype)
    np.testing.assert_allclose(result.numpy(), expected, tolerance, tolerance, equal_nan=True)


@pytest.mark.parametrize("numel", [1, 2, 3, 10, 1001, 100_000])
def test_exact_quantiles_equal_numpy_bit_for_bit(numel: int) -> None:
    """In exact mode, float64 quantiles are bit-identical to numpy's default method."""
    generator = torch.Generator().manual_seed(numel)
    tensor = torch.randn(numel, generator=generator, dtype=torch.float64).exp()
    levels = (0.0, 0.1, 0.25, 1 / 3, 0.5, 0.75, 0.9, 0.999, 1.0)
    result = quantiles(_prepare(tensor), levels, sample_size=1, exact=True)
    np.testing.assert_array_equal(result.numpy(), np.quantile(tensor.numpy(), levels))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_histogram_matches_numpy(case: str, dtype: torch.dtype) -> None:
    """Counts equal numpy.histogram with the same edges, and sum to the finite count."""
    tensor = _make(case, dtype)
    bins = 16
    edges, counts, nonfinite = _parts(histogram(_prepare(tensor), bins), bins)
    array = _as_float64(tensor)
    finite = array[np.isfinite(array)]
    assert nonfinite.item() == array.size - finite.size
    assert counts.sum().item() == finite.size
    if finite.size == 0:
        assert edges.isnan().all()
        assert (counts == 0).all()
        return
    pad = 0.5 if finite.min() == finite.max() else 0.0
    assert (edges[0].item(), edges[-1].item()) == (finite.min() - pad, finite.max() + pad)
    expected, _ = np.histogram(finite, bins=_as_float64(edges))
    np.testing.assert_array_equal(counts.numpy(), expected)


def test_values_on_bin_edges_land_where_numpy_puts_them() -> None:
    """Entries equal to an edge go to the bin that edge opens, and the max to the last bin."""
    generator = torch.Generator().manual_seed(3)
    data = torch.rand(1000, generator=generator) * 0.63 + 0.1
    edges = _parts(histogram(_prepare(data), 64), 64)[0]
    # the edges lie within [min, max], so adding them leaves the edges unchanged
    on_edges = torch.cat([data, edges, edges])
    packed = histogram(_prepare(on_edges), 64)
    same_edges, counts, _ = _parts(packed, 64)
    assert torch.equal(same_edges, edges)
    expected, _ = np.histogram(_as_float64(on_edges), bins=_as_float64(edges))
    np.testing.assert_array_equal(counts.numpy(), expected)


@pytest.mark.parametrize("n_buckets", [1, 5, 66])
def test_sort_based_counting_matches_index_add(n_buckets: int) -> None:
    """The deterministic-mode counter gives the same counts as bincount, empty buckets included."""
    generator = torch.Generator().manual_seed(n_buckets)
    index = torch.randint(0, max(n_buckets - 1, 1), (5000,), generator=generator, dtype=torch.int32)
    expected = torch.bincount(index.long(), minlength=n_buckets)
    result = count_sorted(index, n_buckets)
    assert result.dtype == torch.int64
    assert torch.equal(result, expected)


def test_large_mean_std_is_accurate() -> None:
    """The std of 1000 + N(0, 1) in float32 has a relative error below 1e-3 against float64."""
    generator = torch.Generator().manual_seed(7)
    tensor = (1000 + torch.randn(1_000_003, generator=generator, dtype=torch.float64)).float()
    reference = _as_float64(tensor).std()
    for chunk_size in (4096, 2**22):
        std = moments(_prepare(tensor), chunk_size=chunk_size)[1].item()
        assert abs(std - reference) / reference < 1e-3


@pytest.mark.parametrize("chunk_size", [64, 1000, 4096])
def test_chunked_results_match_unchunked(chunk_size: int) -> None:
    """Combining chunks, empty ones included, gives the one-chunk moments and histogram."""
    tensor = _make("nonfinite", torch.float64)
    tensor[:1000] = math.nan
    prepared = _prepare(tensor)
    whole = moments(prepared, chunk_size=tensor.numel())
    chunked = moments(prepared, chunk_size=chunk_size)
    np.testing.assert_allclose(chunked.numpy(), whole.numpy(), rtol=1e-12, atol=1e-12)
    assert torch.equal(
        histogram(prepared, 32, chunk_size=chunk_size),
        histogram(prepared, 32, chunk_size=tensor.numel()),
    )


@pytest.mark.slow
def test_tensor_past_torch_quantile_limit() -> None:
    """Past 2**24 elements: moments are exact, counts exact, quantiles within the DKW rank bound.

    With the default 8,192 samples, each subsampled quartile lies within 0.030 in rank of the
    truth with probability above 1 - 7.9e-7.
    """
    numel = 20_000_000
    generator = torch.Generator().manual_seed(2024)
    tensor = torch.randn(numel, generator=generator)
    tensor[::100_003] = math.nan
    prepared = _prepare(tensor)
    array = _as_float64(tensor)
    finite = array[np.isfinite(array)]
    expected = _reference_moments(array)
    np.testing.assert_allclose(moments(prepared).numpy(), expected, rtol=1e-5, atol=1e-5)
    bounds = np.quantile(finite, [q + d for q in LEVELS for d in (-0.03, 0.03)]).reshape(-1, 2)
    for value, (low, high) in zip(quantiles(prepared).tolist(), bounds, strict=True):
        assert low <= value <= high
    exact = quantiles(prepared, exact=True).numpy()
    np.testing.assert_allclose(exact, np.quantile(finite, LEVELS), rtol=1e-6, atol=1e-7)
    counts = _parts(histogram(prepared), 64)[1]
    assert counts.double().sum().item() == finite.size


def test_subsampling_uses_only_the_private_generator() -> None:
    """Subsampled quantiles leave the global RNG untouched and repeat for the same seed."""
    tensor = _make("normal", torch.float32, numel=200_000)
    state = torch.get_rng_state()
    first = quantiles(_prepare(tensor, seed=5), sample_size=1000)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(quantiles(_prepare(tensor, seed=5), sample_size=1000), first)


def test_subsample_without_finite_values_is_nan() -> None:
    """A subsample that holds no finite value gives NaN quantiles."""
    tensor = _make("all_nan", torch.float32, numel=5000)
    assert quantiles(_prepare(tensor), sample_size=100).isnan().all()


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: QuantileReducer(sample_size=0), r"sample_size=0\).*positive int"),
        (lambda: QuantileReducer(sample_size=-5), r"sample_size=-5\)"),
        (lambda: QuantileReducer(sample_size=2.5), r"sample_size=2.5\)"),  # type: ignore[arg-type]
        (lambda: QuantileReducer(sample_size=True), r"sample_size=True\)"),
        (lambda: QuantileReducer(exact="yes"), r"exact='yes'\).*True or False"),  # type: ignore[arg-type]
        (lambda: HistogramReducer(bins=0), r"bins=0\).*positive int"),
        (lambda: HistogramReducer(bins=1.5), r"bins=1.5\)"),  # type: ignore[arg-type]
        (lambda: HistogramReducer(bins=10**7), r"bins=10000000\).*at most 65,536"),
    ],
)
def test_constructors_reject_bad_configuration(factory: Callable[[], object], message: str) -> None:
    """Bad configuration fails in the constructor, naming the argument, value and valid choices."""
    with pytest.raises(ValueError, match=message):
        factory()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: quantiles(p, (0.5, 1.5)), "qs must be"),
        (lambda p: quantiles(p, ()), "qs must be"),
        (lambda p: quantiles(p, sample_size=0), "sample_size must be"),
        (lambda p: histogram(p, 0), "bins must be"),
        (lambda p: histogram(p, 8, chunk_size=-1), "chunk_size must be"),
        (lambda p: moments(p, chunk_size=0), "chunk_size must be"),
    ],
)
def test_functions_reject_bad_arguments(
    call: Callable[[PreparedTensor], object], message: str
) -> None:
    """The functional layer rejects arguments it cannot honour instead of returning garbage."""
    with pytest.raises(ValueError, match=message):
        call(_prepare(_make("normal", torch.float32)))


def test_reducers_follow_the_protocol() -> None:
    """Each reducer returns one detached value per metric, and its repr shows its configuration."""
    tensor = _make("normal", torch.float32).requires_grad_()
    for reducer in (*default_reducers(), QuantileReducer(sample_size=10, exact=True)):
        assert isinstance(reducer, Reducer)
        result = reducer.reduce(_prepare(tensor))
        assert result.shape == (len(reducer.metrics),)
        assert result.grad_fn is None
    assert repr(QuantileReducer(sample_size=10)) == "QuantileReducer(sample_size=10, exact=False)"
    assert repr(HistogramReducer(bins=8)) == "HistogramReducer(bins=8)"
    assert repr(MomentsReducer()) == "MomentsReducer()"


def test_default_reducers_give_the_twelve_metrics() -> None:
    """The default reducers produce exactly the twelve documented names, as ``DEFAULT_METRICS``."""
    names = [name for reducer in default_reducers() for name in reducer.metrics]
    documented = ["mean", "std", "min", "max", "p25", "p50", "p75"]
    documented += ["zero_fraction", "nonfinite_fraction", "rms", "max_abs", "l2_norm"]
    assert sorted(names) == sorted(documented)
    assert tuple(names) == DEFAULT_METRICS


def test_histogram_reducer_packs_and_unpacks() -> None:
    """The reducer packs grid and counts on the device; unpacking gives the full histogram."""
    reducer = HistogramReducer(bins=8)
    assert isinstance(reducer, Reducer)
    assert reducer.metrics == ()
    prepared = _prepare(_make("nonfinite", torch.float32))
    packed = reducer.reduce(prepared)
    assert packed.shape == (8 + 4,)
    edges, counts, nonfinite = reducer.unpack(packed)
    assert (len(edges), len(counts)) == (9, 8)
    full = histogram(prepared, 8)
    assert edges == full[:9].tolist()
    assert counts == full[9:17].tolist()
    assert nonfinite == full[-1].item()
    assert reducer.unpack(packed.tolist()) == (edges, counts, nonfinite)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_in_deterministic_mode() -> None:
    """On CUDA, with deterministic algorithms on, all reductions run and agree with the CPU."""
    tensor = _make("nonfinite", torch.float32, numel=300_001)
    cpu = _prepare(tensor)
    torch.use_deterministic_algorithms(True)
    try:
        cuda = _prepare(tensor.cuda())
        packed = histogram(cuda, 32)
        results = (moments(cuda), quantiles(cuda, exact=True))
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(packed.cpu(), histogram(cpu, 32))
    np.testing.assert_allclose(results[0].cpu().numpy(), moments(cpu).numpy(), rtol=1e-5, atol=1e-6)
    assert torch.equal(results[1].cpu(), quantiles(cpu, exact=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", CASES)
def test_host_shortcuts_match_the_device_path(case: str, dtype: torch.dtype) -> None:
    """The CPU shortcuts give the results of the masked path every accelerator runs.

    Moments agree to rounding, histograms and exact quantiles bit for bit, subsampled quantiles
    bit for bit for the same seed.
    """
    tensor = _make(case, dtype, numel=300_007)
    host, device = _prepare(tensor, seed=3), _prepare_device_path(tensor, seed=3)
    tolerance = _tolerance(dtype)
    np.testing.assert_allclose(
        moments(host).numpy(), moments(device).numpy(), tolerance, tolerance, equal_nan=True
    )
    assert torch.allclose(histogram(host, 50), histogram(device, 50), 0, 0, equal_nan=True)
    for kwargs in ({"exact": True}, {"sample_size": 4096}):
        np.testing.assert_array_equal(
            quantiles(host, **kwargs).numpy(), quantiles(device, **kwargs).numpy()
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_host_values_round_as_torch_tensor_does(dtype: torch.dtype) -> None:
    """The worker's results, built by numpy, are bit for bit what ``torch.tensor`` builds.

    Doubles between two floats round to nearest (ties to even), subnormals and the largest
    float included; the count is the 0-d int64 tensor ``torch.full`` makes.
    """
    generator = np.random.default_rng(4)
    values = [
        *generator.normal(size=200).tolist(),
        *(generator.normal(size=50) * 1e-40).tolist(),  # float32 subnormals
        0.1,
        1 / 3,
        -0.0,
        1e-46,
        3.4028234663852886e38,
        1 + 2**-24,
        1 + 3 * 2**-24,
        math.nan,
        math.inf,
        -math.inf,
    ]
    built, expected = host_values(values, dtype), torch.tensor(values, dtype=dtype)
    assert built.dtype == expected.dtype
    assert built.shape == expected.shape
    assert built.view(torch.int32 if dtype == torch.float32 else torch.int64).tolist() == (
        expected.view(torch.int32 if dtype == torch.float32 else torch.int64).tolist()
    )
    count = host_count(300_007)
    assert torch.equal(count, torch.full((), 300_007, dtype=torch.int64))
    assert count.shape == ()
    assert count.dtype == torch.int64


def test_a_flat_working_dtype_tensor_is_reduced_where_it_lies() -> None:
    """A flat float32 tensor without autograd is used as it is (no torch call, no copy).

    Its results equal those of the same values given as a 2-D tensor and as one that requires
    grad, which are flattened and detached; the single-block pass equals a blocked one.
    """
    generator = torch.Generator().manual_seed(9)
    flat = torch.randn(4096, generator=generator)
    prepared = PreparedTensor(flat, torch.Generator().manual_seed(1))
    assert prepared.values is flat
    others = (flat.reshape(64, 64), flat.clone().requires_grad_())
    for other in others:
        again = PreparedTensor(other, torch.Generator().manual_seed(1))
        assert again.values is not other
        assert not again.values.requires_grad
        for reducer in (*default_reducers(), HistogramReducer(bins=32)):
            assert torch.equal(reducer.reduce(again), reducer.reduce(prepared))
    strided = torch.randn(2 * 4096, generator=generator)[::2]  # flat, not contiguous
    assert summarize(strided) == summarize(strided.contiguous())


def test_moments_of_millions_of_entries_are_accurate() -> None:
    """Over 5 M float32 entries the one-pass CPU variance keeps a relative error below 1e-6."""
    generator = torch.Generator().manual_seed(11)
    tensor = torch.randn(5_000_000, generator=generator) * 0.02 + 0.01
    expected = _reference_moments(_as_float64(tensor))
    np.testing.assert_allclose(moments(_prepare(tensor)).numpy(), expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_accelerator_path_never_reads_a_value_on_the_host(dtype: torch.dtype) -> None:
    """Every reducer runs on a meta tensor, which has no values to read.

    A meta tensor takes the accelerator path (its finiteness is unknown) and raises on every
    host read a CUDA tensor would pay a synchronization for: ``.item()``, ``float()``, a branch
    on a value, ``nonzero``, ``bincount``, boolean masks, ``tolist``. So on an accelerator the
    reducers never make the host wait; ``test_cuda.py`` checks the same with CUDA's sync
    debug mode where a GPU is present.
    """
    tensor = torch.empty(300_007, dtype=dtype, device="meta")
    with pytest.raises(RuntimeError, match="meta"):
        float(tensor[0])  # what a host read does here
    prepared = PreparedTensor(tensor, torch.Generator())
    assert prepared.all_finite is None
    for reducer in (*default_reducers(), QuantileReducer(exact=True), HistogramReducer(bins=50)):
        values = reducer.reduce(prepared)
        assert values.device.type == "meta"
        assert values.shape == (len(reducer.metrics) or 50 + 4,)


@pytest.mark.usefixtures("without_kernels")
def test_the_blocked_host_pass_sees_every_block() -> None:
    """The CPU's one blocked pass reads every entry of every block, the partial last one too.

    A NaN in the last block, or finite entries whose block sum overflows, turn it off; the
    masked path and ``aminmax`` then give the right answers.
    """
    generator = torch.Generator().manual_seed(5)
    values = torch.randn(2 * HOST_BLOCK + HOST_BLOCK // 2 + 3, generator=generator)
    values = values.to(torch.float64)
    values[::7] = 0.0
    values[HOST_BLOCK + 5] = -40.0  # the min, in the second block
    values[-1] = 50.0  # the max, the last entry of the partial block
    array = values.numpy()
    summary = _prepare(values).host_summary
    assert summary is not None
    assert summary.total == pytest.approx(array.sum(), rel=1e-12, abs=1e-9)
    assert summary.squares == pytest.approx(np.square(array).sum(), rel=1e-12)
    zeros = int(np.count_nonzero(array == 0))
    assert (summary.lo, summary.hi, summary.zeros) == (-40.0, 50.0, zeros)

    values[-2] = math.nan
    prepared = _prepare(values)
    assert prepared.host_summary is None
    assert prepared.all_finite is False
    np.testing.assert_allclose(
        moments(prepared).numpy(), _reference_moments(values.numpy()), rtol=1e-12, atol=1e-12
    )

    huge = torch.full((HOST_BLOCK + 1,), 3e34)  # every entry finite, each block's sum is not
    huge[7] = 0.0
    prepared = _prepare(huge)
    assert prepared.host_summary is None
    assert prepared.all_finite is True
    assert [float(bound) for bound in prepared.finite_range] == [0.0, pytest.approx(3e34)]
    assert moments(prepared)[4].item() == pytest.approx(1 / huge.numel())


@pytest.mark.parametrize(
    ("values", "dtype"),
    [
        ([-3e38, 3e38, 0.0, 1e38, -1e38, 2.5e38], torch.float32),  # max - min overflows
        ([-1e300, 1e300, 0.0, 3.0, -7e299], torch.float64),
        ([0.0, 1e-45, 1e-45, 0.0], torch.float32),  # a subnormal range, widened by 0.5
        ([1e7, 1e7 + 1, 1e7 + 2, 1e7 + 1], torch.float32),  # a span of a few ulps
        ([3.4028234663852886e38] * 3, torch.float32),  # constant at the top of the range
        ([-1.7976931348623157e308] * 2, torch.float64),  # constant at the bottom
        ([-5.0, 5.0, *[i / 7 for i in range(-35, 36)]], torch.float32),  # many values on edges
    ],
)
@pytest.mark.parametrize("bins", [1, 7, 64])
def test_histogram_edges_hold_exactly_their_counts(
    values: list[float], dtype: torch.dtype, bins: int
) -> None:
    """Extreme ranges still give finite, non-decreasing edges whose numpy counts equal ours."""
    tensor = torch.tensor(values, dtype=dtype)
    host, device = histogram(_prepare(tensor), bins), histogram(_prepare_device_path(tensor), bins)
    assert torch.equal(host, device)
    for packed in (host, device):
        edges, counts, nonfinite = _parts(packed, bins)
        edges64 = _as_float64(edges)
        assert np.isfinite(edges64).all()
        assert (np.diff(edges64) >= 0).all()
        assert edges64[0] <= tensor.min().item() <= tensor.max().item() <= edges64[-1]
        expected, _ = np.histogram(_as_float64(tensor), bins=edges64)
        np.testing.assert_array_equal(counts.numpy(), expected)
        assert nonfinite.item() == 0


def test_histogram_edges_are_even_up_to_rounding() -> None:
    """Each edge lies within a millionth of a bin width of ``min + i * (max - min) / bins``."""
    generator = torch.Generator().manual_seed(5)
    tensor = torch.randn(100_000, generator=generator) * 4 - 1
    edges = _parts(histogram(_prepare(tensor), 64), 64)[0]
    nominal = np.linspace(edges[0].item(), edges[-1].item(), 65)
    width = nominal[1] - nominal[0]
    assert np.abs(_as_float64(edges) - nominal).max() < 1e-5 * width


def test_subsample_positions_are_shared_within_a_sample_only() -> None:
    """Tensors of one size share positions from the cache; a new cache draws anew."""
    cache: IndexCache = {}
    generator = torch.Generator().manual_seed(0)
    first = PreparedTensor(torch.randn(50_000), generator, cache).random_index(1000)
    again = PreparedTensor(torch.randn(50_000), generator, cache).random_index(1000)
    other_size = PreparedTensor(torch.randn(60_000), generator, cache).random_index(1000)
    assert again is first
    assert other_size is not first
    cpu = torch.device("cpu")
    # and the sample's seed, under ``numel`` -1 (``PreparedTensor._seed``)
    assert set(cache) == {(cpu, 50_000, 1000), (cpu, 60_000, 1000), (cpu, -1, -1)}
    assert first.min().item() >= 0
    assert first.max().item() < 50_000
    cache.clear()
    fresh = PreparedTensor(torch.randn(50_000), generator, cache).random_index(1000)
    assert not torch.equal(fresh, first)
    uncached = PreparedTensor(torch.randn(50_000), generator).random_index(1000)
    assert not torch.equal(uncached, fresh)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_inner_edge_is_the_first_float_of_its_bin(dtype: torch.dtype) -> None:
    """The binning puts every edge in its own bin and the float just below it in the one before.

    The binning is the device's ``(x * 0.5 - lo * 0.5) * scale`` in the working dtype; the
    edges come from the host search. Ranges cross zero, sit far from it, and span many powers;
    bin counts reach past one block of thresholds searched at once.
    """
    from torchinstruments_core.reducers.functional import histogram_counts

    generator = torch.Generator().manual_seed(9)
    for trial in range(30):
        scale_exponent = float(torch.randint(-30, 30, (), generator=generator))
        center = torch.randn((), generator=generator, dtype=torch.float64) * 10 ** (trial % 4)
        tensor = (torch.randn(1000, generator=generator, dtype=torch.float64) + center) * (
            2.0**scale_exponent
        )
        tensor = tensor.to(dtype)
        bins = [1, 3, 64, 100, 4099][trial % 5]  # 4099: past one block of the edge search
        packed = histogram_counts(_prepare(tensor), bins)
        edges = torch.tensor(
            HistogramReducer(bins=bins).unpack(packed, float64=dtype == torch.float64)[0],
            dtype=dtype,
        )
        lo, scale = packed[0], packed[2]
        inner = edges[1:-1]
        below = torch.nextafter(inner, torch.tensor(-math.inf, dtype=dtype))
        targets = torch.arange(1, bins, dtype=dtype)

        top = bins - 1
        bin_of = [
            torch.mul(values, 0.5).sub_(lo * 0.5).mul_(scale).clamp_(0, top)
            for values in (inner, below)
        ]
        assert (bin_of[0] >= targets).all(), trial
        assert (bin_of[1] < targets).all(), trial


def test_histogram_bins_are_bounded_where_they_are_configured() -> None:
    """histogram_bins past MAX_HISTOGRAM_BINS fails in inject_observer, before any allocation.

    10**7 bins allocated 19 GiB in the backward and 10**9 got the process killed; the error
    names the argument, the value and the allowed range, and nothing is left attached.
    """
    model = torch.nn.Linear(2, 2)
    for bins in (MAX_HISTOGRAM_BINS + 1, 10**7, 10**9):
        with pytest.raises(ConfigurationError, match=rf"histogram_bins={bins} .*1 to 65,536"):
            inject_observer(model, sink=RecordingSink(), histogram_bins=bins)
    with inject_observer(model, sink=RecordingSink(), histogram_bins=MAX_HISTOGRAM_BINS):
        pass


def test_the_scale_is_an_exact_power_of_two_bringing_max_abs_to_one() -> None:
    """The moments' scale: a normal power of two, ``max_abs * scale`` in ``[1, 2)`` where it can.

    Zero and subnormal maxima get the largest normal power, infinity and NaN the smallest.
    """
    for dtype in (torch.float32, torch.float64):
        info = torch.finfo(dtype)
        exponents = {torch.float32: (-126, 127), torch.float64: (-1022, 1023)}[dtype]
        for value in (1.0, 1.5, 3.0, 1e-3, 1e20, info.max, info.smallest_normal, 1e-30, 7e5):
            max_abs = torch.tensor(value, dtype=dtype)
            scale = power_of_two_scale(max_abs)
            mantissa, exponent = math.frexp(scale.item())
            assert mantissa == 0.5
            assert exponents[0] <= exponent - 1 <= exponents[1]
            scaled = (max_abs * scale).item()
            if exponent - 1 == exponents[0]:  # the smallest normal power: max_abs near the top
                assert 1.0 <= scaled < 4.0, value
            else:
                assert 1.0 <= scaled < 2.0, value
        special = {
            0.0: exponents[1],
            info.smallest_normal * info.eps: exponents[1],  # the smallest subnormal
            math.inf: exponents[0],
            math.nan: exponents[0],
        }
        for value, expected in special.items():
            special_scale = power_of_two_scale(torch.tensor(value, dtype=dtype)).item()
            assert special_scale == 2.0**expected, value


EDGE_MAGNITUDES = [1e20, 3e38, 1e-30, 1e-40]


@pytest.mark.parametrize("magnitude", EDGE_MAGNITUDES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["finite", "nonfinite"])
@pytest.mark.parametrize("path", ["host", "device"])
def test_moments_at_the_ends_of_the_float_range(
    magnitude: float, dtype: torch.dtype, case: str, path: str
) -> None:
    """Entries whose squares or sums overflow or underflow float32 get accurate moments.

    On the CPU shortcut and on the masked path accelerators run, against numpy in float64:
    every statistic finite (the scale is a power of two found on the device, no host read),
    except an ``l2_norm`` whose true value is past float32's largest float.
    """
    generator = torch.Generator().manual_seed(21)
    values = (torch.rand(50_001, generator=generator, dtype=torch.float64) * 1.6 - 0.6) * magnitude
    tensor = values.to(dtype)
    if case == "nonfinite":
        tensor[::101] = math.nan
        tensor[7] = math.inf
    prepared = _prepare(tensor) if path == "host" else _prepare_device_path(tensor)
    result = moments(prepared, chunk_size=16_384).to(torch.float64).numpy()
    expected = _reference_moments(_as_float64(tensor))
    info = torch.finfo(torch.float32)
    spacing = 2 * info.smallest_normal * info.eps
    l2_at = MOMENT_METRICS.index("l2_norm")
    if expected[l2_at] > info.max:  # a norm past float32 is infinite, as vector_norm's is
        assert result[l2_at] == math.inf
        expected[l2_at] = math.inf
    assert np.isfinite(np.delete(result, l2_at)).all()
    np.testing.assert_allclose(result, expected, rtol=2e-6, atol=spacing)


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_quantiles_between_the_largest_floats_of_both_signs_are_finite(
    path: str, dtype: torch.dtype
) -> None:
    """Interpolating between -max and +max (whose difference overflows) stays finite."""
    top = torch.finfo(dtype).max
    tensor = torch.tensor([-top, top, -top, top, top * 0.5], dtype=dtype)
    prepared = _prepare(tensor) if path == "host" else _prepare_device_path(tensor)
    levels = (0.1, 0.3, 0.5, 0.6, 0.9)
    result = quantiles(prepared, levels, exact=True).to(torch.float64).numpy()
    ordered = np.sort(_as_float64(tensor)) / 2  # halves: numpy's own lerp would overflow
    expected = np.quantile(ordered, levels) * 2
    assert np.isfinite(result).all()
    np.testing.assert_allclose(result, expected, rtol=1e-6)


def _shares_memory(result: torch.Tensor, tensor: torch.Tensor) -> bool:
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    mine = result.untyped_storage()
    return mine.data_ptr() < end and start < mine.data_ptr() + mine.nbytes()


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(1000),
        torch.randn(64, 64, dtype=torch.float64),
        torch.randn(300).to(torch.bfloat16),
        torch.tensor([1.0, math.nan, -math.inf, 2.0, 0.0]),
        torch.tensor([3.0]),
        torch.randn(40, 40)[:, ::2],
        torch.full((7,), math.nan),
    ],
    ids=["float32", "float64", "bfloat16", "nonfinite", "one", "strided", "all-nan"],
)
def test_the_built_in_reducers_results_never_view_what_they_reduce(tensor: torch.Tensor) -> None:
    """What ``Measurer`` relies on to skip ``unalias`` unless a reducer is not built in.

    Each built-in reducer's result is a host value or a tensor of its own storage, whatever the
    tensor (every path: the kernels', torch's with masks, exact quartiles of a few entries).
    """
    from torchinstruments_core.reducers import PrecisionReducer

    reducers: list[Reducer | HistogramReducer] = [
        MomentsReducer(),
        QuantileReducer(),
        QuantileReducer(exact=True),
        PrecisionReducer(),
        HistogramReducer(bins=8),
    ]
    for reducer in reducers:
        prepared = PreparedTensor(tensor, torch.Generator().manual_seed(0))
        result = reducer.reduce(prepared)
        if isinstance(result, torch.Tensor):
            assert not _shares_memory(result, tensor), reducer
            assert not _shares_memory(result, prepared.values), reducer
