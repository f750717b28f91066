"""Prompts, files and plugins refused with a bastion error naming the cause, the same rule on every path.

Before: ``generate([{"role": "user"}])``, ``content=None`` or a non-string role rendered an empty or
garbage turn (``bastion run`` refused the same row), and a training prompts file rendered ``None`` as
text and split a raw U+2028 into two broken lines; a run stopped by one bad row said only "1 input line
cannot be decoded"; an output folder where no lock file can be created was reported as a lock held by
another run; the drop-in's ``stop_strings=""`` was accepted and ``[5]`` an ``AttributeError``; a
plugin hook raising was a raw ``RuntimeError`` and an empty component name a ``ValueError``; a binary
``train distill --prompts`` file a ``UnicodeDecodeError``."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

import bastion
from bastion.cli.main import main
from bastion.core import BastionError, InvalidInputError
from bastion.utils.chat import check_messages
from bastion.utils.checks import check_token_ids
from bastion.contract.errors import FileSystemError, InvalidFileError, PluginLoadError
from bastion.testing.tiny import TinyPair

PROMPT = [5, 6, 7, 8]
BAD_MESSAGES = [
    ([{"role": "user"}], "messages[0] (user): 'content' must be text"),
    ([{"role": "user", "content": None}], "got content None"),
    ([{"role": "user", "content": 5}], "got content 5"),
    ([{"role": 5, "content": "hi"}], "messages[0]: 'role' must be a non-empty string"),
    ([{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "image"}]}], "messages[1] (user)"),
]


@pytest.mark.parametrize("messages,message", BAD_MESSAGES, ids=["no-content", "content-None", "content-5", "role-5", "image-part"])
def test_a_malformed_conversation_is_refused_on_every_path(pipe: bastion.Pipeline, messages, message) -> None:
    from bastion.run.inputs import bastion_row
    from bastion.training.prompts import render_row

    for call in (
        lambda: pipe.generate(messages, 4),
        lambda: pipe.chat(messages, 4),
        lambda: pipe.generate_batch([PROMPT, messages], 4),
        lambda: pipe.stream(messages, 4),
        lambda: render_row({"messages": messages}, pipe.tokenizer, "prompts.jsonl:1"),
    ):
        with pytest.raises(InvalidInputError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            call()
    assert message in bastion_row(1, {"messages": messages}).message  # a bastion run row: the same words


def test_a_good_conversation_still_decodes_and_text_parts_are_joined(pipe: bastion.Pipeline) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]
    plain = [{"role": "user", "content": "Hello"}]
    assert check_messages(parts)[0]["content"] == "Hello"
    assert pipe.encode_chat(parts).tolist() == pipe.encode_chat(plain).tolist()
    assert pipe.chat(parts, 4).tokens == pipe.chat(plain, 4).tokens


def _write(path: Path, rows: list, raw: bytes | None = None) -> Path:
    if raw is not None:
        path.write_bytes(raw)
    else:
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def test_training_prompts_split_at_newlines_only_and_refuse_binary_files(pipe: bastion.Pipeline, tmp_path: Path) -> None:
    from bastion.training.prompts import read_user_prompts

    prompts = read_user_prompts(_write(tmp_path / "p.jsonl", [{"prompt": "one\u2028two", "raw": True}, {"prompt": "b"}]), pipe.tokenizer)
    assert [text for _, text in prompts][0] == "one\u2028two" and len(prompts) == 2
    binary = _write(tmp_path / "binary.jsonl", [], raw=b"\xff\xfe\x00\x81" * 8)
    with pytest.raises(InvalidFileError, match="binary.jsonl is not UTF-8 text"):
        read_user_prompts(binary, pipe.tokenizer)
    with pytest.raises(InvalidInputError, match="missing.jsonl does not exist"):
        read_user_prompts(tmp_path / "missing.jsonl", pipe.tokenizer)


def test_train_distill_with_a_binary_prompts_file_is_one_line_naming_it(pair: TinyPair, tmp_path: Path, capsys) -> None:
    binary = _write(tmp_path / "prompts.jsonl", [], raw=b"\xff\xfe\x00\x81" * 8)
    code = main(["train", "distill", "--target", str(pair.target), "--prompts", str(binary), "--out", str(tmp_path / "d.pt"),
                 "--device", "cpu"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert "prompts.jsonl is not UTF-8 text" in err.strip().splitlines()[-1]


# ------------------------------------------------------------------ bastion run
def _run_args(pair: TinyPair, inp: Path | str, out: Path | str, *extra: str) -> list[str]:
    return ["run", "--input", str(inp), "--output", str(out), "--target", str(pair.target), "--drafter", str(pair.drafter),
            "--max-new-tokens", "3", "--device", "cpu", "--no-progress", *extra]  # fmt: skip


@pytest.mark.parametrize(
    "row,named",
    [
        ({"prompt": "hi", "seed": -1}, "input line 1: field 'seed': seed must be"),
        ({"messages": [{"role": "user", "content": None}]}, "input line 1: messages[0] (user): 'content' must be text"),
        ({"prompt": ""}, "input line 1: 'prompt' must be a non-empty string"),
    ],
)
def test_a_run_stopped_by_one_bad_row_names_the_line_and_field_on_its_one_line(pair: TinyPair, tmp_path: Path, capsys, row, named) -> None:
    assert main(_run_args(pair, _write(tmp_path / "in.jsonl", [row]), tmp_path / "out.jsonl")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err


def test_several_bad_rows_name_the_first_on_the_first_line_and_list_every_one(pair: TinyPair, tmp_path: Path, capsys) -> None:
    rows = [{"prompt": "fine"}, {"prompt": "a", "top_p": 0}, {"prompt": "b", "top_k": -1}]
    assert main(_run_args(pair, _write(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl")) == 2
    first, *rest = capsys.readouterr().err.strip().splitlines()
    assert "2 input lines cannot be decoded" in first and "the first: input line 2: field 'top_p'" in first
    assert [line.strip().split(":")[0] for line in rest] == ["input line 2", "input line 3"]


def test_an_output_where_no_lock_file_can_be_created_names_the_cause_not_another_run(pair: TinyPair, tmp_path: Path, capsys) -> None:
    from bastion.run.manifest import OutputLock

    with pytest.raises(FileSystemError, match="cannot create the lock file beside the output: No such file") as err:
        OutputLock(tmp_path / "missing" / "out.jsonl").acquire()
    assert "another bastion run" not in str(err.value)
    if Path("/proc").is_dir():
        assert main(_run_args(pair, _write(tmp_path / "in.jsonl", [{"prompt": "hi"}]), "/proc/bastion-out.jsonl")) == 2
        line = capsys.readouterr().err.strip()
        assert "cannot create the lock file" in line and "another bastion run" not in line


# ------------------------------------------------------------------ the Hugging Face drop-in
@pytest.mark.parametrize("stops,message", [("", "non-empty"), ([""], "non-empty"), ([5], "non-empty strings, got 5"), (7, "got 7")])
def test_drop_in_stop_strings_follow_the_rule_of_every_stop_string(pair: TinyPair, stops, message) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(pair.target), dtype=torch.float32).eval()
    gen = bastion.hf.speculative(str(pair.drafter), tokenizer=AutoTokenizer.from_pretrained(str(pair.target)))
    ids = torch.tensor([PROMPT])
    with pytest.raises(InvalidInputError, match=f"stop_strings: .*{message}"):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, custom_generate=gen, stop_strings=stops)


# ------------------------------------------------------------------ plugins
def test_a_plugin_hook_that_raises_is_a_plugin_error_naming_it_and_registers_nothing() -> None:
    from bastion.contract.hookspecs import hookimpl
    from bastion.contract.registry import Registry
    from bastion.trees.best_first import BestFirstBuilder

    plugin = types.ModuleType("half_plugin")

    def hook(register):  # type: ignore[no-untyped-def]
        register("tree_builder", "half-registered", BestFirstBuilder)
        raise KeyError("broke half-way")

    plugin.bastion_register_components = hookimpl(hook)  # type: ignore[attr-defined]
    reg = Registry(load_entry_points=False)
    with pytest.raises(PluginLoadError, match="plugin 'half_plugin' failed while registering") as err:
        reg.register_plugin(plugin)
    assert isinstance(err.value.__cause__, KeyError) and "broke half-way" in str(err.value)
    assert "half-registered" not in reg.names("tree_builder")

    empty = types.ModuleType("empty_name_plugin")
    empty.bastion_register_components = hookimpl(lambda register: register("tree_builder", "", BestFirstBuilder))  # type: ignore[attr-defined]
    with pytest.raises(BastionError, match="tree_builder names must be non-empty strings.*empty_name_plugin"):
        reg.register_plugin(empty)
    with pytest.raises(InvalidInputError, match="names must be non-empty strings"):
        reg.register("tree_builder", "", BestFirstBuilder)


def test_a_bad_tree_names_the_builder_that_built_it() -> None:
    from bastion.core import Tree, TreeValidationError
    from bastion.utils.checks import check_built_tree
    from bastion.trees.best_first import BestFirstBuilder

    class PluginBuilder(BestFirstBuilder):
        pass

    tree = Tree.from_parents(torch.tensor([7, 3, 4]), [-1, 0, 1])
    check_built_tree(tree, 7, 10, 8, builder=PluginBuilder())  # a good tree passes
    for root, vocab, max_nodes, message in ((8, 10, 8, "root first"), (7, 10, 2, "max_nodes = 2"), (7, 4, 8, r"\[0, 4\)")):
        with pytest.raises(TreeValidationError, match=r"tree_builder PluginBuilder\.build \(plugin runtime\) built an invalid tree: .*" + message):
            check_built_tree(tree, root, vocab, max_nodes, builder=PluginBuilder())
    with pytest.raises(TreeValidationError, match="^root first"):  # without a builder: the check alone
        check_built_tree(tree, 8, 10, 8)


# ------------------------------------------------------------------ token ids
def test_check_token_ids_names_the_first_bad_id() -> None:
    assert check_token_ids([1, 2], 10) == [1, 2] and check_token_ids(torch.tensor([3]), 10) == [3]
    for tokens, message in (([1, 15], r"tokens\[1\] = 15 lies outside the vocabulary \[0, 10\)"), ([-1], "-1"),
                            (["a"], "'a'"), ([1.0], "1.0"), ([True], "True"), ("ab", "sequence"),
                            (torch.zeros(2), "integer tensor")):  # fmt: skip
        with pytest.raises(InvalidInputError, match=message):
            check_token_ids(tokens, 10)
