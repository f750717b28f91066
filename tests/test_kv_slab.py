"""The preallocated cache layer behaves like transformers' DynamicLayer, but fills storage in place."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.cache_utils import DynamicLayer

from bastion.huggingface.causal_lm import HFTarget
from bastion.huggingface.kv_slab import SlabLayer
from bastion.contract.tree import Tree
from bastion.testing.tiny import tiny_model


def test_slab_layer_matches_dynamic_layer_under_random_updates_and_crops() -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    slab, plain = SlabLayer(), DynamicLayer()
    for _ in range(60):
        if rng.random() < 0.7 or plain.get_seq_length() == 0:
            n = rng.randint(1, 300)  # sometimes past the spare capacity: storage must grow
            k, v = torch.randn(1, 2, n, 8, generator=gen), torch.randn(1, 2, n, 8, generator=gen)
            got, want = slab.update(k, v), plain.update(k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        else:
            drop = -rng.randint(1, plain.get_seq_length())
            slab.crop(drop)
            plain.crop(drop)
        assert slab.get_seq_length() == plain.get_seq_length()
        assert torch.equal(slab.keys, plain.keys) and torch.equal(slab.values, plain.values)


def test_target_verify_steps_reuse_the_cache_storage_instead_of_copying_the_context() -> None:
    target = HFTarget(tiny_model("qwen3", seed=0))
    target.prefill(torch.randint(3, 200, (1, 40)))
    layer = target.cache.layers[0]
    assert isinstance(layer, SlabLayer)
    storage = layer.keys.data_ptr()
    for step in range(20):
        tree = Tree.from_parents(torch.randint(3, 200, (5,)), [-1, 0, 0, 1, 3])
        target.forward_tree(tree)
        target.commit(torch.tensor([0, 1, 3]) if step % 2 else torch.tensor([0]))
        assert layer.keys.data_ptr() == storage  # same slab: no per-step concatenation of the context


def _fresh_mask(ancestors: torch.Tensor, ctx: int, dtype: torch.dtype) -> torch.Tensor:
    """The tree mask written out independently: context visible, tree part ancestor-only."""
    n = ancestors.shape[0]
    mask = torch.zeros(1, 1, n, ctx + n, dtype=dtype)
    mask[0, 0, :, ctx:][~ancestors] = torch.finfo(dtype).min
    return mask


def test_tree_mask_buffer_is_reused_across_steps_and_always_equals_a_fresh_mask() -> None:
    target = HFTarget(tiny_model("qwen3", seed=0))
    target.prefill(torch.randint(3, 200, (1, 30)))
    rng = random.Random(1)
    storage = None
    for step in range(25):
        n = rng.randint(2, 12)
        parents = [-1] + [rng.randrange(i) for i in range(1, n)]
        tree = Tree.from_parents(torch.randint(3, 200, (n,)), parents)
        ctx = target.context_len
        mask = target._tree_mask(tree.ancestor_mask(), ctx)
        assert torch.equal(mask, _fresh_mask(tree.ancestor_mask(), ctx, target.dtype))
        if step:
            assert mask.data_ptr() == storage  # one persistent buffer
        storage = mask.data_ptr()
        target.forward_tree(tree)
        target.commit(torch.tensor([0]))


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 6), st.integers(0, 9), st.data())
def test_keeping_ascending_rows_in_place_equals_selecting_them_and_later_updates_land_alike(batch, length, data) -> None:
    """``keep_rows`` (in place, filled slots only) leaves the same keys and values as HF's
    ``batch_select_indices`` (a copy of every row's whole capacity), and the next update and crop act alike."""
    rows = sorted(data.draw(st.sets(st.integers(0, batch - 1), min_size=1)))
    gen = torch.Generator().manual_seed(batch * 31 + length)
    moved, selected = SlabLayer(), SlabLayer()
    for layer in (moved, selected):
        k = torch.randn(batch, 2, length + 1, 4, generator=torch.Generator().manual_seed(7))
        layer.update(k, k + 1)
    moved.keep_rows(rows)
    selected.batch_select_indices(torch.tensor(rows))
    assert torch.equal(moved.keys, selected.keys) and torch.equal(moved.values, selected.values)
    new = torch.randn(len(rows), 2, 3, 4, generator=gen)
    for layer in (moved, selected):
        layer.update(new, new * 2)
        layer.crop(-1)
    assert torch.equal(moved.keys, selected.keys) and torch.equal(moved.values, selected.values)
    assert moved.keys.shape == (len(rows), 2, length + 3, 4)


def test_keeping_rows_out_of_order_or_outside_the_batch_is_refused() -> None:
    layer = SlabLayer()
    k = torch.zeros(3, 1, 2, 4)
    layer.update(k, k)
    for rows in ([1, 0], [0, 0], [3], [-1, 2]):
        with pytest.raises(ValueError):
            layer.keep_rows(rows)
