"""The findings rules, each on a small run recorded with a planted fault and on a healthy one."""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import polars as pl
import pytest
import torch
from polars.testing import assert_frame_equal
from torch import nn

from analysis_helpers import FAULT_AT, FrameRun, Gain, model, record
from torchinstruments_analysis.findings import COLUMNS, Rule, Thresholds, find
from torchinstruments_analysis.read import Run, open_run

_M = TypeVar("_M", bound=nn.Module)


def _rule(found: pl.DataFrame, rule: Rule) -> pl.DataFrame:
    return found.filter(pl.col("rule") == rule.value)


def _part(net: nn.Module, name: str, kind: type[_M]) -> _M:
    module = net.get_submodule(name)
    assert isinstance(module, kind)
    return module


def _at_fault(net: nn.Module, step: int) -> bool:
    return step == FAULT_AT


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory):
    return record(tmp_path_factory.mktemp("healthy") / "run", model(("relu2", nn.ReLU())))


def test_healthy_run_has_no_finding(healthy) -> None:
    """A healthy ReLU MLP gives no finding of any rule, in the documented columns."""
    found = find(open_run(healthy))
    assert found.columns == list(COLUMNS)
    assert found.height == 0, found.get_column("message").to_list()


def test_dead_units_name_the_relu_after_a_bias_shift(tmp_path) -> None:
    """A large negative bias before a ReLU is named as dead units from the first broken sample."""

    def shift(net: nn.Module, step: int) -> None:
        if _at_fault(net, step):
            _part(net, "fc2", nn.Linear).bias.sub_(100.0)

    run = open_run(record(tmp_path / "run", model(("relu2", nn.ReLU())), fault=shift))
    dead = _rule(find(run), Rule.DEAD_UNITS)
    assert dead.select("layer", "signal", "metric", "sample_id").rows() == [
        ("relu2", "output", "zero_fraction", FAULT_AT)
    ]
    assert dead.item(0, "value") >= 0.99
    assert dead.item(0, "threshold") == 0.99


def test_dead_units_use_the_catalog_type_else_the_name(tmp_path) -> None:
    """Without result.json the ReLU family is read from the name; an unnamed one is not guessed."""

    def shift(net: nn.Module, step: int) -> None:
        if _at_fault(net, step):
            _part(net, "fc2", nn.Linear).bias.sub_(100.0)

    source = open_run(record(tmp_path / "run", model(("act", nn.ReLU())), fault=shift))
    assert _rule(find(source), Rule.DEAD_UNITS).get_column("layer").to_list() == ["act"]
    for name, expected in (("act", []), ("block.relu", ["block.relu"])):
        renamed = source.history.with_columns(pl.col("layer").replace("act", name))
        layers = [name if n == "act" else n for n in source.layers]
        bare = FrameRun(tmp_path / "no_catalog", renamed, source.samples, layers)
        assert _rule(find(bare), Rule.DEAD_UNITS).get_column("layer").to_list() == expected


@pytest.mark.parametrize(("activation", "bound"), [(nn.Sigmoid, "bounds"), (nn.Tanh, "bounds")])
def test_saturation_names_a_squashing_layer_driven_to_its_bounds(
    tmp_path, activation, bound
) -> None:
    """Weights scaled up 100x pile sigmoid/tanh outputs at their bounds; unscaled ones do not."""

    def scale(net: nn.Module, step: int) -> None:
        if _at_fault(net, step):
            _part(net, "fc2", nn.Linear).weight.mul_(100.0)

    broken = find(open_run(record(tmp_path / "b", model(("act", activation())), fault=scale)))
    healthy = find(open_run(record(tmp_path / "h", model(("act", activation())))))
    saturated = _rule(broken, Rule.SATURATION)
    assert saturated.select("layer", "sample_id").rows() == [("act", FAULT_AT)]
    assert bound in saturated.item(0, "message")
    assert _rule(healthy, Rule.SATURATION).height == 0


@pytest.mark.parametrize(
    ("gain", "rule"), [(1e-4, Rule.VANISHING_GRADIENT), (1e4, Rule.EXPLODING_GRADIENT)]
)
def test_gradient_steps_name_the_layer_before_a_gain(tmp_path, gain, rule) -> None:
    """A gain of 1e-4 (1e4) shrinks (grows) the gradient reaching the layer before it 1e4x."""

    def set_gain(net: nn.Module, step: int) -> None:
        if _at_fault(net, step):
            _part(net, "gain", Gain).gain = gain

    run = open_run(record(tmp_path / "run", model(("gain", Gain())), fault=set_gain, steps=6))
    steps = _rule(find(run), rule)
    assert steps.select("layer", "signal", "sample_id").rows()[0] == (
        "fc2",
        "output_gradient",
        FAULT_AT,
    )
    ratio = steps.item(0, "value")
    assert ratio == pytest.approx(gain, rel=1e-3)
    assert "that of gain, the next observed layer in execution order" in steps.item(0, "message")


