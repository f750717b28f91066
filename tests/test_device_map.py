"""``device_map`` placement: one-device maps load through the same path as ``device=``, maps over several
devices go through accelerate (a clear error when it is missing), the drafter runs where the features are."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from bastion import Pipeline
from bastion.cli.main import main
from bastion.contract.errors import IncompatibleComponentsError, InvalidInputError
from bastion.huggingface.causal_lm import single_device
from bastion.testing.tiny import TinyPair, save_tiny_pair

HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.mark.parametrize(
    "device_map, expected",
    [
        ("cpu", torch.device("cpu")),
        (torch.device("cpu"), torch.device("cpu")),
        ({"": "cpu"}, torch.device("cpu")),
        ({"model.layers": "cpu", "lm_head": "cpu"}, torch.device("cpu")),
        (0, torch.device("cuda", 0)),
        ("auto", None),
        ("balanced", None),
        ({"model.layers.0": 0, "model.layers.1": 1}, None),
        ({"model": "cpu", "lm_head": "disk"}, None),
    ],
)
def test_a_map_naming_one_device_resolves_to_it_and_a_spread_needs_the_dispatcher(device_map, expected) -> None:
    assert single_device(device_map) == expected


@pytest.mark.parametrize("device_map", ["nowhere", {}])
def test_a_device_map_that_names_no_device_is_a_clear_error(device_map) -> None:
    with pytest.raises(InvalidInputError, match="device_map"):
        single_device(device_map)


def test_device_map_on_one_device_decodes_exactly_like_device(pair: TinyPair) -> None:
    ids = torch.tensor([[5, 17, 300, 42, 9]])
    by_device = Pipeline.from_pretrained(pair.target, pair.drafter, device="cpu")
    by_map = Pipeline.from_pretrained(pair.target, pair.drafter, device_map={"": "cpu"})
    assert by_map.target.feature_device(by_map.drafter.feature_layers) == torch.device("cpu")
    assert by_map.drafter.model.device == torch.device("cpu")
    a = by_device.generate(ids, max_new_tokens=12)
    b = by_map.generate(ids, max_new_tokens=12)
    assert a.tokens == b.tokens and len(a.tokens) == 12


@pytest.mark.skipif(HAS_ACCELERATE, reason="accelerate is installed: the spread map is loaded, not refused")
def test_a_spread_device_map_without_accelerate_says_how_to_install_it(pair: TinyPair, tmp_path, capsys) -> None:
    with pytest.raises(IncompatibleComponentsError, match=r"pip install 'bastion\[multi-device\]'"):
        Pipeline.from_pretrained(pair.target, pair.drafter, device_map="auto")
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": 1, "prompt": "hi"}\n')
    args = ["run", "--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--target", str(pair.target),
            "--drafter", str(pair.drafter), "--device-map", "auto", "--no-progress"]  # fmt: skip
    assert main(args) == 2
    assert "accelerate" in capsys.readouterr().err
