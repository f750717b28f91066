"""Plugins as a newcomer writes them: a duplicate name costs only that name, a typo in a lazy
``"module:Class"`` path shows in ``bastion plugins``, and the example plugin ships what its tests use."""

from __future__ import annotations

import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

import bastion
from bastion.cli.main import main
from bastion.contract.errors import PluginLoadError
from bastion.contract.registry import PluginLoadWarning, Registry

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "plugins" / "bastion-example-drafter"

FIRST = """
from bastion.contract.hookspecs import hookimpl

@hookimpl
def bastion_register_components(register):
    register("verifier", "fh-taken", "bastion.testing.contract:FixedLatencyModel")
"""

SECOND = """
from bastion.contract.hookspecs import hookimpl

@hookimpl
def bastion_register_components(register):
    register("tree_builder", "fh-valid-before", "bastion.trees.chain:ChainBuilder")
    register("verifier", "fh-taken", "bastion.testing.contract:FixedLatencyModel")
    register("budget_controller", "fh-valid-after", "bastion.controllers.budget:FixedController")
"""

TYPOS = """
from bastion.contract.hookspecs import hookimpl

@hookimpl
def bastion_register_components(register):
    register("tree_builder", "fh-good", "bastion.trees.chain:ChainBuilder")
    register("tree_builder", "fh-bad-module", "bastion.trees.chian:ChainBuilder")
    register("drafter", "fh-bad-class", "bastion_example_drafter.drafter:NGramDrafterr")
"""


def test_one_duplicate_name_keeps_the_plugins_valid_components(fake_plugin_dist):
    fake_plugin_dist("fh-first-dist", "fh_first_plugin", FIRST)
    ep = fake_plugin_dist("fh-second-dist", "fh_second_plugin", SECOND)
    reg = Registry()
    with pytest.warns(PluginLoadWarning, match=r"verifier 'fh-taken' skipped.*fh-first-dist \(fh_first_plugin\)"):
        reg.load()
    assert reg.info("tree_builder", "fh-valid-before").source == "fh-second-dist"
    assert reg.info("budget_controller", "fh-valid-after").source == "fh-second-dist"
    assert reg.info("verifier", "fh-taken").source == "fh-first-dist"
    [skipped] = [f for f in reg.failures() if f.plugin == ep]
    assert skipped.component == "verifier 'fh-taken'" and "fh-second-dist" in skipped.error


def test_a_typo_in_a_lazy_factory_shows_as_broken_in_bastion_plugins(fake_plugin_dist, monkeypatch, capsys):
    fake_plugin_dist("fh-typo-dist", "fh_typo_plugin", TYPOS)
    reg = Registry()
    monkeypatch.setattr(bastion, "registry", reg)
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.startswith("  fh-")}
    assert "BROKEN" not in lines["fh-good"]
    assert "BROKEN" in lines["fh-bad-module"] and "bastion.trees.chian" in lines["fh-bad-module"]
    assert "BROKEN" in lines["fh-bad-class"] and "NGramDrafterr" in lines["fh-bad-class"]
    assert "broken components: 2" in out
    assert main(["plugins", "--json"]) == 0
    rows = {c["name"]: c for c in json.loads(capsys.readouterr().out)["components"]}
    assert "broken" not in rows["fh-good"] and "ModuleNotFoundError" in rows["fh-bad-module"]["broken"]
    assert "AttributeError" in rows["fh-bad-class"]["broken"]
    with pytest.raises(PluginLoadError, match="NGramDrafterr"):
        reg.create("drafter", "fh-bad-class")


def test_the_example_plugin_packages_its_readme_and_exports_what_its_tests_import():
    meta = tomllib.loads((EXAMPLE / "pyproject.toml").read_text(encoding="utf-8"))
    assert meta["project"]["readme"] == "README.md" and (EXAMPLE / "README.md").is_file()
    import bastion_example_drafter as pkg

    for test in (EXAMPLE / "tests").glob("test_*.py"):
        for names in re.findall(r"^from bastion_example_drafter import (.+)$", test.read_text(encoding="utf-8"), flags=re.M):
            for name in (n.strip(" ()") for n in names.split(",")):
                assert name in pkg.__all__ and hasattr(pkg, name), f"{test.name} imports {name}"
    hooks = sys.modules.get("bastion_example_drafter.hooks") or __import__("bastion_example_drafter.hooks").hooks
    assert hooks is not None


def test_the_example_plugin_registers_a_drafter_a_tree_builder_and_a_budget_controller_that_all_resolve():
    reg = Registry()
    mine = [c for c in reg.components() if c.source == "bastion-example-drafter"]
    assert {c.kind for c in mine} == {"drafter", "tree_builder", "budget_controller"}
    assert all(reg.check_factory(c) is None for c in mine)
