"""HFTarget: prefill, tree forward (4D ancestor mask, depth positions), features and KV compaction."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bastion.core import IncompatibleComponentsError, InvalidInputError, Tree
from bastion.huggingface.causal_lm import HFTarget
from bastion.testing.tiny import tiny_model


ATOL = 1e-4


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model(request):
    return tiny_model(request.param, seed=3)


def _plain_logits(model, ids: list[int]) -> torch.Tensor:  # [L, V]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _random_tree(rng: torch.Generator, n: int, vocab: int) -> Tree:
    parents, tokens, used = [-1], [int(torch.randint(3, vocab, (1,), generator=rng))], set()
    for i in range(1, n):
        while True:
            p = int(torch.randint(0, i, (1,), generator=rng))
            t = int(torch.randint(3, vocab, (1,), generator=rng))
            if (p, t) not in used:
                used.add((p, t))
                break
        parents.append(p)
        tokens.append(t)
    return Tree.from_parents(tokens, parents)


def _assert_cache_equals_prefill(target: HFTarget, model, ids: list[int]) -> None:
    fresh = HFTarget(model)
    fresh.prefill(torch.tensor([ids]))
    assert target.context_len == len(ids)
    for got, want in zip(target.cache.layers, fresh.cache.layers, strict=True):
        assert got.keys.shape == want.keys.shape
        torch.testing.assert_close(got.keys, want.keys, atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=ATOL, rtol=1e-4)


def test_prefill_logits_and_features_match_hf_hidden_states(model):
    target = HFTarget(model)
    ids = torch.randint(3, 256, (1, 9))
    out = target.prefill(ids, feature_layers=(1, 0), all_logits=True)
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    torch.testing.assert_close(out.logits, ref.logits[0], atol=ATOL, rtol=1e-4)
    # requested order is kept; layer i's features are HF hidden_states[i + 1] (last one post-norm)
    want = torch.cat([ref.hidden_states[2][0], ref.hidden_states[1][0]], dim=-1)
    torch.testing.assert_close(out.features, want, atol=ATOL, rtol=1e-4)
    only_first = target.prefill(ids, feature_layers=(0,))
    torch.testing.assert_close(only_first.features, ref.hidden_states[1][0], atol=ATOL, rtol=1e-4)
    assert target.prefill(ids).features is None
    assert target.context_len == 9


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tree_forward_logits_equal_plain_forward_of_each_root_path(attn):
    model = tiny_model("qwen3", seed=5)
    model.config._attn_implementation = attn
    target = HFTarget(model)
    assert target.attn_implementation == attn
    rng = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 256, (12,), generator=rng).tolist()
    target.prefill(torch.tensor([prompt]))
    tree = _random_tree(rng, 14, 256)
    out = target.forward_tree(tree, feature_layers=(0,))
    assert out.logits.shape == (14, 256) and out.features.shape == (14, 64)
    tokens = tree.tokens.tolist()
    for node in range(len(tree)):
        path_ids = prompt + [tokens[i] for i in tree.path(node)]
        torch.testing.assert_close(out.logits[node], _plain_logits(model, path_ids)[-1], atol=ATOL, rtol=1e-4)


@settings(max_examples=12)
@given(n=st.integers(1, 12), seed=st.integers(0, 10_000), ctx=st.integers(1, 20))
def test_commit_leaves_cache_equal_to_fresh_prefill_of_committed_sequence(n, seed, ctx):
    model = _hyp_model()
    rng = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 256, (ctx,), generator=rng).tolist()
    target = HFTarget(model)
    target.prefill(torch.tensor([prompt]))
    tree = _random_tree(rng, n, 256)
    target.forward_tree(tree)
    leaf = int(torch.randint(0, n, (1,), generator=rng))
    path = tree.path(leaf)
    target.commit(torch.tensor(path))
    committed = prompt + [tree.tokens.tolist()[i] for i in path]
    _assert_cache_equals_prefill(target, model, committed)


_HYP_MODEL = {}


def _hyp_model():
    if "m" not in _HYP_MODEL:
        _HYP_MODEL["m"] = tiny_model("llama", seed=7)
    return _HYP_MODEL["m"]


def test_repeated_tree_steps_keep_cache_consistent_and_drop_uncommitted_trees(model):
    target = HFTarget(model)
    rng = torch.Generator().manual_seed(1)
    committed = torch.randint(3, 256, (6,), generator=rng).tolist()
    target.prefill(torch.tensor([committed]))
    for step in range(4):
        tree = _random_tree(rng, 9, 256)
        if step == 2:  # a tree forwarded but never committed is dropped by the next forward
            target.forward_tree(_random_tree(rng, 5, 256))
        target.forward_tree(tree)
        path = tree.path(int(torch.randint(0, 9, (1,), generator=rng)))
        target.commit(torch.tensor(path))
        committed += [tree.tokens.tolist()[i] for i in path]
        _assert_cache_equals_prefill(target, model, committed)


def test_commit_of_a_chain_prefix_moves_nothing_and_stays_consistent(model):
    target = HFTarget(model)
    prompt = [5, 6, 7]
    target.prefill(torch.tensor([prompt]))
    tree = Tree.from_parents([9, 10, 11, 12], [-1, 0, 1, 2])
    target.forward_tree(tree)
    target.commit(torch.tensor([0, 1]))
    _assert_cache_equals_prefill(target, model, prompt + [9, 10])


def test_tied_embeddings_share_weights_and_decode_like_hf():
    model = tiny_model("llama", seed=2, tie_word_embeddings=True)
    target = HFTarget(model)
    assert target.output_head().weight.data_ptr() == target.input_embeddings().weight.data_ptr()
    ids = torch.randint(3, 256, (1, 7))
    out = target.prefill(ids, all_logits=True)
    torch.testing.assert_close(out.logits, _plain_logits(model, ids[0].tolist()), atol=ATOL, rtol=1e-4)
    assert target.vocab_size == 256


def test_untied_target_exposes_separate_head_and_config_facts(tiny_qwen3_dir):
    target = HFTarget.from_pretrained(tiny_qwen3_dir, device="cpu", dtype=torch.float32)
    assert target.output_head().weight.data_ptr() != target.input_embeddings().weight.data_ptr()
    assert target.max_positions == 512
    assert 2 in target.eos_token_ids
    assert target.device.type == "cpu" and target.dtype == torch.float32
    assert target.num_layers == 2 and target.hidden_size == 64


def test_eos_ids_merge_generation_config_and_config(model):
    model.generation_config.eos_token_id = [2, 7]
    try:
        assert HFTarget(model).eos_token_ids == frozenset({2, 7})
    finally:
        model.generation_config.eos_token_id = 2


@pytest.mark.parametrize("impl", ["flash_attention_2", "flex_attention", "paged_attention"])
def test_attention_that_ignores_custom_masks_is_refused(tiny_qwen3_dir, impl):
    with pytest.raises(IncompatibleComponentsError, match="custom tree attention mask"):
        HFTarget.from_pretrained(tiny_qwen3_dir, attn_implementation=impl)


def test_wrapping_a_model_configured_for_flash_attention_is_refused():
    model = tiny_model("qwen3")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(IncompatibleComponentsError, match="sdpa"):
        HFTarget(model)


def test_bad_calls_raise_clear_errors(model):
    target = HFTarget(model)
    with pytest.raises(InvalidInputError, match="prefill"):
        target.forward_tree(Tree.from_parents([3], [-1]))
    with pytest.raises(InvalidInputError, match="empty"):
        target.prefill(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(InvalidInputError, match="at most 512"):
        target.prefill(torch.ones(1, 513, dtype=torch.long))
    with pytest.raises(IncompatibleComponentsError, match="out of range"):
        target.prefill(torch.ones(1, 3, dtype=torch.long), feature_layers=(2,))
    target.prefill(torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(InvalidInputError, match="pending tree"):
        target.commit(torch.tensor([0]))
    target.forward_tree(Tree.from_parents([3, 4, 5], [-1, 0, 0]))
    with pytest.raises(InvalidInputError, match="root"):
        target.commit(torch.tensor([1, 2]))
    with pytest.raises(InvalidInputError, match="1-D tensor"):
        target.commit(torch.tensor([0, 1, 2, 3]))


def test_prefill_computes_logits_for_the_last_position_only_unless_asked():
    model = tiny_model("qwen3", seed=5)
    target = HFTarget(model)
    ids = torch.randint(3, 256, (1, 9))
    last = target.prefill(ids, feature_layers=(0,))
    full = target.prefill(ids, feature_layers=(0,), all_logits=True)
    assert last.logits.shape == (1, target.vocab_size) and full.logits.shape == (9, target.vocab_size)
    torch.testing.assert_close(last.logits[0], full.logits[-1], atol=ATOL, rtol=1e-4)
    assert last.features.shape[0] == 9  # features stay per position: the drafter reads them all


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) for m in model.modules())


def test_features_of_every_layer_and_the_last_equal_hf_hidden_states_through_kept_hooks():
    model = tiny_model("qwen3", seed=6)
    target = HFTarget(model)
    n_layers = model.config.num_hidden_layers
    ids = torch.randint(3, 256, (1, 7))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    base = _hooks(model)  # Hugging Face's own (it installs its output recorders at the first forward)
    everything = tuple(range(n_layers))[::-1]  # the last layer first: HF's final-norm output
    for _ in range(2):  # the hooks registered at the first call serve the second
        out = target.prefill(ids, feature_layers=everything)
        want = torch.cat([ref.hidden_states[i + 1][0] for i in everything], dim=-1)
        torch.testing.assert_close(out.features, want, atol=ATOL, rtol=1e-4)
    assert _hooks(model) - base == n_layers  # one per tapped module, not one per call
    HFTarget(model).prefill(ids, feature_layers=everything)  # a second target over the model shares them
    assert _hooks(model) - base == n_layers
    out = target.prefill(ids, feature_layers=(0,))  # another layer set replaces the hooks
    torch.testing.assert_close(out.features, ref.hidden_states[1][0], atol=ATOL, rtol=1e-4)
    assert _hooks(model) - base == 1
    with torch.no_grad():  # disarmed hooks leave the model's own forward as it was
        torch.testing.assert_close(model(ids).logits, ref.logits, atol=ATOL, rtol=1e-4)


def test_a_model_without_a_final_norm_attribute_reads_the_last_layer_from_hf_hidden_states():
    model = tiny_model("qwen3", seed=4)
    target = HFTarget(model)
    target._final_norm = None  # as for a decoder whose final norm is not at ``.norm``
    last = model.config.num_hidden_layers - 1
    ids = torch.randint(3, 256, (1, 5))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True)
    out = target.prefill(ids, feature_layers=(last, 0))
    want = torch.cat([ref.hidden_states[last + 1][0], ref.hidden_states[1][0]], dim=-1)
    torch.testing.assert_close(out.features, want, atol=ATOL, rtol=1e-4)


def test_a_model_that_served_features_still_pickles_and_its_deep_copy_reads_its_own_features():
    import copy
    import io

    model = tiny_model("qwen3", seed=8)
    ids = torch.randint(3, 256, (1, 6))
    layers = tuple(range(model.config.num_hidden_layers))
    first = HFTarget(model).prefill(ids, feature_layers=layers).features
    buffer = io.BytesIO()
    torch.save(model, buffer)  # the kept hooks do not stop a whole-model save
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)  # a different model: its features must be its own
        ref = twin(ids, output_hidden_states=True)
    got = HFTarget(twin).prefill(ids, feature_layers=layers).features
    want = torch.cat([ref.hidden_states[i + 1][0] for i in layers], dim=-1)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    again = HFTarget(model).prefill(ids, feature_layers=layers).features  # the original is untouched
    torch.testing.assert_close(again, first, atol=ATOL, rtol=1e-4)
