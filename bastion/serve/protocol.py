"""OpenAI's request bodies as pydantic models, and the response bodies the server sends back.

:func:`parse_completion` and :func:`parse_chat` turn a request body (bytes) into a checked
:class:`CompletionRequest` / :class:`ChatRequest`, raising :class:`~bastion.serve.errors.BadRequestError`
(``param`` names the field) for malformed JSON, wrong types, out-of-range values, fields this server
does not support (``n`` > 1, ``logprobs``, tools, penalties...) and fields it does not know. Fields a
client commonly sends at their neutral value (``n: 1``, ``presence_penalty: 0``, ``logprobs: false``...)
are accepted, since they ask for nothing. The ``*_response`` and ``*_chunk`` functions build OpenAI's
response and streaming-chunk objects.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from bastion.serve.errors import BadRequestError

__all__ = [
    "ChatMessage",
    "ChatRequest",
    "CompletionRequest",
    "FINISH_REASONS",
    "StreamOptions",
    "chat_chunk",
    "chat_response",
    "completion_chunk",
    "completion_response",
    "finish_reason",
    "new_id",
    "parse_chat",
    "parse_completion",
    "usage",
]

#: the engine's stop reasons -> OpenAI's ``finish_reason``
FINISH_REASONS: dict[str, str] = {"eos": "stop", "stop": "stop", "length": "length", "position-limit": "length"}


def _none(v: Any) -> bool:
    return v is None


def _falsy(v: Any) -> bool:
    return v is None or v is False


def _one(v: Any) -> bool:
    return v is None or (v == 1 and not isinstance(v, bool))


def _zero(v: Any) -> bool:
    return v is None or (v == 0 and not isinstance(v, bool))


def _empty(v: Any) -> bool:
    return v is None or v == {} or v == []


def _no_tool_choice(v: Any) -> bool:
    return v is None or v == "none"


def _text_format(v: Any) -> bool:
    return v is None or v == {"type": "text"}


#: fields this server does not implement -> (accepts the value as neutral, what the field asks for)
_SHARED_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (_one, "more than one choice per request (n > 1)"),
    "logit_bias": (_empty, "logit biases"),
    "presence_penalty": (_zero, "a presence penalty"),
    "frequency_penalty": (_zero, "a frequency penalty"),
}
_COMPLETION_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    **_SHARED_UNSUPPORTED,
    "logprobs": (_falsy, "log-probabilities"),
    "echo": (_falsy, "echoing the prompt"),
    "best_of": (_one, "best-of sampling"),
    "suffix": (_none, "a suffix (insertion)"),
}
_CHAT_UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    **_SHARED_UNSUPPORTED,
    "logprobs": (_falsy, "log-probabilities"),
    "top_logprobs": (_zero, "log-probabilities"),
    "tools": (_empty, "tool calls"),
    "tool_choice": (_no_tool_choice, "tool calls"),
    "parallel_tool_calls": (_none, "tool calls"),
    "functions": (_empty, "function calls"),
    "function_call": (_no_tool_choice, "function calls"),
    "response_format": (_text_format, "a response format other than text"),
    "audio": (_none, "audio output"),
    "modalities": (lambda v: v is None or v == ["text"], "output modalities other than text"),
    "prediction": (_none, "predicted outputs"),
    "store": (_falsy, "stored completions"),
}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Model):
    """``stream_options``: ``include_usage`` adds a final chunk carrying the usage (and ``usage: null``
    on every other chunk)."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(_Model):
    """The fields completions and chat share."""

    model: str
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # an extension (vLLM's); 0 and -1 switch it off
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # an extension (vLLM's): decode to max_tokens past end-of-sequence tokens
    user: str | None = None  # an end-user id for the client's own records; it changes nothing here
    # neutral values of the unsupported fields (checked beforehand, see _check_unsupported)
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    def stops(self) -> tuple[str, ...]:
        """The stop strings as a tuple."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is text (fed as it is, no chat template) or token ids; a
    list holding one of either is accepted too (one prompt per request)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | bool | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None

    def prompt_value(self) -> str | list[int]:
        """The one prompt of the request: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise BadRequestError("prompt is empty: the prompt needs at least one token", param="prompt", code="empty_prompt")
        if all(isinstance(x, int) for x in p):
            return list(p)  # type: ignore[arg-type]
        if len(p) != 1:
            raise BadRequestError(
                f"prompt: this server takes one prompt per request, got a list of {len(p)}", param="prompt",
            )
        return p[0]  # type: ignore[return-value]


