"""One method set per stage: the engine calls the batch-first methods at every batch size; components
written against the single-sequence methods (every plugin written before) are driven through them by the
batch-first defaults, and components written against the batch-first methods answer single-sequence
calls through thin adapters. Both kinds pass the contract kit and decode losslessly, alone and batched."""

from __future__ import annotations

import functools

import pytest
import torch

import bastion
from bastion.core import BudgetController, BudgetDecision, DraftBatch, Drafter, LatencyModel, Verifier, Verdict
from bastion.contract.sampling import sample_tokens
from bastion.testing import check_budget_controller, check_drafter, check_latency_model, check_verifier
from bastion.testing.contract import FixedLatencyModel
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.reference import greedy_reference
from bastion.testing.tiny import tiny_model
from bastion.verifiers.exact import ExactVerifier, walk_tree

PROMPTS = [[5, 6, 7, 8], [9, 3, 3, 9, 3], [1, 2]]


@functools.lru_cache(maxsize=None)
def _model():
    return tiny_model("qwen3", seed=4)


# ------------------------------------------------------------------------ written against single sequences
class SingleLatency(LatencyModel):
    def predict(self, n_tokens: int, context_len: int) -> float:
        return 1e-3 + 2e-5 * n_tokens

    def observe(self, n_tokens: int, context_len: int, seconds: float) -> None:
        pass


class SingleController(BudgetController):
    def choose(self, log_scores, context_len, latency, overhead_s) -> int:
        if log_scores.numel() == 0:
            raise bastion.core.InvalidInputError("empty")
        return int(min(5, log_scores.numel()))


class SingleVerifier(Verifier):
    def verify(self, tree, logits, sampling, generator=None) -> Verdict:
        if logits.shape[0] != len(tree):
            raise bastion.core.InvalidInputError("one logits row per node")
        host = tree.on_host()
        choices = sample_tokens(logits, sampling, generator).tolist()  # [n] one target choice per node
        path = walk_tree(list(host.tokens), list(host.parents), choices)
        return Verdict(torch.tensor(path), tuple(host.tokens[i] for i in path[1:]), choices[path[-1]])


# ------------------------------------------------------------------------ written against batches
class _Rows(DraftBatch):
    def __init__(self, rows: list[NoisyOracleDrafter]) -> None:
        self.rows = rows

    def propose(self, steps):
        return [row.propose(step) for row, step in zip(self.rows, steps, strict=True)]

    def commit(self, tokens, features):
        for row, tok, feat in zip(self.rows, tokens, features, strict=True):
            row.commit(tok, feat)

    def keep(self, rows):
        self.rows = [self.rows[i] for i in rows]

    def extend(self, other):
        self.rows.extend(other.rows)
        other.rows = []


class BatchDrafter(Drafter):
    """Implements only ``open_batch`` (each row a noisy oracle of its own)."""

    def __init__(self, model) -> None:
        self.inner = NoisyOracleDrafter(model, block_size=4, noise=0.7)

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    def open_batch(self, contexts):
        rows = []
        for context in contexts:
            row = self.inner.fork()
            row.begin(context)
            rows.append(row)
        return _Rows(rows)


