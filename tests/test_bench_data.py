"""Benchmark datasets (GSM8K, HumanEval, MT-bench formats) and prompt templates."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bastion.bench.datasets import (
    FORMATS,
    Prompt,
    default_data_dir,
    load_dataset,
    parse_dataset_spec,
)
from bastion.bench.templates import TEMPLATES, byte_encode, encode_prompt, render_prompt
from bastion.contract.errors import InvalidInputError



def _write_jsonl(path: Path, rows: list[dict], gz: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture()
def data_dir(tmp_path: Path) -> Path:
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "humaneval").mkdir()
    (tmp_path / "mt_bench").mkdir()
    _write_jsonl(tmp_path / "gsm8k" / "test.jsonl", [{"question": f"What is {i} + {i}?", "answer": f"#### {2 * i}"} for i in range(5)])
    _write_jsonl(
        tmp_path / "humaneval" / "HumanEval.jsonl.gz",
        [{"task_id": f"HumanEval/{i}", "prompt": f"def f{i}(x):\n    \"\"\"Return x.\"\"\"\n", "test": ""} for i in range(3)],
        gz=True,
    )
    _write_jsonl(
        tmp_path / "mt_bench" / "question.jsonl",
        [{"question_id": 81 + i, "category": "writing", "turns": [f"first turn {i}", f"second turn {i}"]} for i in range(4)],
    )
    return tmp_path


def test_each_format_reads_its_default_file_with_domain_ids_and_first_turn(data_dir: Path) -> None:
    gsm = load_dataset("gsm8k", data_dir=data_dir)
    assert [p.id for p in gsm] == ["0", "1", "2", "3", "4"] and gsm[3].text == "What is 3 + 3?"
    assert {p.domain for p in gsm} == {"math"}
    code = load_dataset("humaneval", data_dir=data_dir)
    assert [p.id for p in code] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"] and code[0].domain == "code"
    assert code[1].text.startswith("def f1(x):")
    chat = load_dataset("mt_bench", data_dir=data_dir)
    assert [p.id for p in chat] == ["81", "82", "83", "84"]
    assert [p.text for p in chat] == [f"first turn {i}" for i in range(4)]  # first turns only
    assert {p.domain for p in chat} == {"chat"}


def test_limit_keeps_the_first_prompts_in_file_order(data_dir: Path) -> None:
    assert [p.id for p in load_dataset("gsm8k", limit=2, data_dir=data_dir)] == ["0", "1"]
    assert len(load_dataset("mt_bench", limit=100, data_dir=data_dir)) == 4
    with pytest.raises(InvalidInputError, match="limit"):
        load_dataset("gsm8k", limit=0, data_dir=data_dir)


def test_explicit_path_and_json_array_sources_are_read(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps([{"question": "a?"}, {"question": "b?"}]), encoding="utf-8")
    assert [p.text for p in load_dataset(f"gsm8k={path}")] == ["a?", "b?"]
    jl = _write_jsonl(tmp_path / "q.jsonl", [{"turns": "only one turn"}])
    assert load_dataset(f"mt_bench={jl}")[0].text == "only one turn"


def test_bad_specs_and_records_raise_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="unknown dataset 'nope'"):
        load_dataset("nope")
    with pytest.raises(InvalidInputError, match="not found"):
        load_dataset(f"gsm8k={tmp_path / 'missing.jsonl'}")
    with pytest.raises(InvalidInputError, match="empty source"):
        parse_dataset_spec("gsm8k=")
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "no question field"}])
    with pytest.raises(InvalidInputError, match="'question'"):
        load_dataset(f"gsm8k={bad}")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"question": "ok"}\n{not json\n', encoding="utf-8")
    with pytest.raises(InvalidInputError, match=r"broken.jsonl:2"):
        load_dataset(f"gsm8k={broken}")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(InvalidInputError, match="no prompts"):
        load_dataset(f"gsm8k={empty}")


def test_data_dir_comes_from_the_environment_variable(monkeypatch: pytest.MonkeyPatch, data_dir: Path) -> None:
    monkeypatch.setenv("BASTION_DATA_DIR", str(data_dir))
    assert default_data_dir() == data_dir
    assert len(load_dataset("gsm8k")) == 5


def test_the_public_benchmark_files_load_in_their_published_formats(shared_data: Path) -> None:
    for name in FORMATS:
        prompts = load_dataset(name, limit=3)  # found the way `bastion bench` finds them
        per = 13 if FORMATS[name].limit_per_category else 1  # Spec-Bench: 3 of each of its 13 categories
        assert len(prompts) == 3 * per and all(p.text.strip() for p in prompts)
    assert load_dataset("humaneval", limit=1, data_dir=shared_data)[0].id == "HumanEval/0"
    assert len(load_dataset("spec_bench", data_dir=shared_data)) == 480


class _ChatTok:
    chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        assert tokenize is False and add_generation_prompt is True
        return "".join(f"<|{m['role']}|>{m['content']}" for m in messages) + "<|assistant|>"

    def encode(self, text, add_special_tokens=True):
        return ([1] if add_special_tokens else []) + [ord(c) % 200 + 3 for c in text]


def test_templates_wrap_instructions_in_the_chat_template_and_leave_code_raw() -> None:
    math = Prompt("gsm8k", "math", "0", "What is 2 + 2?")
    code = Prompt("humaneval", "code", "HumanEval/0", "def f(x):\n")
    tok = _ChatTok()
    assert render_prompt(math, tok) == "<|user|>What is 2 + 2?<|assistant|>"
    assert render_prompt(code, tok) == "def f(x):\n"  # completion, no chat wrapper
    assert render_prompt(math, None) == TEMPLATES["math"].plain.format(text="What is 2 + 2?")
    assert render_prompt(math, tok, style="plain") == "Question: What is 2 + 2?\nAnswer:"
    with pytest.raises(InvalidInputError, match="chat template"):
        render_prompt(math, None, style="chat")
    # chat-templated text gets no extra special tokens; plain completions keep the tokenizer's own
    assert encode_prompt(math, tok, 256)[0, 0].item() != 1
    assert encode_prompt(code, tok, 256)[0, 0].item() == 1


def test_encoding_without_tokenizer_folds_bytes_and_keeps_the_prompt_tail() -> None:
    p = Prompt("mt_bench", "chat", "81", "héllo world")
    ids = encode_prompt(p, None, vocab_size=100)
    text = render_prompt(p, None)
    assert ids.shape == (1, len(text.encode("utf-8"))) and int(ids.max()) < 100
    assert ids[0].tolist() == byte_encode(text, 100)
    tail = encode_prompt(p, None, vocab_size=100, max_tokens=5)
    assert tail[0].tolist() == ids[0, -5:].tolist()
