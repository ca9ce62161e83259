"""Where a GGUF conversion is cached: by the file's content, so a new virtual environment reuses it."""

from __future__ import annotations

import os
import shutil

from pagedkv.core.model.model_loader import conversion_key


def test_the_same_gguf_at_another_path_reuses_its_conversion(tmp_path):
    first = tmp_path / "venv-a" / "model.gguf"
    first.parent.mkdir()
    first.write_bytes(os.urandom(3 << 20))
    second = tmp_path / "venv-b" / "model.gguf"
    second.parent.mkdir()
    shutil.copyfile(first, second)  # a fresh copy: another path, inode and mtime
    assert conversion_key(first) == conversion_key(second)


def test_a_different_gguf_gets_its_own_conversion(tmp_path):
    data = bytearray(os.urandom(3 << 20))
    path = tmp_path / "model.gguf"
    path.write_bytes(data)
    before = conversion_key(path)
    for offset in (0, len(data) - 1):  # a change in the header or at the end
        changed = bytearray(data)
        changed[offset] ^= 0xFF
        path.write_bytes(changed)
        assert conversion_key(path) != before
    path.write_bytes(data + b"\0")  # same head and nearly the same tail, another size
    assert conversion_key(path) != before
