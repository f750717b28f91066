"""Pipeline arguments and component outputs refused with a bastion error that names the cause.

Before: ``pipe.decode([V + 5])`` returned ``''`` (the tokenizer drops an unknown id), ``[-1]`` was a raw
``OverflowError`` and ``["a"]`` a raw ``TypeError``; ``strict_verdicts="yes"`` (or ``"no"``) switched
the strict check on; a plugin builder's invalid tree was a ``TreeValidationError`` naming no builder."""

from __future__ import annotations

import pytest
import torch

import bastion
from bastion.contract.errors import InvalidInputError, TreeValidationError
from bastion.testing.tiny import TinyPair
from bastion.trees.best_first import BestFirstBuilder

PROMPT = [5, 6, 7, 8]


@pytest.mark.parametrize("tokens,cause", [("over", "lies outside the vocabulary"), ([-1], "-1"), (["a"], "'a'"), ([1.5], "1.5"), ([True], "True")])
def test_decode_refuses_ids_a_tokenizer_would_drop_or_choke_on(pipe: bastion.Pipeline, tokens, cause) -> None:
    if tokens == "over":
        tokens = [pipe.target.vocab_size + 5]
    with pytest.raises(InvalidInputError, match=cause):
        pipe.decode(tokens)


def test_decode_of_encoded_text_gives_the_text_back(pipe: bastion.Pipeline) -> None:
    assert pipe.decode(pipe.encode("hello world")[0]) == "hello world"
    assert pipe.decode(torch.tensor([], dtype=torch.long)) == ""


@pytest.mark.parametrize("flag", ["strict_verdicts", "validate_trees"])
@pytest.mark.parametrize("value", ["yes", "no", 1, 0.0])
def test_a_boolean_pipeline_flag_refuses_anything_but_a_bool_or_none(pair: TinyPair, flag: str, value) -> None:
    with pytest.raises(InvalidInputError, match=flag):
        bastion.Pipeline.from_pretrained(pair.target, str(pair.drafter), **{flag: value})


class WrongRootBuilder(BestFirstBuilder):
    builds_valid_trees = True

    def build(self, marginals, root_token, max_nodes):
        tree = super().build(marginals, root_token, max_nodes)
        return type(tree).from_parents(torch.cat([tree.tokens[:1] + 1, tree.tokens[1:]]), tree.parents)


@pytest.mark.parametrize("batched", [False, True])
def test_a_plugin_builders_invalid_tree_names_the_builder(pair: TinyPair, batched: bool) -> None:
    pipe = bastion.Pipeline.from_pretrained(pair.target, str(pair.drafter), max_nodes=8, tree_builder=WrongRootBuilder(),
                                            budget_controller="fixed")
    with pytest.raises(TreeValidationError, match=r"tree_builder WrongRootBuilder\.build .*root"):
        if batched:
            pipe.generate_batch([PROMPT, PROMPT[:3]], max_new_tokens=8)
        else:
            pipe.generate(PROMPT, max_new_tokens=8)
