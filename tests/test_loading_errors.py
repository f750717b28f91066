"""Loading a target: broken weights, configs and tokenizers are named with the real cause; a device the
machine does not have is refused with what to use instead."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import bastion
from bastion.core import IncompatibleComponentsError, InvalidFileError, InvalidInputError
from bastion.huggingface.causal_lm import HFTarget
from bastion.testing.tiny import save_tiny_target

DEMO_TARGET = Path(bastion.__file__).parent / "demo" / "assets" / "target"


@pytest.fixture
def target_dir(tmp_path: Path) -> Path:
    return save_tiny_target(tmp_path / "target", "qwen3", seed=0)


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbled"])
def test_broken_target_weights_name_the_file(target_dir: Path, damage: str) -> None:
    weights = target_dir / "model.safetensors"
    blob = weights.read_bytes()
    weights.write_bytes({"truncated": blob[: len(blob) // 3], "empty": b"", "garbled": b"\x07" * 4096}[damage])
    with pytest.raises(InvalidFileError, match="model.safetensors"):
        HFTarget.from_pretrained(target_dir)


def test_non_json_target_config_names_the_file(target_dir: Path) -> None:
    (target_dir / "config.json").write_text("{ not json")
    with pytest.raises(InvalidFileError, match="config.json"):
        HFTarget.from_pretrained(target_dir)


def test_target_path_that_does_not_exist_is_an_invalid_input(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="cannot load the target model"):
        HFTarget.from_pretrained(tmp_path / "no" / "such" / "model")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_says_what_to_use(target_dir: Path) -> None:
    with pytest.raises(InvalidInputError, match='no CUDA device; use device="cpu"'):
        HFTarget.from_pretrained(target_dir, device="cuda")


def test_unknown_device_name_is_an_invalid_input(target_dir: Path) -> None:
    with pytest.raises(InvalidInputError, match="unknown device 'gpu0'"):
        HFTarget.from_pretrained(target_dir, device="gpu0")


def _pipeline(target_dir: Path) -> bastion.Pipeline:
    from bastion.testing.drafters import NoisyOracleDrafter
    from bastion.testing.tiny import tiny_model

    return bastion.Pipeline.from_pretrained(target_dir, NoisyOracleDrafter(tiny_model("qwen3", seed=0), block_size=2))


def test_target_without_tokenizer_files_has_no_tokenizer(target_dir: Path) -> None:
    pipe = _pipeline(target_dir)
    assert pipe.tokenizer is None
    with pytest.raises(InvalidInputError, match="no tokenizer"):
        pipe.encode("hello")


def test_corrupt_tokenizer_reports_the_real_load_error(target_dir: Path) -> None:
    shutil.copy(DEMO_TARGET / "tokenizer_config.json", target_dir)
    (target_dir / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    with pytest.raises(InvalidFileError, match="tokenizer files in .* cannot be loaded") as err:
        _pipeline(target_dir)
    assert "no tokenizer" not in str(err.value)


def test_tokenizer_with_ids_outside_the_target_vocabulary_is_refused(target_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_TARGET / name, target_dir)  # a real tokenizer, far wider than the tiny model's 256
    with pytest.raises(IncompatibleComponentsError, match=r"outside the target's vocabulary \[0, 256\)"):
        _pipeline(target_dir)


def test_demo_pair_tokenizer_passes_the_vocabulary_check() -> None:
    pipe = bastion.Pipeline.demo()
    assert pipe.tokenizer is not None and len(pipe.encode("Hello")[0]) > 0


@pytest.mark.parametrize("name,dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16), ("torch.float16", torch.float16), ("auto", None)])
def test_dtype_names_bastion_accepts_load_a_target_in_that_dtype(target_dir: Path, name: str, dtype) -> None:
    target = HFTarget.from_pretrained(target_dir, dtype=name)
    assert target.dtype == (dtype or next(iter(target.model.parameters())).dtype)


def test_an_unknown_dtype_name_is_an_invalid_input(target_dir: Path) -> None:
    with pytest.raises(InvalidInputError, match="unknown dtype 'float13'"):
        HFTarget.from_pretrained(target_dir, dtype="float13")
