"""The DFlash drafter against a real (tiny) Hugging Face target: compatibility checks, the draft-context
cache, tempering, losslessness in a pipeline and one drafter forward per step whatever the tree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import bastion
from bastion.contract.errors import IncompatibleComponentsError, InvalidInputError
from bastion.huggingface.causal_lm import HFTarget
from bastion.engine.pipeline import Pipeline
from bastion.contract.types import DraftContext, DraftStep
from bastion.drafters.dflash import DFlashDrafter
from bastion.drafters.dflash import DFlashConfig, DFlashDraftModel
from bastion.testing.contract import FixedLatencyModel, check_drafter
from bastion.testing.reference import greedy_reference
from bastion.testing.tiny import tiny_model

BLOCK, MASK_ID, LAYERS = 5, 255, (0, 1)


@pytest.fixture(scope="module")
def target() -> HFTarget:
    return HFTarget(tiny_model("qwen3", seed=0))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, target: HFTarget) -> Path:
    torch.manual_seed(3)
    cfg = DFlashConfig.for_target(target.config, num_layers=2, block_size=BLOCK, target_layer_ids=LAYERS, mask_token_id=MASK_ID)
    return DFlashDraftModel(cfg).save_pretrained(tmp_path_factory.mktemp("dflash"))


@pytest.fixture()
def drafter(checkpoint: Path, target: HFTarget) -> DFlashDrafter:
    d = bastion.registry.create("drafter", "dflash", checkpoint=str(checkpoint), device="cpu", dtype="float32")
    d.bind(target)
    return d


def test_registered_dflash_loads_the_checkpoint_and_reads_its_feature_layers(drafter: DFlashDrafter) -> None:
    assert "dflash" in bastion.registry.names("drafter")
    assert drafter.feature_layers == LAYERS
    assert drafter.vocab_size == 256 and drafter.num_draft_tokens == BLOCK - 1


def test_dflash_drafter_honours_the_drafter_contract(drafter: DFlashDrafter, target: HFTarget) -> None:
    check_drafter(drafter, 256, target=target)


def test_incremental_context_cache_matches_full_recomputation(drafter: DFlashDrafter, target: HFTarget) -> None:
    torch.manual_seed(0)
    prompt = torch.randint(0, 200, (1, 9))
    feats = target.prefill(prompt, LAYERS).features  # [9, F]
    extra = torch.randn(3, feats.shape[1])  # features of a later root + 2 accepted tokens
    drafter.begin(DraftContext(tokens=prompt[0], features=feats))
    drafter.propose(DraftStep(root_token=11, context_len=9))
    assert drafter.cached_positions == 9  # only committed positions are cached, never the block
    drafter.commit(torch.tensor([11, 12, 13]), extra)
    got = drafter.propose(DraftStep(root_token=14, context_len=12)).log_probs
    assert drafter.cached_positions == 12
    block = torch.tensor([[14] + [MASK_ID] * (BLOCK - 1)])
    with torch.no_grad():
        full = drafter.model.block_logits(
            torch.cat([feats, extra])[None], block, embed=target.input_embeddings(), head=target.output_head(),
            block_positions=torch.arange(12, 12 + BLOCK),
        )[0]
    assert torch.allclose(got, torch.log_softmax(full, -1), atol=1e-5)


def test_propose_tempers_marginals_by_the_step_temperature(drafter: DFlashDrafter, target: HFTarget) -> None:
    prompt = torch.arange(3, 10)[None]
    feats = target.prefill(prompt, LAYERS).features
    drafter.begin(DraftContext(tokens=prompt[0], features=feats))
    plain = drafter.propose(DraftStep(root_token=4, context_len=7, temperature=1.0)).log_probs
    drafter.begin(DraftContext(tokens=prompt[0], features=feats))
    cold = drafter.propose(DraftStep(root_token=4, context_len=7, temperature=0.5)).log_probs
    assert torch.allclose(cold, torch.log_softmax(plain * 2.0, -1), atol=1e-5)


def test_propose_rejects_a_context_length_the_drafter_did_not_see(drafter: DFlashDrafter, target: HFTarget) -> None:
    prompt = torch.arange(3, 10)[None]
    drafter.begin(DraftContext(tokens=prompt[0], features=target.prefill(prompt, LAYERS).features))
    with pytest.raises(InvalidInputError, match="context length"):
        drafter.propose(DraftStep(root_token=4, context_len=8))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"hidden_size": 32, "head_dim": 8}, "hidden size 32"),
        ({"vocab_size": 128}, "vocabulary 128"),
        ({"num_hidden_layers": 3}, "3 layers"),
    ],
)
def test_bind_names_each_incompatibility(checkpoint: Path, overrides: dict, message: str) -> None:
    other = HFTarget(tiny_model("qwen3", seed=1, **overrides))
    d = DFlashDrafter(checkpoint)
    with pytest.raises(IncompatibleComponentsError, match=message):
        d.bind(other)


def test_bind_rejects_a_mask_token_outside_the_target_vocabulary(tmp_path: Path) -> None:
    big = tiny_model("qwen3", seed=0, vocab_size=512).config
    cfg = DFlashConfig.for_target(big, num_layers=1, block_size=3, target_layer_ids=(1,), mask_token_id=400)
    DFlashDraftModel(cfg).save_pretrained(tmp_path)
    with pytest.raises(IncompatibleComponentsError, match="mask token id 400"):
        DFlashDrafter(tmp_path).bind(HFTarget(tiny_model("qwen3", seed=0)))


@pytest.mark.parametrize("builder", ["best-first", "chain"])
def test_pipeline_with_dflash_drafter_is_lossless_against_greedy_decoding(
    checkpoint: Path, target: HFTarget, builder: str
) -> None:
    pipe = Pipeline(
        target=target,
        drafter=DFlashDrafter(checkpoint),
        tree_builder=builder,
        budget_controller="full",
        latency_model=FixedLatencyModel(),
        verifier="exact",
        max_nodes=12,
    )
    prompt = torch.tensor([[1, 17, 42, 99, 7, 3]])
    res = pipe.generate(prompt, max_new_tokens=20, temperature=0.0, stop_on_eos=False)
    assert res.tokens == greedy_reference(target.model, prompt, 20)


@pytest.mark.parametrize(("builder", "max_nodes"), [("best-first", 2), ("best-first", 24), ("chain", 5), ("static", 16)])
def test_one_drafter_forward_per_step_whatever_the_tree(
    checkpoint: Path, target: HFTarget, builder: str, max_nodes: int
) -> None:
    drafter = DFlashDrafter(checkpoint)
    blocks: list[tuple[int, ...]] = []
    proposals: list[int] = []
    handle = drafter.model.register_forward_hook(lambda _m, args, _o: blocks.append(tuple(args[0].shape)))
    propose = drafter.propose
    drafter.propose = lambda step: (proposals.append(step.context_len), propose(step))[1]  # type: ignore[method-assign]
    try:
        pipe = Pipeline(
            target=target, drafter=drafter, tree_builder=builder, budget_controller="full",
            latency_model=FixedLatencyModel(), verifier="exact", max_nodes=max_nodes,
        )
        res = pipe.generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=12, stop_on_eos=False)
    finally:
        handle.remove()
    # every drafted step runs exactly one drafter forward (the pipeline's last step may skip drafting
    # when only the bonus token is still wanted)
    assert len(blocks) == len(proposals) >= len(res.steps) - 1
    assert set(blocks) == {(1, BLOCK, 64)}  # the same one-block forward, whatever the tree's size or shape
