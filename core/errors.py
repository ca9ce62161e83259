"""Errors a user can act on; each message says what to change."""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class for errors raised by pagedkv itself."""


class ConfigError(PagedKVError, ValueError):
    """The engine configuration is invalid."""


class RequestRejected(PagedKVError, ValueError):
    """A request can never be served (too long, empty, bad parameters); other requests are unaffected."""
