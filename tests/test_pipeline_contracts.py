"""How the pipeline meets its components: keyword-only assembly, latency models bound to the target,
drafters claiming checkpoints through the registry, typed budget decisions and the tree-validation flag."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

import bastion
from bastion.controllers.latency import RooflineLatency
from bastion.core import (
    BudgetController,
    BudgetDecision,
    IncompatibleComponentsError,
    LatencyModel,
    Tree,
    TreeBuilder,
    TreeValidationError,
    UnknownComponentError,
)
from bastion.huggingface.causal_lm import HFTarget
from bastion.contract.interfaces import COMPONENT_INTERFACES, KINDS
from bastion.contract.registry import Registry
from bastion.testing.contract import FixedLatencyModel
from bastion.testing.drafters import NoisyOracleDrafter
from bastion.testing.tiny import tiny_model

MARKER = "my-drafter.json"


@functools.lru_cache(maxsize=None)
def _model():
    return tiny_model("qwen3", seed=0)


def _target() -> HFTarget:
    return HFTarget(_model())


def test_pipeline_components_after_the_drafter_are_keyword_only():
    target, drafter = _target(), NoisyOracleDrafter(_model(), block_size=3)
    with pytest.raises(TypeError):
        bastion.Pipeline(target, drafter, "chain")  # type: ignore[misc]
    with pytest.raises(TypeError):
        bastion.Pipeline.from_pretrained(target, drafter, "chain")  # type: ignore[misc]
    pipe = bastion.Pipeline(target, drafter, tree_builder="chain", verifier="exact")
    assert type(pipe.tree_builder).__name__ == "ChainBuilder"


def test_one_table_of_kinds_serves_registry_hookspecs_and_pipeline():
    from bastion.contract import hookspecs

    assert KINDS == tuple(COMPONENT_INTERFACES) == hookspecs.KINDS == bastion.registry.kinds()
    with pytest.raises(bastion.core.InvalidInputError, match="unknown kinds"):
        bastion.Pipeline(_target(), NoisyOracleDrafter(_model()), component_options={"drafters": {}})


def test_a_latency_model_named_without_options_is_bound_to_the_target_not_given_its_config():
    reg = Registry(load_entry_points=False)
    reg.register("latency_model", "plain", FixedLatencyModel)  # takes no model_config= / device=
    pipe = bastion.Pipeline(_target(), NoisyOracleDrafter(_model()), latency_model="plain", registry=reg)
    assert isinstance(pipe.latency_model, FixedLatencyModel)
    assert len(pipe.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4).tokens) == 4


def test_roofline_reads_config_device_and_dtype_from_the_target_it_is_bound_to():
    target = _target()
    model = RooflineLatency(profile=None, probe=False)
    with pytest.raises(bastion.core.InvalidInputError, match="bind it to a target"):
        model.predict(4, 10)
    model.bind(target)
    assert model.device == target.device and model.cost.bytes_per_param == 4
    assert model.cost.num_layers == target.num_layers and model.predict(4, 10) > 0
    half = RooflineLatency(dtype=torch.float16, profile=None, probe=False)
    half.bind(target)
    assert half.cost.bytes_per_param == 2, "an option given at construction wins over the target's"
    pipe = bastion.Pipeline(target, NoisyOracleDrafter(_model()), component_options={"latency_model": {"profile": None}})
    assert pipe.latency_model.cost.signature == model.cost.signature


class MarkerDrafter(NoisyOracleDrafter):
    """A third-party drafter with its own checkpoint format: a directory holding ``my-drafter.json``."""

    def __init__(self, checkpoint: str, device="cpu", dtype=None, **_: object) -> None:
        spec = json.loads((Path(checkpoint) / MARKER).read_text())
        super().__init__(_model(), block_size=spec["block_size"])

    @classmethod
    def claims_checkpoint(cls, path) -> bool:
        return (Path(path) / MARKER).is_file()


def _marker_checkpoint(tmp_path: Path) -> Path:
    (tmp_path / MARKER).write_text(json.dumps({"block_size": 3}))
    return tmp_path


def test_a_third_party_drafter_loads_its_own_checkpoint_by_path(tmp_path, tiny_qwen3_dir):
    reg = Registry(load_entry_points=False)
    reg.register("drafter", "marker", MarkerDrafter)
    ckpt = _marker_checkpoint(tmp_path)
    assert reg.drafter_for_checkpoint(str(ckpt)) == "marker"
    pipe = bastion.Pipeline.from_pretrained(tiny_qwen3_dir, ckpt, registry=reg, budget_controller="fixed")
    assert isinstance(pipe.drafter, MarkerDrafter) and pipe.drafter.block_size == 3


def test_a_dflash_checkpoint_is_claimed_by_dflash_alone(tmp_path):
    from bastion.drafters.dflash import DFlashConfig, DFlashDraftModel

    cfg = DFlashConfig.for_target(_model().config, num_layers=1, block_size=3, target_layer_ids=(0,), mask_token_id=255)
    ckpt = DFlashDraftModel(cfg).save_pretrained(tmp_path / "dflash")
    reg = Registry(load_entry_points=False)
    reg.register("drafter", "marker", MarkerDrafter)
    assert reg.drafter_for_checkpoint(str(ckpt)) == "dflash"


def test_unclaimed_and_doubly_claimed_checkpoints_are_refused_by_name(tmp_path):
    reg = Registry(load_entry_points=False)
    reg.register("drafter", "marker", MarkerDrafter)
    with pytest.raises(UnknownComponentError, match="nor a checkpoint any registered drafter claims"):
        reg.drafter_for_checkpoint(str(tmp_path))
    reg.register("drafter", "marker-too", MarkerDrafter)
    with pytest.raises(IncompatibleComponentsError, match="several drafters claim .*marker, marker-too"):
        reg.drafter_for_checkpoint(str(_marker_checkpoint(tmp_path)))


class ChooseOnly(BudgetController):
    """Implements only ``choose``: the interface's ``decide`` wraps it."""

    def choose(self, log_scores, context_len, latency, overhead_s) -> int:
        return min(3, int(log_scores.shape[0]))


