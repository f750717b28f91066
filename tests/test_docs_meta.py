"""Meta-tests: hooks, public names and the README's commands are documented and kept in sync."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import yaml

import bastion.core
import bastion.testing
from bastion.contract import hookspecs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
THIS = Path(__file__).name


def _hookspecs() -> list:
    return [
        fn
        for name, fn in vars(hookspecs).items()
        if name.startswith("bastion_") and callable(fn) and hasattr(fn, f"{hookspecs.NAME}_spec")
    ]


def _signature(fn) -> str:
    """``name(param: Annotation, ...) -> Return`` as written in the source annotations."""
    params = ", ".join(
        f"{p.name}: {p.annotation}" if p.annotation is not inspect.Parameter.empty else p.name
        for p in inspect.signature(fn).parameters.values()
    )
    return f"{fn.__name__}({params}) -> {inspect.signature(fn).return_annotation}"


def _docs_text() -> str:
    return "\n".join(p.read_text() for p in sorted(DOCS.rglob("*.md")))


def _nav_files(nav) -> list[str]:
    out: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out.extend(_nav_files(value) if isinstance(value, list) else [value])
    return out


SPECS = _hookspecs()


def test_the_hookspec_module_defines_the_component_registration_hook():
    assert "bastion_register_components" in [fn.__name__ for fn in SPECS]
    assert _signature(hookspecs.bastion_register_components) == "bastion_register_components(register: Register) -> None"


@pytest.mark.parametrize("spec", SPECS, ids=lambda fn: fn.__name__)
def test_every_hookspec_is_documented_with_its_signature(spec):
    sig = _signature(spec)
    assert sig in _docs_text(), f"document `{sig}` in docs/hooks.md"
    assert spec.__doc__ and spec.__doc__.strip(), f"{spec.__name__} needs a docstring"


@pytest.mark.parametrize("spec", SPECS, ids=lambda fn: fn.__name__)
def test_every_hookspec_has_a_test(spec):
    tested = [p.name for p in (ROOT / "tests").glob("test_*.py") if p.name != THIS and spec.__name__ in p.read_text()]
    assert tested, f"no test under tests/ exercises {spec.__name__}"


def test_the_hooks_page_documents_every_component_kind_and_the_block_variable():
    text = (DOCS / "hooks.md").read_text()
    for kind in hookspecs.KINDS:
        assert f'"{kind}"' in text
    assert "BASTION_BLOCK_PLUGINS" in text and "DuplicateComponentError" in text


def test_the_api_page_names_every_public_core_and_testing_name():
    text = (DOCS / "api.md").read_text()
    missing = [n for n in [*bastion.core.__all__, *bastion.testing.__all__] if n not in text]
    assert not missing, f"docs/api.md does not mention {missing}"


def test_every_docs_page_is_in_the_mkdocs_nav_and_every_nav_entry_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_files(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(set(nav)) == pages, f"pages missing from nav: {set(pages) - set(nav)}; nav entries without a page: {set(nav) - set(pages)}"
    for required in ("index.md", "user-guide.md", "plugin-guide.md", "hooks.md", "api.md"):
        assert required in nav


def _quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S)]


def test_readme_has_exactly_two_single_line_quick_start_commands():
    commands = _quick_start_commands()
    assert len(commands) == 2, commands
    assert all("\n" not in c for c in commands)
    install, test = commands
    assert install.startswith("python3 -m venv .venv") and "pip install torch==2.13.0 && pip install -e ." in install
    assert "bastion generate --prompt" in install
    assert '".[test]"' in test and "-e plugins/bastion-example-drafter" in test and "python -m pytest" in test


def test_ci_runs_exactly_the_readme_test_command_and_builds_the_docs_strictly():
    script = (ROOT / ".ci" / "run").read_text()
    match = re.search(r"^TEST_COMMAND='(.*)'$", script, flags=re.M)
    assert match, ".ci/run must define TEST_COMMAND='...'"
    assert match.group(1) == _quick_start_commands()[1]
    assert 'bash -euo pipefail -c "$TEST_COMMAND"' in script
    assert "mkdocs build --strict" in script and "set -euo pipefail" in script
    assert (ROOT / ".ci" / "run").stat().st_mode & 0o111, ".ci/run must be executable"


def test_docs_and_readme_contain_no_machine_specific_paths():
    for path in [ROOT / "README.md", *DOCS.rglob("*.md")]:
        text = path.read_text()
        for needle in ("/work/", "/home/", "/root/", "/opt/", "/Users/"):
            assert needle not in text, f"{path.name} mentions the machine path {needle}"
