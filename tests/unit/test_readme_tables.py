"""The READMEs' marked results tables are what the committed result files render to."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from optim.apps.benchmarks.output import Table, markdown_table, text_table
from optim.apps.cli.render import READMES, RenderError, check_file, render_text

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("readme", READMES)
def test_every_marked_table_is_its_render(readme: str) -> None:
    """A table edited by hand, or a result file changed without re-rendering, fails here."""
    path = ROOT / readme
    assert "<!-- table: " in path.read_text(), f"{readme} has no rendered table"
    diff = check_file(path, ROOT)
    assert not diff, f"run `python -m optim bench render` and commit the result:\n{diff}"


def test_check_catches_an_edited_number(tmp_path: Path) -> None:
    """One number changed inside a marked table of a copy of the README: the check reports that line."""
    copy = tmp_path / "benchmarks" / "README.md"
    copy.parent.mkdir()
    shutil.copytree(ROOT / "benchmarks" / "results", tmp_path / "benchmarks" / "results")
    text = (ROOT / "benchmarks" / "README.md").read_text()
    start = text.index("<!-- table: benchmarks/results/link.json kind=link -->")
    row = text.index("| 1gbit |", start)
    line = text[row : text.index("\n", row)]
    edited = line.replace("| 0.961 |", "| 0.991 |", 1)
    assert edited != line
    copy.write_text(text[:row] + edited + text[row + len(line) :])
    diff = check_file(copy, tmp_path)
    assert f"-{edited}" in diff.splitlines() and f"+{line}" in diff.splitlines()
    copy.write_text(render_text(copy.read_text(), tmp_path))
    assert check_file(copy, tmp_path) == ""


def test_text_outside_markers_is_left_alone(tmp_path: Path) -> None:
    """Rendering replaces only what is between the markers; everything else stays byte for byte."""
    results = tmp_path / "r.json"
    results.write_text('{"rows": [], "config": {"allreduce_bytes": 1024}}')
    text = "intro | not a table\n<!-- table: r.json kind=link -->\nold\n<!-- /table -->\ntail\n"
    rendered = render_text(text, tmp_path)
    assert rendered.startswith("intro | not a table\n<!-- table: r.json kind=link -->\n\n| link rate |")
    assert rendered.endswith("\n\n<!-- /table -->\ntail\n")
    assert render_text(rendered, tmp_path) == rendered


@pytest.mark.parametrize(
    "text",
    [
        "<!-- table: r.json kind=link -->\n| a |\n",  # never closed
        "<!-- table: r.json kind=nope -->\n<!-- /table -->\n",  # unknown kind
        "<!-- table: missing.json kind=link -->\n<!-- /table -->\n",  # no such file
        "<!-- table: r.json kind=link rate=1gbit -->\n<!-- /table -->\n",  # option the kind does not take
    ],
)
def test_bad_markers_are_refused(tmp_path: Path, text: str) -> None:
    (tmp_path / "r.json").write_text('{"rows": [], "config": {"allreduce_bytes": 1024}}')
    with pytest.raises(RenderError):
        render_text(text, tmp_path)


def test_one_table_two_layouts() -> None:
    """The text a command prints and the Markdown of a README hold the same cells."""
    table = Table(columns=("run", "ratio"), rows=(("a|b", "1.000"),), left=frozenset({0}))
    assert markdown_table(table) == "| run | ratio |\n|---|---:|\n| a\\|b | 1.000 |"
    assert text_table(table) == "run  ratio\na|b  1.000"
    with pytest.raises(ValueError, match="cells"):
        Table(columns=("a",), rows=(("1", "2"),))


def test_result_files_record_the_commit(tmp_path: Path) -> None:
    """New result files say which commit made them; outside a git checkout the commit is "unknown"."""
    from optim.apps.benchmarks.output import bench_env, git_commit, write_bench_json

    commit = bench_env()["commit"]
    assert commit == "unknown" or (len(commit) == 40 and int(commit, 16) >= 0)
    assert git_commit(tmp_path) == "unknown"
    written = write_bench_json(tmp_path / "r.json", {"config": {"steps": 3}, "rows": []}).read_text()
    assert f'"commit": "{commit}"' in written and '"steps": 3' in written


def test_the_rise_table_marks_a_sparse_run_that_rises_above_dense() -> None:
    from optim.apps.benchmarks.suite_report import rise_table

    def row(name: str, rise: float) -> dict:
        return {
            "setting": "s",
            "horizon": 300,
            "trained_steps": 1000,
            "name": name,
            "largest_loss_rise": rise,
            "dense_largest_loss_rise": 0.5,
        }

    suite = {"rows": [row("adams", 0.5), row("adamw", 0.4), row("local@0.1", 0.3), row("local@0.01", 0.7)]}
    table = rise_table(suite)
    assert table.columns == ("setting", "steps", "dense", "local@0.1", "local@0.01")
    assert table.rows == (("s", "1000", "0.50", "0.30", "0.70!"),)
