"""One pluggy PluginManager per engine, and the typed registries its registrar hooks fill.

Built-in backends, allocators and schedulers arrive through the same
``pagedkv`` entry-point group as third-party plugins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from pagedkv.core import hookspecs
from pagedkv.core.errors import ConfigError

log = logging.getLogger("pagedkv")


@dataclass(frozen=True)
class Entry:
    name: str
    factory: Callable[..., Any]
    description: str
    plugin: str


class Registry:
    """Name -> factory, for one kind of component (backend, allocator, scheduler)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.entries: dict[str, Entry] = {}
        self._current_plugin = "?"

    def register(self, name: str, factory: Callable[..., Any], description: str = "") -> None:
        if name in self.entries:
            raise ConfigError(
                f"{self.kind} {name!r} is registered twice ({self.entries[name].plugin} and {self._current_plugin})"
            )
        self.entries[name] = Entry(name, factory, description, self._current_plugin)

    def get(self, name: str) -> Entry:
        try:
            return self.entries[name]
        except KeyError:
            known = ", ".join(sorted(self.entries)) or "none"
            raise ConfigError(f"unknown {self.kind} {name!r}; available: {known}") from None

    def names(self) -> list[str]:
        return sorted(self.entries)


def make_plugin_manager(extra_plugins: Iterable[Any] = ()) -> pluggy.PluginManager:
    """A manager with the hook specs, every entry-point plugin, and ``extra_plugins``."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    _load_entry_points(pm)
    for plugin in extra_plugins:
        pm.register(plugin)
    return pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """Like ``pm.load_setuptools_entrypoints``, but a broken plugin is reported, not fatal."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=hookspecs.PROJECT):
        if pm.has_plugin(ep.name) or pm.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - a third-party import can fail in any way
            log.warning("pagedkv plugin %r (%s) failed to import and is skipped: %s", ep.name, ep.value, exc)
            continue
        pm.register(plugin, name=ep.name)


def build_registry(pm: pluggy.PluginManager, kind: str, hook_name: str) -> Registry:
    """Run one registrar hook over every plugin, remembering which plugin registered what."""
    registry = Registry(kind)
    hook = getattr(pm.hook, hook_name)
    for impl in reversed(hook.get_hookimpls()):
        registry._current_plugin = pm.get_name(impl.plugin) or repr(impl.plugin)
        impl.function(register=registry.register)
    return registry


def has_impls(pm: pluggy.PluginManager, hook_name: str) -> bool:
    return bool(getattr(pm.hook, hook_name).get_hookimpls())
