"""Where ``engine run --input`` results go, so that a run never loses results it, or an earlier run, wrote.

The paths are checked before the model loads (a directory, a missing folder or the input
itself as ``--output`` is one line, not a traceback a minute later), and the output file is
opened only when its first line is ready: a run that fails before it has a result (a bad
model, an interrupt while loading) leaves an existing file as it was. Once the first line
is written the file is replaced, and every later line is flushed as it is written.
"""

from __future__ import annotations

import json
import os
from typing import IO, Any

from pagedkv.core.errors import PagedKVError


def check_batch_paths(input_path: str, output_path: str) -> None:
    """Refuse an unreadable input or an output that cannot be written, before any work."""
    if not os.path.isfile(input_path):
        what = "is a directory" if os.path.isdir(input_path) else "does not exist"
        raise PagedKVError(f"cannot read --input {input_path}: it {what}")
    if not os.access(input_path, os.R_OK):
        raise PagedKVError(f"cannot read --input {input_path}: permission denied")
    if os.path.isdir(output_path):
        raise PagedKVError(f"--output {output_path} is a directory; give a file path")
    if os.path.exists(output_path):
        if os.path.samefile(input_path, output_path):
            raise PagedKVError("--output must not be the --input file")
        if not os.access(output_path, os.W_OK):
            raise PagedKVError(f"cannot write --output {output_path}: permission denied")
        return
    folder = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(folder):
        raise PagedKVError(f"cannot write --output {output_path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PagedKVError(f"cannot write --output {output_path}: the folder {folder} is not writable")


class LazyOutput:
    """A JSONL sink that opens (and truncates) its file at the first line; flushes every line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def write(self, line: dict[str, Any]) -> None:
        if self._file is None:
            try:
                self._file = open(self.path, "w", encoding="utf-8")
            except OSError as exc:
                raise PagedKVError(f"cannot write --output {self.path}: {exc.strerror}") from None
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
