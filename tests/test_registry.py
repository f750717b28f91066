"""The registry: built-ins and entry-point plugins through one hook, duplicates, blocking, broken plugins."""

from __future__ import annotations

import sys
import types
import warnings

import pytest

import bastion
from bastion.contract.errors import DuplicateComponentError, PluginLoadError, UnknownComponentError
from bastion.contract.hookspecs import KINDS, hookimpl
from bastion.contract.registry import BLOCK_ENV, BUILTIN_PLUGINS, BUILTIN_SOURCE, PluginLoadWarning, Registry

GOOD = """
from bastion.contract.hookspecs import hookimpl

@hookimpl
def bastion_register_components(register):
    register("drafter", "fake-good", "bastion_example_drafter.drafter:NGramDrafter", description="fake")
    register("tree_builder", "fake-tree", "bastion.testing.contract:FixedLatencyModel")
"""

BROKEN_ON_IMPORT = """
raise ImportError("this plugin needs a library that is not installed")
"""

DUPLICATE = """
from bastion.contract.hookspecs import hookimpl

@hookimpl
def bastion_register_components(register):
    register("verifier", "fake-unique", "x:y")
    register("drafter", "fake-good", "x:y")
"""


TYPO = """
from bastion.contract.hookspecs import hookimpl

@hookimpl
def bastion_register_component(register):
    register("drafter", "typo-drafter", "x:y")
"""


def _plugin(**components: str) -> types.ModuleType:
    """A hook-implementing module registering ``kind=name`` pairs."""
    mod = types.ModuleType("plugin_" + "_".join(components.values()).replace("-", "_"))

    @hookimpl
    def bastion_register_components(register):
        for kind, name in components.items():
            register(kind, name, "bastion.testing.contract:FixedLatencyModel")

    mod.bastion_register_components = bastion_register_components  # type: ignore[attr-defined]
    return mod


def _isolated() -> Registry:
    return Registry(builtin_plugins=(), load_entry_points=False)


def test_kinds_are_the_five_component_kinds():
    assert bastion.registry.kinds() == KINDS == (
        "drafter",
        "tree_builder",
        "latency_model",
        "budget_controller",
        "verifier",
    )


def test_builtins_register_through_the_public_hook_with_source_builtin():
    reg = Registry(load_entry_points=False)
    builtins = reg.components()
    for modname in BUILTIN_PLUGINS:
        hook = sys.modules[modname].bastion_register_components
        assert hasattr(hook, "bastion_impl"), f"{modname} must implement the hook with bastion's hookimpl"

    assert builtins, "the built-in hooks registered nothing"
    assert {c.source for c in builtins} == {BUILTIN_SOURCE}
    assert {c.plugin for c in builtins} <= set(BUILTIN_PLUGINS)


def test_registering_a_duplicate_name_fails_naming_both_sources():
    reg = _isolated()
    reg.register_plugin(_plugin(verifier="twice"), name="first_plugin", source="dist-one")
    with pytest.raises(DuplicateComponentError) as err:
        reg.register_plugin(_plugin(verifier="twice"), name="second_plugin", source="dist-two")
    msg = str(err.value)
    assert "'twice'" in msg and "dist-one (first_plugin)" in msg and "dist-two (second_plugin)" in msg
    with pytest.raises(DuplicateComponentError, match=r"dist-one \(first_plugin\).*runtime"):
        reg.register("verifier", "twice", lambda: None)


def test_the_same_name_under_two_kinds_is_not_a_duplicate():
    reg = _isolated()
    reg.register_plugin(_plugin(verifier="same", drafter="same"), name="p")
    assert reg.names("verifier") == ["same"] and reg.names("drafter") == ["same"]


def test_unknown_kind_and_unknown_name_raise_clear_errors():
    reg = _isolated()
    reg.register("verifier", "only", lambda: None)
    with pytest.raises(UnknownComponentError, match="unknown component kind 'drafters'"):
        reg.names("drafters")
    with pytest.raises(UnknownComponentError, match="no verifier named 'missing'. Registered: only"):
        reg.create("verifier", "missing")
    with pytest.raises(ValueError, match="non-empty strings"):
        reg.register("verifier", "", lambda: None)


