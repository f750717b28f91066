"""The contract kit accepts correct components and rejects each kind of broken one with a clear message."""

from __future__ import annotations

import heapq

import pytest
import torch

import bastion
from bastion.core import (
    BastionError,
    BudgetController,
    BudgetDecision,
    DraftContext,
    DraftStep,
    Drafter,
    InvalidInputError,
    LatencyModel,
    Marginals,
    SamplingConfig,
    Tree,
    TreeBuilder,
    Verdict,
    Verifier,
)
from bastion.contract.sampling import sample_tokens
from bastion.testing import (
    FixedLatencyModel,
    check_budget_controller,
    check_component,
    check_drafter,
    check_latency_model,
    check_tree_builder,
    check_verifier,
)

V = 16


# ------------------------------------------------------------------------------------ reference components
class UnigramDrafter(Drafter):
    """Correct: context unigram counts (plus one) at every depth."""

    def __init__(self, vocab_size: int = V, depth: int = 3) -> None:
        self._v, self.depth = vocab_size, depth
        self.hist: list[int] = []

    @property
    def vocab_size(self) -> int:
        return self._v

    def begin(self, context: DraftContext) -> None:
        self.hist = context.tokens.tolist()

    def propose(self, step: DraftStep) -> Marginals:
        if not 0 <= step.root_token < self._v:
            raise InvalidInputError("root out of range")
        counts = torch.bincount(torch.tensor(self.hist + [step.root_token]), minlength=self._v).float() + 1.0
        return Marginals.from_logits(counts.log().expand(self.depth, -1).clone(), temperature=step.temperature)

    def commit(self, tokens: torch.Tensor, features: torch.Tensor | None) -> None:
        self.hist += tokens.tolist()

    def reset(self) -> None:
        self.hist = []


class BestFirst(TreeBuilder):
    """Correct: heap-ordered best-first expansion (first child / next sibling)."""

    def build(self, marginals: Marginals, root_token: int, max_nodes: int) -> Tree:
        if max_nodes < 1:
            raise InvalidInputError("max_nodes must be >= 1")
        lp = marginals.log_probs  # [K, V]
        order = lp.argsort(dim=-1, descending=True)  # [K, V]
        tokens, parents, scores = [root_token], [-1], [0.0]
        heap: list[tuple[float, int, int, int]] = []  # (-score, parent node, depth index, rank)

        def push(parent: int, d: int, rank: int) -> None:
            if d < lp.shape[0] and rank < lp.shape[1]:
                s = scores[parent] + float(lp[d, order[d, rank]])
                if s > float("-inf"):
                    heapq.heappush(heap, (-s, parent, d, rank))

        push(0, 0, 0)
        while heap and len(tokens) < max_nodes:
            neg, parent, d, rank = heapq.heappop(heap)
            tokens.append(int(order[d, rank]))
            parents.append(parent)
            scores.append(-neg)
            push(len(tokens) - 1, d + 1, 0)
            push(parent, d, rank + 1)
        return Tree.from_parents(tokens, parents, torch.tensor(scores))


class Linear(LatencyModel):
    """Correct: online least squares on (1, n) with a positive floor."""

    def __init__(self) -> None:
        self.a, self.b, self.obs = 1e-3, 1e-5, []

    def predict(self, n_tokens: int, context_len: int) -> float:
        return max(self.a + self.b * n_tokens, 1e-6)

    def observe(self, n_tokens: int, context_len: int, seconds: float) -> None:
        if not seconds == seconds:
            raise InvalidInputError("NaN")
        self.obs.append((n_tokens, seconds))
        x = torch.tensor([[1.0, n] for n, _ in self.obs], dtype=torch.float64)
        y = torch.tensor([s for _, s in self.obs], dtype=torch.float64)
        if len({n for n, _ in self.obs}) > 1:
            sol = torch.linalg.lstsq(x, y[:, None]).solution.flatten()
            self.a, self.b = float(sol[0]), max(float(sol[1]), 0.0)


class Speedup(BudgetController):
    """Correct: argmax over n of cumsum(rho) / (overhead + latency(n))."""

    def choose(self, log_scores: torch.Tensor, context_len: int, latency: LatencyModel, overhead_s: float) -> int:
        return self.decide(log_scores, context_len, latency, overhead_s).n

    def decide(self, log_scores, context_len, latency, overhead_s) -> BudgetDecision:
        if log_scores.numel() == 0:
            raise InvalidInputError("empty")
        acc = log_scores.double().exp().cumsum(0)  # [n_max]
        n = torch.arange(1, acc.numel() + 1)
        cost = latency.predict_many(n, context_len) + overhead_s
        s = acc / cost
        best = int(s.argmax()) + 1
        return BudgetDecision(best, float(s[best - 1]))


