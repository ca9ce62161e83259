"""Triton backend: paged attention, KV write and block copy kernels.

``triton`` is imported only when the backend is built (see ``plugin.py``).
"""
