"""Plain decoding as one of the controller's choices: lossless while switching, probes only with a drafter
that never pays, never off with one that always pays, calibrated predictions that match what verification
realizes."""

from __future__ import annotations

import functools
import math

import pytest
import torch

import bastion
from bastion.controllers import BastionController
from bastion.huggingface.causal_lm import HFTarget
from bastion.testing.drafters import NoisyOracleDrafter, PlantedDrafter
from bastion.testing import FixedLatencyModel
from bastion.testing.reference import greedy_reference
from bastion.testing.tiny import tiny_model

NEW = 24
#: forces a switch every step or two: probe, 1 plain step, probe, 2 plain steps, probe, ...
SWITCHING = dict(margin=math.inf, min_backoff=1, max_backoff=2, probe_share=None)


@functools.lru_cache(maxsize=None)
def _model(arch: str):
    return tiny_model(arch, seed={"qwen3": 0, "llama": 1}[arch])


@functools.lru_cache(maxsize=None)
def _hf_greedy(arch: str, prompt: tuple[int, ...], new: int) -> list[int]:
    """Hugging Face ``generate``, greedy, stopping at EOS like the pipeline's default."""
    with torch.no_grad():
        out = _model(arch).generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=0)
    return out[0, len(prompt) :].tolist()


@functools.lru_cache(maxsize=None)
def _greedy_through_eos(prompt: tuple[int, ...], new: int) -> list[int]:
    """The target's own greedy continuation, EOS or not (one uncached forward per token)."""
    return greedy_reference(_model("qwen3"), torch.tensor([prompt]), new)


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (2, 9, 23)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_output_equals_hf_generate_while_switching_between_drafting_and_plain_steps(arch):
    model = _model(arch)
    drafter = NoisyOracleDrafter(model, block_size=5, noise=0.6, feature_layers=(0, 1))
    ctrl = BastionController(min_budget=3, gate=SWITCHING)
    pipe = bastion.Pipeline(HFTarget(model), drafter, budget_controller=ctrl, max_nodes=12)
    for prompt in _prompts(len(arch)):
        res = pipe.generate(torch.tensor([prompt]), max_new_tokens=NEW, temperature=0.0)
        assert res.tokens == _hf_greedy(arch, tuple(prompt), NEW)
        kinds = [s.drafted for s in res.steps]
        switches = sum(a != b for a, b in zip(kinds, kinds[1:]))
        assert switches >= 4, kinds  # really switched back and forth mid-generation
        assert any(s.accepted > 0 for s in res.steps if s.drafted)
        # the drafter received the target features of every committed position, plain steps included
        assert drafter.features_seen == len(prompt) + len(res.tokens) - 1


def test_demo_pair_with_switching_is_lossless_and_keeps_the_dflash_context_current():
    pipe = bastion.Pipeline.demo(budget_controller=BastionController(gate=SWITCHING, min_budget=4))
    ids = pipe.encode("Natalia sold clips to 48 of her friends in April. How many clips did she sell?")
    res = pipe.generate(ids, max_new_tokens=40, temperature=0.0)
    with torch.no_grad():
        ref = pipe.target.model.generate(ids, do_sample=False, max_new_tokens=40, min_new_tokens=0)[0, ids.shape[1] :]
    assert res.tokens == ref.tolist() and len(res.tokens) > 20
    assert {s.drafted for s in res.steps} == {True, False}
    # every committed position reached the drafter's context: prompt + every token but the pending root
    assert pipe.drafter.cached_positions + pipe.drafter._pending_len == ids.shape[1] + len(res.tokens) - 1
    # the drafter still drafts well after plain steps: its context is the real one
    assert sum(s.accepted for s in res.steps if s.drafted) > 0


