"""Which plain steps of single-sequence decoding reach the latency model and the controller: one in 32
of a run, from its second step on (the first after a drafted step runs on caches the draft evicted and
is slower than the plain steps it stands for); a run's first step only until a later one was reported."""

from __future__ import annotations

import torch

import bastion
from bastion.controllers.budget import FixedController
from bastion.core import pipeline as pipeline_module
from bastion.core.hf_target import HFTarget
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_model


class Scripted(FixedController):
    """Drafts or not by a fixed script (True: draft), one entry per step, verifying the whole tree."""

    def __init__(self, script: list[bool]) -> None:
        super().__init__(budget=2)
        self.script = list(script)
        self.plain_reports: list[int] = []  # the step index of every plain step reported
        self.step = -1

    def speculate(self) -> bool:
        self.step += 1
        return self.step < len(self.script) and self.script[self.step]  # past the script: plain

    def observe(self, outcome) -> None:  # type: ignore[no-untyped-def]
        if not outcome.drafted:
            self.plain_reports.append(self.step)
        super().observe(outcome)


def _reported(script: list[bool]) -> list[int]:
    model = tiny_model("qwen3", seed=0)
    controller = Scripted(script)
    pipe = bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=2, noise=0.0),
                            tree_builder="chain", budget_controller=controller, max_nodes=2)
    seen: list[int] = []
    observe = pipe.latency_model.observe
    pipe.latency_model.observe = lambda n, c, s: (seen.append(n), observe(n, c, s))  # type: ignore[method-assign]
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(1))
    # an exact drafter of block 2 accepts its one node: a drafted step emits 2 tokens, a plain one 1;
    # the prefill emits one and a last plain step (past the script) another
    result = pipe.generate(ids, max_new_tokens=2 + sum(2 if d else 1 for d in script), stop_on_eos=False)
    assert [s.drafted for s in result.steps] == script + [False]  # every scripted step ran as scripted
    assert seen.count(1) == len(controller.plain_reports)  # the latency model saw the same plain steps
    return controller.plain_reports


def test_a_runs_first_plain_step_is_reported_only_until_a_later_plain_step_was() -> None:
    d, p = True, False
    #        0  1  2  3  4  5  6  7  8  9
    script = [d, p, d, p, p, p, d, p, p, d]
    # steps 1 and 3 (first of their runs, no second step reported yet), 4 (second of its run) and 8;
    # not step 5 (third of its run) nor 7 (first of its run once a second step was reported)
    assert _reported(script) == [1, 3, 4, 8]


def test_a_long_plain_run_reports_one_step_in_32_from_its_second() -> None:
    every = pipeline_module._PLAIN_REPORT_EVERY
    script = [True] + [False] * (2 * every + 3)
    assert _reported(script) == [1, 2, 2 + every, 2 + 2 * every]
