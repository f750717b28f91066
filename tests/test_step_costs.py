"""The per-step drafting cost the controller prices a step with is a steady step's: the first draft
after rows join also catches the drafter up on the newcomers' prompts (a one-time cost per request), so
it does not enter the cost level; every later speculative step does."""

from __future__ import annotations

import time
import types

import bastion
from bastion.engine.costs import BatchCosts
from bastion.engine.observer import StageClock, StepObserver
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_model


def _clock(draft_s: float) -> StageClock:
    clock = StageClock(time.perf_counter())
    clock.seconds = {"draft": draft_s, "tree": 0.0, "controller": 0.0, "commit": 0.0}
    return clock


def test_the_first_draft_after_a_join_does_not_set_the_step_drafting_cost():
    pipe = types.SimpleNamespace(_batch_costs=BatchCosts())
    obs = StepObserver(pipe, drafts=True)
    obs.joined = True
    obs.speculative_done(2, 8, _clock(0.030))  # the catch-up draft
    assert pipe._batch_costs.draft.sizes == ()
    for _ in range(3):
        obs.speculative_done(2, 8, _clock(0.010))  # steady drafts
    assert pipe._batch_costs.draft(2) == 0.010
    obs.joined = True
    obs.speculative_done(2, 8, _clock(0.050))
    assert pipe._batch_costs.draft(2) == 0.010


def test_an_engine_marks_joins_so_its_first_draft_is_left_out():
    model = tiny_model("qwen3", seed=5)
    pipe = bastion.Pipeline(model, NoisyOracleDrafter(model, block_size=4, noise=0.5), budget_controller="fixed", max_nodes=8,
                            component_options={"budget_controller": {"budget": 4}})
    seen: list[bool] = []
    original = StepObserver.speculative_done

    def spy(self, b, emitted, clock):
        seen.append(self.joined)
        return original(self, b, emitted, clock)

    StepObserver.speculative_done = spy
    try:
        pipe.generate_batch([[5, 6, 7], [8, 9, 10, 11]], 8, stop_on_eos=False)
    finally:
        StepObserver.speculative_done = original
    assert seen[0] is True and not any(seen[1:]) and len(seen) >= 2
    assert pipe._batch_costs.draft.sizes == (2,)  # the steady steps taught it
