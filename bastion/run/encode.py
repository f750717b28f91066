"""Turn validated input rows into token ids: chat template for ``messages`` (and, unless raw, for a
``prompt`` as one user turn), and the check that the prompt leaves the target room to generate."""

from __future__ import annotations

from typing import Any

from attrs import field, frozen

from bastion.utils.chat import chat_ids, has_chat_template, user_turn
from bastion.contract.errors import InvalidInputError
from bastion.run.inputs import InputRow, RowError
from bastion.run.settings import Decode, resolve

__all__ = ["EncodedRow", "encode_row", "encode_rows", "has_chat_template", "messages_ids", "prompt_ids"]


@frozen
class EncodedRow:
    """A valid input row with its prompt token ids and the settings it is decoded with."""

    row: InputRow
    ids: tuple[int, ...] = field(converter=tuple)
    decode: Decode

    @property
    def max_new_tokens(self) -> int:
        return self.decode.max_new_tokens


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
    """Token ids of one input row's prompt (``messages`` always go through the chat template; a row's
    own ``raw`` overrides the ``raw`` argument)."""
    if row.messages is not None:
        return messages_ids(tokenizer, [dict(m) for m in row.messages])
    assert row.prompt is not None
    return prompt_ids(tokenizer, row.prompt, raw=raw if row.raw is None else row.raw)


def encode_rows(
    items: tuple[InputRow | RowError, ...],
    tokenizer: Any,
    *,
    max_positions: int,
    defaults: Decode,
    raw: bool = False,
) -> list[EncodedRow | RowError]:
    """Encode every valid row, decoded with its own settings over ``defaults`` (the command line's);
    a row whose prompt is empty or leaves no position to generate into becomes a :class:`RowError`
    naming its line. Errors from parsing pass through in place."""
    out: list[EncodedRow | RowError] = []
    for item in items:
        if isinstance(item, RowError):
            out.append(item)
            continue
        openai = item.openai is not None
        try:
            ids = encode_row(item, tokenizer, raw=raw)
            decode = resolve(item.settings, defaults, item.line)
        except InvalidInputError as exc:
            out.append(RowError(item.line, str(exc), item.id, openai))
            continue
        if decode.stop and tokenizer is None:
            out.append(RowError(item.line, "stop strings need a tokenizer; this target has none", item.id, openai))
        elif not ids:
            out.append(RowError(item.line, "the prompt encodes to no tokens", item.id, openai))
        elif len(ids) >= max_positions:
            out.append(
                RowError(
                    item.line,
                    f"prompt too long: {len(ids)} tokens, the target takes at most {max_positions} positions "
                    "(prompt plus at least one new token)",
                    item.id,
                    openai,
                )
            )
        else:
            out.append(EncodedRow(item, ids, decode))
    return out
