"""The demo's autoregressive drafter: shipped next to the demo pair, selectable by name, lossless, useful."""

from __future__ import annotations

import json

import pytest
import torch

from bastion.core import InvalidInputError
from bastion.demo import demo_drafter, demo_paths
from bastion.drafters.model import ModelDrafter

PROMPT = "Sara has 5 boxes with 12 pencils in each box. She gives away 17 pencils. How many pencils does she have left?"


@pytest.fixture(scope="module")
def ar_pipe():
    from bastion import registry
    from bastion.engine.pipeline import Pipeline

    return Pipeline.demo(drafter="model", budget_controller=registry.create("budget_controller", "fixed", budget=16), max_nodes=16)


def test_the_ar_drafter_ships_in_half_precision_with_the_targets_vocabulary() -> None:
    from safetensors import safe_open

    path = demo_drafter("model")
    with safe_open(str(path / "model.safetensors"), "pt") as fh:
        assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.float16}
    cfg = json.loads((path / "config.json").read_text())
    target_cfg = json.loads((demo_paths().target / "config.json").read_text())
    assert cfg["vocab_size"] == target_cfg["vocab_size"] and cfg["num_hidden_layers"] < target_cfg["num_hidden_layers"]
    assert sum(p.stat().st_size for p in path.iterdir()) < 8 * 2**20
    assert json.loads((path / "train_summary.json").read_text())["heldout"]["top1"] > 0.5


def test_demo_with_the_model_drafter_matches_autoregressive_greedy_and_accepts_drafts(ar_pipe) -> None:
    from bastion.bench.methods import ARDecoder

    assert isinstance(ar_pipe.drafter, ModelDrafter)
    tok = ar_pipe.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(text, add_special_tokens=False)], dtype=torch.long)
    res = ar_pipe.generate(ids, max_new_tokens=40)
    assert res.tokens == ARDecoder(ar_pipe.target).generate(ids, max_new_tokens=40).tokens
    assert res.acceptance_length > 2.0


def test_generate_command_takes_the_model_drafter_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    from bastion.cli.main import main

    assert main(["generate", "--prompt", PROMPT, "--drafter", "model", "--max-new-tokens", "12"]) == 0
    assert "acceptance=" in capsys.readouterr().err


def test_unknown_demo_drafters_are_named() -> None:
    with pytest.raises(InvalidInputError, match="unknown demo drafter 'eagle'; the demo ships dflash, model"):
        demo_drafter("eagle")
