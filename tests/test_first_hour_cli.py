"""The command line as a newcomer meets it: one --device default, and log output through ``logging``
with a global --log-level."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from bastion.cli.main import build_parser, main

PROMPT = "What is 2+3?"
COMMANDS = {
    "generate": ["generate", "--prompt", PROMPT],
    "bench": ["bench", "--quick"],
    "run": ["run", "--input", "in.jsonl", "--output", "out.jsonl"],
    "serve": ["serve"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_pipeline_command_defaults_to_device_auto(command):
    args = build_parser().parse_args(COMMANDS[command])
    assert args.device == "auto"


@pytest.mark.parametrize("cuda", [False, True])
def test_device_auto_is_cuda_when_available_else_cpu(monkeypatch, cuda):
    from bastion.cli.options import pipeline_kwargs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    args = build_parser().parse_args(COMMANDS["generate"])
    assert pipeline_kwargs(args)["device"] == ("cuda" if cuda else "cpu")
    args = build_parser().parse_args([*COMMANDS["generate"], "--device", "cpu"])
    assert pipeline_kwargs(args)["device"] == "cpu"


def test_the_device_help_says_what_auto_means(capsys):
    for command in COMMANDS:
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "default auto: cuda when CUDA is available, else cpu" in text, command


@pytest.fixture
def restore_logging():
    names = ["bastion", "py.warnings", "transformers", "torch", "huggingface_hub"]
    levels = {n: logging.getLogger(n).level for n in names}
    filters = list(warnings.filters)
    yield
    logging.captureWarnings(False)
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)
    warnings.filters[:] = filters
    from bastion.utils.logs import configure_logging, request_level

    request_level(None)
    configure_logging()  # the quiet default, as every command starts


def test_log_level_is_a_global_option_before_or_after_the_command():
    parser = build_parser()
    assert parser.parse_args(["--log-level", "info", "plugins"]).log_level == "info"
    assert parser.parse_args(["plugins", "--log-level", "debug"]).log_level == "debug"
    assert parser.parse_args(["plugins"]).log_level is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-level", "loud", "plugins"])


def test_log_level_routes_python_warnings_and_bastion_logs_through_logging(capsys, restore_logging):
    from bastion.utils.logs import configure_logging

    configure_logging("warning")
    warnings.warn("a library warning", UserWarning)
    logging.getLogger("bastion.test").warning("a bastion warning")
    logging.getLogger("bastion.test").info("an info line")
    err = capsys.readouterr().err
    assert "a library warning" in err and "a bastion warning" in err and "an info line" not in err
    configure_logging("info")
    logging.getLogger("bastion.test").info("an info line")
    assert "an info line" in capsys.readouterr().err
    configure_logging("error")
    warnings.warn("hidden", UserWarning)
    logging.getLogger("bastion.test").warning("hidden too")
    assert "hidden" not in capsys.readouterr().err


def test_quiet_by_default_and_log_level_info_shows_weight_loading(capfd, restore_logging):
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "2", "--device", "cpu"]) == 0
    assert "Loading weights" not in capfd.readouterr().err
    assert main(["--log-level", "info", "generate", "--prompt", PROMPT, "--max-new-tokens", "2"]) == 0
    assert "Loading weights" in capfd.readouterr().err
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "2", "--log-level", "error"]) == 0
    assert "Loading weights" not in capfd.readouterr().err


def test_an_unknown_log_level_in_python_is_a_bastion_error():
    from bastion.contract.errors import BastionError
    from bastion.utils.logs import configure_logging

    with pytest.raises(BastionError, match="debug, info, warning, error"):
        configure_logging("loud")


def test_binary_garbage_as_a_bench_dataset_is_one_line_naming_the_file(capsys, tmp_path):
    from bastion.cli.main import main

    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(bytes(range(128, 256)) * 8)
    assert main(["bench", "--datasets", f"gsm8k={garbage}", "--quick", "--no-progress", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(garbage) in err[0] and "not UTF-8" in err[0]


def test_calibrate_takes_the_same_device_default_as_every_other_command():
    from bastion.cli.main import build_parser

    assert build_parser().parse_args(["calibrate"]).device == "auto"
