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
    assert len(err) == 1 and "no CUDA device; use --device cpu" in err[0]


def test_a_bad_target_path_is_one_line(tmp_path, capsys):
    code = main(["generate", "--prompt", "hi", "--target", str(tmp_path / "missing"), "--drafter", str(tmp_path / "d")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code in (1, 2) and len(err) == 1 and err[0].startswith("bastion: error:")


def test_generate_warns_when_the_position_limit_cut_the_output(monkeypatch, capsys):
    import bastion.cli.generate_cmd as gen
    from bastion.core.types import GenerationResult

    class Tok:
        def encode(self, text):
            return [1, 2, 3]

        def decode(self, tokens, skip_special_tokens=True):
            return "out"

    class Pipe:
        tokenizer = Tok()

        class target:
            max_positions = 5

        def generate(self, ids, **kw):
            return GenerationResult(tokens=[4, 5], steps=(), prompt_len=3, prefill_s=0.0, wall_s=0.1,
                                    stop_reason="position-limit")

    monkeypatch.setattr(gen, "build_pipeline", lambda args: Pipe())
    assert main(["generate", "--prompt", "hi", "--raw"]) == 0
    err = capsys.readouterr().err
    assert "warning: output stopped after 2 tokens" in err and "position limit (5)" in err
