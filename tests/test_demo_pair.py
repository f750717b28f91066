"""The embedded demo pair: shipped assets, default pipeline, lossless greedy decoding, the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from bastion.demo import ASSETS_DIR, demo_paths

PROMPT = "Sara has 5 boxes with 12 pencils in each box. She gives away 17 pencils. How many pencils does she have left?"


@pytest.fixture(scope="module")
def demo_pipe():
    from bastion import registry
    from bastion.engine.pipeline import Pipeline

    return Pipeline.demo(budget_controller=registry.create("budget_controller", "fixed", budget=32))


def _prompt_ids(tok) -> torch.Tensor:
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True)
    return torch.tensor([tok.encode(text, add_special_tokens=False)], dtype=torch.long)


def test_demo_assets_are_small_half_precision_and_complete() -> None:
    from safetensors import safe_open

    paths = demo_paths()
    total = sum(p.stat().st_size for p in ASSETS_DIR.rglob("*") if p.is_file())
    assert total < 40 * 2**20, f"demo assets take {total / 2**20:.1f} MiB"
    for d in (paths.target, paths.drafter):
        with safe_open(str(d / "model.safetensors"), "pt") as fh:
            assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.float16}
    assert (paths.target / "tokenizer.json").is_file()


def test_demo_drafter_mask_token_is_the_tokenizers_mask(demo_pipe) -> None:
    cfg = json.loads((demo_paths().drafter / "config.json").read_text())
    assert cfg["dflash_config"]["mask_token_id"] == demo_pipe.tokenizer.mask_token_id


def test_demo_pipeline_loads_fp32_and_matches_hf_generate_greedy(demo_pipe) -> None:
    """The oracle is Hugging Face's own ``model.generate`` on a separately loaded copy of the target."""
    from transformers import AutoModelForCausalLM

    assert next(demo_pipe.target.model.parameters()).dtype == torch.float32
    ids = _prompt_ids(demo_pipe.tokenizer)
    res = demo_pipe.generate(ids, max_new_tokens=48)
    model = AutoModelForCausalLM.from_pretrained(str(demo_paths().target), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False, eos_token_id=None,
            pad_token_id=model.config.eos_token_id if model.config.eos_token_id is not None else 0,
        )
    ref = out[0, ids.shape[1] :].tolist()
    n = len(res.tokens)  # the pipeline stops at EOS; HF was told not to
    assert n >= 1 and res.tokens == ref[:n]
    assert n == 48 or res.tokens[-1] in demo_pipe.target.eos_token_ids
    # the trained drafter commits clearly more than one token per target forward on a math prompt
    assert res.acceptance_length > 2.0


def test_generate_command_defaults_to_demo_streams_text_to_stdout_and_the_summary_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    from bastion.cli.main import main

    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "24", "--compare-ar"]) == 0
    captured = capsys.readouterr()
    summary = captured.err.strip().splitlines()[-1]
    assert summary.startswith("tokens=24") and "acceptance=" in summary and "tok/s=" in summary
    assert "speedup=" in summary and "identical to AR" in summary
    assert captured.out.strip() and "tokens=" not in captured.out  # only the generated text on stdout
