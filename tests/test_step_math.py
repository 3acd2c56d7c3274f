"""The whole-model gradient row against torch: its norm, its non-finite and its zero entries.

``whole_gradient`` counts a finite float32 or float64 CPU gradient in the compiled kernels' one
pass and any other gradient with torch; every mix of the two must give torch's counts and
``clip_grad_norm_``'s norm.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import pytest
import torch

from optimizer_helpers import count_summed_gradients
from torchinstruments_core._step_math import whole_gradient

if TYPE_CHECKING:
    from collections.abc import Callable

    import numpy as np
    from numpy.typing import NDArray


def _finite_with_zeros(dtype: torch.dtype) -> torch.Tensor:
    gradient = torch.randn(64, 48, generator=torch.Generator().manual_seed(3)).to(dtype)
    gradient[0, :5] = 0.0
    gradient[1, :3] = -0.0  # equals zero, as torch's == 0 says
    return gradient


def _with(value: float, count: int) -> Callable[[], torch.Tensor]:
    def make() -> torch.Tensor:
        gradient = _finite_with_zeros(torch.float32)
        gradient.view(-1)[100 : 100 + count] = value
        return gradient

    return make


def _listed(values: torch.Tensor | list[float]) -> list[float]:
    """A step row's values as floats, from a tensor or as host floats."""
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


