"""The ``eagle3`` drafter (EAGLE-3 checkpoints drafting candidate trees): greedy output equal to Hugging Face
``generate`` with every candidate-tree builder and the bastion controller, single and batched; seeded
reproducibility at T > 0; per-node log q and the draft cache against plain recomputations; both weight
layouts; checkpoint claiming; broken checkpoints named; the contract kit."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

import bastion
from bastion.core import CandidateTree, DraftContext, DraftStep, IncompatibleComponentsError, InvalidInputError
from bastion.contract.errors import InvalidFileError
from bastion.huggingface.causal_lm import HFTarget
from bastion.drafters.eagle3 import Eagle3Config, Eagle3DraftModel, Eagle3Drafter, default_feature_layers
from bastion.drafters.eagle3.model import Eagle3KV
from bastion.testing import check_drafter
from bastion.testing.tiny import tiny_model

VOCAB, DRAFT_VOCAB, LAYERS = 256, 224, 8
NEW_TOKENS = 14
CANDIDATE_BUILDERS = [n for n in bastion.registry.names("tree_builder") if "candidate_tree" in bastion.registry.create("tree_builder", n).accepts]


@functools.lru_cache(maxsize=None)
def _target():
    return tiny_model("llama", seed=0, num_hidden_layers=LAYERS, vocab_size=VOCAB)


def _config(**overrides) -> Eagle3Config:
    base = dict(
        hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB, target_hidden_size=64, feature_layer_ids=(1, 3, LAYERS - 1),
    )
    base.update(overrides)
    return Eagle3Config(**base)


def draft_model(cfg: Eagle3Config | None = None, *, mix: float = 0.05, seed: int = 1) -> Eagle3DraftModel:
    """A random EAGLE-3 network that mostly proposes the target's own next token.

    ``fc`` passes the target's last layer output through, the final norm and lm head are the target's
    (its rows of the draft vocabulary), and the attention / MLP branches are scaled by ``mix``: small,
    so the proposals stay close to the target's (and are accepted), but not zero, so they depend on
    the draft cache. Every other weight is random; ``d2t`` is a random subset of the target vocabulary."""
    cfg = cfg or _config()
    target = _target()
    gen = torch.Generator().manual_seed(seed)
    model = Eagle3DraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3 if p.dim() > 1 else 1 + 0.05 * torch.randn(p.shape, generator=gen))
        chosen = torch.randperm(cfg.vocab_size, generator=gen)[: cfg.draft_vocab_size].sort().values
        model.d2t.copy_(chosen - torch.arange(cfg.draft_vocab_size))
        if cfg.hidden_size == target.config.hidden_size and cfg.vocab_size == VOCAB:
            model.fc.weight.zero_()
            model.fc.weight[:, -cfg.target_hidden_size :] = torch.eye(cfg.hidden_size)
            model.norm.weight.copy_(target.model.norm.weight)
            model.lm_head.weight.copy_(target.lm_head.weight[chosen])
        model.midlayer.self_attn.o_proj.weight.mul_(mix)
        model.midlayer.mlp.down_proj.weight.mul_(mix)
    return model.eval()


@functools.lru_cache(maxsize=None)
def _model() -> Eagle3DraftModel:
    return draft_model()


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (2, 5, 9, 17)]


@functools.lru_cache(maxsize=None)
def _reference(prompt: tuple[int, ...], new: int = NEW_TOKENS) -> list[int]:
    with torch.no_grad():
        out = _target().generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new, min_new_tokens=0)
    return out[0, len(prompt) :].tolist()


def _drafter(**kw) -> Eagle3Drafter:
    return bastion.registry.create("drafter", "eagle3", checkpoint=_model(), **kw)


def _pipeline(builder: str = "best-first", budget: int | None = 16, **kw) -> bastion.Pipeline:
    controller = "bastion" if budget is None else bastion.registry.create("budget_controller", "fixed", budget=budget)
    return bastion.Pipeline(HFTarget(_target()), _drafter(**kw), tree_builder=builder, budget_controller=controller,
                            max_nodes=budget or 24)


# ------------------------------------------------------------------ lossless decoding
@pytest.mark.parametrize("builder", CANDIDATE_BUILDERS)
@pytest.mark.parametrize("budget", [4, 16, None], ids=["fixed4", "fixed16", "bastion"])
def test_greedy_output_equals_hf_generate_with_the_eagle3_drafter_for_every_builder_and_controller(builder, budget):
    pipe = _pipeline(builder, budget)
    accepted = 0
    for prompt in _prompts()[:3]:
        res = pipe.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS)
        assert res.tokens == _reference(tuple(prompt)), f"{builder} budget {budget} prompt {prompt}"
        accepted += sum(s.accepted for s in res.steps)
    assert accepted > 0 or budget is None  # the bastion controller may find plain decoding faster here


def test_batched_greedy_output_with_the_eagle3_drafter_equals_hf_generate_for_every_prompt():
    pipe = _pipeline("best-first", 12)
    prompts = _prompts()
    results = pipe.generate_batch(prompts, max_new_tokens=NEW_TOKENS)
    for prompt, res in zip(prompts, results, strict=True):
        assert res.tokens == _reference(tuple(prompt)), prompt
    assert sum(s.accepted for res in results for s in res.steps) > 0  # candidate trees went through the batch


def test_sampled_output_with_the_eagle3_drafter_is_reproducible_per_seed():
    pipe = _pipeline("best-first", 12)
    prompt = torch.tensor([_prompts()[1]])
    runs = [pipe.generate(prompt, max_new_tokens=NEW_TOKENS, temperature=0.8, seed=s).tokens for s in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]  # the seed matters


# ------------------------------------------------------------------ proposals
def _bound(**kw) -> tuple[Eagle3Drafter, HFTarget]:
    target = HFTarget(_target())
    drafter = _drafter(**kw)
    drafter.bind(target)
    return drafter, target


def _features(target: HFTarget, drafter: Eagle3Drafter, ids: list[int]) -> torch.Tensor:
    target.reset()
    return target.prefill(torch.tensor([ids]), drafter.feature_layers).features  # [L, F]


def _chain_log_q(drafter: Eagle3Drafter, feats: torch.Tensor, context: list[int], root: int, path: list[int]) -> list[float]:
    """log q of each token of ``path`` below ``root``, fed one by one as a chain (no tree masks)."""
    model = drafter.model
    cache = Eagle3KV()
    with torch.no_grad():
        ids = torch.tensor([*context[1:], root])
        out = model.rows(drafter._embed_ids(ids), model.fc(feats), torch.arange(len(context)), cache, None)[-1:]
        got = []
        for depth, tok in enumerate(path):
            log_p = torch.log_softmax(model.logits(out).double()[0], dim=-1)  # [Vd]
            draft_id = int((model.target_ids(torch.arange(DRAFT_VOCAB)) == tok).nonzero())
            got.append(float(log_p[draft_id]))
            out = model.rows(drafter._embed_ids(torch.tensor([tok])), out, torch.tensor([len(context) + depth]), cache, None)
    return got


def test_every_candidate_log_q_is_the_draft_networks_log_prob_along_its_path_fed_as_a_chain():
    drafter, target = _bound(total_token=30, depth=3, top_k=4)
    context = _prompts()[2]
    feats = _features(target, drafter, context)
    drafter.begin(DraftContext(tokens=torch.tensor(context), features=feats))
    root = 17
    cand = drafter.propose(DraftStep(root_token=root, context_len=len(context)))
    assert isinstance(cand, CandidateTree) and len(cand) == 30 and cand.max_depth <= 4
    cand.validate(vocab_size=VOCAB, root_token=root)
    tokens, parents, log_q = cand.host_lists()
    draft_vocab = set(drafter.model.target_ids(torch.arange(DRAFT_VOCAB)).tolist())
    assert set(tokens[1:]) <= draft_vocab  # every candidate is a mapped draft token
    for i in range(1, len(tokens)):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        want = _chain_log_q(drafter, feats, context, root, path[::-1])
        assert log_q[i] == pytest.approx(want[-1], abs=1e-5), f"node {i}"


def test_kept_candidates_are_the_best_by_cumulative_log_q_of_everything_expanded():
    drafter, target = _bound(total_token=20, depth=3, top_k=4)
    context = _prompts()[1]
    drafter.begin(DraftContext(tokens=torch.tensor(context), features=_features(target, drafter, context)))
    small = drafter.propose(DraftStep(root_token=9, context_len=len(context)))
    drafter.total_token = 1 + 4 + 3 * 16  # everything EAGLE-3 expands at depth 3, top-k 4
    full = drafter.propose(DraftStep(root_token=9, context_len=len(context)))
    assert len(full) == 53
    full_scores = sorted(full.log_scores()[1:], reverse=True)
    assert sorted(small.log_scores()[1:], reverse=True) == pytest.approx(full_scores[:19], abs=1e-6)
    # the frontier rule: at each depth > 1 only the children of the best top_k nodes of the depth above exist
    depths, parents = full.depths(), full.parents.tolist()
    for d in range(2, 5):
        assert len({parents[i] for i in range(len(depths)) if depths[i] == d}) == 4


def _draft_ids(drafter: Eagle3Drafter, tokens: torch.Tensor) -> list[int]:
    """Draft ids of target tokens (the inverse of d2t)."""
    mapped = drafter.model.target_ids(torch.arange(DRAFT_VOCAB)).tolist()
    return [mapped.index(t) for t in tokens.tolist()]


def test_log_q_is_tempered_by_the_step_temperature():
    drafter, target = _bound(depth=1, top_k=5)
    context = [3, 4, 5]
    drafter.begin(DraftContext(tokens=torch.tensor(context), features=_features(target, drafter, context)))
    trees = {t: drafter.propose(DraftStep(root_token=9, context_len=3, temperature=t)) for t in (1.0, 0.5)}
    with torch.no_grad():  # the root's hidden state, kept for the next proposal with the same root
        logits = drafter.model.logits(drafter._root_row.output).double()[0]  # [Vd]
    for t, tree in trees.items():
        children = tree.tokens[1:6]  # depth 1: the root's top 5
        want = torch.log_softmax(logits / t, dim=-1)[_draft_ids(drafter, children)]
        torch.testing.assert_close(tree.log_q[1:6].double(), want, atol=1e-5, rtol=0)


def test_draft_cache_after_commits_gives_the_same_tree_as_a_fresh_drafter_over_the_whole_context():
    drafter, target = _bound(total_token=24, depth=3, top_k=4)
    context = _prompts()[1]
    target.reset()
    pre = target.prefill(torch.tensor([context]), drafter.feature_layers)
    drafter.begin(DraftContext(tokens=torch.tensor(context), features=pre.features))
    committed, root = list(context), 11
    with torch.no_grad():
        all_feats = [pre.features]
        for step in range(4):
            cand = drafter.propose(DraftStep(root_token=root, context_len=len(committed)))
            tokens, parents, _ = cand.host_lists()
            # accept the root, then the deepest candidate's path prefix of `step` tokens
            leaf = max(range(len(tokens)), key=lambda i: cand.depths()[i])
            path, j = [], leaf
            while j > 0:
                path.append(tokens[j])
                j = parents[j]
            accepted = [root, *path[::-1][:step]]
            feats = torch.randn(len(accepted), drafter.config.feature_size, generator=torch.Generator().manual_seed(step))
            drafter.commit(torch.tensor(accepted), feats)
            committed += accepted
            all_feats.append(feats)
            root = 20 + step
            fresh = Eagle3Drafter(drafter.model)
            fresh.bind(target)
            fresh.begin(DraftContext(tokens=torch.tensor(committed), features=torch.cat(all_feats)))
            fresh.total_token, fresh.depth, fresh.top_k = 24, 3, 4
            want = fresh.propose(DraftStep(root_token=root, context_len=len(committed)))
            got = drafter.propose(DraftStep(root_token=root, context_len=len(committed)))
            assert got.tokens.tolist() == want.tokens.tolist() and got.parents.tolist() == want.parents.tolist()
            torch.testing.assert_close(got.log_q, want.log_q, atol=1e-5, rtol=0)
            assert drafter.cached_rows == len(committed)
            # a second proposal with another root (never committed) leaves the cache consistent
            drafter.propose(DraftStep(root_token=root + 1, context_len=len(committed)))
            drafter.propose(DraftStep(root_token=root, context_len=len(committed)))


def test_max_depth_limits_the_candidates_and_zero_gives_the_root_alone():
    drafter, target = _bound()
    context = [3, 4, 5, 6]
    drafter.begin(DraftContext(tokens=torch.tensor(context), features=_features(target, drafter, context)))
    assert drafter.propose(DraftStep(root_token=9, context_len=4, max_depth=2)).max_depth == 2
    assert drafter.last_depth == 2
    assert len(drafter.propose(DraftStep(root_token=9, context_len=4, max_depth=0))) == 1
    full = drafter.propose(DraftStep(root_token=9, context_len=4))
    assert len(full) == 60 and drafter.last_depth == 8  # EAGLE-3's defaults: total_token 60, depth 7


def test_the_eagle3_drafter_passes_the_contract_kit():
    check_drafter(_drafter(total_token=16, depth=3, top_k=3), target=HFTarget(_target()))


def test_forks_share_the_network_and_keep_their_own_sequences():
    drafter, target = _bound(total_token=16, depth=2, top_k=3)
    a, b = drafter.fork(), drafter.fork()
    assert a.model is drafter.model and a._embed is drafter._embed
    ctx_a, ctx_b = [3, 4, 5], [7, 8, 9, 10]
    a.begin(DraftContext(tokens=torch.tensor(ctx_a), features=_features(target, drafter, ctx_a)))
    b.begin(DraftContext(tokens=torch.tensor(ctx_b), features=_features(target, drafter, ctx_b)))
    tree_a = a.propose(DraftStep(root_token=12, context_len=3))
    b.propose(DraftStep(root_token=13, context_len=4))
    again = a.propose(DraftStep(root_token=12, context_len=3))
    assert tree_a.tokens.tolist() == again.tokens.tolist() and drafter.cached_rows == 0


# ------------------------------------------------------------------ checkpoints
def _save(tmp_path: Path, model: Eagle3DraftModel | None = None, layout: str = "safeailab", name: str = "eagle3") -> Path:
    return (model or _model()).save_pretrained(tmp_path / name, layout=layout)


def _edit(folder: Path, *, config=None, tensors=None) -> Path:
    from safetensors.torch import load_file, save_file

    if config is not None:
        data = json.loads((folder / "config.json").read_text())
        config(data)
        (folder / "config.json").write_text(json.dumps(data))
    if tensors is not None:
        state = load_file(str(folder / "model.safetensors"))
        tensors(state)
        save_file(state, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("layout", ["safeailab", "vllm"])
def test_both_weight_layouts_load_and_draft_the_same_tree(tmp_path, layout):
    folder = _save(tmp_path, layout=layout)
    from safetensors.torch import load_file

    names = set(load_file(str(folder / "model.safetensors")))
    assert ("layers.0.self_attn.q_proj.weight" in names and "draft_id_to_target_id" in names) == (layout == "vllm")
    assert bastion.registry.drafter_for_checkpoint(str(folder)) == "eagle3"
    target = HFTarget(_target())
    loaded = bastion.registry.create("drafter", "eagle3", checkpoint=str(folder), total_token=20, depth=3, top_k=4)
    loaded.bind(target)
    ours, _ = _bound(total_token=20, depth=3, top_k=4)
    context = _prompts()[0]
    trees = []
    for d in (loaded, ours):
        d.begin(DraftContext(tokens=torch.tensor(context), features=_features(target, d, context)))
        trees.append(d.propose(DraftStep(root_token=5, context_len=len(context))))
    assert trees[0].tokens.tolist() == trees[1].tokens.tolist() and trees[0].parents.tolist() == trees[1].parents.tolist()
    torch.testing.assert_close(trees[0].log_q, trees[1].log_q, atol=0, rtol=0)


def test_from_pretrained_picks_the_eagle3_drafter_for_its_checkpoint_and_decodes_losslessly(tmp_path):
    target_dir = tmp_path / "target"
    _target().save_pretrained(target_dir)
    folder = _save(tmp_path)
    pipe = bastion.Pipeline.from_pretrained(target_dir, folder, max_nodes=12)
    assert isinstance(pipe.drafter, Eagle3Drafter) and pipe.drafter.total_token == 60
    prompt = _prompts()[1]
    assert pipe.generate(torch.tensor([prompt]), max_new_tokens=10).tokens == _reference(tuple(prompt))[:10]


def test_the_token_embedding_is_the_targets_unless_the_checkpoint_stores_one(tmp_path):
    drafter, target = _bound()
    assert drafter._embed is target.input_embeddings()
    own = Eagle3DraftModel(_config(), with_embedding=True)
    folder = own.save_pretrained(tmp_path / "with-embed")
    loaded = Eagle3Drafter(str(folder))
    loaded.bind(target)
    assert loaded._embed is loaded.model.embed_tokens
    torch.testing.assert_close(loaded.model.embed_tokens.weight, own.embed_tokens.weight)


def test_claims_only_eagle3_checkpoints(tmp_path):
    folder = _save(tmp_path)
    assert Eagle3Drafter.claims_checkpoint(folder)
    plain = tmp_path / "plain"
    _target().save_pretrained(plain)
    assert not Eagle3Drafter.claims_checkpoint(plain) and not Eagle3Drafter.claims_checkpoint(tmp_path / "absent")
    # an EAGLE-3 config under a plain architecture name is recognised by its weights
    renamed = _edit(_save(tmp_path, name="renamed", layout="vllm"), config=lambda c: c.update(architectures=["LlamaForCausalLM"]))
    assert Eagle3Drafter.claims_checkpoint(renamed)


def test_a_checkpoint_without_d2t_is_named_when_its_draft_vocabulary_is_smaller(tmp_path):
    folder = _edit(_save(tmp_path), tensors=lambda s: s.pop("d2t"))
    with pytest.raises(InvalidFileError, match=r"eagle3: tensor d2t \(or draft_id_to_target_id\) is missing"):
        Eagle3Drafter(str(folder))
    # with the target's own vocabulary no map is needed
    same = draft_model(_config(draft_vocab_size=VOCAB))
    folder = _edit(same.save_pretrained(tmp_path / "full"), tensors=lambda s: s.pop("d2t"))
    assert Eagle3Drafter(str(folder)).model.d2t.abs().sum() == 0


def test_a_d2t_mapping_outside_the_vocabulary_is_named(tmp_path):
    folder = _edit(_save(tmp_path), tensors=lambda s: s["d2t"].add_(VOCAB))
    with pytest.raises(InvalidFileError, match=r"model.safetensors: tensor d2t maps draft tokens to target ids in \[\d+, \d+\], outside"):
        Eagle3Drafter(str(folder))


def test_an_fc_that_is_not_three_target_hidden_states_wide_is_named(tmp_path):
    folder = _edit(_save(tmp_path), tensors=lambda s: s.update({"fc.weight": s["fc.weight"][:, :128].contiguous()}))
    with pytest.raises(InvalidFileError, match=r"model.safetensors: tensor fc.weight has shape \(64, 128\), config.json gives \(64, 192\) \(\[hidden_size, 3 x target_hidden_size 64\]\)"):
        Eagle3Drafter(str(folder))
    # a checkpoint built for a target of another width loads, and is refused by this target
    wide = Eagle3Drafter(Eagle3DraftModel(_config(target_hidden_size=96)))
    with pytest.raises(IncompatibleComponentsError, match=r"fc reads 288 features \(3 x target_hidden_size 96\) but the target's hidden size is 64"):
        wide.bind(HFTarget(_target()))


def test_a_vocabulary_mismatch_is_named(tmp_path):
    folder = _edit(_save(tmp_path), tensors=lambda s: s.update({"lm_head.weight": s["lm_head.weight"][:200].contiguous()}))
    with pytest.raises(InvalidFileError, match=r"tensor lm_head.weight has shape \(200, 64\), config.json gives \(224, 64\)"):
        Eagle3Drafter(str(folder))
    other = Eagle3Drafter(Eagle3DraftModel(_config(vocab_size=300)))
    with pytest.raises(IncompatibleComponentsError, match=r"target vocabulary 256 != the checkpoint's vocab_size 300"):
        other.bind(HFTarget(_target()))


def test_feature_layers_outside_the_target_are_named(tmp_path):
    named = Eagle3Drafter(Eagle3DraftModel(_config(feature_layer_ids=(1, 3, LAYERS))))
    with pytest.raises(IncompatibleComponentsError, match=r"feature layer ids \[1, 3, 8\] \(eagle_aux_hidden_state_layer_ids\) include \[8\], outside the target's 8 layers"):
        named.bind(HFTarget(_target()))
    default = Eagle3Drafter(Eagle3DraftModel(_config(feature_layer_ids=None)))
    with pytest.raises(IncompatibleComponentsError, match=r"include \[-1\], outside the target's 3 layers"):
        default.bind(HFTarget(tiny_model("llama", seed=0, num_hidden_layers=3, vocab_size=VOCAB)))
    with pytest.raises(InvalidInputError, match="bind\\(target\\) first"):
        default.feature_layers


def test_default_feature_layers_are_the_hidden_states_entering_layers_2_half_and_minus_3():
    assert default_feature_layers(32) == (1, 15, 28)  # HF hidden_states[2], [16], [29]
    drafter = Eagle3Drafter(Eagle3DraftModel(_config(feature_layer_ids=None)))
    drafter.bind(HFTarget(_target()))
    assert drafter.feature_layers == (1, 3, 4)


def test_a_missing_tensor_and_a_bad_config_are_named(tmp_path):
    folder = _edit(_save(tmp_path), tensors=lambda s: s.pop("midlayer.hidden_norm.weight"))
    with pytest.raises(InvalidFileError, match=r"model.safetensors: tensor midlayer.hidden_norm.weight missing"):
        Eagle3Drafter(str(folder))
    folder = _edit(_save(tmp_path, name="two"), config=lambda c: c.update(num_hidden_layers=2))
    with pytest.raises(InvalidFileError, match=r"config.json: field num_hidden_layers is 2"):
        Eagle3Drafter(str(folder))


@pytest.mark.parametrize("bad", [{"total_token": 0}, {"depth": -1}, {"top_k": 1.5}, {"checkpoint": 3}])
def test_bad_options_are_rejected_with_the_option_named(bad):
    kwargs = {"checkpoint": _model(), **bad}
    with pytest.raises(InvalidInputError, match=next(iter(bad))):
        bastion.registry.create("drafter", "eagle3", **kwargs)
