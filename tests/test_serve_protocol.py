"""Request parsing and response shapes of the OpenAI-compatible server (no model, no sockets)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")

from bastion.contract.errors import BastionError, ComponentError, InvalidInputError
from bastion.serve.errors import BadRequestError, ServerError, UnavailableError, as_api_error
from bastion.serve.protocol import (
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    finish_reason,
    parse_chat,
    parse_completion,
)


def _body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def _bad(parse, raw: bytes) -> BadRequestError:  # type: ignore[no-untyped-def]
    with pytest.raises(BadRequestError) as info:
        parse(raw)
    return info.value


def test_completion_defaults_follow_openai() -> None:
    req = parse_completion(_body(model="m", prompt="hi"))
    assert (req.max_tokens, req.temperature, req.top_p, req.top_k, req.seed, req.stream) == (16, 1.0, 1.0, 0, None, False)
    assert req.prompt_value() == "hi" and req.stops() == () and not req.include_usage


def test_completion_prompt_forms_text_ids_and_singleton_lists() -> None:
    assert parse_completion(_body(model="m", prompt=[5, 6, 7])).prompt_value() == [5, 6, 7]
    assert parse_completion(_body(model="m", prompt=["a b"])).prompt_value() == "a b"
    assert parse_completion(_body(model="m", prompt=[[1, 2]])).prompt_value() == [1, 2]
    err = _bad(lambda raw: parse_completion(raw).prompt_value(), _body(model="m", prompt=["a", "b"]))
    assert err.param == "prompt"
    assert _bad(lambda raw: parse_completion(raw).prompt_value(), _body(model="m", prompt=[])).code == "empty_prompt"


def test_stop_accepts_a_string_or_a_list() -> None:
    assert parse_completion(_body(model="m", prompt="x", stop="\n")).stops() == ("\n",)
    assert parse_chat(_body(model="m", messages=[{"role": "user", "content": "x"}], stop=["a", "b"])).stops() == ("a", "b")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"logprobs": 3}, "logprobs"),
        ({"echo": True}, "echo"),
        ({"best_of": 2}, "best_of"),
        ({"suffix": "tail"}, "suffix"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"frequency_penalty": -1}, "frequency_penalty"),
    ],
)
def test_unsupported_completion_fields_are_refused_by_name(fields: dict, param: str) -> None:
    err = _bad(parse_completion, _body(model="m", prompt="x", **fields))
    assert err.status == 400 and err.param == param and err.code == "unsupported_field" and param in err.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"n": 3}, "n"),
    ],
)
def test_unsupported_chat_fields_are_refused_by_name(fields: dict, param: str) -> None:
    err = _bad(parse_chat, _body(model="m", messages=[{"role": "user", "content": "x"}], **fields))
    assert err.status == 400 and err.param == param and param in err.message


def test_neutral_values_of_unsupported_fields_are_accepted() -> None:
    parse_completion(_body(model="m", prompt="x", n=1, logprobs=None, echo=False, best_of=1, presence_penalty=0,
                           frequency_penalty=0.0, logit_bias={}))
    parse_chat(_body(model="m", messages=[{"role": "user", "content": "x"}], n=1, tools=[], tool_choice="none",
                     response_format={"type": "text"}, logprobs=False))


@pytest.mark.parametrize(
    ("raw", "param", "code"),
    [
        (b"{not json", None, "invalid_json"),
        (b"[1, 2]", None, "invalid_json"),
        (_body(prompt="x"), "model", "missing_field"),
        (_body(model="m", prompt="x", max_tokens="8"), "max_tokens", "invalid_value"),
        (_body(model="m", prompt="x", max_tokens=0), "max_tokens", "invalid_value"),
        (_body(model="m", prompt="x", max_tokens=2.5), "max_tokens", "invalid_value"),
        (_body(model="m", prompt="x", max_tokens=True), "max_tokens", "invalid_value"),
        (_body(model="m", prompt="x", temperature=-0.1), "temperature", "invalid_value"),
        (_body(model="m", prompt="x", temperature="hot"), "temperature", "invalid_value"),
        (_body(model="m", prompt="x", top_p=0), "top_p", "invalid_value"),
        (_body(model="m", prompt="x", seed=-1), "seed", "invalid_value"),
        (_body(model="m", prompt="x", stop=3), "stop", "invalid_value"),
        (_body(model="m", prompt="x", stream="yes"), "stream", "invalid_value"),
        (_body(model="m", prompt="x", stream_options={"bogus": True}), "stream_options.bogus", "unknown_field"),
        (_body(model="m", prompt="x", mystery=1), "mystery", "unknown_field"),
        (_body(model="m", prompt=3.5), "prompt", "invalid_value"),
    ],
)
def test_malformed_completion_requests_name_the_field(raw: bytes, param: str | None, code: str) -> None:
    err = _bad(parse_completion, raw)
    assert (err.param, err.code) == (param, code)
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([], "messages"),
        ([{"role": "tool", "content": "x"}], "messages.0.role"),
        ([{"role": "user"}, {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages.1.content.0.type"),
        ([{"content": "x"}], "messages.0.role"),
    ],
)
def test_malformed_chat_messages_name_the_field(messages: list, param: str) -> None:
    err = _bad(parse_chat, _body(model="m", messages=messages))
    assert err.param == param


def test_chat_messages_take_text_parts_and_echoed_empty_fields() -> None:
    req = parse_chat(_body(model="m", messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "2+"}, {"type": "text", "text": "3?"}]},
        {"role": "assistant", "content": "5", "refusal": None, "tool_calls": None},
        {"role": "user", "content": "and 4+4?"},
    ]))
    assert req.conversation() == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "5"}, {"role": "user", "content": "and 4+4?"},
    ]
    echoed = parse_chat(_body(model="m", messages=[{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]))
    with pytest.raises(BadRequestError) as info:
        echoed.conversation()
    assert info.value.param == "messages.0.tool_calls"


def test_chat_token_limit_prefers_max_completion_tokens() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert parse_chat(_body(**base)).token_limit() is None
    assert parse_chat(_body(**base, max_tokens=9)).token_limit() == 9
    assert parse_chat(_body(**base, max_tokens=9, max_completion_tokens=4)).token_limit() == 4


def test_finish_reasons_map_engine_stop_reasons() -> None:
    assert [finish_reason(r) for r in ("eos", "stop", "length", "position-limit", None)] == ["stop", "stop", "length", "length", None]


def test_responses_and_chunks_have_openai_shapes() -> None:
    done = completion_response("cmpl-1", "m", "hi", "eos", 3, 2)
    assert done["object"] == "text_completion" and done["choices"][0]["finish_reason"] == "stop"
    assert done["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chat = chat_response("chatcmpl-1", "m", "hi", "length", 3, 2)
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"} and chat["choices"][0]["finish_reason"] == "length"
    piece = completion_chunk("cmpl-1", "m", 0, "a", with_usage=True)
    assert piece["choices"][0]["text"] == "a" and piece["usage"] is None
    assert "usage" not in completion_chunk("cmpl-1", "m", 0, "a")
    last = chat_chunk("c", "m", 0, None, usage_={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 2


def test_errors_map_to_statuses_and_stay_bastion_errors() -> None:
    assert as_api_error(InvalidInputError("bad")).status == 400
    component = as_api_error(ComponentError("budget controller X.decide_width raised RuntimeError: boom"))
    assert isinstance(component, ServerError) and component.status == 500 and "budget controller X" in component.message
    assert as_api_error(RuntimeError("boom")).status == 500
    full = UnavailableError("full", retry_after=3)
    assert full.status == 503 and full.headers == {"Retry-After": "3"}
    assert all(isinstance(e, BastionError) for e in (component, full, BadRequestError("x")))
