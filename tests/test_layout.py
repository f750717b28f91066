"""The package's rooms and the older names that keep working.

``bastion.core`` was one folder holding the contract, the engine, the Hugging Face adapter and the
utilities; those now live in ``bastion.contract``, ``bastion.engine``, ``bastion.huggingface`` and
``bastion.utils``. Code written against the old module names keeps importing them and gets the moved
module itself (the same object: patching one name patches the other)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import bastion
import bastion.core

ROOMS = {"contract", "engine", "huggingface", "utils"}


@pytest.mark.parametrize("old", sorted(bastion.core.MOVED))
def test_every_old_module_name_imports_the_moved_module_itself(old: str) -> None:
    moved = importlib.import_module(bastion.core.MOVED[old])
    assert importlib.import_module(f"bastion.core.{old}") is moved
    assert getattr(bastion.core, old) is moved
    assert moved.__spec__.name == moved.__name__ == bastion.core.MOVED[old]  # its own spec, not the alias's


def test_every_moved_module_lives_in_a_room_and_the_old_folder_holds_no_module() -> None:
    assert {target.split(".")[1] for target in bastion.core.MOVED.values()} <= ROOMS
    folder = Path(bastion.core.__file__).parent
    assert sorted(p.name for p in folder.glob("*.py")) == ["__init__.py"]


def test_the_public_contract_names_import_from_both_homes() -> None:
    from bastion.contract import BudgetController, Drafter, LatencyModel, Marginals, Tree, TreeBuilder, Verifier
    from bastion.core import BudgetController as B, Drafter as D, LatencyModel as L, Marginals as M, Tree as T
    from bastion.core import TreeBuilder as TB, Verifier as V
    from bastion.core.hf_target import HFTarget
    from bastion.core.pipeline import Pipeline

    assert (B, D, L, M, T, TB, V) == (BudgetController, Drafter, LatencyModel, Marginals, Tree, TreeBuilder, Verifier)
    assert Pipeline is bastion.Pipeline and HFTarget.__module__ == "bastion.huggingface.causal_lm"
    assert set(bastion.core.__all__) == set(bastion.contract.__all__)


def test_an_unknown_old_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_module"):
        bastion.core.no_such_module  # noqa: B018
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("bastion.core.no_such_module")


def test_import_bastion_alone_gives_bastion_core_and_contract_as_attributes() -> None:
    """``import bastion; bastion.core.Tree`` (a fresh interpreter: nothing else imported first)."""
    import subprocess
    import sys

    code = "import bastion; print(bastion.core.Tree.__name__, bastion.contract.Drafter.__name__, bastion.core.hf_target.HFTarget.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["Tree", "Drafter", "HFTarget"]