class SampleAndMatch(Verifier):
    """Correct: walk while the target's own token (argmax or sample) matches a child."""

    def verify(self, tree: Tree, logits: torch.Tensor, sampling: SamplingConfig, generator=None) -> Verdict:
        if logits.shape[0] != len(tree):
            raise InvalidInputError("one logits row per node")
        kids = tree.children_lists()
        tok = tree.tokens.tolist()
        node, path = 0, [0]
        while True:
            x = int(sample_tokens(logits[node], sampling, generator))
            nxt = [c for c in kids[node] if tok[c] == x]
            if not nxt:
                return Verdict(torch.tensor(path), [tok[i] for i in path[1:]], x)
            node = nxt[0]
            path.append(node)


# ------------------------------------------------------------------------------------ correct ones pass
def test_correct_reference_components_pass_every_check():
    check_drafter(UnigramDrafter(), vocab_size=V)
    check_tree_builder(BestFirst(), best_first=True)
    check_latency_model(Linear(), calibration=True)
    check_latency_model(FixedLatencyModel())
    check_budget_controller(Speedup())
    check_budget_controller(Speedup(), Linear())
    check_verifier(SampleAndMatch())


# ------------------------------------------------------------------------------------ broken ones fail
class WrongVocab(UnigramDrafter):
    def propose(self, step: DraftStep) -> Marginals:
        return Marginals(super().propose(step).log_probs[:, :-1])


class Unnormalized(UnigramDrafter):
    def propose(self, step: DraftStep) -> Marginals:
        return Marginals(super().propose(step).log_probs + 0.5)


class Random(UnigramDrafter):
    def propose(self, step: DraftStep) -> Marginals:
        return Marginals.from_logits(torch.randn(self.depth, self._v))


class AcceptsAnyRoot(UnigramDrafter):
    def propose(self, step: DraftStep) -> Marginals:
        return Marginals.from_logits(torch.zeros(self.depth, self._v))


class NeedsFeatures(UnigramDrafter):
    feature_layers = (0,)


class IndexErrorRoot(UnigramDrafter):
    """Fails on a bad root by accident (indexing past its table), not with bastion's documented error."""

    def propose(self, step: DraftStep) -> Marginals:
        if not 0 <= step.root_token < self._v:
            raise IndexError(f"index {step.root_token} is out of bounds")
        return super().propose(step)


@pytest.mark.parametrize(
    ("drafter", "message"),
    [
        (WrongVocab(), "marginals cover 15 tokens"),
        (Unnormalized(), "normalized"),
        (Random(), "not deterministic"),
        (AcceptsAnyRoot(), "outside the vocabulary"),
        (NeedsFeatures(), "pass target= or feature_dim="),
        (IndexErrorRoot(), "outside the vocabulary .*raised IndexError"),
    ],
    ids=lambda x: type(x).__name__ if not isinstance(x, str) else "",
)
def test_check_drafter_rejects_each_broken_drafter_with_a_clear_message(drafter, message):
    with pytest.raises(AssertionError, match=message):
        check_drafter(drafter, vocab_size=V)


def test_check_drafter_rejects_a_vocab_size_mismatch_and_non_drafters():
    with pytest.raises(AssertionError, match="vocab_size is 16, expected 17"):
        check_drafter(UnigramDrafter(), vocab_size=17)
    with pytest.raises(AssertionError, match="bastion.core.Drafter"):
        check_drafter(object(), vocab_size=V)  # type: ignore[arg-type]


def test_check_drafter_feeds_features_of_the_given_width_to_feature_drafters():
    check_drafter(NeedsFeatures(), vocab_size=V, feature_dim=8)


class ChildBeforeParent(BestFirst):
    def build(self, marginals: Marginals, root_token: int, max_nodes: int) -> Tree:
        t = super().build(marginals, root_token, max_nodes)
        if len(t) < 3:
            return t
        return Tree(t.tokens, torch.tensor([-1, 2, 0] + t.parents[3:].tolist()), t.depths, t.log_scores)


class WrongScores(BestFirst):
    def build(self, marginals: Marginals, root_token: int, max_nodes: int) -> Tree:
        t = super().build(marginals, root_token, max_nodes)
        return Tree(t.tokens, t.parents, t.depths, t.log_scores * 0.5)


