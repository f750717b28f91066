"""The example n-gram drafter: bastion's contract kit plus its own behaviour."""

from __future__ import annotations

import pytest
import torch

from bastion.core import DraftContext, DraftStep, InvalidInputError
from bastion.testing import check_drafter
from bastion_example_drafter import NGramDrafter


def _begin(drafter: NGramDrafter, tokens: list[int]) -> NGramDrafter:
    drafter.begin(DraftContext(tokens=torch.tensor(tokens), features=None))
    return drafter


@pytest.mark.parametrize("options", [{}, {"depth": 1}, {"max_ngram": 1}, {"min_ngram": 2, "max_ngram": 4, "depth": 12}])
def test_drafter_passes_the_bastion_contract_kit(options):
    check_drafter(NGramDrafter(vocab_size=50, **options), vocab_size=50)


def test_drafter_predicts_the_continuation_of_a_repeated_ngram():
    d = _begin(NGramDrafter(vocab_size=10, depth=4), [1, 2, 3, 4, 5, 1, 2])
    m = d.propose(DraftStep(root_token=3, context_len=7))
    assert m.log_probs.argmax(dim=-1).tolist() == [4, 5, 1, 2]
    assert bool((m.probs().max(dim=-1).values > 0.9).all())


def test_longer_matches_outweigh_shorter_ones():
    # "7 8" was followed by 1 once; "8" alone was followed by 2 three times
    d = _begin(NGramDrafter(vocab_size=10, depth=1, max_ngram=2, ngram_weight=4.0), [7, 8, 1, 8, 2, 8, 2, 8, 2, 7])
    m = d.propose(DraftStep(root_token=8, context_len=10))
    assert int(m.log_probs[0].argmax()) == 1


def test_without_any_match_marginals_are_uniform_and_finite():
    d = _begin(NGramDrafter(vocab_size=6, depth=3), [0, 1, 2])
    m = d.propose(DraftStep(root_token=5, context_len=3))
    assert torch.allclose(m.probs(), torch.full((3, 6), 1 / 6))


def test_every_log_prob_is_finite_thanks_to_smoothing():
    d = _begin(NGramDrafter(vocab_size=300, depth=6, smoothing=1e-6), [4, 5] * 40)
    lp = d.propose(DraftStep(root_token=4, context_len=80)).log_probs
    assert bool(torch.isfinite(lp).all())


def test_committed_tokens_become_part_of_the_searched_context():
    d = _begin(NGramDrafter(vocab_size=10, depth=2, max_ngram=2), [0])
    d.commit(torch.tensor([6, 7, 8]), None)
    m = d.propose(DraftStep(root_token=6, context_len=4))
    assert m.log_probs.argmax(dim=-1).tolist() == [7, 8]


def test_temperature_flattens_the_marginals():
    d = _begin(NGramDrafter(vocab_size=10, depth=1), [1, 2, 1])
    sharp = d.propose(DraftStep(root_token=2, context_len=3, temperature=0.5)).probs().max()
    flat = d.propose(DraftStep(root_token=2, context_len=3, temperature=2.0)).probs().max()
    assert sharp > flat


@pytest.mark.parametrize(
    "options",
    [{"depth": 0}, {"min_ngram": 3, "max_ngram": 2}, {"smoothing": 0.0}, {"ngram_weight": 0.5}, {"vocab_size": 0}],
)
def test_bad_options_raise_invalid_input(options):
    with pytest.raises(InvalidInputError):
        NGramDrafter(**{"vocab_size": 10, **options})


def test_bad_calls_raise_invalid_input():
    with pytest.raises(InvalidInputError, match="vocab_size is unknown"):
        _begin(NGramDrafter(), [1])
    with pytest.raises(InvalidInputError, match="before begin"):
        NGramDrafter(vocab_size=5).propose(DraftStep(root_token=1, context_len=0))
    with pytest.raises(InvalidInputError, match=r"lie in \[0, 5\)"):
        _begin(NGramDrafter(vocab_size=5), [1, 9])
    with pytest.raises(InvalidInputError, match="root_token"):
        _begin(NGramDrafter(vocab_size=5), [1]).propose(DraftStep(root_token=5, context_len=1))


def test_each_row_of_a_batch_searches_its_own_history():
    d = NGramDrafter(vocab_size=10, depth=2)
    batch = d.open_batch([DraftContext(tokens=torch.tensor(t), features=None) for t in ([1, 2, 3, 1], [4, 5, 6, 4])])
    a, b = batch.propose([DraftStep(root_token=2, context_len=4), DraftStep(root_token=5, context_len=4)])
    assert a.log_probs.argmax(dim=-1).tolist() == [3, 1] and b.log_probs.argmax(dim=-1).tolist() == [6, 4]
    batch.keep([1])
    batch.commit([torch.tensor([5, 6])], [None])
    (c,) = batch.propose([DraftStep(root_token=4, context_len=6)])
    assert c.log_probs.argmax(dim=-1).tolist() == [5, 6]


def test_a_joining_batch_adds_its_rows_after_the_running_ones():
    d = NGramDrafter(vocab_size=10, depth=1)
    running = d.open_batch([DraftContext(tokens=torch.tensor([1, 2, 5, 1]), features=None)])
    running.extend(d.open_batch([DraftContext(tokens=torch.tensor([7, 8, 6, 7]), features=None)]))
    a, b = running.propose([DraftStep(root_token=2, context_len=4), DraftStep(root_token=8, context_len=4)])
    assert int(a.log_probs[0].argmax()) == 5 and int(b.log_probs[0].argmax()) == 6
