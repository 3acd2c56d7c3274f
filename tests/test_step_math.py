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

from torchinstruments_core._step_math import whole_gradient

if TYPE_CHECKING:
    from collections.abc import Callable


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
    norm, nonfinite, zeros = record.values.tolist()
    assert record.metrics == ("l2_norm", "nonfinite_count", "zero_count")
    assert nonfinite == sum(int((~torch.isfinite(g)).sum()) for g in gradients)
    assert zeros == sum(int((g == 0).sum()) for g in gradients)
    entries = sum(g.numel() for g in gradients)
    assert record.n_finite.item() == entries - nonfinite
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
    plain = whole_gradient([g / 1024 for g in gradients]).values.tolist()
    scaled = whole_gradient(gradients, torch.tensor(1024.0)).values.tolist()
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
    assert whole_gradient(finite).values.tolist()[1:] == [0.0, 8.0 + 7 + 8]
    assert calls == []
    whole_gradient(CASES["nan"]())
    assert calls == [64 * 48]  # only the gradient with the NaN
