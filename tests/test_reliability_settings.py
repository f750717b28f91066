"""Every generation setting is checked once, by one rule, on every path: the pipeline's keywords and
``GenerationConfig``, a ``bastion run`` row and its command line, ``bastion generate`` and ``bench``, and
the Hugging Face drop-in. Before, ``stop=5`` was a raw ``TypeError``, a typo in a ``sampling`` mapping a
``TypeError`` that is not a ``BastionError``, ``bastion run --temperature -1`` an attrs ``ValueError``
(exit code 1), ``--threads 0`` was ignored by ``run`` and ``-2`` a torch ``RuntimeError``, ``bench
--seed -1`` ran, ``--warmup-tokens -1`` was a ``ValueError``, and the largest seed was refused for a
batch's second row and for ``bastion run`` (a value the caller never passed)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import bastion
from bastion.cli.main import main
from bastion.cli.options import generation_settings
from bastion.core import BastionError, InvalidInputError
from bastion.contract.errors import InvalidOptionError
from bastion.engine.params import GenerationConfig, SamplingParams, check_setting, derived_seed
from bastion.run.inputs import bastion_row
from bastion.run.job import RunConfig
from bastion.testing.tiny import TinyPair

PROMPT = [5, 6, 7, 8]

BAD = [
    ("seed", -1), ("seed", 2**64), ("seed", 1.5), ("seed", True), ("seed", "7"),
    ("temperature", -1.0), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", 1e-9),
    ("temperature", "0.5"), ("top_p", 0.0), ("top_p", 1.5), ("top_p", "x"), ("top_k", -1), ("top_k", 2.5),
    ("max_new_tokens", 0), ("max_new_tokens", 2.5), ("max_new_tokens", "4"),
    ("stop", ""), ("stop", [""]), ("stop", [1]), ("stop", 5), ("stop", {"a": 1}),
]  # fmt: skip


def _hf_path(name: str, value: object) -> object:
    """The drop-in's settings of one ``model.generate`` call, as ``SpeculativeGenerate`` checks them."""
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    if name == "stop":
        return bastion.hf._stop_list(value)
    if name == "seed":
        return bastion.hf._call_config(4, sampling, value)
    if name == "max_new_tokens":
        return bastion.hf._call_config(value, sampling, None)
    return bastion.hf._call_config(4, {**sampling, name: value}, None)


def _rule(name: str, value: object) -> str:
    with pytest.raises(InvalidInputError) as err:
        check_setting(name, value)
    return str(err.value)


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_a_bad_setting_is_refused_with_the_same_message_on_every_path(pipe: bastion.Pipeline, name: str, value: object) -> None:
    rule = _rule(name, value)
    assert name in rule
    kwargs = {"max_new_tokens": 4, name: value}
    for call in (
        lambda: pipe.generate(PROMPT, **kwargs),
        lambda: pipe.generate_batch([PROMPT, PROMPT[:3]], **kwargs),
        lambda: GenerationConfig().merge(**{name: value}),
        lambda: _hf_path(name, value),
    ):
        with pytest.raises(InvalidInputError) as err:
            call()
        assert rule in str(err.value)
    row = bastion_row(1, {"prompt": "hi", name: value})  # a bastion run row
    assert rule in row.message and f"field '{name}'" in row.message
    if name != "stop":
        with pytest.raises(InvalidInputError) as err:  # the run's command line
            RunConfig(input="in.jsonl", output="out.jsonl", **{name: value})
        assert rule in str(err.value) and f"--{name.replace('_', '-')}" in str(err.value)
    with pytest.raises(InvalidInputError) as err:  # generate's command line
        generation_settings(argparse.Namespace(**{name: value}))
    assert rule in str(err.value)


def test_stop_that_is_not_text_names_stop() -> None:
    for value in (5, {"a": 1}, 2.5):
        with pytest.raises(InvalidInputError, match="stop must be a string or a list of strings"):
            GenerationConfig(stop=value)


def test_an_unknown_sampling_setting_is_an_option_error() -> None:
    with pytest.raises(InvalidOptionError, match="temprature") as err:
        GenerationConfig(sampling={"temprature": 1.0})
    assert isinstance(err.value, BastionError) and isinstance(err.value, TypeError)
    with pytest.raises(InvalidOptionError, match="topp"):
        GenerationConfig().merge(topp=0.5)
    with pytest.raises(InvalidOptionError, match="topp"):
        check_setting("topp", 0.5)


def test_run_config_refuses_bad_numbers_as_bastion_errors_naming_the_option() -> None:
    for field, value, flag in (("temperature", -1, "--temperature"), ("temperature", float("nan"), "--temperature"),
                               ("max_new_tokens", 0, "--max-new-tokens"), ("top_k", -1, "--top-k")):  # fmt: skip
        with pytest.raises(InvalidInputError, match=flag):
            RunConfig(input="in.jsonl", output="out.jsonl", **{field: value})
    with pytest.raises(InvalidInputError, match="--on-error"):
        RunConfig(input="in.jsonl", output="out.jsonl", on_error="later")


