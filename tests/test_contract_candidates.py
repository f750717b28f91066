"""Third-party drafters that propose candidate trees: a correct one passes the contract kit and decodes
losslessly in a pipeline; broken ones fail the kit with a message that says what is wrong."""

from __future__ import annotations

import math

import pytest
import torch

import bastion
from bastion.core import CandidateTree, DraftContext, DraftStep, Drafter, InvalidInputError, Tree, TreeBuilder
from bastion.huggingface.causal_lm import HFTarget
from bastion.testing import check_drafter, check_tree_builder
from bastion.testing.reference import greedy_reference
from bastion.testing.tiny import tiny_model

V = 16


class BigramTreeDrafter(Drafter):
    """Correct: expands the two likeliest next tokens of a smoothed context bigram model, depth by depth."""

    proposes = "candidate_tree"

    def __init__(self, vocab_size: int = V, depth: int = 3) -> None:
        self._v, self.depth = vocab_size, depth
        self.hist: list[int] = []

    @property
    def vocab_size(self) -> int:
        return self._v

    def begin(self, context: DraftContext) -> None:
        self.hist = context.tokens.tolist()

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        self.hist += tokens.tolist()

    def reset(self) -> None:
        self.hist = []

    def _next(self, token: int, temperature: float) -> torch.Tensor:
        counts = torch.ones(self._v)
        for a, b in zip(self.hist, self.hist[1:]):
            if a == token:
                counts[b] += 1.0
        return torch.log_softmax(counts.log() / temperature, dim=-1)  # [V]

    def propose(self, step: DraftStep) -> CandidateTree:
        if not 0 <= step.root_token < self._v:
            raise InvalidInputError("root out of range")
        tokens, parents, log_q = [step.root_token], [-1], [0.0]
        frontier = [0]
        for _ in range(self.depth):
            nxt = []
            for node in frontier:
                lp = self._next(tokens[node], step.temperature)
                vals, idx = lp.topk(2)
                for v, t in zip(vals.tolist(), idx.tolist()):
                    tokens.append(t)
                    parents.append(node)
                    log_q.append(v)
                    nxt.append(len(tokens) - 1)
            frontier = nxt[:2]
        return CandidateTree.from_lists(tokens, parents, log_q)


class WrongRoot(BigramTreeDrafter):
    def propose(self, step: DraftStep) -> CandidateTree:
        c = super().propose(step)
        return CandidateTree(torch.cat([(c.tokens[:1] + 1) % self._v, c.tokens[1:]]), c.parents, c.log_q)


class OverOne(BigramTreeDrafter):
    def propose(self, step: DraftStep) -> CandidateTree:
        c = super().propose(step)
        return CandidateTree(c.tokens, c.parents, torch.cat([c.log_q[:1], torch.full_like(c.log_q[1:], math.log(0.9))]))


class ChildFirst(BigramTreeDrafter):
    def propose(self, step: DraftStep) -> CandidateTree:
        c = super().propose(step)
        parents = c.parents.clone()
        parents[1] = len(c) - 1
        return CandidateTree(c.tokens, parents, c.log_q)


class SaysMarginals(BigramTreeDrafter):
    proposes = "marginals"


class ReturnsATree(BigramTreeDrafter):
    def propose(self, step: DraftStep):
        c = super().propose(step)
        return Tree.from_parents(c.tokens, c.parents)


def test_a_third_party_candidate_tree_drafter_passes_the_contract_kit():
    check_drafter(BigramTreeDrafter(), vocab_size=V)


def test_a_third_party_candidate_tree_drafter_decodes_losslessly_in_a_pipeline():
    model = tiny_model("qwen3", seed=0)
    for builder in ("best-first", "chain"):
        pipe = bastion.Pipeline(
            HFTarget(model),
            BigramTreeDrafter(vocab_size=256, depth=4),
            tree_builder=builder,
            budget_controller=bastion.registry.create("budget_controller", "fixed", budget=8),
            max_nodes=8,
        )
        prompt = torch.tensor([[5, 9, 5, 9, 5, 9, 7]])
        assert pipe.generate(prompt, max_new_tokens=12).tokens == greedy_reference(model, prompt, 12)


@pytest.mark.parametrize(
    ("drafter", "message"),
    [
        (WrongRoot(), "root first: node 0 holds token"),
        (OverOne(), "carry probability .* > 1"),
        (ChildFirst(), "parents precede children"),
        (SaysMarginals(), "declares proposes='marginals' but propose\\(\\) returned candidate_tree"),
        (ReturnsATree(), "must return bastion.core.Marginals or bastion.core.CandidateTree, got Tree"),
    ],
    ids=lambda x: type(x).__name__ if not isinstance(x, str) else "",
)
def test_broken_candidate_tree_drafters_fail_the_contract_kit_with_a_clear_message(drafter, message):
    with pytest.raises(AssertionError, match=f"{type(drafter).__name__}: .*{message}"):
        check_drafter(drafter, vocab_size=V)


class InventsNodes(TreeBuilder):
    """Claims to take candidate trees but builds a chain of token 0 regardless of the candidates."""

    accepts = frozenset({"marginals", "candidate_tree"})

    def build(self, marginals, root_token: int, max_nodes: int) -> Tree:
        if max_nodes < 1:
            raise InvalidInputError("max_nodes must be >= 1")
        if isinstance(marginals, CandidateTree):
            n = min(max_nodes, 3)
            return Tree.from_parents([root_token] + [0] * (n - 1), list(range(-1, n - 1)), [0.0] * n)
        return bastion.registry.create("tree_builder", "best-first").build(marginals, root_token, max_nodes)


def test_a_builder_that_ignores_the_candidates_fails_the_contract_kit():
    with pytest.raises(AssertionError, match="InventsNodes: candidate tree .* is not a candidate below its parent"):
        check_tree_builder(InventsNodes())