class DecidingController(ChooseOnly):
    def decide(self, log_scores, context_len, latency, overhead_s) -> BudgetDecision:
        return BudgetDecision(self.choose(log_scores, context_len, latency, overhead_s), 1.25)


def test_the_pipeline_records_the_typed_decision_of_each_step():
    prompt = torch.tensor([[5, 6, 7]])
    plain = bastion.Pipeline(_target(), NoisyOracleDrafter(_model()), budget_controller=ChooseOnly())
    res = plain.generate(prompt, max_new_tokens=6)
    assert res.steps and all(s.predicted_speedup is None for s in res.steps)
    assert ChooseOnly().decide(torch.zeros(5), 0, FixedLatencyModel(), 0.0) == BudgetDecision(3)
    typed = bastion.Pipeline(_target(), NoisyOracleDrafter(_model()), budget_controller=DecidingController())
    res = typed.generate(prompt, max_new_tokens=6)
    drafted = [s for s in res.steps if s.budget > 1]
    assert drafted and all(s.predicted_speedup == 1.25 for s in drafted)


def test_every_drafted_step_records_the_controllers_choice_and_the_tokens_it_accepted():
    pipe = bastion.Pipeline(_target(), NoisyOracleDrafter(_model()), budget_controller=ChooseOnly())
    seen: list = []
    res = pipe.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=12, stop_on_eos=False, on_step=seen.append)
    assert list(res.steps) == seen and seen
    drafted = [s for s in seen if s.drafted]
    assert drafted and all(s.budget == 3 and 0 <= s.accepted <= 2 for s in drafted)
    assert sum(s.emitted for s in seen) == len(res.tokens) - 1  # every token but the prefill's first


class BrokenBuilder(TreeBuilder):
    """Returns a tree whose root is not the requested root token."""

    def __init__(self, trusted: bool) -> None:
        self.builds_valid_trees = trusted  # type: ignore[misc]

    def build(self, marginals, root_token, max_nodes) -> Tree:
        return Tree.from_parents(torch.tensor([(root_token + 1) % marginals.vocab_size, 1]), [-1, 0])


def test_tree_validation_trusts_only_built_in_builders_that_declare_valid_trees():
    prompt = torch.tensor([[5, 6, 7]])
    for declared in (False, True):  # a plugin builder is checked at its boundary whatever it declares
        untrusted = bastion.Pipeline(_target(), NoisyOracleDrafter(_model()), tree_builder=BrokenBuilder(declared))
        assert untrusted.validate_trees
        with pytest.raises(TreeValidationError, match="root first"):
            untrusted.generate(prompt, max_new_tokens=4)
    opted_out = bastion.Pipeline(_target(), NoisyOracleDrafter(_model()), tree_builder=BrokenBuilder(True), validate_trees=False)
    assert not opted_out.validate_trees
    assert not bastion.Pipeline(_target(), NoisyOracleDrafter(_model())).validate_trees  # best-first: built in, declared
    forced = bastion.Pipeline(
        _target(), NoisyOracleDrafter(_model()), tree_builder=BrokenBuilder(True), validate_trees=True
    )
    with pytest.raises(TreeValidationError):
        forced.generate(prompt, max_new_tokens=4)
    for name in bastion.registry.names("tree_builder"):
        if bastion.registry.info("tree_builder", name).source == "builtin":
            assert bastion.registry.create("tree_builder", name).builds_valid_trees, name


def test_a_latency_model_instance_is_bound_once_by_the_pipeline():
    bound: list[object] = []

    class Recording(FixedLatencyModel):
        def bind(self, target) -> None:
            bound.append(target)

    target = _target()
    bastion.Pipeline(target, NoisyOracleDrafter(_model()), latency_model=Recording())
    assert bound == [target]
    assert LatencyModel.bind(FixedLatencyModel(), target) is None  # the default is a no-op
