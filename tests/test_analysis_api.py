"""The analysis API on real runs: summary, first_nonfinite, diff and ranks."""

from __future__ import annotations

import math

import polars as pl
import pytest
from torch import nn

from analysis_helpers import model, record
from analysis_runs import GradientBlowup, blowup_model, train, write_rank_folders
from torchinstruments_analysis import diff, first_nonfinite, open_run, ranks, summary
from torchinstruments_core.run_directory import history_schema


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Healthy runs (two input scales), a forward blowup and a backward blowup at sample 4."""
    root = tmp_path_factory.mktemp("runs")
    train(blowup_model(), root / "healthy", healthy=20)
    train(blowup_model(), root / "scaled", healthy=20, scale=3.0)
    train(blowup_model(), root / "forward", healthy=4, broken=3)
    train(blowup_model(GradientBlowup), root / "backward", healthy=4, broken=2)
    return root


def test_summary_matches_polars_computed_directly(runs):
    """Each summary cell is the mean (max for nonfinite) over the run's samples, per layer."""
    run = open_run(runs / "healthy")
    table = summary(run)
    history = pl.read_parquet(runs / "healthy" / "history.parquet")
    assert table["layer"].to_list() == ["0", "1", "2", "3", "4"]
    assert "rank" not in table.columns
    assert "update_to_weight" not in table.columns
    for row in table.iter_rows(named=True):
        mine = history.filter(pl.col("layer") == row["layer"])
        for signal in ("output", "output_gradient"):
            rms = mine.filter(pl.col("signal") == signal, pl.col("metric") == "rms")
            assert row[f"{signal}_rms"] == pytest.approx(rms["value"].mean())
            early = rms.filter(pl.col("sample_id") <= 1)["value"].mean()  # first tenth of 20
            recent = rms.filter(pl.col("sample_id") >= 18)["value"].mean()
            assert row[f"{signal}_rms_early"] == pytest.approx(early)
            assert row[f"{signal}_rms_recent"] == pytest.approx(recent)
            zeros = mine.filter(pl.col("signal") == signal, pl.col("metric") == "zero_fraction")
            assert row[f"{signal}_zero_fraction"] == pytest.approx(zeros["value"].mean())
        assert row["samples"] == 20
    assert table.filter(pl.col("layer") == "1")["output_zero_fraction"][0] > 0.2  # a ReLU


def test_summary_filters_layers_signals_metrics_and_steps(runs):
    """A glob, a signal, a metric and a step range narrow the rows and columns."""
    run = open_run(runs / "healthy")
    table = summary(run, layers="[13]", signals=["output"], metrics=["max_abs"], steps=(5, 10))
    assert table["layer"].to_list() == ["1", "3"]
    assert table.columns[4:] == ["output_max_abs", "output_max_abs_early", "output_max_abs_recent"]
    assert table["samples"].to_list() == [5, 5]
    history = pl.read_parquet(runs / "healthy" / "history.parquet")
    expected = history.filter(
        pl.col("layer") == "3",
        pl.col("signal") == "output",
        pl.col("metric") == "max_abs",
        pl.col("sample_id").is_between(5, 9),
    )["value"]
    assert table["output_max_abs"][1] == pytest.approx(expected.mean())


def test_summary_shows_the_largest_nonfinite_fraction(runs):
    """nonfinite_fraction is the largest seen, so a single bad sample shows."""
    table = summary(open_run(runs / "forward"), layers="2")
    assert table["output_nonfinite_fraction"][0] == 1.0


