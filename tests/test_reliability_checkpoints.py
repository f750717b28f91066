"""Checkpoints are complete or refused before any decode: a target or drafter whose weights lack a tensor,
hold one the model does not have, store a floating weight as integers or bools, disagree in shape or hold
NaN is an ``InvalidFileError`` naming the file and the tensor; a config that would allocate beyond a bound
names the field and the memory it would need. Before these checks each case loaded with random weights,
cast silently, blamed the drafter, or allocated gigabytes."""

from __future__ import annotations

import time

import pytest
import torch
from safetensors.torch import load_file

from bastion.core import BastionError, InvalidFileError, InvalidInputError
from bastion.huggingface.causal_lm import HFTarget
from bastion.contract.registry import registry
from bastion.testing.tiny import mutated_copy


def _drop(name):
    return lambda s: {k: v for k, v in s.items() if k != name}


# ------------------------------------------------------------------ target weights
@pytest.mark.parametrize(
    "weights,tensor",
    [
        (_drop("lm_head.weight"), "lm_head.weight"),
        (_drop("model.norm.weight"), "model.norm.weight"),
        (lambda s: {**s, "model.extra.weight": torch.zeros(3)}, "model.extra.weight"),
        (lambda s: {**s, "model.norm.weight": torch.ones(7)}, "model.norm.weight"),
        (lambda s: {k: v.to(torch.int64) for k, v in s.items()}, "int64"),
        (lambda s: {**s, "model.norm.weight": s["model.norm.weight"].bool()}, "model.norm.weight"),
    ],
    ids=["no-lm-head", "no-norm", "unexpected", "shape", "int64", "bool"],
)
def test_incomplete_or_wrong_target_weights_are_refused_naming_file_and_tensor(pair, tmp_path, weights, tensor) -> None:
    target = mutated_copy(pair.target, tmp_path / "t", weights=weights)
    with pytest.raises(InvalidFileError, match="model.safetensors") as err:
        HFTarget.from_pretrained(target)
    assert tensor in str(err.value)
    assert "ignore_mismatched_sizes" not in str(err.value)


def test_tied_target_without_lm_head_still_loads(tmp_path) -> None:
    from bastion.testing.tiny import save_tiny_target

    target = save_tiny_target(tmp_path / "tied", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(target / "model.safetensors"))
    HFTarget.from_pretrained(target)


def test_nan_target_weights_blame_the_target(pair, tmp_path) -> None:
    def nan(s):
        w = s["model.layers.0.mlp.down_proj.weight"].clone()
        w[0, 0] = float("nan")
        return {**s, "model.layers.0.mlp.down_proj.weight": w}

    target = mutated_copy(pair.target, tmp_path / "t", weights=nan)
    with pytest.raises(InvalidFileError, match="model.layers.0.mlp.down_proj.weight") as err:
        HFTarget.from_pretrained(target)
    assert "model.safetensors" in str(err.value) and "NaN" in str(err.value)


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 10**6), ("intermediate_size", 10**9), ("vocab_size", 10**10)])
def test_absurd_target_config_is_refused_before_building(pair, tmp_path, field, value) -> None:
    def grow(c):
        c[field] = value
        c.pop("layer_types", None)

    target = mutated_copy(pair.target, tmp_path / "t", config=grow)
    start = time.perf_counter()
    with pytest.raises(InvalidFileError, match=field) as err:
        HFTarget.from_pretrained(target)
    assert "config.json" in str(err.value) and "GB" in str(err.value)
    assert time.perf_counter() - start < 10.0


@pytest.mark.parametrize("field,value", [("num_attention_heads", 0), ("hidden_size", -4), ("num_hidden_layers", "2")])
def test_non_positive_target_config_sizes_name_the_field(pair, tmp_path, field, value) -> None:
    def bad(c):
        c[field] = value
        c.pop("head_dim", None)

    target = mutated_copy(pair.target, tmp_path / "t", config=bad)
    with pytest.raises(InvalidFileError, match=field) as err:
        HFTarget.from_pretrained(target)
    assert "config.json" in str(err.value)


# ------------------------------------------------------------------ DFlash drafters
def _dflash(path, **kw):
    return registry.create("drafter", "dflash", checkpoint=str(path), **kw)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.int8])
def test_dflash_weights_stored_as_integers_or_bools_are_refused(pair, tmp_path, dtype) -> None:
    drafter = mutated_copy(pair.drafter, tmp_path / "d", weights=lambda s: {k: v.to(dtype) for k, v in s.items()})
    with pytest.raises(InvalidFileError, match="model.safetensors") as err:
        _dflash(drafter)
    assert "fc.weight" in str(err.value) or "layers.0" in str(err.value)


def test_dflash_huge_block_size_is_refused_naming_field_and_memory(pair, tmp_path) -> None:
    def big(c):
        c["block_size"] = 10**9

    drafter = mutated_copy(pair.drafter, tmp_path / "d", config=big)
    with pytest.raises(InvalidFileError, match="block_size") as err:
        _dflash(drafter)
    assert "config.json" in str(err.value) and "GB" in str(err.value)


def test_dflash_zero_heads_names_the_field(pair, tmp_path) -> None:
    def zero(c):
        c["num_attention_heads"] = 0
        c.pop("head_dim")

    drafter = mutated_copy(pair.drafter, tmp_path / "d", config=zero)
    with pytest.raises(InvalidFileError, match="num_attention_heads"):
        _dflash(drafter)


@pytest.mark.parametrize("blob", [b'{"hidden', b"", b"[1, 2]", b"\x00\xff\xfe\x01"], ids=["truncated", "empty", "array", "binary"])
def test_broken_drafter_config_names_the_file_when_the_pipeline_resolves_it(pair, tmp_path, blob) -> None:
    drafter = mutated_copy(pair.drafter, tmp_path / "d")
    (drafter / "config.json").write_bytes(blob)
    with pytest.raises(InvalidFileError, match="config.json"):
        registry.drafter_for_checkpoint(str(drafter))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("name", ["dflash", "model"])
def test_drafter_on_cuda_without_cuda_is_a_bastion_error(pair, name) -> None:
    path = pair.drafter if name == "dflash" else pair.target
    with pytest.raises(InvalidInputError, match="no CUDA device"):
        registry.create("drafter", name, checkpoint=str(path), device="cuda")


def test_model_drafter_refuses_a_dflash_folder(pair) -> None:
    with pytest.raises(InvalidFileError, match="DFlash") as err:
        registry.create("drafter", "model", checkpoint=str(pair.drafter))
    assert "config.json" in str(err.value)


def test_model_drafter_refuses_incomplete_weights(pair, tmp_path) -> None:
    target = mutated_copy(pair.target, tmp_path / "t", weights=_drop("model.embed_tokens.weight"))
    with pytest.raises(InvalidFileError, match="model.embed_tokens.weight"):
        registry.create("drafter", "model", checkpoint=str(target))


# ------------------------------------------------------------------ options
def test_option_typo_is_a_bastion_error_and_a_type_error(pair) -> None:
    with pytest.raises(BastionError, match="bad_option") as err:
        registry.create("drafter", "dflash", checkpoint=str(pair.drafter), bad_option=1)
    assert isinstance(err.value, TypeError)
    with pytest.raises(TypeError, match="bad_option"):
        registry.create("tree_builder", "best-first", bad_option=1)
