"""The ``model`` drafter (any causal LM drafting candidate trees): lossless greedy and sampled decoding with
every builder that takes candidate trees, exact per-node log q, a draft cache equal to a fresh prefill,
the early-stop rule, pairing errors and checkpoint detection in ``from_pretrained``."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import bastion
from bastion.core import CandidateTree, DraftContext, DraftStep, IncompatibleComponentsError, InvalidInputError
from bastion.huggingface.causal_lm import HFTarget
from bastion.drafters.model import ModelDrafter, pays_for_depth, predicted_gain, worth_expanding
from bastion.testing import check_drafter
from bastion.testing.tiny import tiny_model

ARCHS = ("qwen3", "llama")
BUDGETS = (1, 4, 16)
NEW_TOKENS = 18
CANDIDATE_BUILDERS = [n for n in bastion.registry.names("tree_builder") if "candidate_tree" in bastion.registry.create("tree_builder", n).accepts]


@functools.lru_cache(maxsize=None)
def _target(arch: str, **overrides):
    return tiny_model(arch, seed={"qwen3": 0, "llama": 1}[arch], **overrides)


def _draft_model(arch: str, noise: float = 0.05, **overrides):
    """A one-layer perturbed copy of the target: same vocabulary, close but not equal distributions."""
    target = _target(arch, **overrides)
    draft = tiny_model(arch, seed=7, num_hidden_layers=1, **overrides)
    gen = torch.Generator().manual_seed(3)
    own = draft.state_dict()
    with torch.no_grad():
        for k, v in target.state_dict().items():
            if k in own and own[k].shape == v.shape:
                own[k].copy_(v + noise * v.std().nan_to_num(0.0) * torch.randn(v.shape, generator=gen))
    return draft.eval()


def _prompts(arch: str) -> list[list[int]]:
    gen = torch.Generator().manual_seed(len(arch) + 1)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (2, 5, 9, 17, 30)]


@functools.lru_cache(maxsize=None)
def _reference(arch: str, prompt: tuple[int, ...], new: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = _target(arch).generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=0)
    return out[0, len(prompt) :].tolist()


def _pipeline(arch: str, builder: str, budget: int, **drafter_kw) -> bastion.Pipeline:
    drafter = bastion.registry.create("drafter", "model", checkpoint=_draft_model(arch), **drafter_kw)
    return bastion.Pipeline(
        HFTarget(_target(arch)),
        drafter,
        tree_builder=builder,
        budget_controller=bastion.registry.create("budget_controller", "fixed", budget=budget),
        max_nodes=budget,
    )


def test_best_first_and_chain_are_the_builders_that_take_candidate_trees():
    assert set(CANDIDATE_BUILDERS) >= {"best-first", "chain"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("builder", CANDIDATE_BUILDERS)
def test_greedy_output_equals_hf_generate_with_the_model_drafter_for_every_candidate_builder_and_budget(arch, builder):
    prompts = _prompts(arch)
    accepted = 0
    for i, budget in enumerate(BUDGETS):
        pipe = _pipeline(arch, builder, budget, depth=5, width=3, top_k=3)
        for prompt in (prompts[i % len(prompts)], prompts[(i + 2) % len(prompts)]):
            res = pipe.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS)
            assert res.tokens == _reference(arch, tuple(prompt)), f"{builder} budget {budget} prompt {prompt}"
            assert all(s.budget <= budget for s in res.steps)
            accepted += sum(s.accepted for s in res.steps)
    assert accepted > 0


def test_greedy_output_is_lossless_with_early_stopping_and_a_limited_position_range():
    # a draft model with fewer positions than the target: the drafter shortens its trees near the end
    arch = "qwen3"
    pipe = bastion.Pipeline(
        HFTarget(_target(arch)),
        ModelDrafter(_draft_model(arch), depth=6, width=2, top_k=2),
        budget_controller="bastion",
        max_nodes=12,
    )
    pipe.drafter._max_positions = 40
    prompt = _prompts(arch)[4]  # 30 tokens: only a few draft positions are left
    res = pipe.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS)
    assert res.tokens == _reference(arch, tuple(prompt))


def _all_paths_log_prob(model, context: list[int], cand: CandidateTree) -> list[float]:
    tokens, parents, _ = cand.host_lists()
    out = [0.0]
    for i in range(1, len(tokens)):
        path, j = [], parents[i]
        while j >= 0:
            path.append(tokens[j])
            j = parents[j]
        ids = torch.tensor([context + path[::-1]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, -1].double(), dim=-1)
        out.append(float(logp[tokens[i]]))
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_every_candidate_log_q_is_the_draft_models_own_log_prob_along_its_path(arch):
    model = _draft_model(arch)
    drafter = ModelDrafter(model, depth=4, width=3, top_k=3, early_stop=False)
    drafter.bind(HFTarget(_target(arch)))
    context = _prompts(arch)[2]
    drafter.begin(DraftContext(tokens=torch.tensor(context), features=None))
    root = 17
    cand = drafter.propose(DraftStep(root_token=root, context_len=len(context)))
    assert isinstance(cand, CandidateTree) and len(cand) == 1 + 3 + 9 + 9 + 9  # width 3 expanded per depth
    cand.validate(vocab_size=256, root_token=root)
    want = _all_paths_log_prob(model, context, cand)
    torch.testing.assert_close(cand.log_q.double(), torch.tensor(want, dtype=torch.float64), atol=1e-5, rtol=0)
    # after a partial commit (root + one fed node + one leaf that was never fed), the next proposal is
    # still exact: committed leaves are run at the next step's first forward
    tokens, parents, _ = cand.host_lists()
    depth = cand.depths()
    leaf = max(range(len(tokens)), key=lambda i: depth[i])
    path, j = [], leaf
    while j > 0:
        path.append(tokens[j])
        j = parents[j]
    committed = [root, *path[::-1]]
    drafter.commit(torch.tensor(committed), None)
    cand2 = drafter.propose(DraftStep(root_token=5, context_len=len(context) + len(committed)))
    want2 = _all_paths_log_prob(model, context + committed, cand2)
    torch.testing.assert_close(cand2.log_q.double(), torch.tensor(want2, dtype=torch.float64), atol=1e-5, rtol=0)


def test_log_q_is_tempered_by_the_step_temperature():
    model = _draft_model("qwen3")
    drafter = ModelDrafter(model, depth=1, top_k=4)
    drafter.begin(DraftContext(tokens=torch.tensor([3, 4, 5]), features=None))
    cand = drafter.propose(DraftStep(root_token=9, context_len=3, temperature=0.5))
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([[3, 4, 5, 9]])).logits[0, -1].double() / 0.5, dim=-1)
    torch.testing.assert_close(cand.log_q[1:].double(), want[cand.tokens[1:]], atol=1e-5, rtol=0)


class _Recorder:
    def __init__(self) -> None:
        self.committed: list[int] = []


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_cache_equals_a_fresh_prefill_after_every_commit(arch):
    model = _draft_model(arch)
    drafter = ModelDrafter(model, depth=4, width=3, top_k=3, early_stop=False)
    pipe = bastion.Pipeline(
        HFTarget(_target(arch)),
        drafter,
        budget_controller=bastion.registry.create("budget_controller", "fixed", budget=8),
        max_nodes=8,
    )
    checks = 0
    original = drafter.commit

    def checked_commit(tokens, features):
        nonlocal checks
        original(tokens, features)
        committed = drafter.committed_tokens
        fresh = ModelDrafter(model)
        fresh.begin(DraftContext(tokens=torch.tensor(committed), features=None))
        for got, want in zip(drafter.cache.layers, fresh.cache.layers, strict=True):
            assert got.keys.shape == want.keys.shape
            torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)
        checks += 1

    drafter.commit = checked_commit
    moved = 0
    keep = drafter._kv.keep

    def counting_keep(slots):
        nonlocal moved
        moved += slots != list(range(len(slots)))  # an accepted path that is not the chain of first slots
        keep(slots)

    drafter._kv.keep = counting_keep
    steps = 0
    for prompt in _prompts(arch)[1:4]:
        res = pipe.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS)
        assert res.tokens == _reference(arch, tuple(prompt))
        steps += len(res.steps)
        # every committed token is either in the cache or queued for the next forward
        assert drafter.committed_tokens + drafter._pending == prompt + res.tokens[:-1]
    assert checks == steps > 0
    assert moved > 0  # some commits had to move cache entries into place


def test_commits_keep_fed_nodes_without_recomputing_the_context():
    model = _draft_model("qwen3")
    drafter = ModelDrafter(model, depth=3, width=1, top_k=1, early_stop=False)
    drafter.begin(DraftContext(tokens=torch.tensor([3, 4, 5, 6]), features=None))
    cand = drafter.propose(DraftStep(root_token=9, context_len=4))
    assert cand.parents.tolist() == [-1, 0, 1, 2]  # a chain of the greedy tokens
    drafter.commit(cand.tokens[:3], None)  # root + 2 fed nodes
    assert drafter.committed_tokens == [3, 4, 5, 6, *cand.tokens[:3].tolist()]
    assert drafter._pending == []
    drafter.commit(torch.tensor([int(cand.tokens[3]), 11]), None)  # not from a proposal: queued
    assert drafter._pending == [int(cand.tokens[3]), 11]


def test_the_model_drafter_passes_the_contract_kit():
    target = HFTarget(_target("qwen3"))
    check_drafter(ModelDrafter(_draft_model("qwen3"), depth=3, width=2, top_k=3), target=target)


def test_early_stop_rule_expands_only_depths_that_pay_for_their_cost():
    assert predicted_gain([-0.1, -0.2], [-0.1], [0.5, 0.25], None) == pytest.approx(0.75 * math.exp(-0.1))
    # one free slot: only the best predicted child counts, and only by how much it beats the weakest node
    assert predicted_gain([-0.1, -3.0], [-0.1], [0.5], 2) == pytest.approx(0.5 * math.exp(-0.1) - math.exp(-3.0))
    assert predicted_gain([-0.1, -0.2], [-5.0], [0.5], 2) == 0.0
    assert worth_expanding(0.5, 0.01, 0.004) and not worth_expanding(0.5, 0.01, 0.006)
    assert worth_expanding(0.0, None, 1.0) and worth_expanding(0.0, 1.0, None)  # unknown: expand

    model = _draft_model("qwen3")
    drafter = ModelDrafter(model, depth=6, width=2, top_k=2)
    drafter.begin(DraftContext(tokens=torch.tensor([3, 4, 5]), features=None))
    drafter.propose(DraftStep(root_token=9, context_len=3))  # first call: cost unknown, full depth
    assert drafter.last_depth == 6 and drafter.depth_cost_s is not None
    drafter.propose(DraftStep(root_token=9, context_len=3, seconds_per_token=1e-9))  # tokens are cheap
    assert drafter.last_depth == 1
    drafter.propose(DraftStep(root_token=9, context_len=3, seconds_per_token=1e6))  # tokens are precious
    assert drafter.last_depth == 6


_LOG_RHO = st.lists(st.floats(min_value=-9.0, max_value=0.0), max_size=30)


@given(
    _LOG_RHO,
    st.lists(st.floats(min_value=-9.0, max_value=0.0), min_size=1, max_size=16),
    st.integers(min_value=1, max_value=24),
    st.floats(min_value=0.0, max_value=0.05),
    st.floats(min_value=1e-5, max_value=0.05),
    st.floats(min_value=1e-4, max_value=0.05),
)
def test_a_depth_pays_exactly_when_its_gain_per_second_beats_the_current_rate(scores, predicted, slots, draft_s, cost, rest_s):
    # a planted controller that verifies its best `slots` candidates: S = A / (rest + draft)
    def estimate(log_scores, seconds):
        return sum(math.exp(s) for s in log_scores[: slots + 1]) / (rest_s + seconds)

    a_now = 1.0 + sum(sorted((math.exp(s) for s in scores), reverse=True)[:slots])
    a_next = 1.0 + sum(sorted((math.exp(s) for s in [*scores, *predicted]), reverse=True)[:slots])
    gain_per_second, rate = (a_next - a_now) / cost, a_now / (rest_s + draft_s)
    assume(abs(gain_per_second - rate) > 1e-6 * rate)  # no float ties
    assert pays_for_depth(estimate, scores, predicted, slots, draft_s, cost) == (gain_per_second > rate)


@pytest.mark.parametrize("rest_s", [1e-4, 3e-3, 0.03, 1.0])
def test_drafter_expands_exactly_the_depths_whose_gain_per_second_beats_the_current_rate(rest_s):
    cost = 0.004  # planted seconds per depth
    drafter = ModelDrafter(_draft_model("qwen3"), depth=6, width=2, top_k=3, depth_cost_s=cost)
    calls: list[tuple[float, float]] = []  # (A of the best 8 nodes, drafting seconds) per question

    def estimate(log_scores, seconds):  # a planted controller verifying its best 8 nodes
        a = sum(math.exp(s) for s in log_scores[:8])
        calls.append((a, seconds))
        return a / (rest_s + seconds)

    drafter.begin(DraftContext(tokens=torch.tensor([3, 4, 5]), features=None))
    drafter.propose(DraftStep(root_token=9, context_len=3, max_nodes=8, estimate_speedup=estimate))
    assert drafter.depth_cost_s == cost  # planted: not overwritten by measurements
    pays = []
    for (a_now, d_now), (a_next, d_next) in zip(calls[::2], calls[1::2]):  # (now, after one more depth)
        assert d_next == pytest.approx(d_now + cost)
        pays.append((a_next - a_now) / cost > a_now / (rest_s + d_now))
    expanded = drafter.last_depth - 1
    assert pays[:expanded] == [True] * expanded  # every depth it fed paid
    assert expanded == 5 or pays[expanded] is False  # and it stopped at the first that did not
    assert len(pays) == expanded + (expanded < 5)


def test_expanded_depths_grow_as_committed_tokens_get_dearer():
    depths = []
    for rest_s in (1e-4, 0.03, 1.0):
        drafter = ModelDrafter(_draft_model("qwen3"), depth=6, width=2, top_k=3, depth_cost_s=0.004)
        drafter.begin(DraftContext(tokens=torch.tensor([3, 4, 5]), features=None))
        est = lambda scores, seconds, r=rest_s: sum(math.exp(s) for s in scores[:8]) / (r + seconds)  # noqa: E731
        drafter.propose(DraftStep(root_token=9, context_len=3, max_nodes=8, estimate_speedup=est))
        depths.append(drafter.last_depth)
    assert depths[0] == 1 and depths[0] < depths[-1] and depths == sorted(depths)


def test_depth_cost_estimate_recovers_from_a_stale_measurement_without_expanding():
    drafter = ModelDrafter(_draft_model("qwen3"), depth=4, width=2, top_k=2)
    drafter.begin(DraftContext(tokens=torch.tensor([3, 4, 5]), features=None))
    drafter.depth_cost_s = 50.0  # one very slow measurement (a load spike, a cold first call)
    est = lambda scores, seconds: sum(math.exp(s) for s in scores) / (1.0 + seconds)  # noqa: E731
    drafter.propose(DraftStep(root_token=9, context_len=3, estimate_speedup=est))
    assert drafter.last_depth == 1  # no depth can pay 50 s
    for _ in range(40):  # the root's forward is measured every step
        drafter.propose(DraftStep(root_token=9, context_len=3, estimate_speedup=est))
    assert drafter.depth_cost_s < 0.5 and drafter.last_depth > 1


def test_pipeline_passes_depth_budget_and_token_cost_to_the_drafter():
    arch = "qwen3"
    seen: list[DraftStep] = []
    drafter = ModelDrafter(_draft_model(arch), depth=4)
    propose = drafter.propose
    drafter.propose = lambda step: seen.append(step) or propose(step)
    pipe = bastion.Pipeline(HFTarget(_target(arch)), drafter, max_nodes=10)
    pipe.generate(torch.tensor([_prompts(arch)[1]]), max_new_tokens=8)
    assert all(s.max_nodes == 10 and s.max_depth is not None and s.max_depth <= 6 for s in seen)
    assert seen[0].seconds_per_token is None and all(s.seconds_per_token > 0 for s in seen[1:])
    # the controller's own objective travels with every step
    assert all(isinstance(s.estimate_speedup([0.0, -0.1, -0.5], 0.001), float) for s in seen)


def test_pairing_a_candidate_drafter_with_a_marginals_only_builder_fails_at_assembly():
    drafter = ModelDrafter(_draft_model("qwen3"))
    with pytest.raises(IncompatibleComponentsError, match=r"StaticBuilder takes marginals.*ModelDrafter proposes candidate trees"):
        bastion.Pipeline(HFTarget(_target("qwen3")), drafter, tree_builder="static")


def test_an_undeclared_candidate_drafter_with_a_marginals_only_builder_fails_at_the_first_step():
    class Undeclared(ModelDrafter):
        proposes = None

    pipe = bastion.Pipeline(HFTarget(_target("qwen3")), Undeclared(_draft_model("qwen3")), tree_builder="beam")
    with pytest.raises(IncompatibleComponentsError, match="BeamBuilder takes marginals.*Undeclared proposes candidate trees"):
        pipe.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=4)


def test_a_draft_model_with_another_vocabulary_is_rejected_at_assembly():
    other = tiny_model("qwen3", seed=2, vocab_size=300)
    with pytest.raises(IncompatibleComponentsError, match=r"vocabulary \(300\) differs from the target's \(256\)"):
        bastion.Pipeline(HFTarget(_target("qwen3")), ModelDrafter(other))


@pytest.mark.parametrize("bad", [{"depth": 0}, {"width": -1}, {"top_k": 1.5}, {"checkpoint": 3}])
def test_bad_options_are_rejected_with_the_option_named(bad):
    kwargs = {"checkpoint": _draft_model("qwen3"), **bad}
    with pytest.raises(InvalidInputError, match=next(iter(bad))):
        bastion.registry.create("drafter", "model", **kwargs)


def test_from_pretrained_picks_the_model_drafter_for_a_plain_causal_lm_directory(tmp_path, tiny_qwen3_dir):
    draft_dir = tmp_path / "draft"
    _draft_model("qwen3").save_pretrained(draft_dir)
    pipe = bastion.Pipeline.from_pretrained(tiny_qwen3_dir, draft_dir, max_nodes=8)
    assert isinstance(pipe.drafter, ModelDrafter)
    prompt = _prompts("qwen3")[1]
    assert pipe.generate(torch.tensor([prompt]), max_new_tokens=10).tokens == _reference("qwen3", tuple(prompt))[:10]


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decoding_with_the_model_drafter_equals_each_prompt_decoded_alone(arch):
    pipe = _pipeline(arch, "best-first", 8, depth=4, width=2, top_k=3)
    prompts = _prompts(arch)
    results = pipe.generate_batch(prompts, max_new_tokens=NEW_TOKENS)
    for prompt, res in zip(prompts, results):
        assert res.tokens == _reference(arch, tuple(prompt)), prompt
    assert any(s.drafted for res in results for s in res.steps)  # candidate trees went through the batch
