"""Pipeline boundaries: a controller's numpy integer is an int, a tree width whose mask would not fit is
refused when the pipeline is built (naming ``max_nodes`` and the memory), and a builder declaring valid
trees with a token outside the vocabulary is a bastion error. Before, the first was refused, the second
allocated gigabytes at the first step and the third was a raw ``IndexError``."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import bastion
from bastion.core import BastionError, InvalidInputError
from bastion.huggingface.causal_lm import HFTarget
from bastion.controllers.full import FullTreeController
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.reference import greedy_reference
from bastion.trees.best_first import BestFirstBuilder

PROMPT = torch.tensor([[5, 6, 7, 8]])


@functools.lru_cache(maxsize=None)
def _model():
    from bastion.testing.tiny import tiny_model

    return tiny_model("qwen3", seed=3)


class NumpyController(FullTreeController):
    def choose(self, log_scores, context_len, latency, overhead_s):
        return np.int64(min(2, int(log_scores.shape[0])))


def test_a_controller_returning_a_numpy_integer_decodes_losslessly() -> None:
    model = _model()
    pipe = bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=4), budget_controller=NumpyController(), max_nodes=8)
    out = pipe.generate(PROMPT, max_new_tokens=12)
    assert out.tokens == greedy_reference(model, PROMPT, 12)[: len(out.tokens)]


def test_max_nodes_whose_mask_would_not_fit_is_refused_at_construction() -> None:
    model = _model()
    capped = bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=4), max_nodes=100_000, budget_controller="full")
    assert capped.max_nodes == 512  # a tree cannot hold more nodes than the target has positions
    from bastion.testing.tiny import tiny_model

    long = tiny_model("qwen3", seed=0, max_position_embeddings=10**7)  # a mask of 100k x 10M entries would not fit
    with pytest.raises(InvalidInputError, match="max_nodes") as err:
        bastion.Pipeline(HFTarget(long), NoisyOracleDrafter(long, block_size=4), max_nodes=100_000, budget_controller="full")
    assert "GB" in str(err.value)


class OutOfVocabBuilder(BestFirstBuilder):
    builds_valid_trees = True

    def build(self, marginals, root_token, max_nodes):
        tree = super().build(marginals, root_token, max_nodes)
        tokens = tree.tokens.clone()
        if len(tokens) > 1:
            tokens[1] = 10_000
        return type(tree).from_parents(tokens, [int(p) for p in tree.parents])


def test_builder_declaring_valid_trees_with_an_out_of_vocabulary_token_is_a_bastion_error() -> None:
    model = _model()
    pipe = bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=4), tree_builder=OutOfVocabBuilder(), max_nodes=8)
    with pytest.raises(BastionError, match="10000"):
        pipe.generate(PROMPT, max_new_tokens=8)
