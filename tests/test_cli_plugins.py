"""``bastion plugins`` (table and --json) and help on every command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import bastion
from bastion.cli.main import COMMAND_MODULES, build_parser, main
from bastion.contract.hookspecs import KINDS
from bastion.contract.registry import BLOCK_ENV, BUILTIN_SOURCE, Registry

BROKEN = 'raise RuntimeError("boom at import")\n'


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plugins", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_command_has_help(capsys):
    sub = next(a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction")
    assert len(sub.choices) >= len(COMMAND_MODULES) and "plugins" in sub.choices
    for command, parser in sub.choices.items():
        assert parser.description and parser.description.strip(), f"bastion {command} has no description"
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert "usage: bastion " + command in out
        assert " ".join(parser.description.split()[:4]) in " ".join(out.split()), f"--help of {command} omits its description"


def test_plugins_json_lists_every_registered_component_with_its_source(capsys):
    payload = _json(capsys)
    rows = payload["components"]
    assert {(r["kind"], r["name"]) for r in rows} == {(c.kind, c.name) for c in bastion.registry.components()}
    assert all(set(r) == {"kind", "name", "source", "plugin", "description"} for r in rows)
    kinds = {r["kind"] for r in rows}
    assert kinds == set(KINDS), f"missing kinds: {set(KINDS) - kinds}"
    assert {r["source"] for r in rows if r["plugin"].startswith("bastion.")} == {BUILTIN_SOURCE}
    example = [r for r in rows if r["name"] == "example-ngram"]
    assert example and example[0]["source"] == "bastion-example-drafter" and example[0]["kind"] == "drafter"
    assert payload["failed"] == [] and isinstance(payload["blocked"], list)


def test_plugins_table_groups_components_by_kind_with_sources(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    for kind in KINDS:
        assert f"{kind}:" in out
    assert "example-ngram" in out and "[bastion-example-drafter]" in out
    assert f"[{BUILTIN_SOURCE}]" in out


def test_plugins_reports_failed_and_blocked_plugins(capsys, monkeypatch, fake_plugin_dist):
    fake_plugin_dist("fake-broken-dist", "fake_broken_cli", BROKEN)
    monkeypatch.setenv(BLOCK_ENV, "bastion-example-drafter")
    monkeypatch.setattr(bastion, "registry", Registry())
    with pytest.warns(UserWarning, match="fake_broken_cli"):
        payload = _json(capsys)
    assert payload["failed"] == [
        {"plugin": "fake_broken_cli", "source": "fake-broken-dist", "error": "RuntimeError: boom at import"}
    ]
    assert payload["blocked"] == ["example_drafter"]
    assert "example-ngram" not in {r["name"] for r in payload["components"]}
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "failed plugin: fake_broken_cli (fake-broken-dist): RuntimeError: boom at import" in out
    assert "blocked plugin: example_drafter" in out


def test_the_installed_console_script_prints_plugins_json():
    script = Path(sys.executable).with_name("bastion")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "bastion.cli.main"]
    done = subprocess.run([*cmd, "plugins", "--json"], capture_output=True, text=True, timeout=120, check=True)
    rows = json.loads(done.stdout)["components"]
    assert ("drafter", "example-ngram", "bastion-example-drafter") in {(r["kind"], r["name"], r["source"]) for r in rows}
