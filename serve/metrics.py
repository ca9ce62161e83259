"""Kept only for ``serve/cli.py``'s import until it moves: the metrics now live in ``serve/http/metrics.py``."""

from pagedkv.serve.http.metrics import ServerMetrics

__all__ = ["ServerMetrics"]