class OverBudget(BestFirst):
    def build(self, marginals: Marginals, root_token: int, max_nodes: int) -> Tree:
        return super().build(marginals, root_token, max_nodes + 1)


class WrongRoot(BestFirst):
    def build(self, marginals: Marginals, root_token: int, max_nodes: int) -> Tree:
        return super().build(marginals, root_token + 1, max_nodes)


class Shuffled(BestFirst):
    """Valid trees, but a depth-first order that is not best-first."""

    def build(self, marginals: Marginals, root_token: int, max_nodes: int) -> Tree:
        t = super().build(marginals, root_token, max_nodes)
        kids = t.children_lists()
        order: list[int] = []
        stack = [0]
        while stack:
            i = stack.pop()
            order.append(i)
            stack.extend(reversed(kids[i]))
        pos = {old: new for new, old in enumerate(order)}
        parents = [-1] + [pos[int(t.parents[i])] for i in order[1:]]
        return Tree.from_parents(t.tokens[order], parents, t.log_scores[order])


@pytest.mark.parametrize(
    ("builder", "message"),
    [
        (ChildBeforeParent(), "parents precede children"),
        (WrongScores(), "log_scores must be log rho"),
        (OverBudget(), "allowed 1..1"),
        (WrongRoot(), "must be the root token"),
    ],
    ids=lambda x: type(x).__name__ if not isinstance(x, str) else "",
)
def test_check_tree_builder_rejects_each_broken_builder_with_a_clear_message(builder, message):
    with pytest.raises(AssertionError, match=message):
        check_tree_builder(builder)


def test_check_tree_builder_best_first_option_rejects_a_valid_but_not_best_first_order():
    check_tree_builder(Shuffled())  # valid trees: passes the general contract
    with pytest.raises(AssertionError, match="non-increasing score order"):
        check_tree_builder(Shuffled(), best_first=True)


class Negative(Linear):
    def predict(self, n_tokens: int, context_len: int) -> float:
        return -1.0


class Decreasing(Linear):
    def predict(self, n_tokens: int, context_len: int) -> float:
        return 1.0 / n_tokens


class NaNCrash(Linear):
    def observe(self, n_tokens: int, context_len: int, seconds: float) -> None:
        if seconds != seconds:
            raise ZeroDivisionError("a NaN measurement")
        super().observe(n_tokens, context_len, seconds)


class NaNPoisoned(Linear):
    def observe(self, n_tokens: int, context_len: int, seconds: float) -> None:
        self.a = self.a + seconds


class Forgetful(FixedLatencyModel):
    pass


class InconsistentMany(Linear):
    def predict_many(self, n_tokens: torch.Tensor, context_len: int) -> torch.Tensor:
        return super().predict_many(n_tokens, context_len) * 2


@pytest.mark.parametrize(
    ("model", "kwargs", "message"),
    [
        (Negative(), {}, "need a finite value > 0"),
        (Decreasing(), {}, "decreases"),
        (NaNPoisoned(), {}, "NaN measurement poisoned"),
        (NaNCrash(), {}, "raised ZeroDivisionError"),
        (Forgetful(base_s=1.0), {"calibration": True}, "calibration"),
        (InconsistentMany(), {}, r"predict\(\) disagrees with predict_batch\(\)"),
    ],
    ids=["negative", "decreasing", "nan", "nan-crash", "no-calibration", "predict-many"],
)
def test_check_latency_model_rejects_each_broken_model_with_a_clear_message(model, kwargs, message):
    with pytest.raises(AssertionError, match=message):
        check_latency_model(model, **kwargs)


class Zero(Speedup):
    def choose(self, log_scores, context_len, latency, overhead_s):
        return 0


class TooMany(Speedup):
    def choose(self, log_scores, context_len, latency, overhead_s):
        return log_scores.numel() + 1


class TensorResult(Speedup):
    def choose(self, log_scores, context_len, latency, overhead_s):
        return torch.tensor(1)


class Mutating(Speedup):
    def choose(self, log_scores, context_len, latency, overhead_s):
        log_scores.zero_()
        return 1


class Alternating(Speedup):
    flip = False

    def choose(self, log_scores, context_len, latency, overhead_s):
        self.flip = not self.flip
        return 1 if self.flip or log_scores.numel() == 1 else 2