# ------------------------------------------------------------------ the largest seed
def test_the_largest_seed_is_valid_for_a_batch_its_second_row_wrapping_to_seed_0(pipe: bastion.Pipeline) -> None:
    top = 2**64 - 1
    rows = pipe.generate_batch([PROMPT, PROMPT], 6, 1.0, top, stop_on_eos=False)
    assert rows[0].tokens == pipe.generate(PROMPT, 6, 1.0, top, stop_on_eos=False).tokens
    assert rows[1].tokens == pipe.generate(PROMPT, 6, 1.0, 0, stop_on_eos=False).tokens
    assert derived_seed(top, 1) == 0 and derived_seed(7, 2) == 9
    with pytest.raises(InvalidInputError, match="seed"):
        SamplingParams().with_seed(-1)


def _run_args(pair: TinyPair, inp: Path, out: Path, *extra: str) -> list[str]:
    return ["run", "--input", str(inp), "--output", str(out), "--target", str(pair.target), "--drafter", str(pair.drafter),
            "--max-new-tokens", "3", "--device", "cpu", "--no-progress", *extra]  # fmt: skip


def _prompts(path: Path, n: int = 2) -> Path:
    path.write_text("".join(json.dumps({"id": i, "prompt": f"Question {i}?"}) + "\n" for i in range(n)))
    return path


def test_bastion_run_takes_the_largest_seed_its_rows_wrapping_as_a_batch_does(pair: TinyPair, pipe: bastion.Pipeline, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out.jsonl"
    assert main(_run_args(pair, _prompts(tmp_path / "in.jsonl"), out, f"--seed={2**64 - 1}", "--temperature=1", "--raw")) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for row, seed in zip(rows, (0, 1)):  # line 1 and line 2: --seed + line, modulo 2**64
        alone = pipe.generate(pipe.encode(f"Question {row['id']}?"), 3, 1.0, seed)
        assert row["token_ids"] == alone.tokens


# ------------------------------------------------------------------ the command lines
def _one_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.strip().splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("threads", ["0", "-2"])
def test_run_threads_below_one_is_refused(pair: TinyPair, tmp_path: Path, capsys, threads: str) -> None:
    code = main(_run_args(pair, _prompts(tmp_path / "in.jsonl"), tmp_path / "out.jsonl", "--threads", threads))
    assert code == 2 and "--threads" in _one_error(capsys)
    assert not (tmp_path / "out.jsonl").exists()


def _bench(pair: TinyPair, tmp_path: Path, *extra: str) -> list[str]:
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question": "What is 2+3?", "answer": "5"}) + "\n")
    return ["bench", "--target", str(pair.target), "--drafter", str(pair.drafter), "--device", "cpu", "--datasets",
            f"gsm8k={data}", "--limit", "1", "--max-new-tokens", "4", "--methods", "ar", "--repeats", "1", "--no-plots",
            "--no-progress", "--out", str(tmp_path / "out"), *extra]  # fmt: skip


@pytest.mark.parametrize(
    "extra,named",
    [
        (("--seed", "-1"), "--seed"),
        (("--seed", str(2**64)), "--seed"),
        (("--temperature", "-1"), "--temperature"),
        (("--temperatures", "0,-1"), "--temperatures"),
        (("--top-p", "0"), "--top-p"),
        (("--top-k", "-1"), "--top-k"),
        (("--warmup-tokens", "-1"), "--warmup-tokens"),
        (("--repeats", "0"), "--repeats"),
        (("--threads", "-2"), "--threads"),
    ],
)
def test_bench_numbers_are_checked_before_any_model_loads(pair: TinyPair, tmp_path: Path, capsys, monkeypatch, extra, named) -> None:
    import bastion.cli.bench_cmd as bench_cmd

    monkeypatch.setattr(bench_cmd, "load_pair", lambda *a, **k: pytest.fail("the models were loaded"))
    assert main(_bench(pair, tmp_path, *extra)) == 2
    assert named in _one_error(capsys)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra", [("--seed=-1",), ("--temperature=nan",), ("--max-new-tokens=0",), ("--stop=",), ("--threads=0",)])
def test_generate_checks_its_settings_before_any_model_loads(pair: TinyPair, capsys, monkeypatch, extra) -> None:
    import bastion.cli.generate_cmd as generate_cmd

    monkeypatch.setattr(generate_cmd, "build_pipeline", lambda *a, **k: pytest.fail("the models were loaded"))
    argv = ["generate", "--target", str(pair.target), "--drafter", str(pair.drafter), "--prompt", "Hi", *extra]
    assert main(argv) == 2
    line = _one_error(capsys)
    assert extra[0].split("=")[0] in line
    assert main([*argv[:-len(extra)], "--prompt", "Yo", *extra]) == 2  # several prompts: the same rule
    assert extra[0].split("=")[0] in _one_error(capsys)
