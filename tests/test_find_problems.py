"""examples/find_problems.py: each planted fault is named by its rule; baseline and fix are not."""

from __future__ import annotations

import polars as pl
import pytest
from polars.testing import assert_frame_equal

from analysis_helpers import load_example
from torchinstruments_analysis.findings import Rule, find
from torchinstruments_analysis.read import open_run

example = load_example()


@pytest.mark.parametrize("fault", list(example.Fault))
def test_each_fault_is_named_by_its_rule_and_the_fix_clears_it(tmp_path, fault) -> None:
    """Broken: the rule's first finding names the faulty layer; baseline and fix: no finding.

    The finding comes after the healthy samples, the fault's start.
    """
    rule, layer = example.EXPECTED[fault]
    found = {
        variant: find(open_run(example.record(fault, variant, tmp_path)))
        for variant in example.Variant
    }
    broken = found[example.Variant.BROKEN].filter(pl.col("rule") == rule.value)
    assert broken.height > 0, found[example.Variant.BROKEN]
    assert broken.item(0, "layer") == layer
    assert broken.item(0, "sample_id") >= example.HEALTHY_SAMPLES
    for variant in (example.Variant.BASELINE, example.Variant.FIXED):
        assert found[variant].filter(pl.col("rule") == rule.value).height == 0, variant


def test_the_invalid_log_is_named_where_it_started(tmp_path) -> None:
    """The log layer's output is the first non-finite one; later layers name it as the start."""
    fault = example.Fault.INVALID_LOG
    run = example.record(fault, example.Variant.BROKEN, tmp_path)
    onsets = find(open_run(run)).filter(pl.col("rule") == Rule.NONFINITE_ONSET.value)
    assert onsets.select("layer", "signal").row(0) == ("log", "output")
    assert "first non-finite values of the run" in onsets.item(0, "message")
    later = onsets.slice(1)
    assert later.height > 0
    assert later.get_column("message").str.contains("the first were in log output").all()


def test_baselines_give_no_finding_at_all(tmp_path) -> None:
    """A healthy run of every fault's model gives no finding of any rule."""
    for fault in example.Fault:
        run = example.record(fault, example.Variant.BASELINE, tmp_path)
        assert find(open_run(run)).height == 0, fault


def test_findings_do_not_depend_on_how_much_is_read_at_once(tmp_path) -> None:
    """Read one sample at a time, every broken run gives exactly the findings read whole gives.

    ``find`` reads a run in spans of samples (bounded memory); onsets, counts, drifts and lost
    gradients carry across spans, so the smallest spans change no row.
    """
    for fault in example.Fault:
        run = open_run(example.record(fault, example.Variant.BROKEN, tmp_path))
        whole = find(run, chunk_rows=10**9)
        assert whole.height > 0, fault
        assert_frame_equal(find(run, chunk_rows=1), whole)


def test_a_learning_rate_too_large_names_each_weight_from_its_first_large_step(tmp_path) -> None:
    """A learning rate 10x larger each step names every weight, at a step record after the fault.

    The ratios of the healthy steps sit near 1e-3 (Karpathy's rule of thumb); the finding
    comes at an optimizer step record (``samples.parquet`` kind ``step``) after the fault began.
    """
    fault = example.Fault.LEARNING_RATE
    run = open_run(example.record(fault, example.Variant.BROKEN, tmp_path))
    found = find(run).filter(pl.col("rule") == Rule.UPDATE_TO_WEIGHT.value)
    assert set(found["layer"]) == {"fc1", "fc2", "head"}
    assert (found["value"] > 0.1).all()
    records = run.samples.collect()
    steps = records.filter(pl.col("kind") == "step").sort("sample_id")["sample_id"].to_list()
    assert set(found["sample_id"]) <= set(steps[example.HEALTHY_SAMPLES :])
    healthy = run.history.filter(
        pl.col("metric") == "update_to_weight",
        pl.col("tensor_path") == "weight",
        pl.col("sample_id").is_in(steps[: example.HEALTHY_SAMPLES]),
    ).collect()["value"]
    assert 1e-4 < healthy.to_frame().select(pl.col("value").median()).item() < 1e-2