def _planted_pipeline(accept_rate: float, confidence: float, prompt: list[int], new: int, **ctrl_kw):
    model = _model("qwen3")
    sequence = prompt + _greedy_through_eos(tuple(prompt), new)
    drafter = PlantedDrafter(sequence, 256, block_size=6, accept_rate=accept_rate, confidence=confidence)
    ctrl = BastionController(**ctrl_kw)
    # 5 s per forward plus 1 s per verified token: the real milliseconds of overhead cannot sway a choice,
    # so the decisions follow from acceptance alone, the same on a busy machine as on an idle one
    latency = FixedLatencyModel(base_s=5.0, per_token_s=1.0, per_context_s=0.0)
    pipe = bastion.Pipeline(HFTarget(model), drafter, budget_controller=ctrl, latency_model=latency, max_nodes=24)
    return pipe, drafter, ctrl


def test_an_always_wrong_drafter_drafts_on_probes_only_and_costs_about_one_forward_per_token():
    prompt, new = [5, 17, 99, 3], 160
    # the back-off schedule alone (no cost-aware stretching: it follows wall-clock probe costs; no per-request
    # acceptance factor: it ends a request's drafting before calibration has learnt as much, which moves
    # the next request's probes; tests/test_request_acceptance.py checks the drafter with the factor on)
    pipe, drafter, ctrl = _planted_pipeline(0.0, 0.99, prompt, new, gate=dict(probe_share=None), request_accept=False)
    first = pipe.generate(torch.tensor([prompt]), max_new_tokens=new, temperature=0.0, stop_on_eos=False)
    assert first.tokens == _greedy_through_eos(tuple(prompt), new)
    assert all(s.accepted == 0 for s in first.steps)
    # learning that the drafter is useless takes a few steps, then only probes draft
    assert drafter.proposals <= 10, [s.drafted for s in first.steps]
    again = pipe.generate(torch.tensor([prompt]), max_new_tokens=new, temperature=0.0, stop_on_eos=False)
    assert len([s for s in again.steps if s.drafted]) == ctrl.gate.probes <= 2
    # the two requests probe as one sequence: after the first switch-off, probes come after 4, 8, 16, ...
    # plain steps (the back-off doubling), the second request continuing the first one's countdown
    kinds = [s.drafted for s in first.steps[:-1] + again.steps]  # a request's last step has no room to draft
    off = kinds.index(False)
    probes = [i for i in range(off, len(kinds)) if kinds[i]]
    waits = [b - a - 1 for a, b in zip([off - 1] + probes, probes)]
    assert len(probes) >= 4 and waits == [4 * 2**k for k in range(len(waits))], waits
    # cost counted in work, not time: target nodes per token and draft calls per token
    verified = sum(s.budget for s in again.steps)
    assert verified / len(again.tokens) <= 1.1
    assert drafter.proposals / len(again.tokens) <= 0.05



def test_with_the_request_factor_an_always_wrong_drafter_still_drafts_on_few_steps_of_each_request():
    prompt, new = [5, 17, 99, 3], 160
    pipe, drafter, ctrl = _planted_pipeline(0.0, 0.99, prompt, new, gate=dict(probe_share=None), request_accept=True)
    for _ in range(2):
        res = pipe.generate(torch.tensor([prompt]), max_new_tokens=new, temperature=0.0, stop_on_eos=False)
        assert res.tokens == _greedy_through_eos(tuple(prompt), new)
        assert len([s for s in res.steps if s.drafted]) <= 8
        assert sum(s.budget for s in res.steps) / len(res.tokens) <= 1.15

def test_a_perfect_drafter_never_switches_off():
    prompt, new = [8, 1, 200, 45, 6], 80
    pipe, drafter, ctrl = _planted_pipeline(1.0, 0.99, prompt, new)
    for _ in range(2):
        res = pipe.generate(torch.tensor([prompt]), max_new_tokens=new, temperature=0.0, stop_on_eos=False)
        assert res.tokens == _greedy_through_eos(tuple(prompt), new)
        # every step drafts (a final one-token step has nothing to draft into)
        assert all(s.drafted for s in res.steps[:-1]), [s.drafted for s in res.steps]
        assert ctrl.gate.plain_steps == 0
        assert res.acceptance_length > 4


