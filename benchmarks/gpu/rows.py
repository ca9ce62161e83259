"""Workers report through JSON-lines files: a row is on disk as soon as it is measured, so a killed worker
still leaves everything it finished."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
        f.flush()


def read_rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut short by a kill
    return rows