def test_summary_adds_update_to_weight_only_when_the_run_has_it(tmp_path):
    """Step records with update_to_weight add its columns; other runs do not get them."""
    write_rank_folders(tmp_path, {0: [1.0, 1.0]}, ["a", "b"])
    path = tmp_path / "rank-000" / "history.parquet"
    history = pl.read_parquet(path)
    updates = history.filter(pl.col("layer") == "a").with_columns(
        signal=pl.lit("update"),
        tensor_path=pl.lit("weight"),
        metric=pl.lit("update_to_weight"),
        value=pl.Series([1e-3, 3e-3]),
    )
    pl.concat([history, updates]).write_parquet(path)
    table = summary(open_run(tmp_path))
    assert table["update_to_weight"].to_list() == [pytest.approx(2e-3), None]
    assert table["update_to_weight_early"][0] == pytest.approx(1e-3)
    assert table["update_to_weight_recent"][0] == pytest.approx(3e-3)


def test_summary_shows_the_optimizer_steps_per_layer(tmp_path):
    """A run recorded with its optimizer: each layer's weights' update_to_weight and gradient rms.

    They are the means over the step records of the layer's weights (biases left out), and the
    whole-model rows (layer ``<model>``) give no row of their own.
    """
    path = record(tmp_path / "run", model(("relu2", nn.ReLU())), optimizer_steps=True)
    table = summary(open_run(path))
    history = pl.read_parquet(path / "history.parquet")
    assert history.filter(pl.col("layer") == "<model>").height > 0
    assert table["layer"].to_list() == ["fc1", "relu1", "fc2", "relu2", "head"]
    assert table["samples"].to_list() == [12] * 5  # forward samples; step records apart
    columns = {
        "update_to_weight": ("update", "update_to_weight"),
        "parameter_gradient_rms": ("parameter_gradient", "rms"),
    }
    for row in table.iter_rows(named=True):
        for column, (signal, metric) in columns.items():
            weight = history.filter(
                pl.col("layer") == row["layer"],
                pl.col("signal") == signal,
                pl.col("metric") == metric,
                pl.col("tensor_path") == "weight",
            )["value"]
            if weight.len() == 0:  # a ReLU has no parameter
                assert row[column] is None
            else:
                assert row[column] == pytest.approx(weight.mean())
                assert row[f"{column}_early"] == pytest.approx(weight[:2].mean())  # 2 of 12


def test_first_nonfinite_names_the_forward_layer_that_started_it(runs):
    """Layer 2 multiplies by inf at sample 4: forward starts there, backward is passed on."""
    found = first_nonfinite(open_run(runs / "forward"))
    forward, backward = found.to_dicts()
    assert forward["sample_id"] == 4
    assert forward["direction"] == "forward"
    assert forward["layer"] == "2"
    assert forward["started"] is True
    assert (forward["evidence"], forward["compared_with"]) == ("previous_layer", "1")
    assert backward["direction"] == "backward"
    assert backward["layer"] == "4"
    assert backward["started"] is False
    assert backward["evidence"] == "forward_output"


def test_first_nonfinite_names_the_backward_layer(runs):
    """Layer 2's backward multiplies by inf: layer 1's output gradient is first; forward clean."""
    found = first_nonfinite(open_run(runs / "backward"))
    assert found.height == 1
    row = found.row(0, named=True)
    assert (row["sample_id"], row["direction"], row["layer"]) == (4, "backward", "1")
    assert row["started"] is True
    assert row["compared_with"] == "2"


def test_first_nonfinite_is_empty_for_a_healthy_run(runs):
    """No row says non-finite: the frame is empty, with its columns."""
    found = first_nonfinite(open_run(runs / "healthy"))
    assert found.height == 0
    assert "started" in found.columns


def _long_rows(sample, layer, signal, *, fraction, rank=0):
    base = {"run_id": "h", "rank": rank, "sample_id": sample, "step": None, "timestamp": None}
    base |= {"layer": layer, "call_index": 0, "signal": signal, "tensor_path": "output"}
    return [
        base | {"metric": "nonfinite_fraction", "value": fraction, "unavailable_reason": None},
        base
        | {
            "metric": "rms",
            "value": None if fraction == 1.0 else 1.0,
            "unavailable_reason": "no_finite_values" if fraction == 1.0 else None,
        },
    ]


