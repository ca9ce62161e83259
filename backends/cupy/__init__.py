"""CuPy backend: hand-written CUDA C kernels launched through CuPy.

``cupy`` is imported only when the backend is built (see ``plugin.py``).
"""
