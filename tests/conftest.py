from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("ci", max_examples=40, deadline=None)
settings.register_profile("dev", max_examples=20, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory):
    from bastion.testing.tiny import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=0)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory):
    from bastion.testing.tiny import save_tiny_target

    return save_tiny_target(tmp_path_factory.mktemp("llama"), "llama", seed=1)
