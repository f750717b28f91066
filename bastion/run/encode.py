"""Turn validated input rows into token ids: chat template for ``messages`` (and, unless raw, for a
``prompt`` as one user turn), and the check that the prompt leaves the target room to generate."""

from __future__ import annotations

from typing import Any

from attrs import field, frozen

from bastion.core.chat import chat_ids, has_chat_template, user_turn
from bastion.core.errors import InvalidInputError
from bastion.run.inputs import InputRow, RowError

__all__ = ["EncodedRow", "encode_row", "encode_rows", "has_chat_template", "messages_ids", "prompt_ids"]


@frozen
class EncodedRow:
    """A valid input row with its prompt token ids and the number of new tokens it asks for."""

    row: InputRow
    ids: tuple[int, ...] = field(converter=tuple)
    max_new_tokens: int


def _require(tokenizer: Any) -> Any:
    if tokenizer is None:
        raise InvalidInputError("the target has no tokenizer files; pass a target directory with a tokenizer")
    return tokenizer


def messages_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of a conversation rendered with the tokenizer's chat template plus the generation prompt."""
    if not has_chat_template(_require(tokenizer)):
        raise InvalidInputError("'messages' need a tokenizer with a chat template; this one has none")
    return chat_ids(tokenizer, messages)


def prompt_ids(tokenizer: Any, prompt: str, *, raw: bool = False) -> list[int]:
    """Token ids of a prompt text: one user turn under the chat template when the tokenizer has one,
    the text as it is with ``raw`` or without a template."""
    _require(tokenizer)
    if not raw and has_chat_template(tokenizer):
        return messages_ids(tokenizer, user_turn(prompt))
    return list(tokenizer.encode(prompt))


def encode_row(row: InputRow, tokenizer: Any, *, raw: bool = False) -> list[int]:
    """Token ids of one input row's prompt (``messages`` always go through the chat template)."""
    if row.messages is not None:
        return messages_ids(tokenizer, [dict(m) for m in row.messages])
    assert row.prompt is not None
    return prompt_ids(tokenizer, row.prompt, raw=raw)


def encode_rows(
    items: tuple[InputRow | RowError, ...],
    tokenizer: Any,
    *,
    max_positions: int,
    default_max_new_tokens: int,
    raw: bool = False,
) -> list[EncodedRow | RowError]:
    """Encode every valid row; a row whose prompt is empty or leaves no position to generate into
    becomes a :class:`RowError` naming its line. Errors from parsing pass through in place."""
    out: list[EncodedRow | RowError] = []
    for item in items:
        if isinstance(item, RowError):
            out.append(item)
            continue
        try:
            ids = encode_row(item, tokenizer, raw=raw)
        except InvalidInputError as exc:
            out.append(RowError(item.line, str(exc), item.id))
            continue
        if not ids:
            out.append(RowError(item.line, "the prompt encodes to no tokens", item.id))
        elif len(ids) >= max_positions:
            out.append(
                RowError(
                    item.line,
                    f"prompt too long: {len(ids)} tokens, the target takes at most {max_positions} positions "
                    "(prompt plus at least one new token)",
                    item.id,
                )
            )
        else:
            out.append(EncodedRow(item, ids, item.max_new_tokens or default_max_new_tokens))
    return out
