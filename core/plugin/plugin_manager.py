"""One pluggy PluginManager per engine, and the typed registries its registrar hooks fill.

Built-in backends, allocators and schedulers arrive through the same
``pagedkv`` entry-point group as third-party plugins; ``PAGEDKV_PLUGINS`` and
``PAGEDKV_DISABLE_PLUGINS`` choose which load (see docs/plugins.md).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

from pagedkv.core import hookspecs
from pagedkv.core.errors import ConfigError

if TYPE_CHECKING:  # type hints only
    from pagedkv.core.config import EngineConfig

log = logging.getLogger("pagedkv")


FaultHandler = Callable[[pluggy.PluginManager, object, str, Exception], None]  # (pm, plugin, hook name, error)


class Register(Protocol):
    """What a registrar hook is given: ``register(name, factory, description)`` adds one component."""

    def __call__(self, name: str, factory: Callable[..., Any], description: str = "") -> None: ...


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


PLUGINS_ENV = "PAGEDKV_PLUGINS"
DISABLE_ENV = "PAGEDKV_DISABLE_PLUGINS"
BUILTIN_DISTRIBUTION = "pagedkv"


@dataclass
class PluginSource:
    """Where an entry-point plugin came from, and what became of it."""

    name: str  # the entry-point name (what PAGEDKV_PLUGINS / PAGEDKV_DISABLE_PLUGINS refer to)
    value: str  # the entry point's target, e.g. "pagedkv.plugins.prefix_cache"
    distribution: str | None
    version: str | None
    builtin: bool
    status: str = "loaded"  # loaded, disabled, not selected, failed
    error: str | None = None


def _names_from_env(var: str) -> list[str] | None:
    """``a, b`` -> ["a", "b"]; unset -> None; set but empty -> []."""
    raw = os.environ.get(var)
    if raw is None:
        return None
    return [name.strip() for name in raw.split(",") if name.strip()]


def make_plugin_manager(extra_plugins: Iterable[object] = ()) -> pluggy.PluginManager:
    """A manager with the hook specs, every entry-point plugin, and ``extra_plugins``.

    ``PAGEDKV_PLUGINS=a,b`` loads only these third-party plugins (empty: none;
    built-ins, whose distribution is ``pagedkv``, always load);
    ``PAGEDKV_DISABLE_PLUGINS=x,y`` blocks plugins, built-in or not, by entry-point name.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    _load_entry_points(pm)
    for plugin in extra_plugins:
        mark_requested(pm, pm.register(plugin))
    return pm


def mark_requested(pm: pluggy.PluginManager, name: str | None, origin: str | None = None) -> None:
    """Remember that plugin ``name`` was asked for (so a start-up fault refuses to start, see plugin_guard);
    ``origin``: the entry point that registered it (what ``PAGEDKV_DISABLE_PLUGINS`` names)."""
    if name is None:
        return
    pm._pagedkv_requested = getattr(pm, "_pagedkv_requested", set()) | {name}  # type: ignore[attr-defined]
    if origin is not None:
        pm._pagedkv_origin = {**getattr(pm, "_pagedkv_origin", {}), name: origin}  # type: ignore[attr-defined]


def was_requested(pm: pluggy.PluginManager, plugin: Any) -> bool:
    return pm.get_name(plugin) in getattr(pm, "_pagedkv_requested", ())


def plugin_label(pm: pluggy.PluginManager, plugin: Any) -> tuple[str, str]:
    """(the plugin's name, the entry-point name that ``PAGEDKV_DISABLE_PLUGINS`` takes to leave it out)."""
    registered = pm.get_name(plugin) or repr(plugin)
    name = registered
    if registered == str(id(plugin)):  # registered without a name: say what it is
        name = getattr(plugin, "__name__", None) or type(plugin).__name__
    return name, getattr(pm, "_pagedkv_origin", {}).get(registered, name)


def plugin_sources(pm: pluggy.PluginManager) -> dict[str, PluginSource]:
    """Entry-point name -> :class:`PluginSource`, for every entry point ``pm`` saw."""
    return getattr(pm, "_pagedkv_sources", {})


