"""bastion.testing.stats: the goodness-of-fit check keeps its false-alarm rate, detects a biased sampler,
and the total-variation tolerance derived from the trial count holds."""

from __future__ import annotations

import pytest
import torch

from bastion.testing.stats import DEFAULT_ALPHA, assert_fits, chi_square_p, total_variation, tv_tolerance

PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.03, 0.01])


def _draws(probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.bincount(torch.multinomial(probs, n, replacement=True, generator=gen), minlength=probs.numel())


def test_exact_draws_fail_the_fit_about_as_often_as_alpha_says():
    alpha, reps = 0.05, 400  # a large alpha so the false-alarm rate is measurable in few repetitions
    fails = sum(chi_square_p(_draws(PROBS, 300, seed), PROBS) < alpha for seed in range(reps))
    # Binomial(400, 0.05): mean 20, sd 4.4; [4, 40] is beyond 3.5 sd on either side
    assert 4 <= fails <= 40, fails


def test_a_biased_sampler_is_rejected_with_its_p_value_and_total_variation():
    biased = PROBS.clone()
    biased[0], biased[1] = 0.33, 0.32  # total variation 0.07 from PROBS
    with pytest.raises(AssertionError, match=r"chi-square p = .* < alpha = 0.001 over 3000 draws \(total variation"):
        assert_fits(_draws(biased, 3000, seed=1), PROBS)
    assert_fits(_draws(PROBS, 3000, seed=1), PROBS)


def test_drawing_a_zero_probability_outcome_always_fails():
    probs = {"a": 0.5, "b": 0.5}
    assert chi_square_p({"a": 500, "b": 499, "c": 1}, probs) == 0.0
    with pytest.raises(AssertionError):
        assert_fits({"a": 500, "b": 499, "c": 1}, probs)


def test_tv_tolerance_bounds_the_total_variation_of_exact_draws():
    for n in (100, 1000):
        tol = tv_tolerance(n, PROBS.numel(), alpha=DEFAULT_ALPHA)
        worst = max(total_variation(_draws(PROBS, n, seed), PROBS) for seed in range(200))
        assert worst <= tol, (n, worst, tol)
    assert tv_tolerance(4000, 7) < tv_tolerance(1000, 7) / 1.9  # shrinks like 1 / sqrt(trials)
