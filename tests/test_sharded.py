"""Sharded parameters in step records: whole-tensor statistics from every rank's shard.

Two real gloo processes (``torch.multiprocessing.spawn``, ``file://`` rendezvous); run these
under ``flock /tmp/ti-ddp.lock``. Each worker writes its rows as JSON; the test compares them
with the same tensors measured whole on one process.
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from torchinstruments_core import AlwaysSampler, Signal, StepTensor, inject_observer
from torchinstruments_core.reducers import DEFAULT_METRICS, default_reducers, precision_reducers
from torchinstruments_core.reducers.functional import DEFAULT_SAMPLE_SIZE
from torchinstruments_core.testing import RecordingSink

if TYPE_CHECKING:
    from collections.abc import Iterator

tensor_api = pytest.importorskip("torch.distributed.tensor")
mesh_api = pytest.importorskip("torch.distributed.device_mesh")

EXACT = ("min", "max", "zero_fraction", "nonfinite_fraction", "max_abs")
ROUNDED = ("mean", "std", "rms", "l2_norm")
QUARTILES = ("p25", "p50", "p75")


def _tensors() -> dict[str, tuple[torch.Tensor, int]]:
    """The full tensors (alike on every rank) and the dim each is sharded along."""
    generator = torch.Generator().manual_seed(4)
    odd = torch.randn(1001, 37, generator=generator) * 2 + 0.5
    odd[::17, 3] = 0.0
    odd[5, 5], odd[900, 1], odd[999, 36] = math.nan, math.inf, -math.inf
    large = torch.randn(200_003, 1, generator=generator, dtype=torch.float64) ** 3
    edge = (torch.rand(301, 7, generator=generator, dtype=torch.float64) - 0.4) * 1e300
    return {
        "odd": (odd, 0),  # uneven shards (501 and 500 rows), zeros and non-finite entries
        "small": (torch.randn(5, 3, generator=generator), 0),  # exact quartiles (15 entries)
        "columns": (torch.randn(40, 9, generator=generator), 1),  # Shard(1)
        "large": (large, 0),  # subsampled quartiles (so are odd's 37,037 entries)
        "edge": (edge, 0),  # squares past float64: the scaled sums
        "single": (torch.tensor([[2.5]]), 0),  # rank 1's shard is empty
    }


def _rows(sink: RecordingSink) -> dict[str, dict[str, Any]]:
    table: dict[str, dict[str, Any]] = {}
    for row in sink.rows:
        key = f"{row.layer}/{row.signal}/{row.tensor_path}"
        table.setdefault(key, {})[row.metric] = [row.value, row.unavailable_reason]
    return table


@contextlib.contextmanager
def _counting_all_gathers() -> Iterator[list[int]]:
    """Count the calls of ``torch.distributed.all_gather`` (what the combination runs)."""
    calls: list[int] = []
    original = dist.all_gather

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return original(*args, **kwargs)

    dist.all_gather = counting
    try:
        yield calls
    finally:
        dist.all_gather = original


def _record_worker(rank: int, folder: str, policy: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{folder}/rdv", rank=rank, world_size=2)
    try:
        mesh = mesh_api.init_device_mesh("cpu", (2,))
        sink = RecordingSink()
        reducers = (*default_reducers(), *precision_reducers())
        model = nn.Linear(2, 2)
        with inject_observer(model, sink=sink, rank_policy=policy, reducers=reducers) as observer:
            sharded, whole = [], []
            for name, (tensor, dim) in _tensors().items():
                placed = tensor_api.distribute_tensor(tensor, mesh, [tensor_api.Shard(dim)])
                sharded.append(StepTensor(name, Signal.PARAMETER, "weight", placed))
                whole.append(StepTensor(name, Signal.PARAMETER, "whole", tensor))
            with _counting_all_gathers() as calls:
                ids = [observer.record_step(7, sharded), observer.record_step(8, whole)]
        result = {"ids": ids, "rows": _rows(sink), "collectives": len(calls)}
        pathlib.Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def _run(worker: Any, tmp_path: pathlib.Path, *args: Any) -> list[dict[str, Any]]:
    mp.spawn(worker, args=(str(tmp_path), *args), nprocs=2, join=True)  # type: ignore[attr-defined]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def _rank_error(values: np.ndarray, got: float, level: float) -> float:
    """How far, in rank, ``got`` is from the ``level`` quantile of the finite ``values``."""
    ordered = np.sort(values[np.isfinite(values)])
    low = np.searchsorted(ordered, got, side="left") / ordered.size
    high = np.searchsorted(ordered, got, side="right") / ordered.size
    return 0.0 if low <= level <= high else min(abs(low - level), abs(high - level))


def _assert_whole(rows: dict[str, dict[str, Any]]) -> None:
    """The sharded rows equal the whole tensor's: exactly, to rounding, or within the bound."""
    for name, (tensor, _) in _tensors().items():
        got = rows[f"{name}/parameter/weight"]
        want = rows[f"{name}/parameter/whole"]
        assert set(got) == set(want)
        for metric in EXACT:
            assert got[metric] == want[metric], (name, metric)
        for metric in ROUNDED:
            assert got[metric][0] == pytest.approx(want[metric][0], rel=1e-6), (name, metric)
        for metric, level in zip(QUARTILES, (0.25, 0.5, 0.75), strict=True):
            if tensor.numel() > DEFAULT_SAMPLE_SIZE:  # subsampled: the stated bound, eps + W / m
                values = tensor.double().numpy().reshape(-1)
                assert _rank_error(values, got[metric][0], level) <= 0.030 + 2 / 8192
            else:  # every entry sent: the exact quartiles of the whole tensor
                assert got[metric][0] == pytest.approx(want[metric][0], rel=1e-6), (name, metric)
        assert got["kurtosis"] == [None, "sharded_tensor"]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["rank0", "all"])
