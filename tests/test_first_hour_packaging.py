"""What ``pip show bastion`` tells a newcomer, and the optional extras: matplotlib (``plot``) and
``datasets`` (``hf``), with a clear message when the bench needs one that is missing."""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

import pytest

from bastion.cli.main import main
from bastion.contract.errors import BastionError

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]


def _names(requirements: list[str]) -> set[str]:
    import re

    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_metadata_has_a_homepage_urls_and_classifiers():
    urls = PROJECT["urls"]
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())
    classifiers = PROJECT["classifiers"]
    assert "License :: OSI Approved :: Apache Software License" in classifiers
    assert any(c.startswith("Programming Language :: Python :: 3.1") for c in classifiers)
    assert any(c.startswith("Topic :: Scientific/Engineering :: Artificial Intelligence") for c in classifiers)
    assert PROJECT.get("keywords") and PROJECT.get("authors")


def test_matplotlib_and_datasets_are_extras_and_the_test_extra_keeps_matplotlib():
    extras = PROJECT["optional-dependencies"]
    assert "matplotlib" not in _names(PROJECT["dependencies"])
    assert "matplotlib" in _names(extras["plot"]) and "matplotlib" in _names(extras["test"])
    assert "datasets" in _names(extras["hf"])
    assert {"fastapi", "uvicorn"} <= _names(extras["serve"])


def test_importing_bastion_and_its_commands_needs_no_matplotlib(monkeypatch):
    import subprocess

    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "import bastion, bastion.cli.main, bastion.bench.reporting, bastion.bench.plots, bastion.cli.bench_cmd\n"
            "bastion.cli.main.build_parser()\n"
            "assert 'matplotlib.pyplot' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_bench_without_matplotlib_says_so_before_loading_any_model(monkeypatch, capsys):
    from bastion.cli import bench_cmd

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails as when it is not installed
    monkeypatch.setattr(bench_cmd, "load_pair", lambda *a, **k: pytest.fail("a model loaded before the check"))
    assert main(["bench", "--quick", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "bastion[plot]" in err and "--no-plots" in err


def test_the_plot_functions_without_matplotlib_raise_a_bastion_error_naming_the_extra(monkeypatch):
    from bastion.bench import plots

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(BastionError, match=r"bastion\[plot\]"):
        plots._plt()


def test_a_hub_dataset_without_datasets_names_the_extra(monkeypatch):
    from bastion.bench import datasets

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(BastionError, match=r"bastion\[hf\]"):
        list(datasets._hub_records("openai/gsm8k:main@test"))
