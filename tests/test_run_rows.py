"""``bastion run`` rows: ids default to the line, per-row settings decode as ``generate`` would with them,
OpenAI batch files in and out, a raw U+2028 in a prompt, and a rerun with nothing left."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bastion.cli.main import main
from bastion.testing.tiny import TinyPair, save_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture(scope="module")
def pipe(pair: TinyPair):  # type: ignore[no-untyped-def]
    from bastion import Pipeline

    return Pipeline.from_pretrained(pair.target, pair.drafter)


def _args(pair: TinyPair, inp: Path, out: Path, *extra: str) -> list[str]:
    return [
        "run", "--input", str(inp), "--output", str(out), "--target", str(pair.target), "--drafter", str(pair.drafter),
        "--max-new-tokens", "6", "--batch-size", "8", "--device", "cpu", "--threads", "1", "--no-progress", *extra,
    ]  # fmt: skip


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def _ids(pipe, row: dict) -> torch.Tensor:  # type: ignore[no-untyped-def]
    from bastion.run.encode import messages_ids, prompt_ids

    if "messages" in row:
        return torch.tensor([messages_ids(pipe.tokenizer, row["messages"])])
    return torch.tensor([prompt_ids(pipe.tokenizer, row["prompt"])])


def test_rows_without_an_id_take_their_line_number(pair: TinyPair, tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "first"}\n\n{"prompt": "third line"}\n', encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert main(_args(pair, inp, out)) == 0
    assert [r["id"] for r in _read(out)] == [1, 3]


def test_per_row_settings_decode_as_generate_does_with_them(pair: TinyPair, pipe, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    rows = [
        {"id": "greedy", "prompt": "What is 2+3?"},
        {"id": "short", "prompt": "Name a prime.", "max_tokens": 3},
        {"id": "sampled", "prompt": "Tell me a story.", "temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 11},
        {"id": "seeded-twin", "prompt": "Tell me a story.", "temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 12},
        {"id": "default-seed", "messages": [{"role": "user", "content": "Hi"}], "temperature": 1.0, "max_new_tokens": 5},
        {"id": "greedy-2", "prompt": "Why?"},
    ]
    probe = pipe.generate(_ids(pipe, rows[0]), max_new_tokens=6)  # a stop string the greedy row does meet
    cut = pipe.decode(probe.tokens)[2:4]
    rows.append({"id": "stopped", "prompt": "What is 2+3?", "stop": [cut]})
    out = tmp_path / "out.jsonl"
    assert main(_args(pair, _write(tmp_path / "in.jsonl", rows), out, "--seed", "100")) == 0
    got = {r["id"]: r for r in _read(out)}
    assert list(got) == [r["id"] for r in rows]
    for line, row in enumerate(rows, start=1):
        kw = {
            "max_new_tokens": row.get("max_tokens", row.get("max_new_tokens", 6)),
            "temperature": row.get("temperature", 0.0),
            "top_p": row.get("top_p", 1.0),
            "top_k": row.get("top_k", 0),
            "seed": row.get("seed", 100 + line),
        }
        want = pipe.generate(_ids(pipe, row), stop=row.get("stop"), **kw)
        assert got[row["id"]]["token_ids"] == want.tokens, row["id"]
        assert got[row["id"]]["stop_reason"] == want.stop_reason
        assert got[row["id"]]["text"] == want.text
    assert got["stopped"]["stop_reason"] == "stop" and cut not in got["stopped"]["text"]


def test_bad_per_row_settings_are_reported_by_line_and_field(pair: TinyPair, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        {"id": 0, "prompt": "ok"},
        {"id": 1, "prompt": "a", "temperature": -1},
        {"id": 2, "prompt": "b", "seed": -1},
        {"id": 3, "prompt": "c", "top_p": 0},
        {"id": 4, "prompt": "d", "stop": [""]},
        {"id": 5, "prompt": "e", "max_tokens": 2, "max_new_tokens": 3},
        {"id": 6, "prompt": "f", "top_k": 1.5},
    ]
    out = tmp_path / "out.jsonl"
    assert main(_args(pair, _write(tmp_path / "in.jsonl", rows), out)) == 2
    err = capsys.readouterr().err
    assert "6 input lines cannot be decoded" in err
    for line, field in ((2, "temperature"), (3, "seed"), (4, "top_p"), (5, "stop"), (7, "top_k")):
        assert f"input line {line}: field '{field}'" in err
    assert "input line 6: give one of ['max_new_tokens', 'max_tokens'], not several" in err


def test_an_openai_batch_file_gives_openai_batch_output_lines(pair: TinyPair, pipe, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    requests = [
        {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "my-model", "messages": chat, "max_tokens": 4}},
        {"custom_id": "req-2", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Once upon a time", "max_tokens": 3}},
        {"custom_id": "req-3", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": chat, "n": 2}},
    ]  # fmt: skip
    out = tmp_path / "out.jsonl"
    assert main(_args(pair, _write(tmp_path / "batch.jsonl", requests), out, "--on-error", "skip")) == 0
    lines = _read(out)
    assert [r["custom_id"] for r in lines] == ["req-1", "req-2", "req-3"]
    first, second, bad = lines
    assert first["error"] is None and first["response"]["status_code"] == 200
    body = first["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "my-model"
    ids = _ids(pipe, {"messages": [chat[0], {"role": "user", "content": "Hello"}]})
    want = pipe.generate(ids, max_new_tokens=4)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": want.text}
    assert body["choices"][0]["finish_reason"] == ("length" if want.stop_reason == "length" else "stop")
    assert body["usage"] == {"prompt_tokens": ids.shape[1], "completion_tokens": len(want.tokens), "total_tokens": ids.shape[1] + len(want.tokens)}
    assert body["bastion"]["token_ids"] == want.tokens
    raw = pipe.generate(torch.tensor([pipe.tokenizer.encode("Once upon a time")]), max_new_tokens=3)  # no chat template
    assert second["response"]["body"]["object"] == "text_completion"
    assert second["response"]["body"]["choices"][0]["text"] == raw.text
    assert bad["response"] is None and bad["error"]["line"] == 3 and "'n'" in bad["error"]["message"]


def test_a_raw_u2028_in_a_prompt_is_one_row(pair: TinyPair, tmp_path: Path) -> None:
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "sep", "prompt": "one\u2028two\x85three"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert "\u2028" in inp.read_text(encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert main(_args(pair, inp, out)) == 0
    assert [r["id"] for r in _read(out)] == ["sep"]


def test_a_rerun_with_nothing_left_loads_no_model_and_says_so(
    pair: TinyPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    inp = _write(tmp_path / "in.jsonl", [{"id": i, "prompt": f"q{i}"} for i in range(3)])
    out = tmp_path / "out.jsonl"
    assert main(_args(pair, inp, out)) == 0
    before = out.read_bytes()
    capsys.readouterr()

    def no_model(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("the model was loaded with nothing to decode")

    monkeypatch.setattr("bastion.cli.run_cmd.build_pipeline", no_model)
    assert main(_args(pair, inp, out)) == 0
    err = capsys.readouterr().err
    assert f"nothing to do: all 3 rows are in {out}" in err and "acceptance" not in err
    assert out.read_bytes() == before
