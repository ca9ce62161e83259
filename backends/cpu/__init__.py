"""Fast CPU paged attention: a small C++/OpenMP kernel built once per machine (see ``build.py``)."""

from pagedkv.backends.cpu.backend import CpuBackend

__all__ = ["CpuBackend"]
