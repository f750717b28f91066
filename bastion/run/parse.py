"""Read a ``bastion run`` prompt file: each line in bastion's own row format (:mod:`bastion.run.inputs`)
or as an OpenAI batch request (:mod:`bastion.run.openai`)."""

from __future__ import annotations

import json
from typing import Any

from bastion.run.inputs import InputRow, ParsedInput, RowError, bastion_row, split_lines
from bastion.run.openai import is_request, parse_request

__all__ = ["parse_input"]


def _row(line: int, obj: Any) -> InputRow | RowError:
    if not isinstance(obj, dict):
        return RowError(line, f"expected a JSON object, got {type(obj).__name__}")
    if is_request(obj):
        return parse_request(line, obj)
    return bastion_row(line, obj)



def parse_input(text: str) -> ParsedInput:
    """Parse JSON Lines ``text``: one item per non-blank line. Malformed JSON, wrong types, bad settings
    and duplicate ids become :class:`RowError` s (a duplicate keeps its first occurrence as the valid
    row; a row without ``id`` has its line number as id)."""
    items: list[InputRow | RowError] = []
    first_line: dict[str, int] = {}
    for line_no, raw in enumerate(split_lines(text), start=1):
        if not raw.strip(" \t\r"):
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
                name = "id" if item.openai is None else "custom_id"
                item = RowError(line_no, f"duplicate {name} {item.id!r} (first on line {seen})", item.id, item.openai is not None)
            else:
                first_line[item.key] = line_no
        items.append(item)
    return ParsedInput(items)
