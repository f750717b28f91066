"""Checkpoint files bastion reads: unsafe shard paths are refused, the config is checked against the
weights' headers before anything is built, and broken files give errors naming the file and the field."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from bastion.contract.errors import IncompatibleComponentsError, InvalidFileError, InvalidInputError
from bastion.drafters.dflash import DFlashConfig, DFlashDraftModel
from bastion.drafters.dflash.checkpoint import load_dflash_state_dict

INDEX = "model.safetensors.index.json"


def _config() -> DFlashConfig:
    return DFlashConfig(
        hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, vocab_size=32, block_size=4, num_target_layers=3, target_layer_ids=(0, 2), mask_token_id=31,
    )


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    return DFlashDraftModel(_config()).save_pretrained(tmp_path / "ckpt")


def _shard(ckpt: Path, index_map: dict) -> None:
    (ckpt / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": index_map}))


@pytest.fixture
def no_layer_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building any draft layer fails the test: the check must come before construction."""
    from bastion.drafters.dflash import model as model_mod

    def refuse(*_a, **_k):
        raise AssertionError("a DFlash layer was built before the config was checked against the weights")

    monkeypatch.setattr(model_mod.DFlashLayer, "__init__", refuse)


# ------------------------------------------------------------------ index files
@pytest.mark.parametrize("shard", ["/etc/hostname", "../outside/model.safetensors", "sub/../../outside/model.safetensors"])
def test_index_naming_a_shard_outside_the_checkpoint_folder_is_refused(ckpt: Path, shard: str) -> None:
    outside = ckpt.parent / "outside"
    outside.mkdir(exist_ok=True)
    (ckpt / "model.safetensors").rename(outside / "model.safetensors")  # so the escape would really load
    _shard(ckpt, {"fc.weight": shard})
    with pytest.raises(InvalidFileError, match=INDEX) as err:
        load_dflash_state_dict(ckpt)
    assert "outside the checkpoint folder" in str(err.value) and shard in str(err.value)


def test_index_without_weight_map_names_the_file_and_the_field(ckpt: Path) -> None:
    (ckpt / INDEX).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(InvalidFileError, match=f"{INDEX}.*weight_map"):
        DFlashDraftModel.from_pretrained(ckpt)


@pytest.mark.parametrize("text", ["not json {", "[1, 2]", '{"weight_map": {"fc.weight": 3}}'])
def test_garbled_or_wrong_typed_index_names_the_file(ckpt: Path, text: str) -> None:
    (ckpt / INDEX).write_text(text)
    with pytest.raises(InvalidFileError, match=INDEX):
        DFlashDraftModel.from_pretrained(ckpt)


def test_sharded_checkpoint_inside_the_folder_loads(ckpt: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(ckpt / "model.safetensors"))
    (ckpt / "model.safetensors").unlink()
    (ckpt / "shards").mkdir()
    names = sorted(state)
    half = len(names) // 2
    save_file({k: state[k] for k in names[:half]}, str(ckpt / "shards" / "a.safetensors"))
    save_file({k: state[k] for k in names[half:]}, str(ckpt / "b.safetensors"))
    _shard(ckpt, {**{k: "shards/a.safetensors" for k in names[:half]}, **{k: "b.safetensors" for k in names[half:]}})
    model = DFlashDraftModel.from_pretrained(ckpt)
    for k, v in state.items():
        assert torch.equal(model.state_dict()[k], v)


# ------------------------------------------------------------------ config vs weights
def test_absurd_layer_count_is_refused_before_any_layer_is_built(ckpt: Path, no_layer_built: None) -> None:
    data = json.loads((ckpt / "config.json").read_text())
    data["num_hidden_layers"] = 10**7
    data["layer_types"] = ["full_attention"]
    (ckpt / "config.json").write_text(json.dumps(data))
    start = time.perf_counter()
    with pytest.raises(IncompatibleComponentsError, match="num_hidden_layers") as err:
        DFlashDraftModel.from_pretrained(ckpt)
    assert "10000000" in str(err.value) and "2" in str(err.value)
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize(
    "field,value,weight",
    [("hidden_size", 4096, "norm.weight"), ("intermediate_size", 10**6, "mlp.gate_proj.weight"),
     ("num_attention_heads", 4, "q_proj.weight")],
)
def test_config_sizes_disagreeing_with_the_weight_headers_are_refused_before_building(
    ckpt: Path, no_layer_built: None, field: str, value: int, weight: str
) -> None:
    data = json.loads((ckpt / "config.json").read_text())
    data[field] = value
    (ckpt / "config.json").write_text(json.dumps(data))
    with pytest.raises(IncompatibleComponentsError, match=weight):
        DFlashDraftModel.from_pretrained(ckpt)


def test_expected_weight_shapes_match_the_built_model() -> None:
    from bastion.drafters.dflash.model import expected_weight_shapes

    for cfg in (_config(), DFlashConfig.from_dict({**_config().to_dict(), "attention_bias": True, "num_hidden_layers": 3})):
        model = DFlashDraftModel(cfg)
        assert expected_weight_shapes(cfg) == {k: tuple(v.shape) for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ broken files
@pytest.mark.parametrize("damage", ["truncated", "empty", "garbled", "header-only"])
def test_broken_safetensors_names_the_file(ckpt: Path, damage: str) -> None:
    weights = ckpt / "model.safetensors"
    blob = weights.read_bytes()
    broken = {
        "truncated": blob[: len(blob) // 2],
        "empty": b"",
        "garbled": bytes(range(256)) * 8,
        "header-only": blob[:8] + b"{not json" + blob[17:64],
    }[damage]
    weights.write_bytes(broken)
    with pytest.raises(InvalidFileError, match="model.safetensors"):
        DFlashDraftModel.from_pretrained(ckpt)


@pytest.mark.parametrize(
    "text,field",
    [("{oops", None), ("[]", None), ('{"hidden_size": "big"}', "hidden_size")],
)
def test_non_json_or_wrong_typed_config_names_the_file_and_field(ckpt: Path, text: str, field: str | None) -> None:
    if field is not None:
        data = json.loads((ckpt / "config.json").read_text())
        data.update(json.loads(text))
        text = json.dumps(data)
    (ckpt / "config.json").write_text(text)
    with pytest.raises(InvalidFileError, match="config.json") as err:
        DFlashDraftModel.from_pretrained(ckpt)
    if field is not None:
        assert field in str(err.value)


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 2.5), ("block_size", True), ("target_layer_ids", "0,2"),
                                         ("rms_norm_eps", "tiny"), ("dflash_config", [1])])
def test_wrong_typed_config_fields_are_named(field: str, value: object) -> None:
    data = _config().to_dict()
    if field == "target_layer_ids":
        data["dflash_config"] = {**data["dflash_config"], field: value}
    else:
        data[field] = value
    with pytest.raises(InvalidInputError, match=field):
        DFlashConfig.from_dict(data)
