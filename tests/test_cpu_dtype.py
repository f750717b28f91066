"""dtype ``auto`` on a CPU: a float16 checkpoint computes in float32 (CPUs have no fast float16
arithmetic), a named dtype is kept, the choice is logged with its reason; loads never read
transformers' deprecated ``torch_dtype`` field."""

from __future__ import annotations

import logging

import pytest
import torch

import bastion
from bastion.utils.dtypes import auto_dtype
from bastion.huggingface.configs import DecoderShape, config_dtype
from bastion.huggingface.causal_lm import HFTarget
from bastion.demo import demo_paths
from bastion.training.frozen import load_frozen_target


def test_auto_dtype_upcasts_only_float16_and_only_on_a_cpu() -> None:
    assert auto_dtype(torch.float16, "cpu").dtype == torch.float32
    assert auto_dtype("float16", "cpu").dtype == torch.float32
    assert "float16" in auto_dtype(torch.float16, "cpu").reason
    for stored in (torch.float32, torch.bfloat16, None):
        assert auto_dtype(stored, "cpu").dtype is None  # the checkpoint's own
    assert auto_dtype(torch.float16, "cuda").dtype is None  # GPUs compute float16 natively
    assert auto_dtype(torch.float16, "meta").dtype is None


def test_dtype_auto_loads_the_float16_demo_target_in_float32_on_a_cpu_and_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="bastion"):
        target = HFTarget.from_pretrained(demo_paths().target, dtype="auto")
    assert target.dtype == torch.float32
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("bastion")]
    assert len(lines) == 1 and "float32" in lines[0] and "float16" in lines[0]


def test_a_named_dtype_is_kept_on_a_cpu() -> None:
    assert HFTarget.from_pretrained(demo_paths().target, dtype="float16").dtype == torch.float16
    assert HFTarget.from_pretrained(demo_paths().target, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_from_pretrained_on_the_demo_paths_verifies_in_the_demo_pipelines_float32() -> None:
    paths = demo_paths()
    pipe = bastion.Pipeline.from_pretrained(paths.target, paths.drafter)
    demo = bastion.Pipeline.demo()
    assert pipe.target.dtype == demo.target.dtype == torch.float32
    assert pipe.drafter.model.dtype == torch.float32  # the target's (the demo's own drafter option aside)
    prompt = pipe.encode_chat([{"role": "user", "content": "What is 2+3?"}])
    assert pipe.generate(prompt, max_new_tokens=16).tokens == demo.generate(prompt, max_new_tokens=16).tokens


def test_drafters_loaded_with_dtype_auto_compute_a_float16_checkpoint_in_float32_on_a_cpu() -> None:
    from bastion.demo import demo_drafter

    dflash = bastion.registry.create("drafter", "dflash", checkpoint=demo_drafter("dflash"), dtype="auto")
    assert dflash.model.dtype == torch.float32
    named = bastion.registry.create("drafter", "dflash", checkpoint=demo_drafter("dflash"), dtype="float16")
    assert named.model.dtype == torch.float16
    model = bastion.registry.create("drafter", "model", checkpoint=demo_drafter("model"), device="cpu", dtype=None)
    assert model.model.dtype == torch.float32


def test_trainings_frozen_target_computes_a_float16_checkpoint_in_float32_on_a_cpu() -> None:
    model = load_frozen_target(demo_paths().target, "cpu", "auto")
    assert next(model.parameters()).dtype == torch.float32
    assert next(load_frozen_target(demo_paths().target, "cpu", "float16").parameters()).dtype == torch.float16


def test_config_dtype_reads_the_old_torch_dtype_key_of_a_plain_dict_only() -> None:
    assert config_dtype({"torch_dtype": "bfloat16"}) == "bfloat16"
    assert config_dtype({"dtype": "float16", "torch_dtype": "bfloat16"}) == "float16"
    assert config_dtype({}) is None


def test_loading_the_demo_pair_never_reads_the_deprecated_torch_dtype_field(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers warns "`torch_dtype` is deprecated" when a config's ``torch_dtype`` alias is read
    (once per process, so a recorder on the alias stands in for the warning)."""
    from transformers import PretrainedConfig

    reads: list[str] = []
    alias = PretrainedConfig.torch_dtype

    def record(config: PretrainedConfig) -> object:
        reads.append(type(config).__name__)
        return alias.fget(config)

    monkeypatch.setattr(PretrainedConfig, "torch_dtype", property(record))
    paths = demo_paths()
    pipe = bastion.Pipeline.from_pretrained(paths.target, paths.drafter)
    DecoderShape.from_config(pipe.target.config)
    bastion.Pipeline.demo(drafter="model")
    assert reads == []


@pytest.mark.parametrize(("flags", "expected"), [((), torch.float32), (("--dtype", "auto"), torch.float32),
                                                 (("--dtype", "float16"), torch.float16)])
def test_calibrate_loads_the_target_as_pipelines_do_dtype_auto_by_default(monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...], expected: torch.dtype) -> None:
    import bastion.controllers.latency.calibrate as cal
    from bastion.cli.main import main
    from bastion.contract.errors import InvalidInputError

    seen: list[torch.dtype] = []

    def record(target: HFTarget, *_args: object, **_kwargs: object) -> None:
        seen.append(target.dtype)
        raise InvalidInputError("measured nothing")

    monkeypatch.setattr(cal, "calibrate", record)
    assert main(["calibrate", "--no-save", "--no-plot", *flags]) == 2
    assert seen == [expected]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_the_python_api_says_device_cpu_in_python() -> None:
    from bastion.contract.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match='use device="cpu"') as info:
        HFTarget.from_pretrained(demo_paths().target, device="cuda")
    assert "use --device" not in str(info.value)
