"""The component registry: (kind, name) -> factory, fed by built-ins and entry-point plugins alike.

Built-ins load on the first query; entry points of the ``bastion`` group load lazily, once, on the first
query a built-in cannot answer (looking up a built-in name imports no third-party code). Hooks are called
through pluggy, one plugin at a time, and each plugin's hook implementations are checked against the hook
specifications when it registers: a misspelled hook name is a listed failure naming it. Set the variable
``BASTION_BLOCK_PLUGINS`` to a comma-separated list of entry-point, distribution or import names to keep
those plugins from loading (``*`` blocks every third-party plugin). A plugin that fails to import or register
is reported with a :class:`PluginLoadError` warning naming it; built-ins and other plugins keep working.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import os
import re
import threading
import warnings
from types import ModuleType
from typing import Any, Callable, Iterable

import attrs
import pluggy

from bastion.contract import hookspecs
from bastion.contract.errors import (
    BastionError,
    DuplicateComponentError,
    IncompatibleComponentsError,
    InvalidInputError,
    InvalidOptionError,
    PluginLoadError,
    UnknownComponentError,
)
from bastion.contract.hookspecs import KINDS

__all__ = [
    "ComponentInfo",
    "PluginFailure",
    "PluginLoadWarning",
    "Registry",
    "registry",
    "BUILTIN_SOURCE",
    "BLOCK_ENV",
    "ENTRY_POINT_GROUP",
]

ENTRY_POINT_GROUP = "bastion"
BLOCK_ENV = "BASTION_BLOCK_PLUGINS"
BUILTIN_SOURCE = "builtin"

#: modules holding bastion's own hook implementations, registered exactly like plugins
BUILTIN_PLUGINS: tuple[str, ...] = (
    "bastion.trees.hooks",
    "bastion.drafters.hooks",
    "bastion.controllers.hooks",
    "bastion.verifiers.hooks",
)


@attrs.frozen
class ComponentInfo:
    kind: str
    name: str
    factory: Callable[..., Any] | str = attrs.field(eq=False, repr=False)
    source: str  # "builtin" or the distribution name of the plugin
    plugin: str  # the module / entry point that registered it
    description: str = ""

    def as_dict(self) -> dict[str, str]:
        return {
            "kind": self.kind,
            "name": self.name,
            "source": self.source,
            "plugin": self.plugin,
            "description": self.description,
        }


@attrs.frozen
class PluginFailure:
    plugin: str  # entry point name
    source: str  # distribution name
    error: str
    #: "kind 'name'" of one component skipped (a duplicate name) while the plugin's others registered;
    #: empty when the whole plugin failed to load
    component: str = ""


class Registry:
    """Typed facade over the plugin manager; pipeline code never touches ``pm.hook`` directly."""

    def __init__(self, builtin_plugins: Iterable[str] = BUILTIN_PLUGINS, load_entry_points: bool = True) -> None:
        self._builtin_plugins = tuple(builtin_plugins)
        self._load_entry_points = load_entry_points
        self._components: dict[tuple[str, str], ComponentInfo] = {}
        self._failures: list[PluginFailure] = []
        self._blocked: list[str] = []
        self._builtins_loaded = False
        self._loaded = False
        self._lock = threading.RLock()
        self.pm = pluggy.PluginManager(hookspecs.NAME)
        self.pm.add_hookspecs(hookspecs)

    # ---------------------------------------------------------------- public API
    def kinds(self) -> tuple[str, ...]:
        return KINDS

    def names(self, kind: str) -> list[str]:
        self._check_kind(kind)
        self.load()
        return sorted(name for (k, name) in self._components if k == kind)

    def info(self, kind: str, name: str) -> ComponentInfo:
        self._check_kind(kind)
        self._load_builtins()
        if (kind, name) not in self._components:  # only now import third-party entry points
            self.load()
        try:
            return self._components[(kind, name)]
        except KeyError:
            raise UnknownComponentError(self._not_found(kind, name)) from None

    def _not_found(self, kind: str, name: str) -> str:
        """Why ``name`` is not a registered ``kind``: near names, and plugins blocked or failed to load."""
        names = self.names(kind)
        near = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
        msg = f"no {kind} named {name!r}" + (f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ".")
        msg += f" Registered: {', '.join(names) or 'none'}."
        if self._blocked:
            msg += f" Blocked by {BLOCK_ENV}: {', '.join(self._blocked)} (their components are not registered)."
        if self._failures:
            whole = [f for f in self._failures if not f.component]
            skipped = [f for f in self._failures if f.component]
            if whole:
                msg += " Plugins that failed to load: " + ", ".join(f"{f.plugin} ({f.source})" for f in whole) + "."
            if skipped:
                msg += " Components skipped as duplicates: " + ", ".join(f"{f.component} of {f.plugin} ({f.source})" for f in skipped) + "."
        return msg

    def create(self, kind: str, name: str, **options: Any) -> Any:
        """Instantiate component ``name`` of ``kind`` with keyword ``options``."""
        info = self.info(kind, name)
        try:
            factory = _resolve(info.factory)
        except PluginLoadError:
            raise
        except Exception as exc:  # a lazy factory whose module or attribute is missing
            raise PluginLoadError(
                f"{kind} {name!r} from {info.source} ({info.plugin}) could not be imported from "
                f"{info.factory!r}: {type(exc).__name__}: {exc}"
            ) from exc
        _check_options(kind, name, factory, options)
        return factory(**options)

    def drafter_for_checkpoint(self, path: str) -> str:
        """The name of the one registered drafter whose ``claims_checkpoint(path)`` is true.

        Raises :class:`UnknownComponentError` when none claims ``path`` and
        :class:`IncompatibleComponentsError` when several do (pass the drafter by name then)."""
        claimants = []
        for name in self.names("drafter"):
            try:
                claims = getattr(_resolve(self._components[("drafter", name)].factory), "claims_checkpoint", None)
                if claims is not None and claims(path) is True:
                    claimants.append(name)
            except Exception:  # a drafter that cannot even be imported or asked claims nothing
                continue
        if not claimants:
            _check_checkpoint_config(path)  # a broken config.json is named, not reported as claimed by nobody
            raise UnknownComponentError(
                f"{path!r} is neither a registered drafter ({', '.join(self.names('drafter')) or 'none'}) nor a "
                "checkpoint any registered drafter claims"
            )
        if len(claimants) > 1:
            raise IncompatibleComponentsError(
                f"several drafters claim checkpoint {path!r}: {', '.join(claimants)}; create the drafter yourself, "
                f"e.g. bastion.registry.create('drafter', {claimants[0]!r}, checkpoint=...)"
            )
        return claimants[0]

    def components(self) -> list[ComponentInfo]:
        self.load()
        return sorted(self._components.values(), key=lambda c: (KINDS.index(c.kind), c.name))

    def failures(self) -> list[PluginFailure]:
        self.load()
        return list(self._failures)

    def check_factory(self, info: ComponentInfo) -> str | None:
        """Why ``info``'s factory cannot be used (a lazy ``"module:attribute"`` whose module or attribute
        is missing, or that names something not callable), or None when it resolves. Imports the module
        of a lazy factory: ``bastion plugins`` calls this for every component it lists."""
        try:
            factory = _resolve(info.factory)
        except Exception as exc:
            return f"cannot import {info.factory!r}: {type(exc).__name__}: {exc}"
        if not callable(factory):
            return f"{info.factory!r} is a {type(factory).__name__}, not a class or function"
        return None

    def blocked(self) -> list[str]:
        self.load()
        return list(self._blocked)

    def register(
        self,
        kind: str,
        name: str,
        factory: Callable[..., Any] | str,
        *,
        description: str = "",
        source: str = "runtime",
        plugin: str = "runtime",
    ) -> None:
        """Register one component directly (tests, notebooks). Duplicates raise
        :class:`DuplicateComponentError` naming both sources."""
        self.load()
        self._add(ComponentInfo(kind, name, factory, source, plugin, description))

    def register_plugin(self, module: ModuleType | object, *, name: str | None = None, source: str = "runtime") -> None:
        """Register a hook-implementing object (module or instance) as a plugin and collect its components.
        Raises :class:`PluginLoadError` naming any hook it implements that bastion does not specify, and
        naming the plugin when its hook raises (chained to the original exception; bastion's own errors,
        a duplicate name for instance, are raised as they are). Registration is all or nothing: what the
        plugin registered before failing is rolled back."""
        self.load()
        name = name or getattr(module, "__name__", repr(module))
        with self._lock:
            snapshot = dict(self._components)
            try:
                self._register_plugin(module, name, source)
            except BaseException as exc:  # all or nothing: what it registered before failing is rolled back
                self._components = snapshot
                if self.pm.is_registered(module):
                    self.pm.unregister(module)
                if isinstance(exc, Exception) and not isinstance(exc, BastionError):
                    raise PluginLoadError(
                        f"plugin {name!r} failed while registering its components and registered nothing: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                raise

    def check_pending(self) -> None:
        """Fail on hook implementations that match no hook specification (every plugin is already
        checked when it registers; this re-checks the whole plugin manager)."""
        self.load()
        self.pm.check_pending()

    def load(self) -> None:
        """Load built-ins and entry-point plugins once (idempotent, thread-safe)."""
        if self._loaded:
            return
        self._load_builtins()
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            if self._load_entry_points:
                self._load_plugins()

    # ---------------------------------------------------------------- internals
    def _load_builtins(self) -> None:
        if self._builtins_loaded:
            return
        with self._lock:
            if self._builtins_loaded:
                return
            self._builtins_loaded = True
            for modname in self._builtin_plugins:
                self._register_plugin(importlib.import_module(modname), modname, BUILTIN_SOURCE)

    def _check_kind(self, kind: str) -> None:
        if kind not in KINDS:
            raise UnknownComponentError(f"unknown component kind {kind!r}; kinds are {', '.join(KINDS)}")

    def _add(self, info: ComponentInfo) -> None:
        self._check_kind(info.kind)
        if not isinstance(info.name, str) or not info.name:
            raise InvalidInputError(
                f"{info.kind} names must be non-empty strings, got {info.name!r} (registered by {info.plugin or info.source})"
            )
        key = (info.kind, info.name)
        if key in self._components:
            prev = self._components[key]
            raise DuplicateComponentError(
                f"{info.kind} {info.name!r} is registered twice: by {prev.source} ({prev.plugin}) "
                f"and by {info.source} ({info.plugin})"
            )
        self._components[key] = info

    def _register_plugin(self, plugin: object, name: str, source: str, *, skip_duplicates: bool = False) -> None:
        """Register ``plugin`` and collect its components. With ``skip_duplicates`` (entry-point plugins) a
        name another source already registered for the same kind is skipped with a warning and a listed
        failure naming both sources, and the plugin's other components stay registered."""
        self.pm.register(plugin, name=name)
        unknown = self._unknown_hooks(plugin)
        if unknown:
            self.pm.unregister(plugin)
            specified = ", ".join(sorted(n for n in dir(hookspecs) if n.startswith("bastion_")))
            raise PluginLoadError(
                f"plugin {name!r} implements unknown hook(s) {', '.join(unknown)}; bastion's hooks are: {specified}"
            )

        def register(kind: str, cname: str, factory: Callable[..., Any] | str, *, description: str = "") -> None:
            try:
                self._add(ComponentInfo(kind, cname, factory, source, name, description))
            except DuplicateComponentError as exc:
                if not skip_duplicates:
                    raise
                self._failures.append(PluginFailure(name, source, f"skipped: {exc}", component=f"{kind} {cname!r}"))
                warnings.warn(
                    PluginLoadWarning(f"bastion plugin {name!r} from {source!r}: {kind} {cname!r} skipped, {exc}; "
                                      "its other components are registered"),
                    stacklevel=5,
                )

        others = [p for p in self.pm.get_plugins() if p is not plugin]
        self.pm.subset_hook_caller("bastion_register_components", remove_plugins=others)(register=register)

    def _unknown_hooks(self, plugin: object) -> list[str]:
        """Names of hooks ``plugin`` implements that no specification declares (pluggy's
        ``check_pending``, for one plugin)."""
        unknown = []
        for caller in self.pm.get_hookcallers(plugin) or []:
            if caller.has_spec():
                continue
            if any(impl.plugin is plugin and not impl.optionalhook for impl in caller.get_hookimpls()):
                unknown.append(caller.name)
        return sorted(unknown)

    def _load_plugins(self) -> None:
        blocked = {b.strip() for b in os.environ.get(BLOCK_ENV, "").split(",") if b.strip()}
        for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = ep.dist.name if ep.dist is not None else "unknown distribution"
            if _is_blocked(blocked, ep.name, dist, ep.module):
                self._blocked.append(ep.name)
                continue
            if self.pm.has_plugin(ep.name):
                continue
            snapshot, failed = dict(self._components), len(self._failures)
            try:
                module = ep.load()
                self._register_plugin(module, ep.name, dist, skip_duplicates=True)
            except Exception as exc:  # a broken plugin must not take the built-ins down
                self._components = snapshot  # roll back whatever it registered before failing
                del self._failures[failed:]
                if self.pm.has_plugin(ep.name):
                    self.pm.unregister(name=ep.name)
                msg = f"{type(exc).__name__}: {exc}"
                self._failures.append(PluginFailure(ep.name, dist, msg))
                warnings.warn(
                    PluginLoadWarning(
                        f"bastion plugin {ep.name!r} from {dist!r} failed to load and was skipped: {msg} "
                        f"(set {BLOCK_ENV}={ep.name} to silence this)"
                    ),
                    stacklevel=3,
                )


