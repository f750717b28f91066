"""The documentation's Python examples run as written, offline: the README's blocks and the plugin
guide's example package, installed as the guide says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def _run(code: str, cwd: Path, extra_path: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (extra_path, str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_readme_python_examples_run_offline_as_written(capsys, monkeypatch):
    blocks = _python_blocks(ROOT / "README.md")
    assert len(blocks) >= 2 and "Pipeline.demo()" in blocks[0] and "custom_generate" in blocks[1]
    for block in blocks:  # in this process (local files only, nothing is fetched), each in a fresh namespace
        exec(compile(block, "README.md", "exec"), {"__name__": "__readme__"})
        assert capsys.readouterr().out.strip(), "the example prints its answer"


def _block(blocks: list[str], marker: str) -> str:
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"expected one block with {marker!r}"
    return found[0]


def test_the_plugin_guide_package_installs_offline_and_its_use_example_runs(tmp_path):
    guide = (ROOT / "docs" / "plugin-guide.md").read_text(encoding="utf-8")
    example = ROOT / "plugins" / "bastion-example-drafter"
    pyproject = _block(re.findall(r"```toml\n(.*?)```", guide, flags=re.S), "[project.entry-points.bastion]")
    blocks = _python_blocks(ROOT / "docs" / "plugin-guide.md")
    hooks, use = _block(blocks, "@hookimpl"), _block(blocks, "Pipeline.from_pretrained")
    # the package as the guide writes it: its pyproject.toml and hooks.py, the drafter from the example
    pkg = tmp_path / "pkg"
    src = pkg / "src" / "bastion_example_drafter"
    src.mkdir(parents=True)
    (pkg / "pyproject.toml").write_text(pyproject, encoding="utf-8")
    (pkg / "README.md").write_text("guide example\n", encoding="utf-8")
    (src / "hooks.py").write_text(hooks, encoding="utf-8")
    for module in (example / "src" / "bastion_example_drafter").glob("*.py"):  # the components and __init__
        if module.name != "hooks.py":
            (src / module.name).write_text(module.read_text(encoding="utf-8"), encoding="utf-8")
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--no-index", "--target", str(site), str(pkg)], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-3000:]
    check = use + (
        "\nimport bastion_example_drafter.hooks as hooks\n"
        f"assert hooks.__file__.startswith({str(site)!r}), hooks.__file__\n"
        "info = bastion.registry.info('drafter', 'example-ngram')\n"
        "assert info.source == 'bastion-example-drafter' and info.plugin == 'example_drafter', info\n"
        "assert len(res.tokens) == 32\n"
    )
    done = _run(check, tmp_path, extra_path=str(site))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip()
