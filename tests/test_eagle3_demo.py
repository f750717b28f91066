"""The shipped demo EAGLE-3 drafter: found by name, small, trained for the demo target, lossless with it."""

from __future__ import annotations

import json

import torch

import bastion
from bastion.demo import DEMO_DRAFTERS, demo_drafter

PROMPT = "Natalia sold clips to 48 of her friends in April. How many clips did she sell?"


def test_the_demo_ships_a_float16_eagle3_drafter_of_a_few_megabytes_for_the_demo_target():
    assert DEMO_DRAFTERS["eagle3"] == "eagle3-drafter"
    path = demo_drafter("eagle3")
    assert bastion.registry.drafter_for_checkpoint(str(path)) == "eagle3"
    config = json.loads((path / "config.json").read_text())
    target = json.loads((path.parent / "target" / "config.json").read_text())
    assert config["vocab_size"] == target["vocab_size"] and config["target_hidden_size"] == target["hidden_size"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
    assert sum(f.stat().st_size for f in path.iterdir()) < 4_000_000
    summary = json.loads((path / "train_summary.json").read_text())
    assert summary["heldout"]["top1"][0] > 0.7  # it was trained: the target's greedy token most of the time


def test_the_demo_eagle3_drafter_decodes_the_targets_own_greedy_tokens_with_several_accepted_per_step():
    pipe = bastion.Pipeline.demo(drafter="eagle3", tree_builder="best-first",
                                 budget_controller=bastion.registry.create("budget_controller", "fixed", budget=16))
    assert type(pipe.drafter).__name__ == "Eagle3Drafter"
    ids = pipe.encode_chat(PROMPT)
    res = pipe.generate(ids, max_new_tokens=40)
    model = pipe.target.model
    with torch.no_grad():
        want = model.generate(ids, do_sample=False, max_new_tokens=40, pad_token_id=0)[0, ids.shape[1]:].tolist()
    assert res.tokens == want[: len(res.tokens)] and (len(res.tokens) == 40 or res.tokens[-1] == 1)
    assert res.acceptance_length > 1.5
