"""Chat-template encoding: the one place that turns a conversation into the target's prompt."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from bastion.core.errors import InvalidInputError

__all__ = ["chat_ids", "chat_text", "has_chat_template", "user_turn"]


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` can render conversations (a Hugging Face tokenizer with a chat template)."""
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def user_turn(text: str) -> list[dict[str, str]]:
    """A conversation of one user message."""
    return [{"role": "user", "content": text}]


def chat_text(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> str:
    """``messages`` rendered with the tokenizer's chat template, ending in the assistant's generation
    prompt. Raises :class:`InvalidInputError` when the tokenizer has no chat template."""
    if not has_chat_template(tokenizer):
        raise InvalidInputError("chat messages need a tokenizer with a chat template; this one has none")
    return str(tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False, add_generation_prompt=True))


def chat_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Token ids of :func:`chat_text` (no extra special tokens: the template already holds them)."""
    return list(tokenizer.encode(chat_text(tokenizer, messages), add_special_tokens=False))
