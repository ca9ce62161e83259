"""Output files (``--trace``, ``--plot``) that never cost the user an existing file for a run that did not start.

:func:`check_output_path` is called while the configuration is read, before
anything slow, so a path that is a directory, in a missing folder or not
writable is one clear error. :class:`OutputFile` writes into a temporary file
next to the target and puts it in place only at :meth:`OutputFile.commit`
(when the run has started); a set-up that fails later leaves the old file as
it was. A target that is not a regular file (``/dev/null``, a FIFO) is written
in place and never replaced.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import BinaryIO

from pagedkv.core.errors import ConfigError


def check_output_path(path: str | os.PathLike, what: str) -> Path:
    """The real path ``what`` (e.g. ``--trace``) will write, or :class:`ConfigError` saying why it cannot."""
    text = os.fspath(path)
    if not text or not text.strip():
        raise ConfigError(f"{what}: the file name is empty")
    if "\0" in text:
        raise ConfigError(f"{what} {text!r}: the file name contains a NUL byte")
    target = Path(os.path.realpath(text))
    if target.is_dir():
        raise ConfigError(f"{what} {text}: is a directory; give a file name")
    parent = target.parent
    if not parent.is_dir():
        raise ConfigError(f"{what} {text}: the folder {parent} does not exist")
    if target.exists():
        if not os.access(target, os.W_OK):
            raise ConfigError(f"{what} {text}: the file is not writable")
        if not target.is_file():
            return target  # a device or FIFO: written in place
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {text}: cannot create files in {parent} (permission denied)")
    return target


def check_output_paths(*named: tuple[str, str] | None) -> None:
    """:func:`check_output_path` for each ``(what, path)`` given (``None`` entries are skipped)."""
    for item in named:
        if item:
            check_output_path(item[1], item[0])


class OutputFile:
    """A file written to a temporary name beside ``path`` and moved onto it by :meth:`commit`."""

    def __init__(self, path: str | os.PathLike, what: str) -> None:
        self.path = os.fspath(path)
        self.what = what
        self.target = check_output_path(path, what)
        self.fh: BinaryIO | None = None
        self._tmp: str | None = None

    def open(self) -> BinaryIO:
        """The stream to write; the target is untouched until :meth:`commit`."""
        if self.target.exists() and not self.target.is_file():
            self.fh = open(self.target, "wb")  # noqa: SIM115 - a device or FIFO: nothing to replace
            return self.fh
        try:
            fd, self._tmp = tempfile.mkstemp(dir=self.target.parent, prefix=f".{self.target.name}.", suffix=".tmp")
        except OSError as exc:
            raise ConfigError(f"{self.what} {self.path}: cannot create a file there: {exc.strerror}") from None
        os.fchmod(fd, _mode_for(self.target))
        self.fh = os.fdopen(fd, "wb")
        return self.fh

    def commit(self) -> None:
        """Put what is written so far in place of the target (the stream stays open for the rest)."""
        if self._tmp is not None:
            os.replace(self._tmp, self.target)
            self._tmp = None

    def discard(self) -> None:
        """Close and remove the temporary file; the target stays as it was."""
        if self.fh is not None:
            with contextlib.suppress(OSError):
                self.fh.close()
            self.fh = None
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._tmp)
            self._tmp = None


def _mode_for(target: Path) -> int:
    """An existing file's permissions, or what a new file would get under the current umask."""
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
