"""The results page reads at a glance: ``benchmarks/report.py`` draws every chart from the
checked-in results, each naming where it was measured, and the README shows what it makes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
charts = pytest.importorskip("charts", reason="needs matplotlib (the test or bench extra)")
import report  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    docs = report.load()
    assert docs, f"no results in {report.RESULTS}"
    return docs


def test_report_draws_every_chart_from_the_checked_in_results(docs, tmp_path):
    drawn = report.draw(docs, tmp_path)
    # The checked-in results hold every figure: each chart is drawn, as a small PNG.
    assert [p.name for *_, p in drawn] == [f"{c.name}.png" for c in charts.CHARTS]
    for question, sentence, path in drawn:
        data = path.read_bytes()
        assert data.startswith(PNG) and 5_000 < len(data) < 120_000, (path, len(data))
        assert question.endswith("?") and sentence


def test_every_chart_names_the_machine_mpi_and_torch_of_its_results(docs):
    for name in {d["name"] for d in docs}:
        group = charts.results(docs, name)
        subtitle, labels = charts.describe(group)
        for doc, label in zip(group, labels, strict=True):
            where = charts.setup(doc)
            for field in ("machine", "mpi", "torch"):
                assert where[field] in subtitle + label, (name, field, subtitle, label)


def test_tables_have_no_empty_column(docs):
    for table in report.tables(docs).split("<details>")[1:]:
        rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ")]
        for column in zip(*rows[1:], strict=True):
            assert any(cell.strip(" |") for cell in column), table


def test_readme_results_section_is_what_report_writes(docs):
    drawn = [(c.question, c.sentence, report.CHARTS_DIR / f"{c.name}.png") for c in charts.CHARTS]
    text = report.README.read_text()
    section = re.search(f"{report.START}\n(.*)\n{report.END}", text, re.S)
    assert section, "README has no results section"
    assert section[1] == report.markdown(docs, drawn), (
        "README's results section is out of date: run python benchmarks/report.py"
    )
    for *_, path in drawn:  # committed beside the README that shows them
        assert path.read_bytes().startswith(PNG), path
