"""The training recipe end to end at --smoke size, from an empty folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bastion.cli.main import main



@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    out = tmp_path_factory.mktemp("recipe")
    code = main(["train", "all", "--smoke", "--out", str(out), "--data-dir", str(shared_data), "--threads", "1"])
    assert code == 0
    return out


def test_smoke_recipe_writes_every_stage(smoke_run: Path) -> None:
    for rel in ("tokenizer/tokenizer.json", "target/config.json", "target/model.safetensors", "distill.pt",
                "drafter/config.json", "drafter/model.safetensors", "export/target/model.safetensors",
                "export/drafter/model.safetensors"):
        assert (smoke_run / rel).is_file(), rel
    summary = json.loads((smoke_run / "target" / "train_summary.json").read_text())
    assert summary["steps"] == 4 and summary["heldout_loss"] == summary["heldout_loss"]  # not NaN


def test_smoke_target_loads_as_plain_hf_model_with_chat_tokenizer(smoke_run: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smoke_run / "target"))
    tok = AutoTokenizer.from_pretrained(str(smoke_run / "target"))
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.vocab_size == len(tok)
    assert tok.mask_token_id is not None and tok.eos_token_id == model.config.eos_token_id
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|user|>\nhi\n<|assistant|>\n"


def test_smoke_drafter_is_a_dflash_checkpoint_for_the_target(smoke_run: Path) -> None:
    from transformers import AutoTokenizer

    from bastion.drafters.dflash import DFlashDraftModel

    cfg = json.loads((smoke_run / "drafter" / "config.json").read_text())
    assert {"block_size", "num_target_layers", "dflash_config"} <= set(cfg)
    tok = AutoTokenizer.from_pretrained(str(smoke_run / "target"))
    assert cfg["dflash_config"]["mask_token_id"] == tok.mask_token_id
    model = DFlashDraftModel.from_pretrained(smoke_run / "drafter")
    assert not any("embed" in k or "lm_head" in k for k in model.state_dict())


def test_smoke_export_is_half_precision_and_decodes_losslessly(smoke_run: Path) -> None:
    from safetensors import safe_open

    from bastion import registry
    from bastion.bench.methods import ARDecoder
    from bastion.engine.pipeline import Pipeline

    for part in ("target", "drafter"):
        with safe_open(str(smoke_run / "export" / part / "model.safetensors"), "pt") as fh:
            assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.float16}
    pipe = Pipeline.from_pretrained(
        smoke_run / "export" / "target", smoke_run / "export" / "drafter",
        budget_controller=registry.create("budget_controller", "fixed", budget=8),
    )
    ids = pipe.encode("<|user|>\nTom has 3 apples.\n<|assistant|>\n")
    res = pipe.generate(ids, max_new_tokens=24)
    ar = ARDecoder(pipe.target).generate(ids, max_new_tokens=24)
    assert res.tokens == ar.tokens
