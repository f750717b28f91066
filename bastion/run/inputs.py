"""Parse and validate a ``bastion run`` prompt file (JSON Lines).

Each non-blank line is one JSON object, in either of two formats:

- bastion's own: ``{"id": ..., "prompt": "..."}`` or ``{"id": ..., "messages": [...]}``, with optional
  per-row settings (:mod:`bastion.run.settings`); ``id`` defaults to the line number;
- an OpenAI batch request: ``{"custom_id": ..., "method": "POST", "url": "/v1/chat/completions",
  "body": {"messages": [...], ...}}`` (or ``"/v1/completions"`` with a ``prompt``), see
  :mod:`bastion.run.openai`; :func:`bastion.run.parse.parse_input` reads a file of either.

Lines are split at ``\\n`` only (a JSON string may hold a raw U+2028 or other line separators that
``str.splitlines`` would cut at). Every problem is reported with its 1-based line number; a row with a
problem becomes a :class:`RowError` instead of a :class:`InputRow`, so a run can stop on the first report
or write error rows and go on.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from attrs import field, frozen

from bastion.utils.chat import check_messages
from bastion.contract.errors import InvalidInputError
from bastion.utils.text import split_jsonl_lines as split_lines
from bastion.run.settings import SETTING_KEYS, RowSettings, parse_settings

__all__ = ["InputRow", "RowError", "ParsedInput", "bastion_row", "id_key", "check_messages", "split_lines"]

_KNOWN_KEYS = frozenset({"id", "prompt", "messages"} | SETTING_KEYS)

#: the two request kinds of an OpenAI batch file (``url``)
Endpoint = Literal["/v1/chat/completions", "/v1/completions"]


def id_key(value: Any) -> str:
    """The canonical key of a row id (``1`` and ``"1"`` are different ids)."""
    return json.dumps(value, ensure_ascii=False)


@frozen
class OpenAIRequest:
    """Where an input row came from an OpenAI batch file: its endpoint and the ``model`` it named."""

    url: Endpoint
    model: str | None = None


@frozen
class InputRow:
    """One valid input row: ``line`` is 1-based in the input. ``raw``: True feeds ``prompt`` without the
    chat template whatever ``--raw`` says (an OpenAI ``/v1/completions`` request); None: ``--raw`` decides."""

    line: int
    id: str | int
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = field(default=None, converter=lambda m: None if m is None else tuple(m))
    settings: RowSettings = RowSettings()
    openai: OpenAIRequest | None = None
    raw: bool | None = None

    @property
    def key(self) -> str:
        return id_key(self.id)

    @property
    def max_new_tokens(self) -> int | None:
        """The row's own new-token limit, or None."""
        return self.settings.max_new_tokens

    def request(self) -> dict[str, Any]:
        """What the row asks the model, as JSON (the prompt or messages, the endpoint): the part of the
        row an output row was decoded from, besides its settings."""
        out: dict[str, Any] = {"prompt": self.prompt} if self.messages is None else {"messages": list(self.messages)}
        if self.openai is not None:
            out["openai"] = {"url": self.openai.url, "model": self.openai.model}
        return out


@frozen
class RowError:
    """An input line that cannot be decoded: where it is, its id when it has a usable one, and why.
    ``openai``: the line was an OpenAI batch request (its error row takes that format)."""

    line: int
    message: str
    id: str | int | None = None
    openai: bool = False

    def describe(self, source: str = "input") -> str:
        return f"{source} line {self.line}: {self.message}"


@frozen
class ParsedInput:
    """Every non-blank input line, in input order, as a valid row or an error."""

    items: tuple[InputRow | RowError, ...] = field(converter=tuple)

    @property
    def rows(self) -> tuple[InputRow, ...]:
        return tuple(i for i in self.items if isinstance(i, InputRow))

    @property
    def errors(self) -> tuple[RowError, ...]:
        return tuple(i for i in self.items if isinstance(i, RowError))


def _valid_id(value: Any) -> bool:
    return (isinstance(value, str) and value != "") or (isinstance(value, int) and not isinstance(value, bool))


def bastion_row(line: int, obj: dict[str, Any]) -> InputRow | RowError:
    rid = obj.get("id", line)
    if not _valid_id(rid):
        return RowError(line, f"'id' must be a non-empty string or an integer, got {rid!r}")
    unknown = sorted(set(obj) - _KNOWN_KEYS)
    if unknown:
        return RowError(line, f"unknown keys {unknown}; rows take {sorted(_KNOWN_KEYS)}", rid)
    has_prompt, has_messages = "prompt" in obj, "messages" in obj
    if has_prompt == has_messages:
        return RowError(line, "give exactly one of 'prompt' and 'messages'", rid)
    if has_prompt and (not isinstance(obj["prompt"], str) or not obj["prompt"]):
        return RowError(line, "'prompt' must be a non-empty string", rid)
    try:
        messages = check_messages(obj["messages"]) if has_messages else None
        settings = parse_settings(obj)
    except InvalidInputError as exc:
        return RowError(line, str(exc), rid)
    return InputRow(line=line, id=rid, prompt=obj.get("prompt"), messages=messages, settings=settings)


