"""Plugin faults stay contained: no plugin can break the engine for everyone.

- A decision hook that raises while serving one request becomes a :class:`PluginFault`,
  which the scheduler turns into that request failing (finish reason ``"error"``).
- Observers (events, block-full notices, stats) are called one plugin at a time; one
  that raises is logged and unregistered, and the run goes on.
- Pool hooks (a block released or evicted) serve no single request: a release happens
  when a request ends, an eviction for whichever request needs a block. A plugin that
  raises there is disabled like an observer and the pool takes its default (the block
  is freed, not cached), so no block leaks and no finished request loses its output.
- Start-up hooks (registrars, ``pagedkv_configure``, ``pagedkv_swap_space``,
  ``pagedkv_engine_started``): a plugin that raises is unregistered and the engine starts
  without it, saying how to leave it out; if the plugin was asked for (named in
  ``PAGEDKV_PLUGINS``, passed to ``Engine(plugins=...)``, or switched on by the config)
  the engine refuses to start with one :class:`ConfigError` line instead. A plugin that
  raises a :class:`ConfigError` itself (it refuses the configuration) stops the start-up as it is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import pluggy

from pagedkv.core.errors import ConfigError, PagedKVError
from pagedkv.core.plugin.plugin_manager import DISABLE_ENV, mark_requested, plugin_label, was_requested

if TYPE_CHECKING:  # type hints only
    from pagedkv.core.config import EngineConfig

log = logging.getLogger("pagedkv")


class PluginFault(PagedKVError):
    """A plugin's decision hook raised while serving one request."""


def call_decision(hook: Any, **kwargs: Any) -> Any:
    """Call a ``firstresult`` hook; any exception becomes a :class:`PluginFault` naming the hook."""
    try:
        return hook(**kwargs)
    except Exception as exc:  # noqa: BLE001 - a plugin may fail in any way
        raise PluginFault(f"plugin hook {hook.name} failed: {type(exc).__name__}: {exc}") from exc


def disable(pm: pluggy.PluginManager, plugin: Any, hook_name: str, exc: BaseException) -> None:
    """Log why ``plugin`` is left out of this run, and unregister it."""
    name, env_name = plugin_label(pm, plugin)
    log.error("pagedkv plugin %r raised in %s and is disabled for this run: %s: %s (to leave it out: %s=%s)",
              name, hook_name, type(exc).__name__, exc, DISABLE_ENV, env_name)
    if pm.is_registered(plugin):
        pm.unregister(plugin)


class Decision:
    """A ``firstresult`` hook as a plain callable of keyword arguments: the first non-None answer, or
    None; a plugin that raises becomes a :class:`PluginFault` (the caller fails the request it serves)."""

    def __init__(self, pm: pluggy.PluginManager, hook_name: str) -> None:
        self.hook = getattr(pm.hook, hook_name)
        self.name = hook_name

    def __bool__(self) -> bool:
        return bool(self.hook.get_hookimpls())

    def __call__(self, **kwargs: Any) -> Any:
        return call_decision(self.hook, **kwargs)


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
                disable(self.pm, impl.plugin, self.name, exc)
                continue
            if result is not None:
                results.append(result)
        return results


class PoolHook:
    """A pool-level hook as a plain callable of ``block_id``; a plugin that raises is disabled
    and counts as having answered None (the pool's default)."""

    def __init__(self, pm: pluggy.PluginManager, hook_name: str, firstresult: bool) -> None:
        self.pm = pm
        self.hook = getattr(pm.hook, hook_name)
        self.name = hook_name
        self.firstresult = firstresult

    def __bool__(self) -> bool:
        return bool(self.hook.get_hookimpls())

    def __call__(self, block_id: int) -> Any:
        for impl in reversed(self.hook.get_hookimpls()):  # pluggy's calling order
            try:
                result = impl.function(block_id=block_id)
            except Exception as exc:  # noqa: BLE001
                disable(self.pm, impl.plugin, self.name, exc)
                continue
            if result is not None and self.firstresult:
                return result
        return None


def call_startup(pm: pluggy.PluginManager, hook_name: str, firstresult: bool = False, **kwargs: Any) -> Any:
    """Call a start-up hook one plugin at a time (in pluggy's order), containing each plugin's faults.

    Returns the first non-None answer if ``firstresult``, else None.
    """
    for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls()):
        if not pm.is_registered(impl.plugin):  # disabled by an earlier fault in this same call
            continue
        try:
            result = impl.function(**{name: kwargs[name] for name in impl.argnames})
        except Exception as exc:  # noqa: BLE001 - a plugin may fail in any way
            startup_fault(pm, impl.plugin, hook_name, exc)
            continue
        if firstresult and result is not None:
            return result
    return None


def startup_fault(pm: pluggy.PluginManager, plugin: Any, hook_name: str, exc: BaseException) -> None:
    """A plugin failed while the engine starts: refuse if it was asked for, else start without it.

    A :class:`ConfigError` is the plugin refusing the user's configuration (a bad telemetry address):
    it is passed on as it is."""
    if isinstance(exc, ConfigError):
        raise exc
    if was_requested(pm, plugin):
        name, env_name = plugin_label(pm, plugin)
        raise ConfigError(
            f"pagedkv plugin {name!r} failed in {hook_name}: {type(exc).__name__}: {exc} "
            f"(it was asked for; switch it off in the configuration or with {DISABLE_ENV}={env_name})"
        ) from exc
    disable(pm, plugin, hook_name, exc)


def configure_plugins(pm: pluggy.PluginManager, config: EngineConfig) -> None:
    """``pagedkv_configure``, one plugin at a time. What a plugin registers here, the config switched on:
    it counts as asked for. A plugin that raises takes what it registered with it."""
    for impl in reversed(pm.hook.pagedkv_configure.get_hookimpls()):
        if not pm.is_registered(impl.plugin):
            continue
        before = set(pm.get_plugins())
        try:
            impl.function(**{name: {"config": config, "pm": pm}[name] for name in impl.argnames})
        except Exception as exc:  # noqa: BLE001 - a plugin may fail in any way
            for plugin in set(pm.get_plugins()) - before:
                pm.unregister(plugin)
            startup_fault(pm, impl.plugin, "pagedkv_configure", exc)
            continue
        origin = plugin_label(pm, impl.plugin)[1]
        for plugin in set(pm.get_plugins()) - before:
            mark_requested(pm, pm.get_name(plugin), origin)