CASES: dict[str, Callable[[], list[torch.Tensor]]] = {
    "float32": lambda: [_finite_with_zeros(torch.float32), torch.zeros(7)],
    "float64": lambda: [_finite_with_zeros(torch.float64), torch.ones(5, dtype=torch.float64)],
    "bfloat16": lambda: [_finite_with_zeros(torch.bfloat16)],
    "strided": lambda: [_finite_with_zeros(torch.float32).t(), _finite_with_zeros(torch.float32)],
    "nan": lambda: [_finite_with_zeros(torch.float32), _with(math.nan, 3)()],
    "inf": lambda: [_with(math.inf, 1)(), _with(-math.inf, 2)()],
    # squares past float64: the kernels' pass does not finish, torch counts (nothing non-finite)
    "huge": lambda: [torch.tensor([1e200, 0.0, -3e199], dtype=torch.float64)],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_gradient_counts_as_torch_does(case: str) -> None:
    """Non-finite and zero entries as torch counts them, the norm as ``clip_grad_norm_``'s.

    Float32 and float64 (counted in the kernels' pass), bfloat16 and a transposed view (by
    torch), a NaN, infinities and entries whose squares overflow (by torch, after the pass).
    """
    gradients = CASES[case]()
    record = whole_gradient(gradients)
    norm, nonfinite, zeros = _listed(record.values)
    assert record.metrics == ("l2_norm", "nonfinite_count", "zero_count")
    assert nonfinite == sum(int((~torch.isfinite(g)).sum()) for g in gradients)
    assert zeros == sum(int((g == 0).sum()) for g in gradients)
    entries = sum(g.numel() for g in gradients)
    assert float(record.n_finite) == entries - nonfinite
    # the norm in float32 at the least: a bfloat16 gradient's as its float32 copy's
    widened = [g.float() if g.dtype == torch.bfloat16 else g for g in gradients]
    holders = [torch.zeros_like(g, requires_grad=True) for g in widened]
    for holder, gradient in zip(holders, widened, strict=True):
        holder.grad = gradient.clone()
    expected = torch.nn.utils.clip_grad_norm_(holders, max_norm=math.inf)
    assert norm == pytest.approx(expected.item(), nan_ok=True)


def test_whole_gradient_divides_the_norm_by_a_scale_and_keeps_the_counts() -> None:
    """A loss scale still on the gradients divides the norm; the counts do not change."""
    gradients = [_finite_with_zeros(torch.float32) * 1024]
    plain = _listed(whole_gradient([g / 1024 for g in gradients]).values)
    scaled = _listed(whole_gradient(gradients, torch.tensor(1024.0)).values)
    assert scaled[0] == pytest.approx(plain[0], rel=1e-6)
    assert scaled[1:] == plain[1:] == [0.0, 8.0]


def test_finite_cpu_gradients_take_one_pass_of_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Finite float32 and float64 CPU gradients are counted without torch's passes.

    Those (``isfinite``, ``== 0`` and their sums) took 500 us for 200 k float32 entries, more
    than an MNIST-sized MLP's training step; a gradient with a NaN still takes them.
    """
    from torchinstruments_core.reducers import _native

    if not _native.usable(torch.zeros(4)):
        pytest.skip("without the compiled kernels every gradient is counted by torch")
    calls: list[int] = []
    isfinite = torch.isfinite

    def counted(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor.numel())
        return isfinite(tensor)

    monkeypatch.setattr(torch, "isfinite", counted)
    finite = CASES["float32"]() + CASES["float64"]()
    assert _listed(whole_gradient(finite).values)[1:] == [0.0, 8.0 + 7 + 8]
    assert calls == []
    whole_gradient(CASES["nan"]())
    assert calls == [64 * 48]  # only the gradient with the NaN


def test_a_gradient_s_own_summary_gives_the_same_row_without_a_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``summaries`` (the kernels' summary of a gradient's own reduction) replace its pass.

    The row equals the one made without them, bit for bit; a gradient whose summary is
    ``None`` (or whose dtype the kernels' pass does not sum) is summed as before.
    """
    from torchinstruments_core.reducers import _native

    if not _native.usable(torch.zeros(4)):
        pytest.skip("without the compiled kernels no reduction has a summary")
    gradients = CASES["float32"]() + CASES["float64"]() + CASES["bfloat16"]()
    shape = _native.profile_shape(0, None, 0)
    summaries: list[NDArray[np.float64] | None] = [
        _native.profile(g.reshape(-1), None, shape).numbers for g in gradients[:3]
    ]
    expected = _listed(whole_gradient(gradients).values)
    summed = count_summed_gradients(monkeypatch)
    summaries += [None, summaries[0]]  # the bfloat16 one is summed whatever it is handed
    assert _listed(whole_gradient(gradients, None, summaries).values) == expected
    assert summed == [5, 64 * 48]


def test_summed_norm_is_the_same_from_a_summary_and_from_a_pass() -> None:
    """``summed_norm``: a summary's squares and the kernels' own pass give one norm.

    Both are the float64 sum of squares, rooted and rounded to the working dtype; a bfloat16
    tensor, or one with a NaN, takes torch's norm (NaN stays NaN).
    """
    from torchinstruments_core._step_math import summed_norm
    from torchinstruments_core.reducers import _native

    if not _native.usable(torch.zeros(4)):
        pytest.skip("without the compiled kernels no reduction has a summary")
    for dtype in (torch.float32, torch.float64):
        tensor = _finite_with_zeros(dtype)
        numbers = _native.profile(tensor.reshape(-1), None, _native.profile_shape(0, None, 0))
        from_summary = summed_norm(tensor, numbers.numbers)
        assert isinstance(from_summary, float)  # a host float, rounded to the dtype
        assert torch.tensor(from_summary, dtype=dtype).item() == from_summary
        assert from_summary == summed_norm(tensor, None)
        exact = math.sqrt(math.fsum(float(x) ** 2 for x in tensor.reshape(-1).tolist()))
        assert from_summary == pytest.approx(exact, rel=1e-7)
    half = _finite_with_zeros(torch.bfloat16)
    torch_norm = summed_norm(half, None)
    assert isinstance(torch_norm, torch.Tensor)
    assert torch_norm.item() == torch.linalg.vector_norm(half.float()).item()
    assert math.isnan(float(summed_norm(_with(math.nan, 1)(), None)))


def test_finite_cpu_gradients_take_no_norm_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finite CPU gradient's norm is the square root of the kernels' sum of squares.

    Only the norm of the per-gradient norms is torch's; a gradient with a NaN still takes a
    norm of its own.
    """
    from torchinstruments_core.reducers import _native

    if not _native.usable(torch.zeros(4)):
        pytest.skip("without the compiled kernels every gradient takes torch's norm")
    sizes: list[int] = []
    vector_norm = torch.linalg.vector_norm

    def counted(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        sizes.append(tensor.numel())
        return vector_norm(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "vector_norm", counted)
    whole_gradient(CASES["float32"]() + CASES["float64"]())
    assert sizes == [4]  # the four gradients' norms, nothing else
    sizes.clear()
    whole_gradient(CASES["nan"]())
    assert sorted(sizes) == [2, 64 * 48]  # the total of two norms, and the NaN gradient's own


ADAM_CASES: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor]]] = {
    "float32": lambda: (torch.randn(5000), torch.rand(5000) ** 6),
    "float64": lambda: (torch.randn(777, dtype=torch.float64), torch.rand(777).double() ** 6),
    "bfloat16": lambda: (torch.randn(300).bfloat16(), (torch.rand(300) ** 2).bfloat16()),
    "strided": lambda: (torch.randn(40, 30).t(), (torch.rand(40, 30) ** 2).t()),
}


@pytest.mark.parametrize("case", sorted(ADAM_CASES))
@pytest.mark.parametrize("amsgrad", [False, True])
def test_adam_ratio_is_the_float64_expression(case: str, amsgrad: bool) -> None:
    """rms(g / sqrt(max(v / c, eps**2))) as float64 torch computes it, on either path.

    Dense float32 and float64 tensors take the kernels' ``ratio_sum`` (no temporaries); a
    bfloat16 or a transposed pair takes torch's expression. Zeros in ``v`` are floored at
    ``eps**2``; under ``amsgrad`` the ratio divides by ``max_exp_avg_sq``.
    """
    from torchinstruments_core._step_math import adam_ratio

    torch.manual_seed(5)
    gradient, second = ADAM_CASES[case]()
    second[..., ::5] = 0.0  # under the floor
    other = torch.full_like(second, 7.0)
    state = {"step": torch.tensor(4.0)}
    state.update(
        {"exp_avg_sq": other, "max_exp_avg_sq": second} if amsgrad else {"exp_avg_sq": second}
    )
    group = {"betas": (0.9, 0.99), "eps": 1e-6, "amsgrad": amsgrad}
    got = adam_ratio(gradient, state, group)
    assert got is not None
    v_hat = (second.double() / (1 - 0.99**4)).clamp(min=1e-12)
    expected = (gradient.double().square() / v_hat).mean().sqrt().item()
    rel = 1e-2 if case == "bfloat16" else 1e-6
    assert float(got) == pytest.approx(expected, rel=rel)


def test_adam_ratio_of_dense_cpu_tensors_makes_no_temporaries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernels compute it: torch's ``square`` (the first temporary) is never called.

    A bfloat16 or a transposed pair, and a NaN ``eps``, take torch's expression.
    """
    from torchinstruments_core._step_math import adam_ratio
    from torchinstruments_core.reducers import _native

    if not _native.usable(torch.zeros(4)):
        pytest.skip("without the compiled kernels torch computes the ratio")
    calls: list[int] = []
    square = torch.Tensor.square

    def counted(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor.numel())
        return square(tensor)

    monkeypatch.setattr(torch.Tensor, "square", counted)
    state = {"exp_avg_sq": torch.rand(1000), "step": 3}
    assert adam_ratio(torch.randn(1000), state, {"betas": (0.9, 0.999)}) is not None
    assert calls == []
    state = {"exp_avg_sq": torch.rand(1000).bfloat16(), "step": 3}
    assert adam_ratio(torch.randn(1000).bfloat16(), state, {"betas": (0.9, 0.999)}) is not None
    assert calls == [1000]
    state = {"exp_avg_sq": torch.rand(20, 50).t(), "step": 3}  # strided: torch's expression
    assert adam_ratio(torch.randn(20, 50).t(), state, {"betas": (0.9, 0.999)}) is not None
    assert calls == [1000, 1000]
    state = {"exp_avg_sq": torch.rand(1000), "step": 3}  # a NaN eps: torch's NaN, no error
    ratio = adam_ratio(torch.randn(1000), state, {"betas": (0.9, 0.999), "eps": math.nan})
    assert ratio is not None
    assert math.isnan(float(ratio))


def test_rounded_is_what_a_float32_tensor_holds_without_a_warning() -> None:
    """``rounded``: the float a 0-d float32 tensor would hold, infinite past float32's range.

    Ties, subnormals, the largest finite float32 and the midpoint above it (which rounds to
    infinity), with warnings turned into errors (numpy's cast warns on overflow); float64 and
    non-finite values are left as they are.
    """
    import warnings

    from torchinstruments_core._step_math import rounded

    largest = float(torch.finfo(torch.float32).max)
    midpoint = largest + 2.0**103  # half of float32's last place at its largest value
    values = [
        0.1, -1 / 3, 1 + 2**-24, 1 + 3 * 2**-24, 1e-40, -1e-45, 1e-46, 0.0, -0.0,
        largest, math.nextafter(midpoint, 0.0), 1e300, -1e300,
    ]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for value in values:
            expected = torch.tensor(value, dtype=torch.float32).item()
            got = rounded(value, torch.float32)
            assert math.copysign(1.0, got) == math.copysign(1.0, expected)
            assert got == expected, value
        assert rounded(midpoint, torch.float32) == math.inf
        assert rounded(-midpoint, torch.float32) == -math.inf
        assert math.isnan(rounded(math.nan, torch.float32))
        assert rounded(1 / 3, torch.float64) == 1 / 3


@pytest.mark.parametrize(
    ("update", "weight"),
    [(3.0, 7.0), (1e-30, 3e-7), (0.0, 2.0), (2.0, 0.0), (0.0, 0.0), (math.nan, 0.0),
     (math.inf, 1.0), (1.0, math.inf), (math.inf, math.inf), (3e38, 1e-3)],
)  # fmt: skip
def test_update_to_weight_of_host_floats_is_float32_s_division(
    update: float, weight: float
) -> None:
    """Two host norms give the float32 quotient torch's division of two float32 norms gives.

    A zero norm before the step gives infinity (NaN over a zero or NaN update), as torch's
    does; a float beside a tensor is divided as a tensor, on the tensor's device.
    """
    from torchinstruments_core._step_math import update_to_weight

    def as32(value: float) -> torch.Tensor:
        return torch.tensor(value, dtype=torch.float32)

    expected = (as32(update) / as32(weight)).item()
    got = update_to_weight(as32(update).item(), as32(weight).item(), torch.float32)
    assert isinstance(got, float)
    assert got == expected or (math.isnan(got) and math.isnan(expected))
    mixed = update_to_weight(as32(update), as32(weight).item(), torch.float32)
    assert isinstance(mixed, torch.Tensor)
    assert mixed.item() == pytest.approx(expected, nan_ok=True)


def test_whole_update_of_host_norms_is_torch_s_norm_of_them() -> None:
    """``whole_update``: host norms give a host row, torch's norm of the same norms in range.

    Summed in float64 and rounded to float32 where every update was float32 (torch's float32
    norm, summing in float32, would overflow past about 1e19), float64 where one was; a mix of
    host floats and tensors goes through torch. The row counts one finite value: a
    non-finite total reads ``non_finite_result``.
    """
    from torchinstruments_core._step_math import whole_update

    norms = [torch.tensor(v, dtype=torch.float32).item() for v in (0.3, 1e-4, 7.25, 0.0)]
    row = whole_update(norms, torch.float32)
    assert isinstance(row.values, list)
    assert row.n_finite == 1.0
    expected = torch.linalg.vector_norm(torch.tensor(norms, dtype=torch.float32)).item()
    assert row.values == [pytest.approx(expected, rel=1e-7)]
    assert torch.tensor(row.values[0], dtype=torch.float32).item() == row.values[0]
    wide = whole_update([1 / 3, 0.5], torch.float64)
    assert wide.values == [math.sqrt(1 / 9 + 0.25)]
    mixed = whole_update([norms[0], torch.tensor(norms[2])], torch.float32)
    assert isinstance(mixed.values, torch.Tensor)
    assert mixed.values.tolist() == [pytest.approx(math.hypot(norms[0], norms[2]), rel=1e-6)]
    assert whole_update([math.inf, 1.0], torch.float32).values == [math.inf]
    assert whole_update([2e19, 1.0], torch.float32).values == [pytest.approx(2e19, rel=1e-7)]
    assert whole_update([3e38, 3e38], torch.float32).values == [math.inf]  # past float32
