from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=40, deadline=None)
settings.register_profile("dev", max_examples=20, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config: pytest.Config) -> None:
    # tests use tiny tensors: one intra-op thread per worker avoids oversubscribing the cores
    # (pytest -n 2 already runs two workers side by side)
    import torch

    torch.set_num_threads(int(os.environ.get("BASTION_TEST_THREADS", "1")))


@pytest.fixture(scope="session")
def shared_data():
    """The public data sets, found exactly as training and benchmarks find them
    (:func:`bastion.utils.folders.default_data_dir`: ``$BASTION_DATA_DIR``, else ``./data`` or
    ``../shared/data``; the package's bundled copies do not count: they hold only a slice of the training
    sets). When ``BASTION_DATA_DIR`` is set (CI sets it) a missing folder FAILS the test; only an
    unconfigured local checkout without the data skips."""
    from bastion.utils.folders import DATA_DIR_ENV, default_data_dir, is_bundled

    found = default_data_dir()
    if (found / "gsm8k").is_dir() and not is_bundled(found):
        return found
    message = f"the shared data sets are not at {found.resolve()} (no gsm8k/ there)"
    if os.environ.get(DATA_DIR_ENV):
        pytest.fail(f"{message}, but {DATA_DIR_ENV} points there")
    pytest.skip(f"{message}; set {DATA_DIR_ENV} to run the data tests")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory):
    from bastion.testing.tiny import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory):
    from bastion.testing.tiny import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("llama"), "llama", seed=1)


@pytest.fixture
def fake_plugin_dist(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """Factory that installs a throw-away distribution with a ``bastion`` entry point on ``sys.path``
    (a real ``*.dist-info`` with ``entry_points.txt``, found by ``importlib.metadata``).

    ``make(dist_name, module_name, source, entry_name=None)`` writes ``module_name.py`` holding ``source``
    and returns the entry-point name (``entry_name``, default the module name). Modules it imported are
    dropped from ``sys.modules`` afterwards.
    """
    import importlib
    import sys
    import textwrap

    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    made: list[str] = []

    def make(dist_name: str, module_name: str, source: str, entry_name: str | None = None) -> str:
        (site / f"{module_name}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist_name.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 1.0\n")
        entry = entry_name or module_name
        (info / "entry_points.txt").write_text(f"[bastion]\n{entry} = {module_name}\n")
        importlib.invalidate_caches()
        made.append(module_name)
        return entry

    yield make
    for name in made:
        sys.modules.pop(name, None)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    """A tiny Qwen3 target (the demo tokenizer) and a one-layer DFlash drafter saved to a folder, 128
    positions; one per test module (a module defining its own ``pair`` uses that one)."""
    from bastion.testing.tiny import save_tiny_pair

    return save_tiny_pair(tmp_path_factory.mktemp("pair"), max_positions=128)


@pytest.fixture(scope="module")
def pipe(pair):
    """The saved tiny pair as a pipeline (``max_nodes=8``); one per test module, like ``pair``."""
    import bastion

    return bastion.Pipeline.from_pretrained(pair.target, str(pair.drafter), max_nodes=8)
