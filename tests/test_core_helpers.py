"""The shared helpers: checks, atomic writes, dtype names, config reading, chat encoding, CLI lists."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from bastion.cli.parsing import csv_list, int_list, parse_int_list, positive_int_list
from bastion.utils.chat import chat_ids, chat_text, has_chat_template, user_turn
from bastion.utils.checks import check_int, check_number, positive_int
from bastion.utils.dtypes import dtype_bytes, dtype_name, parse_dtype
from bastion.contract.errors import InvalidInputError
from bastion.utils.files import atomic_path, write_json_atomic
from bastion.huggingface.configs import DecoderShape, config_dict, config_value
from bastion.contract.sampling import seeded_generator
from bastion.testing.tiny import tiny_config


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "3", None])
def test_check_int_refuses_everything_but_ints_at_or_above_the_bound(bad):
    with pytest.raises(InvalidInputError, match="n must be an int >= 1"):
        check_int("n", bad)


def test_check_int_accepts_integer_likes_optional_none_and_no_bound():
    assert check_int("n", np.int64(3)) == 3 and check_int("n", None, optional=True) is None
    assert check_int("n", -5, low=None) == -5
    assert check_number("x", 0) == 0.0 and check_number("x", 2.5, strict=True) == 2.5
    for bad, kwargs in ((0.0, {"strict": True}), (float("nan"), {}), (float("inf"), {}), (False, {}), (-1e-9, {})):
        with pytest.raises(InvalidInputError, match="x must be a finite number"):
            check_number("x", bad, **kwargs)
    with pytest.raises(InvalidInputError, match="width must be an int >= 1"):
        positive_int(None, type("A", (), {"name": "width"})(), 0)


def test_atomic_path_replaces_the_file_whole_or_leaves_the_old_one(tmp_path):
    target = tmp_path / "sub" / "data.json"
    write_json_atomic(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("{torn")
            raise RuntimeError("crash mid-write")
    assert json.loads(target.read_text()) == {"a": 1}, "a failed write must leave the old content"
    assert [p.name for p in target.parent.iterdir()] == ["data.json"], "no temporary file is left behind"


def test_dtype_names_parse_in_every_spelling_and_unknown_names_are_refused():
    for name in ("bfloat16", "bf16", "torch.bfloat16", " BF16 "):
        assert parse_dtype(name) is torch.bfloat16
    assert parse_dtype(torch.float16) is torch.float16 and dtype_name("fp16") == "float16"
    assert parse_dtype("auto", allow_auto=True) is None and parse_dtype(None, allow_auto=True) is None
    assert dtype_bytes("float32") == 4 and dtype_bytes(torch.bfloat16) == 2
    for bad in ("auto", "int8x", 3):
        with pytest.raises(InvalidInputError, match="unknown dtype"):
            parse_dtype(bad)


def test_decoder_shape_reads_objects_and_dicts_alike_with_defaults():
    cfg = tiny_config("llama", head_dim=None, num_key_value_heads=None)
    shape = DecoderShape.from_config(cfg)
    assert shape == DecoderShape.from_config(config_dict(cfg))
    assert (shape.num_kv_heads, shape.head_dim, shape.num_layers) == (4, 16, 2)
    assert config_value({"a": None}, "a", 7) == 7 and config_value(cfg, "missing", "d") == "d"
    with pytest.raises(InvalidInputError, match="lacks num_hidden_layers.*the test needs"):
        DecoderShape.from_config({"hidden_size": 8, "num_attention_heads": 2, "intermediate_size": 4, "vocab_size": 9},
                                 purpose="the test")


class _Tok:
    chat_template = "<|user|>{content}<|assistant|>"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens=True):
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]


def test_chat_encoding_renders_the_template_and_adds_no_second_special_token():
    tok = _Tok()
    assert has_chat_template(tok) and not has_chat_template(object())
    assert chat_text(tok, user_turn("hi")) == "<user>hi<assistant>"
    assert chat_ids(tok, user_turn("hi")) == [ord(c) for c in "<user>hi<assistant>"]
    with pytest.raises(InvalidInputError, match="chat template"):
        chat_text(object(), user_turn("hi"))


def test_cli_lists_parse_commas_and_name_bad_values():
    assert csv_list(" a, b,,c ") == ["a", "b", "c"]
    assert int_list("4, 8,16") == (4, 8, 16) and positive_int_list("1,2") == (1, 2)
    with pytest.raises(argparse.ArgumentTypeError, match="integers >= 1"):
        positive_int_list("0,4")
    with pytest.raises(argparse.ArgumentTypeError):
        int_list("4,x")
    with pytest.raises(InvalidInputError, match="--layers takes comma-separated integers"):
        parse_int_list("1;2", what="--layers")


def test_seeded_generators_repeat_and_check_their_seed():
    a = torch.rand(4, generator=seeded_generator(5))
    assert torch.equal(a, torch.rand(4, generator=seeded_generator(5)))
    with pytest.raises(InvalidInputError, match="seed"):
        seeded_generator(-1)
