"""The memory part of ``paired.py``: peak and net tensor memory of one profiled step of each kind."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from _overhead_workloads import Workload

MIB = 2**20


@dataclass(frozen=True, slots=True)
class MemoryResult:
    """Peak and left-allocated tensor memory per configuration, and the allowance."""

    peaks: dict[str, int]
    nets: dict[str, int]
    largest_activation: int

    @property
    def added(self) -> int:
        """The sampled step's peak above the plain step's, in bytes."""
        return self.peaks["sampled"] - self.peaks["plain"]

    @property
    def met(self) -> bool:
        """Whether the sampled peak is within one float32 activation of the plain peak."""
        return self.added <= self.largest_activation


def largest_activation(workload: Workload) -> int:
    """Bytes of the largest tensor any module of ``workload`` outputs in one step, in float32."""
    sizes = [0]

    def record(module: torch.nn.Module, inputs: object, output: object) -> None:
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        sizes.extend(t.numel() * 4 for t in outputs if isinstance(t, torch.Tensor))

    handles = [m.register_forward_hook(record) for m in workload.model.modules()]
    workload.step()
    for handle in handles:
        handle.remove()
    return max(sizes)


def measure_memory(
    steps: Mapping[str, Callable[[int], float]], step: int, device: torch.device, largest: int
) -> MemoryResult:
    """Profile two steps of each configuration (``steps[name](step_number)``); keep the second.

    A first profiled step cannot see the frees of tensors allocated before it, hence two.
    """
    peaks: dict[str, int] = {}
    nets: dict[str, int] = {}
    for offset, (name, run) in enumerate(steps.items()):
        for repeat in range(2):
            peaks[name], nets[name] = _memory(
                functools.partial(run, step + 2 * offset + repeat), device
            )
    return MemoryResult(peaks, nets, largest)


def _memory(step: Callable[[], object], device: torch.device) -> tuple[int, int]:
    """Peak and net tensor memory of ``step`` above its start: CUDA's allocator, else the CPU's."""
    if device.type != "cuda":
        from torchinstruments_core.testing import tensor_memory

        memory = tensor_memory(step)
        return memory.peak, memory.net
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, torch.cuda.memory_allocated() - start


def print_memory(results: dict[str, MemoryResult]) -> None:
    """One row per workload: the peaks, what was left allocated, and the target."""
    print(
        "\n| workload | plain peak (MiB) | sampled peak (MiB) | added | largest activation "
        "(float32) | left allocated, sampled (MiB) | target |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, result in results.items():
        verdict = "met" if result.met else "NOT met"
        print(
            f"| {name} | {result.peaks['plain'] / MIB:.1f} | {result.peaks['sampled'] / MIB:.1f}"
            f" | {result.added / MIB:.1f} | {result.largest_activation / MIB:.1f} "
            f"| {result.nets['sampled'] / MIB:.1f} | {verdict} |"
        )