def test_create_passes_options_and_resolves_lazy_factories():
    reg = _isolated()
    reg.register("latency_model", "lazy", "bastion.testing.contract:FixedLatencyModel")
    model = reg.create("latency_model", "lazy", base_s=0.5)
    assert model.predict(1, 1) > 0.5


def test_a_runtime_plugin_with_a_misspelled_hook_is_refused_naming_the_hook():
    reg = _isolated()
    mod = types.ModuleType("typo_plugin")

    @hookimpl
    def bastion_register_component(register):  # missing the final "s"
        register("verifier", "never-registered", "x:y")

    mod.bastion_register_component = bastion_register_component  # type: ignore[attr-defined]
    with pytest.raises(PluginLoadError, match=r"'typo_plugin' implements unknown hook\(s\) bastion_register_component"):
        reg.register_plugin(mod, name="typo_plugin")
    assert not reg.pm.has_plugin("typo_plugin")
    reg.check_pending()  # nothing of the refused plugin stays pending


def test_an_entry_point_with_a_misspelled_hook_is_a_listed_failure_naming_the_hook(fake_plugin_dist):
    ep = fake_plugin_dist("fake-typo-dist", "fake_typo_plugin", TYPO)
    reg = Registry()
    with pytest.warns(PluginLoadWarning, match="bastion_register_component"):
        reg.load()
    [failure] = [f for f in reg.failures() if f.plugin == ep]
    assert failure.source == "fake-typo-dist"
    assert "unknown hook(s) bastion_register_component" in failure.error
    assert "typo-drafter" not in reg.names("drafter")


def test_register_components_is_called_through_pluggy_once_per_plugin():
    reg = _isolated()
    calls: list[str] = []

    class Plugin:
        def __init__(self, name: str) -> None:
            self.name = name

        @hookimpl
        def bastion_register_components(self, register):
            calls.append(self.name)
            register("verifier", self.name, "x:y")

    reg.register_plugin(Plugin("first"), name="first")
    reg.register_plugin(Plugin("second"), name="second")
    assert calls == ["first", "second"], "registering a plugin must not re-run the hooks of earlier plugins"
    assert reg.info("verifier", "second").plugin == "second"


def test_looking_up_a_builtin_imports_no_third_party_plugin(fake_plugin_dist):
    ep = fake_plugin_dist("fake-good-dist", "fake_good_plugin", GOOD)
    reg = Registry()
    assert reg.info("tree_builder", "best-first").source == BUILTIN_SOURCE
    reg.create("budget_controller", "fixed", budget=2)
    assert ep not in sys.modules, "a built-in lookup imported a third-party entry point"
    assert reg.info("drafter", "fake-good").source == "fake-good-dist"  # an unknown name loads the plugins
    assert ep in sys.modules


def test_entry_point_plugin_is_discovered_lazily_with_its_distribution_as_source(fake_plugin_dist):
    ep = fake_plugin_dist("fake-good-dist", "fake_good_plugin", GOOD)
    reg = Registry()
    assert ep not in sys.modules, "entry points must load lazily, on the first query"
    assert "fake-good" in reg.names("drafter")
    info = reg.info("drafter", "fake-good")
    assert (info.source, info.plugin, info.description) == ("fake-good-dist", ep, "fake")
    assert reg.info("tree_builder", "fake-tree").source == "fake-good-dist"
    assert ep in sys.modules
    reg.load()  # idempotent: a second load does not re-register (which would be a duplicate)
    assert reg.names("drafter").count("fake-good") == 1


@pytest.mark.parametrize("block", ["fake_good_plugin", "fake-good-dist", "*", "other, fake_good_plugin"])
def test_a_blocked_plugin_is_not_imported_or_registered(fake_plugin_dist, monkeypatch, block):
    ep = fake_plugin_dist("fake-good-dist", "fake_good_plugin", GOOD)
    monkeypatch.setenv(BLOCK_ENV, block)
    reg = Registry()
    assert "fake-good" not in reg.names("drafter")
    assert ep in reg.blocked()
    assert ep not in sys.modules
    assert set(Registry(load_entry_points=False).names("tree_builder")) <= set(reg.names("tree_builder"))


