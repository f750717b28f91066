"""The exact verifier: greedy walk, sample-and-match distribution, registration and bad input."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import bastion
from bastion.core import InvalidInputError, SamplingConfig, Tree
from bastion.contract.sampling import processed_log_probs
from bastion.testing.stats import assert_fits
from bastion.verifiers.exact import ExactVerifier, walk_tree


def test_exact_is_registered_and_supports_sampling():
    v = bastion.registry.create("verifier", "exact")
    assert isinstance(v, ExactVerifier) and v.supports_sampling
    assert "exact" in bastion.registry.names("verifier")


def test_greedy_walk_follows_the_child_equal_to_the_target_argmax():
    # root(0) -> 5 (1) -> 6 (3) -> 8 (5); root -> 7 (2); node1 -> 9 (4)
    tree = Tree.from_parents([1, 5, 7, 6, 9, 8], [-1, 0, 0, 1, 1, 3])
    logits = torch.full((6, 12), -5.0)
    for node, best in {0: 5, 1: 6, 2: 3, 3: 4, 4: 0, 5: 0}.items():
        logits[node, best] = 5.0
    verdict = ExactVerifier().verify(tree, logits, SamplingConfig(temperature=0.0))
    assert verdict.accepted_nodes.tolist() == [0, 1, 3]
    assert verdict.accepted_tokens == (5, 6)
    assert verdict.bonus_token == 4  # argmax at node 3 (its only child holds 8)
    assert verdict.emitted == (5, 6, 4)


def test_root_only_tree_emits_the_target_choice_as_bonus():
    verdict = ExactVerifier().verify(Tree.from_parents([3], [-1]), torch.tensor([[0.0, 2.0, 1.0]]), SamplingConfig())
    assert verdict.accepted_nodes.tolist() == [0] and verdict.accepted_tokens == () and verdict.bonus_token == 1


def _reference_path(tokens: list[int], parents: list[int], choices: list[int]) -> list[int]:
    path = [0]
    while True:
        nxt = [i for i in range(len(tokens)) if parents[i] == path[-1] and tokens[i] == choices[path[-1]]]
        if not nxt:
            return path
        path.append(nxt[0])


@st.composite
def trees_and_choices(draw):
    n = draw(st.integers(1, 25))
    vocab = draw(st.integers(2, 6))
    tokens, parents, used = [draw(st.integers(0, vocab - 1))], [-1], set()
    for i in range(1, n):
        p = draw(st.integers(0, i - 1))
        free = [t for t in range(vocab) if (p, t) not in used]
        if not free:
            break
        t = draw(st.sampled_from(free))
        used.add((p, t))
        tokens.append(t)
        parents.append(p)
    choices = draw(st.lists(st.integers(0, vocab - 1), min_size=len(tokens), max_size=len(tokens)))
    return tokens, parents, choices


@settings(max_examples=40)
@given(trees_and_choices())
def test_walk_accepts_exactly_the_longest_root_path_matching_target_choices(case):
    tokens, parents, choices = case
    path = walk_tree(tokens, parents, choices)
    assert path == _reference_path(tokens, parents, choices)
    for a, b in zip(path, path[1:]):  # each step goes to a child whose token is the parent's choice
        assert parents[b] == a and tokens[b] == choices[a]
    assert not any(parents[i] == path[-1] and tokens[i] == choices[path[-1]] for i in range(len(tokens)))


def test_bad_logits_shape_is_rejected():
    tree = Tree.from_parents([1, 2], [-1, 0])
    with pytest.raises(InvalidInputError, match="one row per tree node"):
        ExactVerifier().verify(tree, torch.zeros(3, 5), SamplingConfig())
    with pytest.raises(InvalidInputError, match="one row per tree node"):
        ExactVerifier().verify(tree, torch.zeros(2, 3, 5), SamplingConfig())


def test_seeded_sampling_is_reproducible():
    tree = Tree.from_parents([0, 1, 2, 3, 1], [-1, 0, 0, 1, 3])
    logits = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    sampling = SamplingConfig(temperature=1.0)

    def run(seed: int) -> list[tuple[int, ...]]:
        gen = torch.Generator().manual_seed(seed)
        return [ExactVerifier().verify(tree, logits, sampling, gen).emitted for _ in range(30)]

    assert run(11) == run(11)
    assert run(11) != run(12)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=0.7),
        SamplingConfig(temperature=1.0, top_p=0.8),
        SamplingConfig(temperature=1.5, top_p=0.9, top_k=4),
    ],
    ids=["t0.7", "t1-topp0.8", "t1.5-topp0.9-topk4"],
)
def test_sample_and_match_emits_the_target_distribution_token_by_token(sampling):
    """First emitted token ~ target at the root; given it equals child c's token, the second ~ target at c."""
    vocab = 6
    # root token 0; children of the root hold tokens 1, 2, 3; node 1 (token 1) has children 4, 5
    tree = Tree.from_parents([0, 1, 2, 3, 4, 5], [-1, 0, 0, 0, 1, 1])
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(4)) * 1.5
    logits[0, 1] += 1.0  # make the drafted branch likely enough to be followed often
    gen = torch.Generator().manual_seed(123)
    verifier = ExactVerifier()
    total = 2500
    first: Counter[int] = Counter()
    second_after_1: Counter[int] = Counter()
    for _ in range(total):
        emitted = verifier.verify(tree, logits, sampling, gen).emitted
        first[emitted[0]] += 1
        if emitted[0] == 1:
            second_after_1[emitted[1]] += 1
    p = processed_log_probs(logits, sampling).exp()  # [6, V]
    probs = lambda row: {t: float(p[row, t]) for t in range(vocab)}  # noqa: E731
    assert_fits(first, probs(0), what="first emitted tokens")  # a zero-probability token fails too
    assert_fits(second_after_1, probs(1), what="second tokens after token 1")