def test_calibrated_prediction_converges_to_the_realized_acceptance_of_an_over_confident_drafter():
    prompt, new = [9, 4, 77, 120], 300
    pipe, _, ctrl = _planted_pipeline(0.5, 0.95, prompt, new, gate=False)
    res = pipe.generate(torch.tensor([prompt]), max_new_tokens=new, temperature=0.0, stop_on_eos=False)
    assert res.tokens == _greedy_through_eos(tuple(prompt), new)
    late = [s for s in res.steps[len(res.steps) // 3 :] if s.calibrated_accept is not None]
    assert len(late) > 40
    realized = sum(s.accepted + 1 for s in late) / len(late)
    calibrated = sum(s.calibrated_accept for s in late) / len(late)
    raw = sum(s.predicted_accept for s in late) / len(late)
    assert abs(calibrated - realized) / realized < 0.15, (calibrated, realized, raw)
    assert raw / realized > 1.4  # the planted over-confidence the calibration corrects


@pytest.mark.parametrize("layers", [(), (0, 1)], ids=["no-features", "features"])
def test_a_plain_step_asks_the_target_for_one_node_and_the_drafters_feature_layers_only(layers):
    model = _model("qwen3")
    drafter = NoisyOracleDrafter(model, block_size=4, noise=0.6, feature_layers=layers)
    target = HFTarget(model)
    ctrl = BastionController(gate=dict(margin=math.inf, min_backoff=40, max_backoff=40))
    pipe = bastion.Pipeline(target, drafter, budget_controller=ctrl, max_nodes=8)
    asked: list[tuple[int, tuple[int, ...], int | None]] = []
    forward = target.forward_tree

    def recording(tree, feature_layers=()):
        out = forward(tree, feature_layers)
        asked.append((len(tree), tuple(feature_layers), None if out.features is None else int(out.features.shape[-1])))
        return out

    target.forward_tree = recording
    res = pipe.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=12, temperature=1.0, seed=3, stop_on_eos=False)
    plain = [a for a, s in zip(asked, res.steps) if not s.drafted]
    assert len(plain) >= 10  # the first step probes, then the gate waits 40 steps
    assert all(n == 1 and fl == layers for n, fl, _ in plain), plain
    width = None if not layers else len(layers) * model.config.hidden_size
    assert all(f == width for *_, f in plain)  # no features at all when the drafter reads none
    assert drafter.features_seen == (3 + len(res.tokens) - 1 if layers else 0)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_plain_steps_draw_the_same_seeded_tokens_as_the_ar_baseline_and_the_tree_path(temperature, top_k, top_p):
    from bastion.bench.methods import ARDecoder
    from bastion.testing.reference import sampling_reference

    model = _model("qwen3")
    ids = torch.tensor([[11, 42, 7, 99]])
    want = sampling_reference(model, ids, 16, 77, temperature=temperature, top_k=top_k, top_p=top_p)
    ar = ARDecoder(HFTarget(model)).generate(ids, 16, temperature, 77, top_k=top_k, top_p=top_p, stop_on_eos=False)
    assert ar.tokens == want
    drafter = NoisyOracleDrafter(model, block_size=5, noise=0.6, feature_layers=(0, 1))
    pipe = bastion.Pipeline(HFTarget(model), drafter, budget_controller=BastionController(min_budget=3, gate=SWITCHING), max_nodes=12)
    res = pipe.generate(ids, 16, temperature, 77, top_k=top_k, top_p=top_p, stop_on_eos=False)
    assert res.tokens == want
    assert {s.drafted for s in res.steps} == {True, False}


def _counting_verifier(bad_token: int | None = None):
    from bastion.verifiers.exact import ExactVerifier

    class Counting(ExactVerifier):
        def __init__(self) -> None:
            self.calls = {"verify": 0, "next_tokens": 0}

        def verify(self, tree, logits, sampling, generator=None):
            self.calls["verify"] += 1
            return super().verify(tree, logits, sampling, generator)

        def next_tokens(self, roots, logits, sampling, generators):
            self.calls["next_tokens"] += 1
            tokens = super().next_tokens(roots, logits, sampling, generators)
            return tokens if bad_token is None else [bad_token] * len(tokens)

    return Counting()


@pytest.mark.parametrize("strict", [False, True], ids=["plain-path", "strict-verdicts"])
def test_a_plain_step_asks_the_verifier_for_the_next_token_alone_in_strict_mode_too(strict):
    model = _model("qwen3")
    verifier = _counting_verifier()
    ctrl = BastionController(gate=dict(margin=math.inf, min_backoff=40, max_backoff=40))
    pipe = bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=4, noise=0.6), budget_controller=ctrl,
                            verifier=verifier, max_nodes=8, strict_verdicts=strict)
    prompt = (5, 6, 7)
    res = pipe.generate(torch.tensor([prompt]), max_new_tokens=12, stop_on_eos=False)
    assert res.tokens == _hf_greedy("qwen3", prompt, 12)
    plain = sum(not s.drafted for s in res.steps)
    assert plain >= 8  # the first step probes (its tree accepts a few tokens), then the gate waits 40 steps
    # strict mode checks each plain step's token against the target's argmax instead of a verdict walk
    assert verifier.calls == {"verify": len(res.steps) - plain, "next_tokens": plain}