class LyingDecision(Speedup):
    def decide(self, log_scores, context_len, latency, overhead_s):
        n = super().decide(log_scores, context_len, latency, overhead_s).n
        return BudgetDecision(n + 1, 1.0)

    def choose(self, log_scores, context_len, latency, overhead_s):
        return super().decide(log_scores, context_len, latency, overhead_s).n


class UntypedDecision(Speedup):
    def decide(self, log_scores, context_len, latency, overhead_s):
        return super().decide(log_scores, context_len, latency, overhead_s).n

    def choose(self, log_scores, context_len, latency, overhead_s):
        return super().decide(log_scores, context_len, latency, overhead_s).n


@pytest.mark.parametrize(
    ("controller", "message"),
    [
        (Zero(), "need 1 <= n"),
        (TooMany(), "need 1 <= n"),
        (TensorResult(), "Python int"),
        (Mutating(), "modified log_scores"),
        (Alternating(), "for the same inputs"),
        (LyingDecision(), r"decide_width\(\) returned 2; need 1 <= n <= 1"),
        (UntypedDecision(), "must return a BudgetDecision"),
    ],
    ids=lambda x: type(x).__name__ if not isinstance(x, str) else "",
)
def test_check_budget_controller_rejects_each_broken_controller_with_a_clear_message(controller, message):
    with pytest.raises(AssertionError, match=message):
        check_budget_controller(controller)


class AcceptsEverything(SampleAndMatch):
    """Follows the first child regardless of the target: not lossless."""

    def verify(self, tree, logits, sampling, generator=None):
        kids = tree.children_lists()
        path = [0]
        while kids[path[-1]]:
            path.append(kids[path[-1]][0])
        tok = tree.tokens.tolist()
        bonus = int(sample_tokens(logits[path[-1]], sampling, generator))
        return Verdict(torch.tensor(path), [tok[i] for i in path[1:]], bonus)


class DraftBiased(SampleAndMatch):
    """Greedy is right, but at T > 0 it accepts a drafted child whenever the target gives it >= 20%:
    the classic way to lose losslessness."""

    def verify(self, tree, logits, sampling, generator=None):
        if sampling.greedy:
            return super().verify(tree, logits, sampling, generator)
        kids = tree.children_lists()
        tok = tree.tokens.tolist()
        p = logits.softmax(-1)
        path = [0]
        while True:
            good = [c for c in kids[path[-1]] if p[path[-1], tok[c]] >= 0.2]
            if not good:
                break
            path.append(good[0])
        bonus = int(sample_tokens(logits[path[-1]], sampling, generator))
        return Verdict(torch.tensor(path), [tok[i] for i in path[1:]], bonus)


class NoShapeCheck(SampleAndMatch):
    """A batch-first verifier that never looks at the shape of its logits."""

    def verify_batch(self, trees, logits, sampling, generators):
        out = []
        for i, (t, s, g) in enumerate(zip(trees, sampling, generators)):
            row = logits[min(i, logits.shape[0] - 1), : len(t)]  # [<= n, V]: whatever rows there are
            row = torch.cat([row, row[-1:].expand(len(t) - row.shape[0], -1)])  # silently padded to [n, V]
            out.append(SampleAndMatch.verify(self, t, row, s, g))
        return out


class ShapeBug(NoShapeCheck):
    """Rejects wrongly shaped logits only by accident (a RuntimeError from a tensor op)."""

    def verify_batch(self, trees, logits, sampling, generators):
        if logits.shape[1] < max(len(t) for t in trees) or logits.shape[0] != len(trees):
            torch.zeros(2) + torch.zeros(3)  # RuntimeError: sizes must match
        return super().verify_batch(trees, logits, sampling, generators)


class BrokenPath(SampleAndMatch):
    def verify(self, tree, logits, sampling, generator=None):
        v = super().verify(tree, logits, sampling, generator)
        return Verdict(torch.tensor([0, 7]), [int(tree.tokens[7])], v.bonus_token)


@pytest.mark.parametrize(
    ("verifier", "message"),
    [
        (AcceptsEverything(), "greedy walk"),
        (DraftBiased(), "not lossless"),
        (NoShapeCheck(), "must raise when logits have .*raised nothing"),
        (ShapeBug(), "must raise when logits have .*raised RuntimeError"),
        (BrokenPath(), "not a root-to-node path"),
    ],
    ids=lambda x: type(x).__name__ if not isinstance(x, str) else "",
)
def test_check_verifier_rejects_each_broken_verifier_with_a_clear_message(verifier, message):
    with pytest.raises(AssertionError, match=message):
        check_verifier(verifier, trials=200)


