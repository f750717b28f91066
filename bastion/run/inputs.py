"""Parse and validate a ``bastion run`` prompt file (JSON Lines).

Each non-blank line is one JSON object: ``{"id": ..., "prompt": "..."}`` or ``{"id": ...,
"messages": [{"role": ..., "content": ...}, ...]}``, with an optional positive ``max_new_tokens``. Every
problem is reported with its 1-based line number; a row with a problem becomes a :class:`RowError`
instead of a :class:`InputRow`, so a run can stop on the first report or write error rows and go on.
"""

from __future__ import annotations

import json
from typing import Any

from attrs import field, frozen

__all__ = ["InputRow", "RowError", "ParsedInput", "parse_input", "id_key"]

_KNOWN_KEYS = frozenset({"id", "prompt", "messages", "max_new_tokens"})


def id_key(value: Any) -> str:
    """The canonical key of a row id (``1`` and ``"1"`` are different ids)."""
    return json.dumps(value, ensure_ascii=False)


@frozen
class InputRow:
    """One valid input row: ``line`` is 1-based in the input, ``index`` its place among all input lines."""

    line: int
    id: str | int
    prompt: str | None = None
    messages: tuple[dict[str, Any], ...] | None = field(default=None, converter=lambda m: None if m is None else tuple(m))
    max_new_tokens: int | None = None

    @property
    def key(self) -> str:
        return id_key(self.id)


@frozen
class RowError:
    """An input line that cannot be decoded: where it is, its id when it has a usable one, and why."""

    line: int
    message: str
    id: str | int | None = None

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


def _check_messages(messages: Any) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects"
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"messages[{k}] must be an object with string 'role' and 'content'"
    return None


def _row(line: int, obj: Any) -> InputRow | RowError:
    if not isinstance(obj, dict):
        return RowError(line, f"expected a JSON object, got {type(obj).__name__}")
    rid = obj.get("id")
    if "id" not in obj:
        return RowError(line, "missing 'id'")
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
    if has_messages:
        problem = _check_messages(obj["messages"])
        if problem:
            return RowError(line, problem, rid)
    mnt = obj.get("max_new_tokens")
    if mnt is not None and (not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 1):
        return RowError(line, f"'max_new_tokens' must be a positive integer, got {mnt!r}", rid)
    return InputRow(line=line, id=rid, prompt=obj.get("prompt"), messages=obj.get("messages"), max_new_tokens=mnt)


def parse_input(text: str) -> ParsedInput:
    """Parse JSON Lines ``text``: one item per non-blank line. Malformed JSON, wrong types, missing or
    duplicate ids become :class:`RowError` s (a duplicate keeps its first occurrence as the valid row)."""
    items: list[InputRow | RowError] = []
    first_line: dict[str, int] = {}
    for line_no, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            items.append(RowError(line_no, f"malformed JSON: {exc.msg} (column {exc.colno})"))
            continue
        item = _row(line_no, obj)
        if isinstance(item, InputRow):
            seen = first_line.get(item.key)
            if seen is not None:
                item = RowError(line_no, f"duplicate id {item.id!r} (first on line {seen})", item.id)
            else:
                first_line[item.key] = line_no
        items.append(item)
    return ParsedInput(items)
