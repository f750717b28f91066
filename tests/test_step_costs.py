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


class _Heard:
    """A controller and latency model that keep what they are told."""

    def __init__(self) -> None:
        self.feedback: list = []

    def observe(self, outcome) -> None:
        self.feedback.append(outcome)

    def observe_batch(self, width, context_lens, seconds) -> None:
        pass


def _speculative_step(obs: StepObserver, draft_s: float) -> None:
    """One speculative step of two rows (three nodes each, one drafted token accepted) seen by ``obs``."""
    import torch

    clock = StageClock(time.perf_counter())
    clock.seconds = {"draft": draft_s, "tree": 0.0, "controller": 0.001, "commit": 0.001, "verify": 0.004, "accept": 0.0}
    verdicts = [types.SimpleNamespace(accepted_nodes=torch.tensor([0, 1]), num_accepted=1)] * 2
    decision = types.SimpleNamespace(predicted_speedup=1.5, calibrated_accept=2.0)
    stage = types.SimpleNamespace(at=lambda *args: None)
    obs.speculative([10, 10], [_Sized(3), _Sized(3)], [torch.zeros(3), torch.zeros(3)], verdicts, decision, clock, stage)


class _Sized:
    """A tree as the observer reads it: its size and its surrogate."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def accept_score(self) -> float:
        return 2.0


def test_a_batched_step_after_a_join_reaches_the_controller_at_the_steady_drafting_cost():
    """Measured in serving at 2 concurrent requests: the first speculative steps after joins (the drafter
    catching up on the newcomers' prompts) reached the controller at their full seconds, its realized /
    predicted gain at 2 rows fell to 0.17 after two such steps, and the batch then drafted on 6% of its
    steps where fixed widths ran 1.03-1.15x plain decoding. The catch-up is a one-time cost per request:
    such a step now reaches the controller with the steady drafting seconds of its batch size."""
    heard = _Heard()
    pipe = types.SimpleNamespace(_batch_costs=BatchCosts(), budget_controller=heard, latency_model=heard)
    obs = StepObserver(pipe, drafts=True)
    for _ in range(3):
        _speculative_step(obs, 0.010)  # steady drafts at 2 rows
        obs.speculative_done(2, 4, _clock(0.010))
    steady = heard.feedback[-1].overhead_s
    obs.joined = True
    _speculative_step(obs, 0.050)  # the catch-up draft
    assert heard.feedback[-1].overhead_s == steady
    obs.speculative_done(2, 4, _clock(0.050))
    _speculative_step(obs, 0.050)  # a later slow draft is a real cost: heard as it is
    assert heard.feedback[-1].overhead_s > steady + 0.03
