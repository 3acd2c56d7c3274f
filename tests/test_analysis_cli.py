"""The ``torchinstruments`` command line: exit codes, JSON, escaping, and a start without torch."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import polars as pl
import pytest

from analysis_runs import blowup_model, train, write_rank_folders
from torchinstruments_analysis._render import rich_available
from torchinstruments_analysis.cli import main


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    train(blowup_model(), root / "healthy", healthy=6)
    train(blowup_model(), root / "scaled", healthy=6, scale=3.0)
    train(blowup_model(), root / "nan", healthy=4, broken=2)
    return root


def test_summary_prints_every_layer_and_json_parses(runs, capsys):
    """The table lists the layers; --json gives the same rows as the API, as strict JSON."""
    assert main(["summary", str(runs / "healthy"), "--plain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[2:]] == ["0", "1", "2", "3", "4"]
    assert main(["summary", str(runs / "healthy"), "--json", "--layers", "3"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["runs"][0]["complete"] is True
    assert [row["layer"] for row in document["rows"]] == ["3"]
    expected = pl.read_parquet(runs / "healthy" / "history.parquet").filter(
        pl.col("layer") == "3", pl.col("signal") == "output", pl.col("metric") == "rms"
    )
    assert document["rows"][0]["output_rms"] == pytest.approx(expected["value"].mean())


def test_summary_options_reach_the_api(runs, capsys):
    """--signal, --metric, --rank and --steps narrow the table."""
    arguments = ["summary", str(runs / "healthy"), "--json", "--signal", "output"]
    arguments += ["--metric", "std", "--rank", "0", "--steps", "2:4"]
    assert main(arguments) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {row["samples"] for row in rows} == {2}
    assert "output_std" in rows[0]
    assert "output_gradient_std" not in rows[0]


def test_a_bad_step_range_is_refused(runs, capsys):
    """--steps takes A:B; anything else is a usage error naming the value."""
    with pytest.raises(SystemExit) as raised:
        main(["summary", str(runs / "healthy"), "--steps", "7"])
    assert raised.value.code == 2
    assert "'7' is not A:B" in capsys.readouterr().err


def test_first_nonfinite_exits_1_when_found_and_0_when_not(runs, capsys):
    """Exit status 1 with the layer named when non-finite; 0 and a sentence when clean."""
    assert main(["first-nonfinite", str(runs / "nan"), "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert (rows[0]["direction"], rows[0]["layer"], rows[0]["sample_id"]) == ("forward", "2", 4)
    assert main(["first-nonfinite", str(runs / "healthy")]) == 0
    assert "no non-finite value" in capsys.readouterr().out
    assert main(["first-nonfinite", str(runs / "healthy"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"] == []


def test_diff_fails_above_the_ratio_only(runs, capsys):
    """--fail-above exits 1 when a layer moved more than the factor, 0 when none did."""
    a, b = str(runs / "healthy"), str(runs / "scaled")
    assert main(["diff", a, b, "--fail-above", "2", "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert rows[0]["exceeds"] is True
    assert rows[0]["moved"] > 2
    assert main(["diff", a, b, "--fail-above", "100"]) == 0
    assert main(["diff", a, b]) == 0
    assert main(["diff", a, a, "--fail-above", "1.0001", "--plain"]) == 0


def test_ranks_prints_the_rank_that_disagrees(tmp_path, capsys):
    """Ranks on a two-rank run names rank 1 as the high one."""
    write_rank_folders(tmp_path, {0: [1.0, 1.0], 1: [1.0, 4.0]}, ["a"])
    assert main(["ranks", str(tmp_path), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    assert (row["rank_high"], row["max_ratio"]) == (1, 4.0)


def test_a_missing_run_exits_2(tmp_path, capsys):
    """A folder without a run is an error (status 2) with the reason, not a traceback."""
    assert main(["summary", str(tmp_path)]) == 2
    assert "holds no run" in capsys.readouterr().err


def test_an_unfinished_run_is_read_with_a_note(tmp_path, capsys):
    """A run without a finished status is read anyway, and stderr says it is not finished."""
    write_rank_folders(tmp_path, {0: [1.0]}, ["a"])
    (tmp_path / "rank-000" / "result.json").unlink()
    assert main(["summary", str(tmp_path), "--plain"]) == 0
    captured = capsys.readouterr()
    assert "not finished" in captured.err
    assert "\na " in captured.out


@pytest.mark.parametrize("plain", [True, False])
def test_layer_names_are_escaped_in_tables(tmp_path, capsys, plain):
    """A name with ESC, a newline, | and rich markup prints inert, on one line."""
    if not plain and not rich_available():
        pytest.skip("rich is not installed")
    name = "evil\x1b[31m|\n[bold]x"
    write_rank_folders(tmp_path, {0: [1.0]}, [name, "b"])
    arguments = ["summary", str(tmp_path), "--metric", "rms"] + (["--plain"] if plain else [])
    assert main(arguments) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out
    assert "evil\\x1b[31m\\|\\n[bold]x" in out
    assert main(["summary", str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["layer"] == name


def test_findings_plot_report_and_watch_delegate_to_their_modules(
    runs, capsys, monkeypatch, tmp_path
):
    """Each subcommand calls its module's function with the opened run and prints the result."""
    from torchinstruments_analysis import findings, plots, watch

    calls = []
    finding = pl.DataFrame({"rule": ["r"], "layer": ["2"], "message": ["m"]})

    def find(run, **_):
        calls.append(run.path)
        return finding

    monkeypatch.setattr(findings, "find", find)
    monkeypatch.setattr(plots, "plot", lambda runs, out: [out / "a.png"])
    monkeypatch.setattr(plots, "report", lambda run, out: out / "report.html")
    monkeypatch.setattr(watch, "watch", lambda path, interval: calls.append((path, interval)))
    run = str(runs / "healthy")
    assert main(["findings", run, "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["rows"] == finding.to_dicts()
    assert main(["plot", run, run, "--out", str(tmp_path)]) == 0
    assert main(["report", run, "--out", str(tmp_path)]) == 0
    assert capsys.readouterr().out.split() == [
        str(tmp_path / "a.png"),
        str(tmp_path / "report.html"),
    ]
    assert main(["watch", run, "--interval", "0.5"]) == 0
    assert calls == [runs / "healthy", (runs / "healthy", 0.5)]
    monkeypatch.setattr(findings, "find", lambda run, **_: finding.clear())
    assert main(["findings", run]) == 0


def test_a_part_that_is_missing_is_exit_2_with_its_message(runs, capsys, monkeypatch):
    """A delegate raising NotImplementedError or ImportError is reported, not a traceback."""
    from torchinstruments_analysis import findings

    def missing(run, **_):
        raise NotImplementedError("findings are not part of this build")

    monkeypatch.setattr(findings, "find", missing)
    assert main(["findings", str(runs / "healthy")]) == 2
    assert "torchinstruments: findings are not part of this build" in capsys.readouterr().err


@pytest.mark.slow
def test_the_command_line_starts_without_torch_or_polars():
    """Importing the CLI and printing --help import neither torch nor polars, within a second."""
    code = (
        "import sys, contextlib, io\n"
        "from torchinstruments_analysis.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "print(sorted(m for m in ('torch', 'polars', 'numpy') if m in sys.modules))\n"
    )
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seconds = time.perf_counter() - started
    assert out.stdout.strip() == "[]"
    assert seconds < 2.0  # generous on a loaded two-core machine; about 0.1 s when idle


@pytest.mark.slow
def test_summary_in_a_subprocess_never_imports_torch(runs):
    """A whole summary command reads the run with polars only: torch is never imported."""
    code = (
        "import sys, contextlib, io\n"
        "from torchinstruments_analysis.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['summary', {str(runs / 'healthy')!r}]) == 0\n"
        f"    assert main(['first-nonfinite', {str(runs / 'nan')!r}]) == 1\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
