"""``engine plugins``: every plugin in the ``pagedkv`` entry-point group, and the hooks each implements."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON instead of text")


def cmd_plugins(args: argparse.Namespace) -> int:
    """Every plugin in the ``pagedkv`` entry-point group, as PAGEDKV_PLUGINS / PAGEDKV_DISABLE_PLUGINS leave it."""
    from pagedkv.core.plugin.plugin_manager import list_plugins

    rows = list_plugins()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    for row in rows:
        origin = f"{row['distribution'] or '?'} {row['version'] or ''}".strip()
        kind = "built-in" if row["builtin"] else "third-party"
        print(f"{row['name']:<16} {origin:<22} {kind:<12} {row['status']:<13} {', '.join(row['hooks']) or '-'}")
        if row["error"]:
            print(f"{'':<16} error: {row['error']}")
    return 0
