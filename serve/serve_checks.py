"""``engine serve``'s own flags, checked before the model loads: one ``engine: error:`` line each.

The safe defaults live here too: an empty API key is refused (it used to turn
authentication off without a word), and binding an address other than loopback without a
key is refused unless ``--allow-insecure-host`` says the operator means it.
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import os

from pagedkv.core.config import parse_bytes
from pagedkv.core.errors import ConfigError


def api_key_of(args: argparse.Namespace) -> str | None:
    """The API key from ``--api-key`` or ``PAGEDKV_API_KEY`` (the flag wins); an empty one is an error."""
    for source, value in (("--api-key", args.api_key), ("PAGEDKV_API_KEY", os.environ.get("PAGEDKV_API_KEY"))):
        if value is None:
            continue
        if not value.strip():
            raise ConfigError(f"{source} is empty, which would turn authentication off; give a key, or leave "
                              f"{source} unset to serve without one")
        return value
    return None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_serve_args(args: argparse.Namespace) -> str | None:
    """Refuse impossible or unsafe flags; return the API key to use."""
    if isinstance(args.max_request_bytes, str):
        args.max_request_bytes = parse_bytes(args.max_request_bytes)
    if isinstance(getattr(args, "max_inflight_body_bytes", None), str):
        args.max_inflight_body_bytes = parse_bytes(args.max_inflight_body_bytes)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port} is not a TCP port (0..65535)")
    for flag, value, low in (("--max-waiting", args.max_waiting, 1), ("--limit-concurrency", args.limit_concurrency, 1),
                             ("--max-request-bytes", args.max_request_bytes, 1024),
                             ("--max-inflight-body-bytes", getattr(args, "max_inflight_body_bytes", None), 1024),
                             ("--max-prompt-logprobs-tokens", getattr(args, "max_prompt_logprobs_tokens", None), 1)):
        if value is not None and value < low:
            raise ConfigError(f"{flag} {value} must be at least {low}")
    for flag, value, zero_ok in (("--shutdown-timeout", args.shutdown_timeout, True),
                                 ("--header-timeout", args.header_timeout, False),
                                 ("--body-timeout", args.body_timeout, False),
                                 ("--timeout-keep-alive", args.timeout_keep_alive, False),
                                 ("--send-timeout", args.send_timeout, True),
                                 ("--stream-stall-timeout", getattr(args, "stream_stall_timeout", 0.0), True)):
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise ConfigError(f"{flag} {value} must be a finite number of seconds{'' if zero_ok else ' above 0'}")
    key = api_key_of(args)
    if key is None and not is_loopback(args.host) and not args.allow_insecure_host:
        raise ConfigError(f"--host {args.host} serves other machines, but no --api-key (or PAGEDKV_API_KEY) is set; "
                          "give a key, or pass --allow-insecure-host if an open server is what you mean")
    return key
