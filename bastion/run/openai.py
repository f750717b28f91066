"""The OpenAI batch file format in ``bastion run``: request lines in, response lines out.

A request line is ``{"custom_id": "...", "method": "POST", "url": "/v1/chat/completions", "body":
{"model": ..., "messages": [...], "max_tokens": ..., "temperature": ..., ...}}``; ``url``
``/v1/completions`` takes a ``prompt`` text instead, fed to the model as it is (no chat template), as that
endpoint does. ``method`` and ``url`` may be left out (``url`` then follows from the body). The body's
settings are the per-row settings of :mod:`bastion.run.settings`; ``model``, ``user``, ``n`` (1) and
``stream`` (false) are accepted as well.

The output line of such a request has the shape of an OpenAI batch output line: ``{"id", "custom_id",
"response": {"status_code": 200, "request_id", "body": {... "choices": [...], "usage": {...}}}, "error":
null}``, with bastion's own numbers (token ids, acceptance length, ...) under ``body.bastion``. A request
that cannot be decoded gets ``"response": null, "error": {"code": "invalid_request", "message", "line"}``.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from bastion.contract.errors import InvalidInputError
from bastion.contract.types import GenerationResult
from bastion.run.inputs import InputRow, OpenAIRequest, RowError, check_messages
from bastion.run.settings import SETTING_KEYS, parse_settings

__all__ = ["is_request", "parse_request", "is_response_row", "ok_response", "error_response", "response_key_parts"]

_LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})
_BODY_KEYS = frozenset({"model", "messages", "prompt", "user", "n", "stream"} | SETTING_KEYS)
_URLS = ("/v1/chat/completions", "/v1/completions")
_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "position-limit": "length"}


def is_request(obj: Mapping[str, Any]) -> bool:
    """Whether an input object is an OpenAI batch request line (it has ``custom_id`` or ``body``)."""
    return "custom_id" in obj or "body" in obj


def _request(line: int, obj: Mapping[str, Any]) -> InputRow:
    unknown = sorted(set(obj) - _LINE_KEYS)
    if unknown:
        raise InvalidInputError(f"unknown keys {unknown}; an OpenAI batch request takes {sorted(_LINE_KEYS)}")
    if obj.get("method", "POST") != "POST":
        raise InvalidInputError(f"'method' must be \"POST\", got {obj['method']!r}")
    body = obj.get("body")
    if not isinstance(body, dict):
        raise InvalidInputError(f"'body' must be a JSON object, got {type(body).__name__}")
    url = obj.get("url", _URLS[0] if "messages" in body else _URLS[1])
    if url not in _URLS:
        raise InvalidInputError(f"'url' must be one of {list(_URLS)}, got {url!r}")
    unknown = sorted(set(body) - _BODY_KEYS)
    if unknown:
        raise InvalidInputError(f"unknown body keys {unknown}; bastion run reads {sorted(_BODY_KEYS)}")
    if body.get("n", 1) != 1:
        raise InvalidInputError(f"body field 'n': only 1 completion per request, got {body['n']!r}")
    if body.get("stream", False) is not False:
        raise InvalidInputError("body field 'stream': a batch request cannot stream; leave it out or set false")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidInputError(f"body field 'model' must be a string, got {model!r}")
    settings = parse_settings(body)
    if url == "/v1/chat/completions":
        if "prompt" in body or "messages" not in body:
            raise InvalidInputError(f"{url} takes 'messages' in its body, not 'prompt'")
        return InputRow(line, obj["custom_id"], messages=check_messages(body["messages"]), settings=settings,
                        openai=OpenAIRequest(url, model))  # fmt: skip
    prompt = body.get("prompt")
    if "messages" in body or not isinstance(prompt, str) or not prompt:
        raise InvalidInputError(f"{url} takes a non-empty string 'prompt' in its body, not 'messages'")
    return InputRow(line, obj["custom_id"], prompt=prompt, settings=settings, openai=OpenAIRequest(url, model), raw=True)


def parse_request(line: int, obj: Mapping[str, Any]) -> InputRow | RowError:
    """The input row of an OpenAI batch request line, or a :class:`RowError` saying what is wrong."""
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return RowError(line, f"'custom_id' must be a non-empty string, got {cid!r}", openai=True)
    try:
        return _request(line, obj)
    except InvalidInputError as exc:
        return RowError(line, str(exc), cid, openai=True)


def ok_response(row: InputRow, result: GenerationResult, text: str, *, prompt_tokens: int, model: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The output line of a decoded OpenAI request (``extra``: bastion's own numbers, under ``body.bastion``)."""
    assert row.openai is not None
    finish = _FINISH.get(result.stop_reason, "stop")
    if row.openai.url == "/v1/chat/completions":
        kind, choice = "chat.completion", {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        kind, choice = "text_completion", {"index": 0, "text": text}
    new = len(result.tokens)
    body = {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{row.line}",
        "object": kind,
        "created": int(time.time()),
        "model": row.openai.model or model,
        "choices": [{**choice, "logprobs": None, "finish_reason": finish}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": new, "total_tokens": prompt_tokens + new},
        "bastion": extra,
    }
    return {"id": f"batch_req_{row.line}", "custom_id": row.id, "response": {"status_code": 200, "request_id": f"req_{row.line}", "body": body}, "error": None}


def error_response(error: RowError) -> dict[str, Any]:
    """The output line of an OpenAI request that could not be decoded."""
    return {
        "id": f"batch_req_{error.line}",
        "custom_id": error.id,
        "response": None,
        "error": {"code": "invalid_request", "message": error.message, "line": error.line},
    }


def is_response_row(obj: Mapping[str, Any]) -> bool:
    """Whether an output object is a line :func:`ok_response` or :func:`error_response` wrote."""
    if not {"custom_id", "response", "error"} <= set(obj):
        return False
    error, response = obj["error"], obj["response"]
    if error is None:
        return isinstance(response, dict) and isinstance(response.get("body"), dict) and "bastion" in response["body"]
    return isinstance(error, dict) and isinstance(error.get("line"), int)


def response_key_parts(obj: Mapping[str, Any]) -> tuple[bool, Any]:
    """(decoded?, the custom_id when decoded, else the input line) of an output line."""
    if obj["error"] is None:
        return True, obj["custom_id"]
    return False, obj["error"]["line"]