def test_a_verifier_whose_next_token_lies_outside_the_vocabulary_is_named_in_single_and_batched_decoding():
    from bastion.contract.errors import ComponentError

    model = _model("qwen3")
    ctrl = BastionController(gate=dict(margin=math.inf, min_backoff=40, max_backoff=40))
    pipe = bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=4, noise=0.6), budget_controller=ctrl,
                            verifier=_counting_verifier(bad_token=model.config.vocab_size), max_nodes=8,
                            strict_verdicts=False)  # the verifier's own plain-step path (strict mode takes the verdict path)
    with pytest.raises(ComponentError, match="Counting.*outside|Counting.*vocabulary"):
        pipe.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=12, stop_on_eos=False)
    with pytest.raises(ComponentError, match="Counting.*vocabulary"):
        pipe.generate_batch([[5, 6, 7], [8, 9]], max_new_tokens=12, stop_on_eos=False)


def test_the_controller_reports_a_failed_probes_cost_in_plain_steps_and_the_gate_cap_follows_it():
    from bastion.contract.types import StepFeedback

    ctrl = BastionController(calibration=False, gate=dict(min_backoff=1, max_backoff=8, probe_share=0.01))
    gate, latency = ctrl.gate, FixedLatencyModel()
    ctrl.begin(bastion.core.SamplingConfig(temperature=1.0))
    root = torch.zeros(1)
    plain = StepFeedback(drafted=False, log_scores=root, accepted_nodes=torch.zeros(1, dtype=torch.long), context_len=10,
                         verify_s=0.002, overhead_s=0.0)
    probe = StepFeedback(drafted=True, log_scores=torch.tensor([0.0, -0.1, -0.2]), accepted_nodes=torch.zeros(1, dtype=torch.long),
                         context_len=10, verify_s=0.004, overhead_s=0.004)  # 4 plain steps' time, 1 token
    bad = torch.tensor([0.0] + [-30.0] * 7)  # a tree predicted never to be accepted: no gain
    for _ in range(200):
        if ctrl.speculate():
            ctrl.decide(bad, 10, latency, 0.004)
            ctrl.observe(probe)
        else:
            ctrl.observe(plain)
    assert gate.probe_excess == pytest.approx(3.0)  # 0.008 s / 0.002 s - 1 token
    assert gate.cap == 300
    assert gate.backoff > 8  # beyond max_backoff: the probes are expensive
