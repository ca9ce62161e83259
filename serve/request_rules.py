"""Kept only for ``serve/cli.py``'s import until it moves: the limit now lives in ``serve/http/admission.py``."""

from pagedkv.serve.http.admission import DEFAULT_MAX_REQUEST_BYTES

__all__ = ["DEFAULT_MAX_REQUEST_BYTES"]