def test_sharded_step_tensors_describe_the_whole_tensor(
    tmp_path: pathlib.Path, policy: str
) -> None:
    """Over two gloo ranks a sharded tensor's rows are those of the whole tensor.

    Counts, min, max, zero and non-finite fractions are equal to the whole tensor's measured on
    one process, mean, std, rms and l2_norm equal to rounding (also near 1e300 and with an empty
    shard), quartiles exact where every entry is sent and within the stated rank bound where
    subsampled; a reducer without a combination (the precision set) says ``sharded_tensor``.
    The six sharded tensors take one collective on each rank. Under ``rank0`` rank 1 joins it
    but records nothing; under ``all`` both ranks record the same rows. Neither hangs.
    """
    results = _run(_record_worker, tmp_path, policy)
    # six sharded tensors, one collective, on both ranks; the whole tensors need none
    assert [r["collectives"] for r in results] == [1, 1]
    _assert_whole(results[0]["rows"])
    assert results[0]["ids"] == [0, 1]
    if policy == "rank0":
        assert (results[1]["ids"], results[1]["rows"]) == ([None, None], {})
    else:  # the whole tensors' own subsamples differ by rank: their generators moved apart
        sharded = [{k: v for k, v in r["rows"].items() if k.endswith("/weight")} for r in results]
        assert sharded[1] == sharded[0]
    assert len(results[0]["rows"]["odd/parameter/weight"]) == len(DEFAULT_METRICS) + 9


def _fsdp_worker(rank: int, folder: str, policy: str) -> None:
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{folder}/rdv", rank=rank, world_size=2)
    try:
        mesh = mesh_api.init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 33), nn.Tanh(), nn.Linear(33, 3))
        fully_shard(model, mesh=mesh)
        initial = {
            n: p.full_tensor().detach().clone()  # type: ignore[attr-defined]
            for n, p in model.named_parameters()
        }
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sink = RecordingSink()
        collectives: list[int] = []
        with inject_observer(
            model, sink=sink, sampler=AlwaysSampler(), optimizer=optimizer, rank_policy=policy
        ):
            for step in range(2):
                x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step + rank))
                model(x).square().mean().backward()
                with _counting_all_gathers() as calls:
                    optimizer.step()
                collectives.append(len(calls))
                optimizer.zero_grad()
        steps = [s for s in sink.samples if any(str(r.signal) == "parameter" for r in s.rows)]
        rows = {
            f"{r.layer}.{r.tensor_path}/{r.metric}": r.value
            for r in (steps[0].rows if steps else ())
            if str(r.signal) == "parameter"
        }
        expected = {}
        for name, tensor in initial.items():
            values = tensor.double().reshape(-1)
            expected[f"{name}/mean"] = values.mean().item()
            expected[f"{name}/max"] = values.max().item()
            expected[f"{name}/l2_norm"] = torch.linalg.vector_norm(values).item()
            expected[f"{name}/p50"] = values.quantile(0.5).item()
        result = {"rows": rows, "expected": expected, "collectives": collectives}
        pathlib.Path(folder, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["rank0", "all"])
def test_fully_shard_parameters_are_measured_whole_through_the_optimizer(
    tmp_path: pathlib.Path, policy: str
) -> None:
    """FSDP2 ``fully_shard`` on CPU, a real AdamW: the ``parameter`` rows are the full parameter's.

    The first recorded step's parameters (before its update) are the initial ones: mean, max,
    l2_norm and the median equal those of ``full_tensor()`` (exact quartiles: every parameter
    has fewer than 8,192 entries). Each sampled optimizer step runs one collective for all its
    sharded tensors. Under ``rank0`` rank 1 joins each step's collective and writes nothing;
    under ``all`` both ranks write the same values. No hang either way.
    """
    results = _run(_fsdp_worker, tmp_path, policy)
    # each sampled step: one collective for its 4 parameters x 4 signals, on every rank
    assert [r["collectives"] for r in results] == [[1, 1], [1, 1]]
    for rank, result in enumerate(results):
        if policy == "rank0" and rank == 1:
            assert result["rows"] == {}
            continue
        assert set(result["expected"]) <= set(result["rows"])
        for key, value in result["expected"].items():
            assert result["rows"][key] == pytest.approx(value, rel=1e-6, abs=1e-7), (rank, key)
