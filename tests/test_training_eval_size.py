"""The end-of-run held-out evaluation of ``bastion train drafter`` is sized to the run: a short run
gets the teacher-forced figures only (the bench decode of held-out prompts costs minutes on a CPU), a
longer one a few prompts per dataset, growing to the full size; ``--full-eval`` opts into the full one."""

from __future__ import annotations

from pathlib import Path

import pytest

from bastion.cli import train_cmd
from bastion.cli.main import build_parser
from bastion.cli.train_cmd import FULL_EVAL_LIMIT, eval_limit


def _args(*extra: str):
    return build_parser().parse_args(["train", "drafter", "--target", "t", "--data", "d.pt", "--out", "o", *extra])


def test_a_short_drafter_run_decodes_no_held_out_prompts_by_default() -> None:
    assert eval_limit(_args("--draft-steps", "3")) == 0
    assert eval_limit(_args("--draft-steps", "99")) == 0


def test_the_held_out_prompt_count_grows_with_the_run_up_to_the_full_size() -> None:
    counts = [eval_limit(_args("--draft-steps", str(n))) for n in (100, 250, 500, 1000, 2400, 20000)]
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == FULL_EVAL_LIMIT
    assert eval_limit(_args()) == FULL_EVAL_LIMIT  # the recipe's default 2400 steps: the full evaluation


def test_full_eval_opts_into_the_full_evaluation_and_an_explicit_limit_wins() -> None:
    assert eval_limit(_args("--draft-steps", "3", "--full-eval")) == FULL_EVAL_LIMIT
    assert eval_limit(_args("--draft-steps", "3", "--eval-limit", "2")) == 2
    assert eval_limit(_args("--draft-steps", "3", "--eval-limit", "2", "--full-eval")) == 2
    assert eval_limit(_args("--smoke")) == 1  # the smoke recipe still decodes one prompt per dataset


def test_periodic_evaluations_decode_at_least_one_prompt() -> None:
    assert eval_limit(_args("--draft-steps", "30", "--eval-every", "10")) == 1


def test_a_short_run_builds_no_bench_evaluation_and_says_how_to_get_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert train_cmd._acceptance(_args("--draft-steps", "3"), target=None, tok=None) is None
    assert "--full-eval" in capsys.readouterr().out
    assert train_cmd._acceptance(_args("--draft-steps", "3", "--no-eval"), target=None, tok=None) is None
    assert capsys.readouterr().out == ""
    assert callable(train_cmd._acceptance(_args("--draft-steps", "3", "--full-eval", "--data-dir", str(Path("."))), None, None))