def _distribution(ep: Any) -> tuple[str | None, str | None]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return None, None
    return dist.name, dist.version


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    """Like ``pm.load_setuptools_entrypoints``, with the env controls; a broken plugin is reported, not fatal
    (unless it was asked for by name in ``PAGEDKV_PLUGINS``)."""
    from importlib.metadata import entry_points

    wanted = _names_from_env(PLUGINS_ENV)
    disabled = set(_names_from_env(DISABLE_ENV) or ())
    sources: dict[str, PluginSource] = {}
    pm._pagedkv_sources = sources  # type: ignore[attr-defined]
    for name in disabled:
        pm.set_blocked(name)
    for ep in entry_points(group=hookspecs.PROJECT):
        dist_name, version = _distribution(ep)
        if ep.name in sources or pm.has_plugin(ep.name):  # the same name twice: the first on the path wins
            first = sources.get(ep.name)
            if first is not None and (first.distribution, first.value) != (dist_name, ep.value):
                log.warning("pagedkv plugin name %r is taken by %s (%s); the one from %s (%s) is ignored",
                            ep.name, first.distribution, first.value, dist_name, ep.value)
            continue
        builtin = dist_name is not None and _normalize(dist_name) == BUILTIN_DISTRIBUTION
        source = sources[ep.name] = PluginSource(ep.name, ep.value, dist_name, version, builtin)
        requested = wanted is not None and ep.name in wanted
        if pm.is_blocked(ep.name):
            source.status = "disabled"
            if requested:
                log.warning("pagedkv plugin %r is both requested (%s) and disabled (%s); it stays disabled",
                            ep.name, PLUGINS_ENV, DISABLE_ENV)
            continue
        if wanted is not None and not builtin and not requested:
            source.status = "not selected"
            continue
        try:
            plugin = ep.load()
        except Exception as exc:  # noqa: BLE001 - a third-party import can fail in any way
            source.status, source.error = "failed", f"{type(exc).__name__}: {exc}"
            if requested:
                raise ConfigError(
                    f"pagedkv plugin {ep.name!r} (entry point {ep.value!r} from {dist_name or 'an unknown package'}) "
                    f"was requested in {PLUGINS_ENV} but failed to import: {source.error}"
                ) from exc
            log.warning("pagedkv plugin %r (entry point %r from %s) failed to import and is skipped: %s",
                        ep.name, ep.value, dist_name or "an unknown package", source.error)
            continue
        pm.register(plugin, name=ep.name)
        if requested:
            mark_requested(pm, ep.name)
    missing = [name for name in wanted or () if name not in sources]
    if missing:
        known = ", ".join(sorted(sources)) or "none"
        raise ConfigError(
            f"{PLUGINS_ENV} asks for {', '.join(map(repr, missing))}, but no such plugin is installed "
            f"in the {hookspecs.PROJECT!r} entry-point group; installed: {known}"
        )


def list_plugins(pm: pluggy.PluginManager | None = None) -> list[dict[str, Any]]:
    """Every plugin ``pm`` knows (a fresh manager if None), as plain dicts, entry points first.

    Keys: ``name``, ``module`` (the entry point's target, or the object's type), ``distribution``,
    ``version``, ``builtin``, ``status`` (loaded, disabled, not selected, failed, registered),
    ``error`` and ``hooks`` (the names of the hooks it implements, sorted).
    """
    pm = pm if pm is not None else make_plugin_manager()
    rows = []
    sources = plugin_sources(pm)
    for name, source in sources.items():
        plugin = pm.get_plugin(name)
        rows.append({
            "name": name,
            "module": source.value,
            "distribution": source.distribution,
            "version": source.version,
            "builtin": source.builtin,
            "status": source.status,
            "error": source.error,
            "hooks": _hook_names(pm, plugin),
        })
    for name, plugin in pm.list_name_plugin():
        if name in sources or plugin is None:
            continue
        rows.append({  # registered directly: extra_plugins, or a per-engine object from pagedkv_configure
            "name": name,
            "module": f"{type(plugin).__module__}.{type(plugin).__qualname__}",
            "distribution": None,
            "version": None,
            "builtin": False,
            "status": "registered",
            "error": None,
            "hooks": _hook_names(pm, plugin),
        })
    return rows


def _hook_names(pm: pluggy.PluginManager, plugin: Any) -> list[str]:
    if plugin is None:
        return []
    return sorted(caller.name for caller in pm.get_hookcallers(plugin) or ())


def build_registry(
    pm: pluggy.PluginManager,
    kind: str,
    hook_name: str,
    on_fault: FaultHandler | None = None,
) -> Registry:
    """Run one registrar hook over every plugin, remembering which plugin registered what.

    A plugin whose registrar raises leaves no entry behind; ``on_fault(pm, plugin, hook_name, exc)``
    decides what then happens (see ``plugin_guard.startup_fault``); without it the error propagates.
    """
    registry = Registry(kind)
    hook = getattr(pm.hook, hook_name)
    for impl in reversed(hook.get_hookimpls()):
        name = registry._current_plugin = pm.get_name(impl.plugin) or repr(impl.plugin)
        try:
            impl.function(register=registry.register)
        except Exception as exc:
            if on_fault is None or isinstance(exc, ConfigError):  # (a name registered twice is the user's to fix)
                raise
            registry.entries = {key: entry for key, entry in registry.entries.items() if entry.plugin != name}
            on_fault(pm, impl.plugin, hook_name, exc)
    return registry


def has_impls(pm: pluggy.PluginManager, hook_name: str) -> bool:
    return bool(getattr(pm.hook, hook_name).get_hookimpls())


def chosen_components(pm: pluggy.PluginManager, config: EngineConfig,
                      on_fault: FaultHandler | None = None) -> tuple[Entry, Entry, Entry]:
    """The registry entries of ``config``'s backend, allocator and scheduler (a bad name fails here, before
    anything is loaded). ``backend="auto"`` becomes the compiled CPU kernel on CPU when registered, else torch."""
    backends, allocators, schedulers = (
        build_registry(pm, kind, f"pagedkv_register_{kind}s", on_fault)
        for kind in ("backend", "allocator", "scheduler")
    )
    if config.backend == "auto":
        config.backend = "cpu" if config.device == "cpu" and "cpu" in backends.names() else "torch"
    return backends.get(config.backend), allocators.get(config.allocator), schedulers.get(config.scheduler)
