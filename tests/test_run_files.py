"""``bastion run`` input parsing and output files: per-line errors, torn-line repair, keys, order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bastion.contract.errors import InvalidInputError
from bastion.run.inputs import InputRow, RowError
from bastion.run.parse import parse_input
from bastion.run.journal import RowWriter, read_rows, row_key, write_rows_atomic

ids = st.one_of(st.integers(-5, 30), st.text("abc", min_size=1, max_size=3))


def _line(obj: object) -> str:
    return json.dumps(obj) + "\n"


def test_every_bad_line_is_reported_with_its_line_number_and_good_rows_stay() -> None:
    text = "".join(
        [
            _line({"id": 1, "prompt": "hi"}),
            "{not json\n",
            "\n",  # blank lines are skipped, but counted
            _line({"id": 1, "prompt": "again"}),
            _line({"prompt": "no id"}),
            _line({"id": 2, "prompt": "x", "messages": [{"role": "user", "content": "y"}]}),
            _line({"id": 3, "messages": [{"role": "user"}]}),
            _line({"id": 4, "prompt": "ok", "max_new_tokens": 0}),
            _line([1, 2]),
            _line({"id": True, "prompt": "bool id"}),
            _line({"id": 5, "prompt": "ok", "extra": 1}),
            _line({"id": "m", "messages": [{"role": "user", "content": "hello"}], "max_new_tokens": 3}),
        ]
    )
    parsed = parse_input(text)
    errors = {e.line: e.message for e in parsed.errors}
    assert sorted(errors) == [2, 4, 6, 7, 8, 9, 10, 11]
    assert "malformed JSON" in errors[2]
    assert "duplicate id 1 (first on line 1)" in errors[4]
    assert "exactly one of 'prompt' and 'messages'" in errors[6]
    assert "messages[0]" in errors[7]
    assert "max_new_tokens" in errors[8]
    assert "JSON object" in errors[9]
    assert "'id'" in errors[10]
    assert "unknown keys ['extra']" in errors[11]
    rows = parsed.rows
    assert [(r.line, r.id) for r in rows] == [(1, 1), (5, 5), (12, "m")]  # no id: the line number
    assert rows[2].max_new_tokens == 3 and rows[2].messages == ({"role": "user", "content": "hello"},)


@given(st.lists(ids, max_size=25))
def test_each_id_is_valid_once_and_every_repeat_is_a_duplicate_error(row_ids: list) -> None:
    parsed = parse_input("".join(_line({"id": i, "prompt": "p"}) for i in row_ids))
    assert len(parsed.items) == len(row_ids)
    seen: set[str] = set()
    for line, (rid, item) in enumerate(zip(row_ids, parsed.items), start=1):
        key = json.dumps(rid)
        assert item.line == line
        if key in seen:
            assert isinstance(item, RowError) and "duplicate id" in item.message
        else:
            assert isinstance(item, InputRow) and item.id == rid
        seen.add(key)


def _rows(n: int) -> list[dict]:
    return [
        {"id": i, "text": "é" * i, "token_ids": list(range(i)), "new_tokens": i, "acceptance_length": 1.0,
         "mean_budget": 1.0, "seconds": 0.0, "stop_reason": "length"}
        for i in range(n)
    ]


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=30)
@given(n=st.integers(1, 6), cut=st.integers(1, 10_000))
def test_a_torn_last_line_is_cut_off_and_every_complete_row_is_kept(tmp_path: Path, n: int, cut: int) -> None:
    path = tmp_path / "out.jsonl"
    path.unlink(missing_ok=True)  # one file per example
    rows = _rows(n)
    with RowWriter(path) as w:
        w.write(rows)
    data = path.read_bytes()
    last_start = data.rstrip(b"\n").rfind(b"\n") + 1
    keep = last_start + cut % (len(data) - last_start)  # cut inside the last line (its newline included)
    path.write_bytes(data[:keep])
    back = read_rows(path)
    assert list(back.rows) == rows[:-1]
    assert back.torn_bytes == keep - last_start
    assert path.read_bytes() == data[:last_start]  # the file now ends with the last complete line
    with RowWriter(path) as w:  # appending after the repair gives a clean file
        w.write(rows[-1:])
    assert list(read_rows(path).rows) == rows


def test_a_bad_line_before_the_last_is_an_error_naming_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    lines = [json.dumps(r) for r in _rows(3)]
    path.write_text("\n".join([lines[0], "garbage", lines[2]]) + "\n")
    with pytest.raises(InvalidInputError, match=r"out.jsonl line 2: not a bastion run output row"):
        read_rows(path)


def test_read_without_repair_leaves_another_writers_file_alone(tmp_path: Path) -> None:
    path = tmp_path / "part.jsonl"
    data = "".join(_line(r) for r in _rows(2)) + '{"id": 2, "te'
    path.write_text(data)
    back = read_rows(path, repair=False)
    assert len(back.rows) == 2 and back.torn_bytes == len('{"id": 2, "te')
    assert path.read_text() == data


def test_error_rows_are_keyed_by_line_and_decoded_rows_by_id(tmp_path: Path) -> None:
    assert row_key({"id": 1, "token_ids": []}) == "id:1"
    assert row_key({"id": "1", "token_ids": []}) == 'id:"1"'
    assert row_key({"id": None, "line": 7, "error": "bad"}) == "line:7"
    path = tmp_path / "x.jsonl"
    write_rows_atomic(path, _rows(2))
    write_rows_atomic(path, _rows(1))  # replaces, never appends
    assert list(read_rows(path).rows) == _rows(1)
    assert not list(tmp_path.glob(".*.tmp"))


def test_an_unterminated_last_line_that_is_json_but_no_row_is_refused_not_cut(tmp_path: Path) -> None:
    path = tmp_path / "notes.jsonl"
    path.write_text('{"note": 1}')
    with pytest.raises(InvalidInputError, match=r"notes.jsonl line 1: not a bastion run output row"):
        read_rows(path)
    assert path.read_text() == '{"note": 1}'


def test_a_whole_row_without_its_newline_is_torn_and_redone(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    rows = _rows(2)
    path.write_text(_line(rows[0]) + json.dumps(rows[1]))  # the crash came before the newline
    back = read_rows(path)
    assert list(back.rows) == rows[:1] and path.read_text() == _line(rows[0])


def test_a_raw_line_separator_inside_a_json_string_stays_one_line() -> None:
    text = json.dumps({"id": 1, "prompt": "a\u2028b\u2029c\x85d\x0ce"}, ensure_ascii=False) + "\r\n" + _line({"prompt": "x"})
    parsed = parse_input(text)
    assert not parsed.errors
    assert [(r.line, r.id, r.prompt) for r in parsed.rows] == [(1, 1, "a\u2028b\u2029c\x85d\x0ce"), (2, 2, "x")]


def test_openai_batch_requests_parse_and_every_bad_request_names_its_field() -> None:
    good = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7, "seed": 3, "stop": "x"}}
    lines = [
        good,
        {"custom_id": "b", "body": {"prompt": "raw text", "temperature": 0.5}},
        {"custom_id": "c", "method": "GET", "url": "/v1/chat/completions", "body": {"messages": []}},
        {"custom_id": "d", "url": "/v1/embeddings", "body": {"input": "x"}},
        {"custom_id": "e", "body": {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {}}},
        {"body": {"prompt": "no custom id"}},
        {"custom_id": "a", "body": {"prompt": "duplicate"}},
        {"custom_id": "f", "url": "/v1/completions", "body": {"prompt": "x", "max_tokens": 0}},
    ]  # fmt: skip
    parsed = parse_input("".join(_line(o) for o in lines))
    first, second = parsed.rows
    assert first.id == "a" and first.openai is not None and first.openai.model == "m"
    assert (first.settings.max_new_tokens, first.settings.seed, first.settings.stop) == (7, 3, ("x",))
    assert second.prompt == "raw text" and second.raw is True and second.openai.url == "/v1/completions"
    errors = {e.line: e.message for e in parsed.errors}
    assert all(e.openai for e in parsed.errors)
    assert "'method'" in errors[3]
    assert "'url'" in errors[4]
    assert "unknown body keys ['logit_bias']" in errors[5]
    assert "'custom_id'" in errors[6]
    assert "duplicate custom_id 'a' (first on line 1)" in errors[7]
    assert "field 'max_tokens'" in errors[8]