def test_gradient_growth_names_gradients_growing_over_steps(tmp_path, healthy) -> None:
    """A loss scaled up 10x a step from the fault on grows every output gradient past 100x."""
    net = model(("relu2", nn.ReLU()))
    scale = lambda step: 10.0 ** max(0, step - FAULT_AT + 1)  # noqa: E731
    run = open_run(record(tmp_path / "run", net, loss_scale=scale, lr=0.0, steps=10))
    growth = _rule(find(run), Rule.GRADIENT_GROWTH)
    assert set(growth.get_column("layer")) == {"fc1", "relu1", "fc2", "relu2", "head"}
    # first three samples scale 1, last three 10**4, 10**5, 10**6: about 370,000 (the batches
    # differ, so the unscaled gradients differ a little too)
    head = growth.filter(pl.col("layer") == "head").item(0, "value")
    assert head == pytest.approx(3.7e5, rel=0.2)
    assert _rule(find(open_run(healthy)), Rule.GRADIENT_GROWTH).height == 0


def test_scale_drift_and_thresholds_are_configurable(tmp_path) -> None:
    """A gain growing 2x a step drifts its output past 10x; a 1e6 factor keeps the rule silent."""

    def grow(net: nn.Module, step: int) -> None:
        if step >= FAULT_AT:
            _part(net, "gain", Gain).gain *= 2

    run = open_run(record(tmp_path / "run", model(("gain", Gain())), fault=grow, lr=0.0))
    drift = _rule(find(run), Rule.SCALE_DRIFT)
    assert drift.get_column("layer").to_list()[0] == "gain"
    # early gains 1, 1, 1; recent 2**6, 2**7, 2**8, weights fixed: about 149 (batches differ)
    assert drift.item(0, "value") == pytest.approx(448 / 3, rel=0.05)
    quiet = find(run, thresholds=Thresholds(scale_drift_factor=1e6))
    assert _rule(quiet, Rule.SCALE_DRIFT).height == 0


class _Spike(nn.Module):
    """Adds 1e4 to the first entry while ``on``."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.on:
            return x
        spike = torch.zeros_like(x)
        spike.view(-1)[0] = 1e4
        return x + spike


def test_outliers_name_a_layer_with_one_huge_entry(tmp_path, healthy) -> None:
    """One entry of 1e4 among 8,192 puts max_abs / rms near 90, above the default 50."""

    def spike(net: nn.Module, step: int) -> None:
        _part(net, "spike", _Spike).on = step >= FAULT_AT

    net = model(("spike", _Spike()))
    run = open_run(record(tmp_path / "run", net, fault=spike, batch=256))
    found = _rule(find(run), Rule.OUTLIERS)
    assert found.select("layer", "sample_id").rows()[0] == ("spike", FAULT_AT)
    assert found.item(0, "value") == pytest.approx(90.5, rel=0.02)
    assert _rule(find(open_run(healthy)), Rule.OUTLIERS).height == 0


def test_update_to_weight_outside_the_band(tmp_path, healthy) -> None:
    """update_to_weight above 0.1 or below 1e-5 is named at its first record; inside, not.

    No trainer records the ``update`` signal yet, so its rows are added to a real run's table
    in the table's own schema.
    """
    run = open_run(healthy)
    template = run.history.filter(pl.col("signal") == "output").head(1).collect()
    values = {"fc1": [1e-3] * 4 + [0.5] * 4, "fc2": [1e-3] * 8, "head": [1e-3, 1e-7]}
    added = [
        template.with_columns(
            sample_id=pl.lit(100 + i, dtype=template.schema["sample_id"]),
            layer=pl.lit(layer),
            call_index=pl.lit(0, dtype=template.schema["call_index"]),
            signal=pl.lit("update"),
            tensor_path=pl.lit("weight"),
            metric=pl.lit("update_to_weight"),
            value=pl.lit(value, dtype=template.schema["value"]),
        )
        for layer, series in values.items()
        for i, value in enumerate(series)
    ]
    history = pl.concat([run.history.collect(), *added]).lazy()
    found = _rule(find(FrameRun(healthy, history, run.samples, run.layers)), Rule.UPDATE_TO_WEIGHT)
    assert found.select("layer", "sample_id", "value", "threshold").rows() == [
        ("head", 101, 1e-7, 1e-5),
        ("fc1", 104, 0.5, 0.1),
    ]
    assert _rule(find(run), Rule.UPDATE_TO_WEIGHT).height == 0


def _two_ranks(tmp_path, scale: float) -> FrameRun:
    net = model(("relu2", nn.ReLU()))
    first = open_run(record(tmp_path / "r0", net))
    second = open_run(record(tmp_path / "r1", model(("relu2", nn.ReLU())), input_scale=scale))
    history = pl.concat(
        [
            first.history,
            second.history.with_columns(
                rank=pl.lit(1, dtype=pl.Int64()).cast(first.history.collect_schema()["rank"])
            ),
        ]
    )
    return FrameRun(tmp_path, history, first.samples, first.layers)


def test_rank_disagreement_names_a_rank_100x_off(tmp_path) -> None:
    """Rank 1 fed inputs 1000x larger disagrees with rank 0 on the first layer's output rms."""
    found = _rule(find(_two_ranks(tmp_path, 1000.0)), Rule.RANK_DISAGREEMENT)
    first = found.filter((pl.col("layer") == "fc1") & (pl.col("signal") == "output"))
    assert first.select("metric", "sample_id").rows() == [("rms", 0)]
    assert "rank 1" in first.item(0, "message")
    assert first.item(0, "value") > 100


