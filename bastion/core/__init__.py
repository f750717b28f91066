"""The contract's older name: ``from bastion.core import Tree, Drafter, ...`` is
``from bastion.contract import ...``, and the modules that lived here before the package was split into
rooms keep their old names: ``import bastion.core.hf_target`` gives :mod:`bastion.huggingface.causal_lm`
itself (the same module object, so patching either name patches both). :data:`MOVED` lists them."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Sequence

from bastion.contract import *  # noqa: F403 - the contract, under its older name
from bastion.contract import __all__  # noqa: F401

#: old module name under ``bastion.core`` -> where it lives now
MOVED: dict[str, str] = {
    "types": "bastion.contract.types", "tree": "bastion.contract.tree", "candidates": "bastion.contract.candidates",
    "interfaces": "bastion.contract.interfaces", "target": "bastion.contract.target",
    "batching": "bastion.contract.batch_state", "errors": "bastion.contract.errors",
    "hookspecs": "bastion.contract.hookspecs", "registry": "bastion.contract.registry",
    "sampling": "bastion.contract.sampling",
    "pipeline": "bastion.engine.pipeline", "batch": "bastion.engine.plain", "batch_costs": "bastion.engine.costs",
    "blame": "bastion.engine.blame",
    "hf_target": "bastion.huggingface.causal_lm", "hf_batch": "bastion.huggingface.batched",
    "kv_slab": "bastion.huggingface.kv_slab", "compiled_verify": "bastion.huggingface.compiled_verify",
    "hf_config": "bastion.huggingface.configs", "hf_compat": "bastion.huggingface.compat",
    "files": "bastion.utils.files", "folders": "bastion.utils.folders", "dtypes": "bastion.utils.dtypes",
    "checks": "bastion.utils.checks", "logs": "bastion.utils.logs", "sync": "bastion.utils.sync",
    "text": "bastion.utils.text", "chat": "bastion.utils.chat", "running": "bastion.utils.running",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves ``bastion.core.<old>`` to the module it moved to (the module itself, not a copy)."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(MOVED[spec.name.rpartition(".")[2]])
        self._specs[module.__name__] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the moved module ran when it was imported); the import machinery set the
        alias's spec on it, so its own comes back."""
        module.__spec__ = self._specs.pop(module.__name__, module.__spec__)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())


def __getattr__(name: str) -> ModuleType:
    """``bastion.core.<old>`` as an attribute (without an import statement naming it first)."""
    if name in MOVED:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
