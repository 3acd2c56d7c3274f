"""CUDA: a sampled step never waits for the device, and its statistics agree with the CPU's.

These run where CUDA is available. Their CPU counterparts are the tests of the same code paths:
``test_reducers.py::test_host_shortcuts_match_the_device_path`` runs the accelerator reductions
on the CPU, ``test_reducers.py::test_the_accelerator_path_never_reads_a_value_on_the_host`` runs
them on meta tensors (no host reads), ``test_memory.py`` checks the memory bound on the CPU, and
``test_step_control.py`` covers the tensor loss scale.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from helpers import train_side_by_side, values_by_row
from torchinstruments_core import inject_observer
from torchinstruments_core.adapter import loss_scale_reader
from torchinstruments_core.testing import RecordingSink

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
    return nn.Sequential(nn.Linear(32, 64), nn.TransformerEncoder(layer, 2), nn.Linear(64, 8))


@pytest.mark.parametrize("precision", ["float32", "bfloat16", "float16"])
def test_a_sampled_training_step_never_synchronizes(precision: str) -> None:
    """Forward, backward and optimizer step of a sampled step run under sync debug mode "error".

    Under fp16 the gradients are unscaled by the scaler's scale as a device tensor; the
    scaler's own ``step()`` reads ``found_inf`` on the host by design, so it runs outside.
    """
    device = torch.device("cuda")
    model = _model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dtype = getattr(torch, precision)
    scaler = torch.amp.GradScaler("cuda", enabled=precision == "float16")
    sink = RecordingSink()
    x = torch.randn(16, 10, 32, device=device)
    with inject_observer(model, sink=sink) as observer:
        observer.set_gradient_scale(loss_scale_reader(scaler, device))
        for step in range(4):  # warm-up: lazy CUDA state, pinned buffers, generators
            observer.begin_step(step, sample=True)
            torch.cuda.set_sync_debug_mode("error" if step == 3 else "default")
            try:
                with torch.autocast("cuda", dtype=dtype, enabled=precision != "float32"):
                    loss = model(x).float().square().mean()
                scaler.scale(loss).backward()
                if precision != "float16":
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                observer.end_step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if precision == "float16":
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad(set_to_none=True)
        observer.flush()
    assert len(sink.samples) == 4
    last = sink.samples[-1]
    assert not last.forward_only
    gradients = [r for r in last.rows if str(r.signal) == "output_gradient"]
    assert gradients
    assert all(r.value is not None for r in gradients if r.metric == "std")
    if precision == "float16":  # unscaled: a gradient std of the order of the fp32 run's
        assert max(r.value or 0 for r in gradients if r.metric == "max_abs") < 100.0


def test_cuda_statistics_agree_with_the_cpu() -> None:
    """The same model and batch on CUDA and on the CPU give the same statistics.

    Matmuls round differently on the two devices, so values agree to about 1e-4; fractions
    and histogram totals are exact.
    """
    cpu_model = _model()
    cuda_model = copy.deepcopy(cpu_model).cuda()
    x = torch.randn(4, 6, 32)
    sinks = {"cpu": RecordingSink(), "cuda": RecordingSink()}
    for name, model, batch in (("cpu", cpu_model, x), ("cuda", cuda_model, x.cuda())):
        with inject_observer(model, sink=sinks[name]):
            model(batch).square().mean().backward()
    cpu, cuda = values_by_row(sinks["cpu"]), values_by_row(sinks["cuda"])
    assert cpu.keys() == cuda.keys()
    for key, value in cpu.items():
        assert cuda[key] == pytest.approx(value, rel=2e-3, abs=1e-5), key
    for cpu_hist, cuda_hist in zip(
        sinks["cpu"].samples[0].histograms, sinks["cuda"].samples[0].histograms, strict=True
    ):
        assert sum(cpu_hist.counts) == sum(cuda_hist.counts)


def test_compiled_model_on_cuda_is_observed_without_recompiling() -> None:
    """An inductor-compiled CUDA model: eager statistics, and one compile for all steps."""
    from torch._dynamo.utils import counters
    from torch._inductor import config

    torch._dynamo.reset()
    eager_model = _model().cuda()
    compiled: nn.Module = torch.compile(copy.deepcopy(eager_model))  # type: ignore[assignment]
    sink, eager_sink = RecordingSink(), RecordingSink()
    x = torch.randn(8, 10, 32, device="cuda")
    graphs = []
    with (
        config.patch(compile_threads=1),  # no process-wide pool of compile workers left behind
        inject_observer(compiled, sink=sink) as observer,
        inject_observer(eager_model, sink=eager_sink) as eager_observer,
    ):
        train_side_by_side(
            [(observer, compiled), (eager_observer, eager_model)],
            x,
            6,
            lambda step: step % 2 == 0,
            lambda _: graphs.append(counters["stats"]["unique_graphs"]),
        )
    assert graphs[-1] == graphs[1]
    expected = values_by_row(eager_sink)
    for key, value in values_by_row(sink).items():
        assert value == pytest.approx(expected[key], rel=1e-4, abs=1e-6), key


def test_a_sampled_step_adds_at_most_the_largest_activation_to_peak_memory() -> None:
    """Peak CUDA memory of a sampled step exceeds an unsampled one's by at most one activation.

    The largest activation is measured in float32, the working dtype of the reductions.
    """
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(256, 4096), nn.GELU(), nn.Linear(4096, 256)).to(device)
    x = torch.randn(512, 256, device=device)
    largest = 512 * 4096 * 4  # the GELU's output, in bytes
    peaks = {}
    with inject_observer(model, sink=RecordingSink()) as observer:
        for step, sample in enumerate([True, False, True, False, True]):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            start = torch.cuda.memory_allocated()
            observer.begin_step(step, sample=sample)
            model(x).square().mean().backward()
            observer.end_step()
            torch.cuda.synchronize()
            peaks[sample] = torch.cuda.max_memory_allocated() - start
            model.zero_grad(set_to_none=True)
    assert peaks[True] - peaks[False] <= largest, peaks