def test_ranks_within_the_factor_do_not_disagree(tmp_path) -> None:
    """Ranks whose inputs differ 2x in scale give no rank_disagreement."""
    assert _rule(find(_two_ranks(tmp_path, 2.0)), Rule.RANK_DISAGREEMENT).height == 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("scale_drift_factor", 1.0), ("dead_zero_fraction", 0.0), ("window", 0),
     ("update_to_weight_band", (0.1, 0.01))],
)  # fmt: skip
def test_thresholds_refuse_invalid_values(field, value) -> None:
    """A threshold that cannot work fails at construction, naming the field and the value."""
    with pytest.raises(ValueError, match=rf"Thresholds\.{field}="):
        Thresholds(**{field: value})
    assert dataclasses.is_dataclass(Thresholds())


def test_the_analysis_modules_import_no_torch() -> None:
    """Importing findings, plots and watch (and reading a run) loads neither torch nor pyplot."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import torchinstruments_analysis.findings, torchinstruments_analysis.plots\n"
        "import torchinstruments_analysis.watch\n"
        "print(sorted(m for m in ('torch', 'matplotlib.pyplot', 'rich') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("fault", ["ranks", "growth", "exploding"])
def test_cross_sample_rules_read_in_spans_give_the_same_rows(tmp_path, fault) -> None:
    """Rank comparisons, gradient growth and gradient steps read one sample at a time: same rows.

    A step's ranks may sit in two spans, and growth compares a tensor's first samples with its
    last: both carry across spans exactly.
    """
    run: FrameRun | Run
    if fault == "ranks":
        run = _two_ranks(tmp_path, 1000.0)
    elif fault == "growth":
        scale = lambda step: 10.0 ** max(0, step - FAULT_AT + 1)  # noqa: E731
        net = model(("relu2", nn.ReLU()))
        run = open_run(record(tmp_path / "run", net, loss_scale=scale, lr=0.0, steps=10))
    else:

        def set_gain(net: nn.Module, step: int) -> None:
            if _at_fault(net, step):
                _part(net, "gain", Gain).gain = 1e4

        run = open_run(record(tmp_path / "run", model(("gain", Gain())), fault=set_gain))
    whole = find(run, chunk_rows=10**9)
    assert whole.height > 0
    assert_frame_equal(find(run, chunk_rows=1), whole)


def test_find_refuses_an_empty_span(healthy) -> None:
    """``chunk_rows`` below 1 fails at once, naming the argument and the value."""
    with pytest.raises(ValueError, match=r"chunk_rows=0"):
        find(open_run(healthy), chunk_rows=0)


def test_update_to_weight_leaves_out_biases_that_start_at_zero(tmp_path) -> None:
    """A LayerNorm's zero bias has an infinite, then large, ratio: no finding; weights are read.

    Recorded for real with ``inject_observer(..., optimizer=...)``; the same run with a band
    whose top sits below the weights' ratios names them.
    """
    net = model(("norm", nn.LayerNorm(32)), ("relu2", nn.ReLU()))
    run = open_run(record(tmp_path / "run", net, optimizer_steps=True))
    ratios = run.history.filter(pl.col("metric") == "update_to_weight").collect()
    bias = ratios.filter(pl.col("layer") == "norm", pl.col("tensor_path") == "bias")
    bias = bias.sort("sample_id")
    assert bias.item(0, "unavailable_reason") == "non_finite_result"  # 0 / 0 at the first step
    assert bias.select(pl.col("value").max()).item() > 0.1  # then a step as large as the bias
    assert _rule(find(run), Rule.UPDATE_TO_WEIGHT).height == 0
    weights = ratios.filter(pl.col("tensor_path") == "weight")["value"]
    tight = Thresholds(update_to_weight_band=(1e-9, min(weights.drop_nulls().to_list()) / 2))
    named = _rule(find(run, thresholds=tight), Rule.UPDATE_TO_WEIGHT)
    assert set(named["layer"]) == {"fc1", "fc2", "norm", "head"}
    assert named["message"].str.contains(".weight is").all()
