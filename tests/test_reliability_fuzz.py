"""Fuzz over checkpoint folders and over ``bastion generate``'s options.

Checkpoints: a tiny target and its DFlash drafter, with one config field set to a drawn value, one tensor
dropped or stored in a drawn dtype, or the weights file cut or garbled. Every case either loads and decodes
losslessly (the target's own greedy tokens) or raises a ``BastionError`` whose first line names the folder
or file at fault; no other exception, and no allocation above the bound (the process runs under its
normal memory). CLI: every drawn ``bastion generate`` command line exits 0 or 2 and, on 2, prints one line
``bastion...: error: ...`` and no traceback."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.torch import load_file, save_file

import bastion
from bastion.cli.main import main
from bastion.core import BastionError
from bastion.testing.reference import greedy_reference
from bastion.testing.tiny import save_tiny_pair

PROMPT = [5, 6, 7, 8]
_PAIR: list = []


def _pair():
    if not _PAIR:
        _PAIR.append(save_tiny_pair(Path(tempfile.mkdtemp(prefix="bastion-fuzz-")), max_positions=128))
    return _PAIR[0]


FIELDS = ["num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
          "intermediate_size", "vocab_size", "max_position_embeddings", "block_size", "rms_norm_eps", "dtype"]
VALUES = st.sampled_from([0, -1, 1, 2, 3, 16, 64, 10**6, 10**9, 2**63, 2.5, True, None, "x", [], {}, "float16", "int64"])
DTYPES = [torch.int64, torch.int32, torch.bool, torch.uint8, torch.float16, torch.bfloat16, torch.float64]

mutation = st.one_of(
    st.tuples(st.just("config"), st.sampled_from(["target", "drafter"]), st.sampled_from(FIELDS), VALUES),
    st.tuples(st.just("drop"), st.sampled_from(["target", "drafter"]), st.integers(0, 40), st.none()),
    st.tuples(st.just("dtype"), st.sampled_from(["target", "drafter"]), st.integers(0, 40), st.sampled_from(DTYPES)),
    st.tuples(st.just("cut"), st.sampled_from(["target", "drafter"]), st.floats(0.0, 0.999), st.none()),
    st.tuples(st.just("garble"), st.sampled_from(["target", "drafter"]), st.integers(0, 200), st.binary(min_size=1, max_size=8)),
)


def _apply(folder: Path, kind: str, where, value) -> None:
    weights, config = folder / "model.safetensors", folder / "config.json"
    if kind == "config":
        data = json.loads(config.read_text())
        data[where] = value
        config.write_text(json.dumps(data))
        return
    if kind in ("drop", "dtype"):
        state = load_file(str(weights))
        name = sorted(state)[where % len(state)]
        if kind == "drop":
            del state[name]
        else:
            state[name] = state[name].to(value)
        save_file(state, str(weights), metadata={"format": "pt"})
        return
    blob = bytearray(weights.read_bytes())
    if kind == "cut":
        weights.write_bytes(bytes(blob[: int(len(blob) * where)]))
    else:
        blob[where : where + len(value)] = value
        weights.write_bytes(bytes(blob))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(mutation)
def test_a_mutated_checkpoint_decodes_losslessly_or_is_a_named_bastion_error(tmp_path_factory, case) -> None:
    kind, which, where, value = case
    pair = _pair()
    root = tmp_path_factory.mktemp("case")
    target, drafter = root / "target", root / "drafter"
    shutil.copytree(pair.target, target)
    shutil.copytree(pair.drafter, drafter)
    _apply(target if which == "target" else drafter, kind, where, value)
    try:
        pipe = bastion.Pipeline.from_pretrained(target, str(drafter))
        out = pipe.generate(PROMPT, max_new_tokens=6)
    except BastionError as exc:
        first = str(exc).splitlines()[0]
        named = [str(root), "config.json", "safetensors", "vocabulary", "positions", *FIELDS]
        assert any(name in first for name in named), first
        return
    model = pipe.target.model
    assert out.tokens == greedy_reference(model, torch.tensor([PROMPT]), 6)[: len(out.tokens)]


OPTIONS = {
    "--max-new-tokens": ["0", "1", "4", "-3", "x", "2.5", "1000000000"],
    "--temperature": ["0", "1", "0.7", "-1", "nan", "inf", "1e-9", "abc"],
    "--top-p": ["1", "0.5", "0", "1.5", "nan"],
    "--top-k": ["0", "5", "-1", "x"],
    "--seed": ["0", "7", "-1", "18446744073709551615", "18446744073709551616", "x"],
    "--stop": ["", "e", "\u2028"],
    "--device": ["cpu", "cuda", "gpu0", "meta"],
    "--dtype": ["float32", "bf16", "auto", "int8", "x"],
    "--max-nodes": ["1", "8", "0", "100000", "x"],
    "--threads": ["1", "0", "-2"],
}
FLAGS = ["--raw", "--chat", "--json", "--compare-ar"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    st.dictionaries(st.sampled_from(sorted(OPTIONS)), st.integers(0, 10), max_size=4),
    st.lists(st.sampled_from(FLAGS), max_size=2, unique=True),
    st.sampled_from(["What is 2+3?", "", "\x00\x01", "é" * 40, "-x"]),
)
def test_generate_options_exit_0_or_2_with_one_line(capsys, monkeypatch, options, flags, prompt) -> None:
    monkeypatch.setenv("BASTION_NO_DEVICE_PROBE", "1")
    pair = _pair()
    argv = ["generate", "--target", str(pair.target), "--drafter", str(pair.drafter), f"--prompt={prompt}"]
    for name, pick in options.items():
        argv.append(f"{name}={OPTIONS[name][pick % len(OPTIONS[name])]}")
    argv += flags
    if "--max-new-tokens" not in options:
        argv.append("--max-new-tokens=4")
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert code in (0, 2), (argv, code, err)
    if code == 2:
        errors = [line for line in err.strip().splitlines() if "error:" in line]
        assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], (argv, err)
