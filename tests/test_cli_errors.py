"""The CLI: one clear line for any failure (``--debug`` for the traceback) and a warning when the
target's position limit cut the output short."""

from __future__ import annotations

import pytest
import torch

from bastion.cli.main import main


def _boom(*_a, **_k):
    raise RuntimeError("boom: something deep failed\nsecond line of detail")


def test_a_non_bastion_error_prints_one_line_with_a_debug_hint(monkeypatch, capsys):
    monkeypatch.setattr("bastion.cli.generate_cmd.build_pipeline", _boom)
    assert main(["generate", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bastion: error: RuntimeError: boom: something deep failed (rerun with bastion --debug for the traceback)"]


def test_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setattr("bastion.cli.generate_cmd.build_pipeline", _boom)
    with pytest.raises(RuntimeError, match="boom"):
        main(["--debug", "generate", "--prompt", "hi"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_on_a_cpu_machine_is_one_line_saying_what_to_use(capsys):
    assert main(["generate", "--prompt", "hi", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA device" in err[0] and "--device cpu on the command line" in err[0]


def test_a_bad_target_path_is_one_line(tmp_path, capsys):
    code = main(["generate", "--prompt", "hi", "--target", str(tmp_path / "missing"), "--drafter", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code in (1, 2) and len(err) == 1 and err[0].startswith("bastion: error:")


class _CharTokenizer:
    """Byte-per-token stand-in: enough for the CLI's raw prompts and decoding."""

    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [3 + (ord(c) % 200) for c in text]

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in tokens)

    def __len__(self):
        return 256


def test_generate_warns_when_the_position_limit_cut_the_output(monkeypatch, capsys):
    import json

    import bastion
    import bastion.cli.generate_cmd as gen
    from bastion.huggingface.causal_lm import HFTarget
    from bastion.testing.drafters import NoisyOracleDrafter
    from bastion.testing.tiny import tiny_model

    model = tiny_model("qwen3", seed=0, max_position_embeddings=24)
    pipe = bastion.Pipeline(HFTarget(model), NoisyOracleDrafter(model, block_size=3), tokenizer=_CharTokenizer(), max_nodes=4)
    monkeypatch.setattr(gen, "build_pipeline", lambda args: pipe)
    assert main(["generate", "--prompt", "x" * 20, "--raw", "--json", "--max-new-tokens", "30"]) == 0
    captured = capsys.readouterr()
    payload = json.loads(captured.out)
    assert payload["stop_reason"] == "position-limit" and payload["new_tokens"] < 30
    assert f"warning: output stopped after {payload['new_tokens']} tokens" in captured.err
    assert "position limit (24)" in captured.err
