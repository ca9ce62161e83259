"""Caps on the work one number may ask for, so a typo fails with a clear line instead of eating all memory.

Each cap has a default that is far above any real use on one machine and an
environment variable that raises it where a bigger number is legitimate; the
error names both. The memory check compares a host allocation with what the
machine has available right now.
"""

from __future__ import annotations

import os

from pagedkv.core.errors import ConfigError

# name -> (environment variable, default, what it bounds)
CAPS: dict[str, tuple[str, int, str]] = {
    "samples": ("PAGEDKV_MAX_SAMPLES", 128, "samples per request (n; OpenAI's cap)"),
    "requests": ("PAGEDKV_MAX_REQUESTS", 2_000_000, "requests in one simulated workload"),
    "blocks": ("PAGEDKV_MAX_BLOCKS", 1 << 24, "KV blocks in one pool"),
    "trace_bytes": ("PAGEDKV_MAX_TRACE_BYTES", 4 << 30, "bytes of a trace read into memory"),
}


def cap(name: str) -> int:
    """The current value of cap ``name`` (its environment variable, when set to a positive integer, wins)."""
    env, default, _ = CAPS[name]
    text = os.environ.get(env, "").strip()
    if not text:
        return default
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise ConfigError(f"{env}={text!r} is not a positive integer") from None
    if value < 1:
        raise ConfigError(f"{env}={text!r} is not a positive integer")
    return value


def check_cap(name: str, value: int, what: str, error: type[Exception] = ConfigError) -> int:
    """Return ``value`` if it is within cap ``name``; otherwise raise ``error`` saying how to raise the cap."""
    limit = cap(name)
    if value > limit:
        env, _, bounds = CAPS[name]
        raise error(
            f"{what} is {value:,}, above the limit of {limit:,} {bounds}; "
            f"if you really mean it, raise the limit with {env}={value}"
        )
    return value


def available_memory() -> int | None:
    """Bytes of host memory available now (Linux ``MemAvailable``; else free pages), or None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_host_memory(nbytes: int, what: str) -> None:
    """Refuse a host allocation of ``nbytes`` that is more than the machine has available now."""
    available = available_memory()
    if available is not None and nbytes > available:
        raise ConfigError(
            f"{what} needs {_gib(nbytes)} of host memory but only {_gib(available)} is available on this machine; "
            "give a smaller budget"
        )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.2f} GiB"
