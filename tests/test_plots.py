"""Figures and the report folder: real PNG files, readable by matplotlib, and an escaped table."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from analysis_helpers import FAULT_AT, model, record
from torchinstruments_analysis.plots import findings_markdown, plot, report
from torchinstruments_analysis.read import open_run

imread = pytest.importorskip("matplotlib.image").imread

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), path
    assert len(data) > 1000, path
    image = imread(path)
    assert image.ndim == 3
    assert image.shape[0] > 50
    assert image.shape[1] > 50


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    def shift(net: nn.Module, step: int) -> None:
        if step == FAULT_AT:
            bias = net.get_submodule("fc2").bias
            assert isinstance(bias, nn.Parameter)
            bias.sub_(100.0)

    root = tmp_path_factory.mktemp("plots")
    healthy = record(root / "healthy", model(("relu2", nn.ReLU())))
    broken = record(root / "broken", model(("relu2", nn.ReLU())), fault=shift)
    return healthy, broken


def test_plot_writes_a_heatmap_and_layer_lines(runs, tmp_path) -> None:
    """One run gives two valid PNGs named after the signal and metric."""
    paths = plot(open_run(runs[0]), tmp_path / "out", metric="rms", signal="output_gradient")
    assert [p.name for p in paths] == [
        "output_gradient_rms_heatmap.png",
        "output_gradient_rms_layers.png",
    ]
    for path in paths:
        _assert_png(path)


def test_two_runs_are_drawn_side_by_side(runs, tmp_path) -> None:
    """Two runs give one comparison heatmap twice as wide as a single run's."""
    single = plot(open_run(runs[0]), tmp_path / "one")
    pair = plot([open_run(runs[0]), open_run(runs[1])], tmp_path / "two")
    assert [p.name for p in pair] == [
        "output_rms_compare_heatmap.png",
        "output_rms_compare_layers.png",
    ]
    for path in pair:
        _assert_png(path)
    assert imread(pair[0]).shape[1] > 1.5 * imread(single[0]).shape[1]


def test_plot_refuses_three_runs(runs, tmp_path) -> None:
    """Comparisons are of two runs; three raise naming the count."""
    run = open_run(runs[0])
    with pytest.raises(ValueError, match="got 3"):
        plot([run, run, run], tmp_path)


def test_report_folder_links_figures_and_findings(runs, tmp_path) -> None:
    """report() writes the figures, findings.md naming the dead layer, and an index linking all."""
    folder = report(open_run(runs[1]), tmp_path / "report")
    index = (folder / "index.md").read_text()
    pngs = sorted(folder.glob("*.png"))
    assert len(pngs) == 6
    for path in pngs:
        _assert_png(path)
        assert f"]({path.name})" in index
    assert "[findings.md](findings.md)" in index
    findings = (folder / "findings.md").read_text()
    assert "| dead_units | `relu2` | output |" in findings


def test_findings_markdown_keeps_odd_names_in_their_cell() -> None:
    """A layer name with a pipe, a newline, backticks and ESC stays on one line in its cell."""
    import polars as pl

    from torchinstruments_analysis.findings import COLUMNS

    name = "a|b\nc`d\x1b"
    row = ["dead_units", name, "output", "zero_fraction", None, 3, 1.0, 0.99, f"{name} is dead"]
    frame = pl.DataFrame([row], schema=list(COLUMNS), orient="row")
    table = findings_markdown(frame).splitlines()
    body = [line for line in table if line.startswith("| dead_units")]
    assert len(body) == 1
    assert "``a\\|b\\nc`d\\x1b``" in body[0]
    assert "\x1b" not in body[0]
    assert body[0].count(" | ") == 7
