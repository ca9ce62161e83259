"""Plugin faults stay contained: a broken observer is disabled, a broken decision fails one request.

Observers (events, block-full notices, stats) are called one plugin at a time;
one that raises is logged and unregistered, and the run goes on. A decision
hook that raises becomes a :class:`PluginFault`, which the scheduler turns into
a failed request (finish reason ``"error"``) while the others keep running.
"""

from __future__ import annotations

import logging
from typing import Any

import pluggy

from pagedkv.core.errors import PagedKVError

log = logging.getLogger("pagedkv")


class PluginFault(PagedKVError):
    """A plugin's decision hook raised while serving one request."""


def call_decision(hook: Any, **kwargs: Any) -> Any:
    """Call a ``firstresult`` hook; any exception becomes a :class:`PluginFault` naming the hook."""
    try:
        return hook(**kwargs)
    except Exception as exc:  # noqa: BLE001 - a plugin may fail in any way
        raise PluginFault(f"plugin hook {hook.name} failed: {type(exc).__name__}: {exc}") from exc


class Observers:
    """Broadcasts one observer hook, isolating each plugin."""

    def __init__(self, pm: pluggy.PluginManager, hook_name: str) -> None:
        self.pm = pm
        self.hook = getattr(pm.hook, hook_name)
        self.name = hook_name

    def __bool__(self) -> bool:
        return bool(self.hook.get_hookimpls())

    def __call__(self, **kwargs: Any) -> list[Any]:
        results = []
        for impl in list(self.hook.get_hookimpls()):
            try:
                result = impl.function(**{name: kwargs[name] for name in impl.argnames})
            except Exception as exc:  # noqa: BLE001
                name = self.pm.get_name(impl.plugin) or repr(impl.plugin)
                log.error("pagedkv plugin %r raised in %s and is disabled: %s: %s",
                          name, self.name, type(exc).__name__, exc)
                self.pm.unregister(impl.plugin)
                continue
            if result is not None:
                results.append(result)
        return results
