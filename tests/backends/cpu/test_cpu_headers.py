"""Each header of the CPU kernel library compiles on its own: it includes what it uses, so a translation unit
(attention.cpp, kv_write.cpp, linear.cpp, llama_layer.cpp) takes only the headers of its entry family."""

from __future__ import annotations

import subprocess

import pytest

from pagedkv.backends.cpu import build

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler")


@pytest.mark.parametrize("isa", sorted({build.variants()[0], build.variants()[-1]}))
@pytest.mark.parametrize("header", build.HEADERS)
def test_each_kernel_header_compiles_alone(header, isa):
    cmd = [build.compiler(), "-fsyntax-only", "-std=c++17", "-fopenmp", "-Wno-psabi", *build.march(isa),
           "-I", str(build.SOURCE_DIR), "-x", "c++", "-"]
    proc = subprocess.run(cmd, input=f'#include "{header}"\n', capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_every_source_and_header_is_in_the_build():
    # a file of the library that build.py neither compiles nor hashes would go stale in the cache
    on_disk = {p.name for p in build.SOURCE_DIR.iterdir() if p.suffix in (".cpp", ".h")}
    assert on_disk == {*build.SOURCES, *build.HEADERS}
