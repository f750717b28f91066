"""The example tree builder and budget controller: bastion's contract kit, then a lossless pipeline."""

from __future__ import annotations

import pytest
import torch

import bastion
from bastion.core import InvalidInputError, Marginals
from bastion.testing import check_budget_controller, check_component, check_tree_builder
from bastion.testing.reference import greedy_reference
from bastion.testing.tiny import tiny_model
from bastion_example_drafter import FanBuilder, NGramDrafter, ThresholdController


@pytest.mark.parametrize("width", [1, 3, 8])
def test_fan_builder_passes_the_bastion_contract_kit(width):
    check_tree_builder(FanBuilder(width=width))


def test_threshold_controller_passes_the_bastion_contract_kit():
    for options in ({}, {"threshold": 0.0}, {"threshold": 1.0, "max_budget": 1}, {"max_budget": 3}):
        check_budget_controller(ThresholdController(**options))


def test_both_are_found_by_name():
    check_component("tree_builder", "example-fan", options={"width": 2})
    check_component("budget_controller", "example-threshold", options={"threshold": 0.2})


def test_fan_builder_never_adds_a_token_the_drafter_rules_out():
    lp = torch.full((3, 5), float("-inf"))
    lp[:, 1] = 0.0  # one possible token per depth: a fan of width 3 has a single branch
    tree = FanBuilder(width=3).build(Marginals(lp), root_token=4, max_nodes=10)
    assert tree.tokens.tolist() == [4, 1, 1, 1] and bool(torch.isfinite(tree.log_scores).all())


def test_threshold_controller_keeps_the_leading_nodes_above_the_threshold():
    scores = torch.log(torch.tensor([1.0, 0.9, 0.5, 0.3, 0.05]))
    assert ThresholdController(threshold=0.4).decide_width([scores], [10], None, 0.0, 0.0).n == 3
    assert ThresholdController(threshold=0.4, max_budget=2).decide_width([scores], [10], None, 0.0, 0.0).n == 2
    assert ThresholdController(threshold=0.4).choose(scores, 10, None, 0.0) == 3  # the single-sequence adapter
    with pytest.raises(InvalidInputError):
        ThresholdController(threshold=1.5)


def test_threshold_controller_gives_a_batch_its_widest_rows_count():
    rows = [torch.log(torch.tensor([1.0, 0.9, 0.05])), torch.log(torch.tensor([1.0, 0.9, 0.8, 0.7, 0.01]))]
    assert ThresholdController(threshold=0.4).decide_width(rows, [3, 9], None, 0.0, 0.0).n == 4


def test_batched_rows_with_all_three_example_components_equal_their_greedy_references():
    model = tiny_model("qwen3")
    pipe = bastion.Pipeline(model, NGramDrafter(), tree_builder="example-fan", budget_controller="example-threshold",
                            component_options={"tree_builder": {"width": 2}, "budget_controller": {"threshold": 0.05}})
    prompts = [[5, 9, 17, 5, 9, 17, 5, 9], [3, 4, 3, 4, 3, 4], [8, 1, 2]]
    results = pipe.generate_batch(prompts, 12, stop_on_eos=False)
    for prompt, res in zip(prompts, results):
        assert res.tokens == greedy_reference(model, torch.tensor([prompt]), 12)


def test_a_pipeline_with_all_three_example_components_is_lossless():
    model = tiny_model("qwen3")
    pipe = bastion.Pipeline(model, NGramDrafter(), tree_builder="example-fan", budget_controller="example-threshold",
                            component_options={"tree_builder": {"width": 2}, "budget_controller": {"threshold": 0.05}})
    prompt = torch.tensor([[5, 9, 17, 5, 9, 17, 5, 9, 17, 5, 9]])
    res = pipe.generate(prompt, max_new_tokens=16, stop_on_eos=False)
    assert res.tokens == greedy_reference(model, prompt, 16)