def test_an_input_signal_says_when_the_first_layer_was_passed_a_nonfinite_input(tmp_path):
    """With an ``input`` signal recorded, a non-finite input makes the first layer passed on."""
    folder = tmp_path / "hand"
    folder.mkdir()
    rows = [
        *_long_rows(0, "a", "output", fraction=0.0),
        *_long_rows(1, "a", "input", fraction=1.0),
        *_long_rows(1, "a", "output", fraction=1.0),
        *_long_rows(1, "b", "output", fraction=1.0),
    ]
    pl.DataFrame(rows, schema=history_schema()).write_parquet(folder / "history.parquet")
    (row,) = first_nonfinite(open_run(folder)).to_dicts()
    assert (row["sample_id"], row["layer"], row["started"]) == (1, "a", False)
    assert row["evidence"] == "input"


def test_diff_ranks_the_layers_that_moved_most_first(runs):
    """Inputs three times larger move the layers after the first linear layer about 3x."""
    moved = diff(open_run(runs / "healthy"), open_run(runs / "scaled"), fail_above=2.0)
    top = moved.row(0, named=True)
    assert top["moved"] == max(moved["moved"])
    assert top["steps"] == 20
    assert moved["moved"].to_list() == sorted(moved["moved"], reverse=True)
    assert moved["exceeds"].any()
    a = pl.read_parquet(runs / "healthy" / "history.parquet")
    b = pl.read_parquet(runs / "scaled" / "history.parquet")

    def mean(frame):
        key = [pl.col(c) == top[c] for c in ("layer", "signal", "metric")]
        return frame.filter(*key)["value"].mean()

    assert top["ratio"] == pytest.approx(mean(b) / mean(a))
    assert top["change"] == pytest.approx(mean(b) - mean(a))
    same = diff(open_run(runs / "healthy"), open_run(runs / "healthy"), fail_above=1.0)
    assert set(same["moved"]) == {1.0}
    assert not same["exceeds"].any()


def test_ranks_finds_the_rank_that_disagrees(tmp_path):
    """At the step where rank 1 doubled, the ratio is 2 and rank 1 is the high one."""
    write_rank_folders(tmp_path, {0: [1.0, 1.0, 1.0], 1: [1.0, 2.0, 1.0]}, ["a", "b"])
    table = ranks(open_run(tmp_path))
    assert table["layer"].to_list() == ["a", "b"]
    for row in table.iter_rows(named=True):
        assert row["max_ratio"] == pytest.approx(2.0)
        assert row["median_ratio"] == pytest.approx(1.0)
        assert (row["step"], row["rank_high"], row["rank_low"], row["ranks"]) == (10, 1, 0, 2)


def test_ranks_is_empty_for_one_rank_and_infinite_for_a_zero(tmp_path):
    """One rank has nothing to compare; a rank at 0 against a positive one is infinitely apart."""
    write_rank_folders(tmp_path / "one", {0: [1.0]}, ["a"])
    assert ranks(open_run(tmp_path / "one")).height == 0
    write_rank_folders(tmp_path / "two", {0: [0.0], 1: [1.0]}, ["a"])
    assert math.isinf(ranks(open_run(tmp_path / "two"))["max_ratio"][0])


def test_first_nonfinite_answers_per_rank(tmp_path):
    """Each rank gets its own first sample: rank 1 broke at sample 1, rank 0 at sample 2."""
    for rank, broken in ((0, 2), (1, 1)):
        folder = tmp_path / f"rank-{rank:03d}"
        folder.mkdir()
        rows = [
            row
            for sample in range(3)
            for layer in ("a", "b")
            for row in _long_rows(
                sample,
                layer,
                "output",
                fraction=1.0 if sample >= broken and layer == "b" else 0.0,
                rank=rank,
            )
        ]
        pl.DataFrame(rows, schema=history_schema()).write_parquet(folder / "history.parquet")
    found = first_nonfinite(open_run(tmp_path))
    assert found.select("rank", "sample_id", "layer").rows() == [(0, 2, "b"), (1, 1, "b")]
    assert found["started"].to_list() == [True, True]