class TextPart(_Model):
    """One ``{"type": "text", "text": ...}`` part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message. Fields an OpenAI client echoes back from an earlier answer (``refusal``,
    ``tool_calls``...) are accepted when empty."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


#: message fields accepted only when empty (an assistant turn echoed back from a response)
_ECHOED_MESSAGE_FIELDS = ("refusal", "tool_calls", "function_call", "audio", "annotations")


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` go through the target's chat template. Without
    ``max_tokens`` (or ``max_completion_tokens``) the answer may use what the context window leaves, up
    to the server's cap."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    store: bool | None = None

    def token_limit(self) -> int | None:
        """``max_completion_tokens`` or ``max_tokens`` (None: the server's default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        """The messages as ``{"role", "content"}`` dicts for the chat template."""
        out = []
        for i, m in enumerate(self.messages):
            for key in _ECHOED_MESSAGE_FIELDS:
                if not _empty((m.model_extra or {}).get(key)):
                    raise BadRequestError(f"messages[{i}].{key} is not supported by this server", param=f"messages.{i}.{key}")
            extra = sorted(set(m.model_extra or {}) - set(_ECHOED_MESSAGE_FIELDS))
            if extra:
                raise BadRequestError(f"messages[{i}]: unknown field {extra[0]!r}", param=f"messages.{i}.{extra[0]}")
            out.append({"role": m.role, "content": m.text()})
        return out


def _load(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequestError(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise BadRequestError(f"the request body must be a JSON object, got {type(data).__name__}", code="invalid_json")
    return data


def _check_unsupported(data: dict[str, Any], table: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    for key, (neutral, what) in table.items():
        if key in data and not neutral(data[key]):
            raise BadRequestError(
                f"{key}={json.dumps(data[key])[:80]}: this server does not support {what}", param=key, code="unsupported_field",
            )


def _validate(model: type[BaseModel], data: dict[str, Any]) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first_loc = errors[0]["loc"][:1]
        # the branches of a union each report an error: the deepest one says most (a text part's type)
        err = max((e for e in errors if e["loc"][:1] == first_loc), key=lambda e: len(_field_path(e["loc"])))
        loc = _field_path(err["loc"])
        param = ".".join(loc) or None
        if err["type"] == "extra_forbidden":
            raise BadRequestError(f"unknown field {param!r}", param=param, code="unknown_field") from None
        if err["type"] == "missing":
            raise BadRequestError(f"{param} is required", param=param, code="missing_field") from None
        got = json.dumps(err.get("input"), default=str)[:80] if "input" in err else ""
        raise BadRequestError(f"{param}: {err['msg']}" + (f" (got {got})" if got else ""), param=param, code="invalid_value") from None


#: the names pydantic gives the branches of a union in an error's location (left out of ``param``)
_UNION_TAGS = {"str", "int", "float", "bool", "list[int]", "list[str]", "list[list[int]]", "list[TextPart]", "TextPart"}


def _field_path(loc: tuple[Any, ...]) -> list[str]:
    return [str(p) for p in loc if not (isinstance(p, str) and p in _UNION_TAGS)]


def parse_completion(body: bytes) -> CompletionRequest:
    """A checked completions request from its body (:class:`BadRequestError` naming the field)."""
    data = _load(body)
    _check_unsupported(data, _COMPLETION_UNSUPPORTED)
    return _validate(CompletionRequest, data)


def parse_chat(body: bytes) -> ChatRequest:
    """A checked chat request from its body (:class:`BadRequestError` naming the field)."""
    data = _load(body)
    _check_unsupported(data, _CHAT_UNSUPPORTED)
    return _validate(ChatRequest, data)


# ---------------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    """A fresh response id, e.g. ``cmpl-3f2a...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(stop_reason: str | None) -> str | None:
    """OpenAI's ``finish_reason`` for an engine stop reason (None while the request runs)."""
    return None if stop_reason is None else FINISH_REASONS.get(stop_reason, stop_reason)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}


def _choice(body: dict[str, Any], reason: str | None) -> dict[str, Any]:
    """The one choice of a response or chunk: ``body`` (its ``text``, ``message`` or ``delta``) between
    the index and the log-probabilities (none) and finish reason."""
    return {"index": 0, **body, "logprobs": None, "finish_reason": finish_reason(reason)}


def _response(kind: str, rid: str, model: str, body: dict[str, Any], reason: str | None, prompt_tokens: int,
              completion_tokens: int, created: int | None) -> dict[str, Any]:
    """A whole response object of ``kind`` (``"text_completion"``, ``"chat.completion"``) with one choice."""
    return {
        "id": rid, "object": kind, "created": created or int(time.time()), "model": model,
        "choices": [_choice(body, reason)],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def _chunk(kind: str, rid: str, model: str, created: int, body: dict[str, Any] | None, reason: str | None,
           usage_: dict[str, int] | None, with_usage: bool) -> dict[str, Any]:
    """One streamed chunk of ``kind``: one choice of ``body``, or (``body`` None) no choices. ``with_usage``
    adds the ``usage`` key (null except on the last chunk); a given ``usage_`` always does."""
    out: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model}
    out["choices"] = [] if body is None else [_choice(body, reason)]
    if with_usage or usage_ is not None:
        out["usage"] = usage_
    return out


def completion_response(rid: str, model: str, text: str, reason: str | None, prompt_tokens: int, completion_tokens: int,
                        created: int | None = None) -> dict[str, Any]:
    """A whole ``text_completion`` object."""
    return _response("text_completion", rid, model, {"text": text}, reason, prompt_tokens, completion_tokens, created)


def chat_response(rid: str, model: str, text: str, reason: str | None, prompt_tokens: int, completion_tokens: int,
                  created: int | None = None) -> dict[str, Any]:
    """A whole ``chat.completion`` object."""
    message = {"message": {"role": "assistant", "content": text}}
    return _response("chat.completion", rid, model, message, reason, prompt_tokens, completion_tokens, created)


def completion_chunk(rid: str, model: str, created: int, text: str | None, reason: str | None = None,
                     usage_: dict[str, int] | None = None, *, with_usage: bool = False) -> dict[str, Any]:
    """One streamed ``text_completion`` chunk: a piece of text, or (``text`` None) the usage-only
    last chunk with no choices. ``with_usage`` adds the ``usage`` key (null except on the last chunk)."""
    body = None if text is None else {"text": text}
    return _chunk("text_completion", rid, model, created, body, reason, usage_, with_usage)


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any] | None, reason: str | None = None,
               usage_: dict[str, int] | None = None, *, with_usage: bool = False) -> dict[str, Any]:
    """One streamed ``chat.completion.chunk``: a delta (``{"role": ...}``, ``{"content": ...}`` or
    ``{}`` with the finish reason), or (``delta`` None) the usage-only last chunk with no choices."""
    body = None if delta is None else {"delta": delta}
    return _chunk("chat.completion.chunk", rid, model, created, body, reason, usage_, with_usage)
