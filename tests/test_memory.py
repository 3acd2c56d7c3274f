"""Memory on the CPU: a sampled step adds at most one float32 activation, and keeps nothing.

The CUDA counterpart, with the allocator's own peak statistic, is in ``test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchinstruments_core import inject_observer
from torchinstruments_core.testing import RecordingSink, tensor_memory


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sampled_step_adds_at_most_the_largest_activation_and_keeps_nothing(
    dtype: torch.dtype,
) -> None:
    """Peak tensor memory of a sampled step exceeds an unsampled step's by at most one activation.

    The activation is counted in float32, the working dtype of the reductions (a bfloat16
    activation is reduced from a float32 copy). After the step, a sampled step leaves exactly as
    much allocated as an unsampled one: nothing of an activation outlives its sample.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 4096), nn.GELU(), nn.Linear(4096, 256)).to(dtype)
    x = torch.randn(512, 256, dtype=dtype)
    largest = 512 * 4096 * 4  # the GELU's output, in float32 bytes
    measured = {}
    # inline: the profiler does not see the reduction worker's frees (test_background.py
    # checks the worker's own bound)
    with inject_observer(model, sink=RecordingSink(), background_reductions=False) as observer:
        for step, sample in enumerate([True, False, True, False]):

            def train_step(step: int = step, sample: bool = sample) -> None:
                observer.begin_step(step, sample=sample)
                model(x).square().mean().backward()
                observer.end_step()
                model.zero_grad(set_to_none=True)

            measured[sample] = tensor_memory(train_step)
    assert measured[False].peak > largest  # the probe sees the model's own activations
    assert measured[True].peak - measured[False].peak <= largest, measured
    assert measured[True].net == measured[False].net, measured
