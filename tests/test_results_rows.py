"""The front pages stay short: every row of benchmarks/RESULTS.md's table fits 400 characters (its details go
to the notes under the table), and the README fits a five-minute read (250 lines; the rest lives in docs/)."""

from __future__ import annotations

from repo_paths import ROOT

MAX_ROW = 400
MAX_README_LINES = 250


def table_rows(text: str) -> list[str]:
    """The rows of the first Markdown table (header and separator left out)."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| benchmark |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def test_results_rows_are_short():
    rows = table_rows((ROOT / "benchmarks" / "RESULTS.md").read_text())
    assert len(rows) >= 30, "the RESULTS.md table lost its rows"
    long = [f"{len(row)} chars: {row[:80]}" for row in rows if len(row) > MAX_ROW]
    assert not long, "RESULTS.md rows over 400 characters (move the details to the notes):\n" + "\n".join(long)


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines; move sections to docs/"