class BatchController(BudgetController):
    """Implements only the batch-first methods: width min(5, widest tree)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def begin_batch(self, sampling, batch_size: int) -> None:
        self.calls.append(f"begin_batch({batch_size})")

    def speculate_batch(self, context_lens, latency, costs) -> bool:
        self.calls.append("speculate_batch")
        return True

    def decide_width(self, log_scores, context_lens, latency, overhead_s, draft_s) -> BudgetDecision:
        self.calls.append("decide_width")
        if any(s.numel() == 0 for s in log_scores):
            raise bastion.core.InvalidInputError("empty")
        return BudgetDecision(min(5, max(int(s.numel()) for s in log_scores)))


class BatchVerifier(Verifier):
    """Implements only ``verify_batch``."""

    def verify_batch(self, trees, logits, sampling, generators) -> list[Verdict]:
        bastion.contract.interfaces.check_batch_logits(trees, logits)
        return [SingleVerifier.verify(self, t, logits[i, : len(t)], s, g) for i, (t, s, g) in enumerate(zip(trees, sampling, generators))]


def _fail(self, *args, **kwargs):
    raise AssertionError(f"the engine called a single-sequence method of {type(self).__name__}")


class _NoSingleController:
    begin = speculate = choose = decide = _fail


class _NoSingleVerifier:
    verify = _fail


class _NoSingleLatency:
    predict = predict_many = observe = _fail


class _NoSingleDrafter:
    begin = propose = commit = _fail


# the failing single-sequence methods sit below the batch-first class in each MRO: a single-sequence
# call anywhere in the engine fails the test
class StrictBatchController(BatchController, _NoSingleController):
    pass


class StrictBatchVerifier(BatchVerifier, _NoSingleVerifier):
    pass


class StrictBatchLatency(FixedLatencyModel, _NoSingleLatency):
    pass


class StrictBatchDrafter(BatchDrafter, _NoSingleDrafter):
    pass


def _pipe(drafter, latency, controller, verifier) -> bastion.Pipeline:
    return bastion.Pipeline(
        _model(), drafter, tree_builder="best-first", latency_model=latency, budget_controller=controller, verifier=verifier, max_nodes=8
    )


def _assert_lossless(pipe: bastion.Pipeline) -> None:
    model = _model()
    refs = [greedy_reference(model, torch.tensor([p]), 10) for p in PROMPTS]
    assert pipe.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=10, stop_on_eos=False).tokens == refs[0]
    assert [r.tokens for r in pipe.generate_batch(PROMPTS, 10, stop_on_eos=False)] == refs


def test_single_sequence_components_pass_the_contract_kit_through_the_batch_first_defaults():
    check_latency_model(SingleLatency())
    check_budget_controller(SingleController())
    check_verifier(SingleVerifier(), trials=300)
    check_drafter(NoisyOracleDrafter(_model(), block_size=3, noise=0.5), vocab_size=_model().config.vocab_size)


def test_batch_first_components_pass_the_contract_kit_and_answer_single_sequence_calls():
    check_latency_model(FixedLatencyModel())
    check_budget_controller(BatchController())
    check_verifier(BatchVerifier(), trials=300)
    drafter = BatchDrafter(_model())
    check_drafter(drafter, vocab_size=_model().config.vocab_size)
    # the adapters: a batch of one behind each single-sequence name
    lat = FixedLatencyModel()
    assert lat.predict(8, 30) == pytest.approx(float(lat.predict_batch(torch.tensor([8]), [30])[0]))
    scores = torch.tensor([0.0, -0.1, -0.2, -0.3, -0.5, -0.9, -1.0])
    assert BatchController().choose(scores, 10, lat, 0.0) == 5
    ctx = bastion.core.DraftContext(tokens=torch.tensor(PROMPTS[0]), features=None)
    drafter.begin(ctx)
    single = drafter.propose(bastion.core.DraftStep(root_token=3, context_len=4))
    batch = drafter.open_batch([ctx]).propose([bastion.core.DraftStep(root_token=3, context_len=4)])[0]
    assert torch.allclose(single.log_probs, batch.log_probs)


def test_single_sequence_components_decode_losslessly_alone_and_batched():
    _assert_lossless(_pipe(NoisyOracleDrafter(_model(), block_size=4, noise=0.7), SingleLatency(), SingleController(), SingleVerifier()))


def test_batch_first_components_decode_losslessly_alone_and_batched():
    _assert_lossless(_pipe(BatchDrafter(_model()), FixedLatencyModel(), BatchController(), BatchVerifier()))


def test_the_engine_calls_only_batch_first_methods_at_every_batch_size():
    controller = StrictBatchController()
    _assert_lossless(_pipe(StrictBatchDrafter(_model()), StrictBatchLatency(), controller, StrictBatchVerifier()))
    assert "begin_batch(1)" in controller.calls and "begin_batch(3)" in controller.calls
    assert controller.calls.count("decide_width") >= 2


@pytest.mark.parametrize(
    ("interface", "message"),
    [
        (Drafter, "implement open_batch or begin \\+ propose \\+ commit"),
        (LatencyModel, "implement predict_batch or predict_many or predict"),
        (BudgetController, "implement decide_width or decide or choose"),
        (Verifier, "implement verify_batch or verify"),
    ],
)
def test_a_component_implementing_neither_side_cannot_be_created(interface, message):
    namespace = {"vocab_size": property(lambda self: 8)} if interface is Drafter else {}
    if interface is LatencyModel:  # one operation implemented, the other not
        namespace = {"observe_batch": lambda self, w, c, s: None}
    empty = type("Empty", (interface,), namespace)
    with pytest.raises(TypeError, match=message):
        empty()


def test_a_latency_model_missing_its_observations_names_them():
    half = type("Half", (LatencyModel,), {"predict_batch": lambda self, w, c: w.double()})
    with pytest.raises(TypeError, match="implement observe_batch or observe"):
        half()


class FirstChildOnly(ExactVerifier):
    """A subclass of the (batch-first) exact verifier that overrides only ``verify``."""

    seen = 0

    def verify(self, tree, logits, sampling, generator=None):
        type(self).seen += 1
        return super().verify(tree, logits, sampling, generator)


def test_a_subclass_overriding_only_verify_is_called_at_every_batch_size():
    FirstChildOnly.seen = 0
    pipe = _pipe(NoisyOracleDrafter(_model(), block_size=4, noise=0.7), FixedLatencyModel(), BatchController(), FirstChildOnly())
    pipe.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=6, stop_on_eos=False)
    alone = FirstChildOnly.seen
    pipe.generate_batch(PROMPTS, 6, stop_on_eos=False)
    assert alone >= 1 and FirstChildOnly.seen >= alone + 3