def test_check_component_creates_through_the_registry_and_names_missing_components():
    reg = bastion.contract.registry.Registry(builtin_plugins=(), load_entry_points=False)
    reg.register("tree_builder", "ref-best-first", BestFirst, source="tests")
    built = check_component("tree_builder", "ref-best-first", registry=reg, best_first=True)
    assert isinstance(built, BestFirst)
    with pytest.raises(AssertionError, match="no verifier named 'nope' is registered"):
        check_component("verifier", "nope", registry=reg)


#: components that need options to exist: (kind, name) -> a function of a pytest TempPathFactory
#: returning (creation options, extra check arguments). Everything else is created without options.
def _roofline_setup(_tmp: pytest.TempPathFactory) -> tuple[dict, dict]:
    from bastion.testing.tiny import tiny_config

    options = {"model_config": tiny_config("qwen3"), "device": "cpu", "profile": None, "probe": False}
    return options, {"calibration": True}


def _dflash_setup(tmp: pytest.TempPathFactory) -> tuple[dict, dict]:
    from bastion.huggingface.causal_lm import HFTarget
    from bastion.drafters.dflash import DFlashConfig, DFlashDraftModel
    from bastion.testing.tiny import tiny_model

    target = HFTarget(tiny_model("qwen3", seed=0))
    torch.manual_seed(3)
    cfg = DFlashConfig.for_target(target.config, num_layers=1, block_size=4, target_layer_ids=(0, 1), mask_token_id=255)
    directory = DFlashDraftModel(cfg).save_pretrained(tmp.mktemp("dflash"))
    return {"checkpoint": str(directory), "device": "cpu", "dtype": "float32"}, {"target": target}


def _model_setup(tmp: pytest.TempPathFactory) -> tuple[dict, dict]:
    from bastion.huggingface.causal_lm import HFTarget
    from bastion.testing.tiny import save_tiny_target, tiny_model

    directory = save_tiny_target(tmp.mktemp("ar-draft"), "qwen3", seed=4, num_hidden_layers=1)
    return {"checkpoint": str(directory), "depth": 3, "width": 2, "top_k": 3}, {"target": HFTarget(tiny_model("qwen3", seed=0))}


def _eagle3_setup(tmp: pytest.TempPathFactory) -> tuple[dict, dict]:
    from bastion.huggingface.causal_lm import HFTarget
    from bastion.drafters.eagle3 import Eagle3Config, Eagle3DraftModel
    from bastion.testing.tiny import tiny_model

    target = tiny_model("llama", seed=0, num_hidden_layers=8, vocab_size=256)
    cfg = Eagle3Config(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=256, draft_vocab_size=224, target_hidden_size=64, feature_layer_ids=(1, 3, 7),
    )
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(3)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 if p.dim() > 1 else torch.ones(p.shape))
        chosen = torch.randperm(256, generator=gen)[:224].sort().values
        model.d2t.copy_(chosen - torch.arange(224))
    directory = model.save_pretrained(tmp.mktemp("eagle3"))
    return {"checkpoint": str(directory), "total_token": 12, "depth": 3, "top_k": 3}, {"target": HFTarget(target)}


def _example_ngram_setup(_tmp: pytest.TempPathFactory) -> tuple[dict, dict]:
    return {"vocab_size": V}, {}


NEEDS_OPTIONS = {
    ("latency_model", "roofline"): _roofline_setup,
    ("drafter", "dflash"): _dflash_setup,
    ("drafter", "model"): _model_setup,
    ("drafter", "eagle3"): _eagle3_setup,
    ("drafter", "example-ngram"): _example_ngram_setup,
}
CHECK_ARGS = {("tree_builder", "best-first"): {"best_first": True}}


@pytest.mark.parametrize(
    ("kind", "name"), [(c.kind, c.name) for c in bastion.registry.components()], ids=lambda x: str(x)
)
def test_every_registered_component_passes_its_contract_check(kind, name, tmp_path_factory):
    """Built-ins and installed plugins alike, each created through the registry with real options."""
    setup = NEEDS_OPTIONS.get((kind, name))
    options, check_args = setup(tmp_path_factory) if setup else ({}, {})
    try:
        bastion.registry.create(kind, name, **options)
    except (TypeError, BastionError) as exc:
        pytest.fail(f"{kind} {name!r} cannot be created with {sorted(options)}: {exc}; add it to NEEDS_OPTIONS")
    check_component(kind, name, options=options, **{**CHECK_ARGS.get((kind, name), {}), **check_args})