def _normalized(name: str) -> str:
    """Distribution names compare like pip compares them: case-insensitive, ``-``, ``_`` and ``.`` alike."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _is_blocked(blocked: set[str], entry_name: str, dist: str, module: str) -> bool:
    """Whether ``BASTION_BLOCK_PLUGINS`` names this plugin: ``*``, its entry-point name, its distribution
    name (normalized), its import name (the entry point's module) or that module's top-level package."""
    if not blocked:
        return False
    if "*" in blocked or entry_name in blocked or module in blocked or module.split(".")[0] in blocked:
        return True
    return _normalized(dist) in {_normalized(b) for b in blocked}


class PluginLoadWarning(UserWarning):
    """Warning category for plugins that failed to load (see :class:`PluginLoadError`)."""


def _resolve(factory: Callable[..., Any] | str) -> Callable[..., Any]:
    if callable(factory):
        return factory
    module_name, _, attr = factory.partition(":")
    if not attr:
        raise PluginLoadError(f"lazy factory {factory!r} must look like 'package.module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


#: the process-wide default registry (``bastion.registry``)
registry = Registry()


def _check_options(kind: str, name: str, factory: Any, options: dict[str, Any]) -> None:
    """Options ``factory`` does not take (a typo) raise :class:`InvalidOptionError`, a bastion error and a
    ``TypeError``, naming the option and the ones it takes, before the factory runs."""
    import inspect

    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # builtins and C callables: let the call itself decide
        return
    try:
        signature.bind(**options)
    except TypeError as exc:
        takes = [p.name for p in signature.parameters.values() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        raise InvalidOptionError(
            f"{kind} {name!r}: {exc}; it takes {', '.join(takes) or 'no options'}"
        ) from None


def _check_checkpoint_config(path: str) -> None:
    """A local folder's ``config.json`` that exists but is not a JSON object raises
    :class:`InvalidFileError` naming it."""
    from pathlib import Path

    from bastion.utils.files import read_json_object

    config = Path(str(path)).expanduser() / "config.json"
    if config.is_file():
        read_json_object(config)