def test_a_name_not_found_suggests_near_names_and_mentions_blocked_plugins(fake_plugin_dist, monkeypatch):
    ep = fake_plugin_dist("fake-good-dist", "fake_good_plugin", GOOD)
    monkeypatch.setenv(BLOCK_ENV, ep)
    reg = Registry()
    with pytest.raises(UnknownComponentError) as err:
        reg.create("drafter", "fake-good")
    assert f"Blocked by {BLOCK_ENV}: {ep}" in str(err.value)
    with pytest.raises(UnknownComponentError, match="did you mean 'best-first'"):
        reg.create("tree_builder", "best_first")


@pytest.mark.parametrize("block", ["fake_import_name", "Fake.Named_Dist", "nice-name"])
def test_a_plugin_can_be_blocked_by_its_import_name_as_well_as_entry_and_distribution_names(fake_plugin_dist, monkeypatch, block):
    ep = fake_plugin_dist("fake-named-dist", "fake_import_name", GOOD, entry_name="nice-name")
    monkeypatch.setenv(BLOCK_ENV, block)
    reg = Registry()
    assert "fake-good" not in reg.names("drafter")
    assert ep == "nice-name" and ep in reg.blocked()
    assert "fake_import_name" not in sys.modules


def test_a_plugin_that_raises_on_import_is_reported_by_name_and_builtins_still_work(fake_plugin_dist):
    ep = fake_plugin_dist("fake-broken-dist", "fake_broken_plugin", BROKEN_ON_IMPORT)
    reg = Registry()
    with pytest.warns(PluginLoadWarning, match=r"'fake_broken_plugin' from 'fake-broken-dist' failed to load") as rec:
        reg.load()
    assert "needs a library that is not installed" in str(rec[0].message)
    assert BLOCK_ENV in str(rec[0].message)
    [failure] = [f for f in reg.failures() if f.plugin == ep]
    assert failure.source == "fake-broken-dist" and "ImportError" in failure.error
    builtin = Registry(load_entry_points=False)
    for kind in KINDS:
        assert set(builtin.names(kind)) <= set(reg.names(kind))
    with pytest.raises(UnknownComponentError, match=r"failed to load: fake_broken_plugin \(fake-broken-dist\)"):
        reg.info("drafter", "from-the-broken-plugin")


def test_a_plugin_registering_a_taken_name_loses_only_that_name_with_both_sources_named(fake_plugin_dist):
    fake_plugin_dist("fake-good-dist", "fake_good_plugin", GOOD)
    fake_plugin_dist("fake-later-dist", "fake_later_plugin", DUPLICATE)
    reg = Registry()
    with pytest.warns(PluginLoadWarning) as rec:
        reg.load()
    msgs = [str(r.message) for r in rec if "fake_later_plugin" in str(r.message)]
    assert msgs and "fake-good-dist (fake_good_plugin)" in msgs[0] and "fake-later-dist (fake_later_plugin)" in msgs[0]
    assert reg.info("drafter", "fake-good").source == "fake-good-dist"
    assert reg.info("verifier", "fake-unique").source == "fake-later-dist", "the plugin's other components stay"


def test_the_default_registry_is_reachable_as_bastion_registry():
    from bastion.contract.registry import registry

    assert bastion.registry is registry
    with warnings.catch_warnings():
        warnings.simplefilter("error", PluginLoadWarning)
        assert isinstance(bastion.registry.components(), list)


def test_a_lazy_factory_that_cannot_be_imported_raises_an_error_naming_the_component_and_source():
    reg = _isolated()
    reg.register("verifier", "ghost", "no_such_module_anywhere.sub:Thing", source="ghost-dist", plugin="ghost_plugin")
    with pytest.raises(PluginLoadError, match=r"verifier 'ghost' from ghost-dist \(ghost_plugin\).*ModuleNotFoundError"):
        reg.create("verifier", "ghost")
    reg.register("verifier", "bad-format", "no_colon_here")
    with pytest.raises(PluginLoadError, match="must look like 'package.module:attribute'"):
        reg.create("verifier", "bad-format")
