"""Chat-template encoding: the one place that turns a conversation into the target's prompt, and the one
rule a conversation must follow (:func:`check_messages`) on every path: ``Pipeline.generate`` / ``chat``
/ ``generate_batch``, ``bastion run`` rows and OpenAI batch requests, training prompt files."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from bastion.contract.errors import InvalidInputError

__all__ = ["chat_ids", "chat_text", "check_messages", "has_chat_template", "message_text", "user_turn"]


def message_text(content: Any) -> str | None:
    """A message's text: a string, or OpenAI's list of ``{"type": "text", "text": ...}`` parts joined;
    None for anything else (None, numbers, images...)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and all(
        isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return None


def check_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    """``messages`` as a tuple of ``{"role": str, "content": str, ...}`` dicts (text parts joined). A
    conversation that is not a non-empty list of such objects raises :class:`InvalidInputError` naming
    the message at fault (``messages[0]`` without ``content``, a ``content`` of None, a role that is not
    a string) instead of rendering an empty turn."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidInputError('\'messages\' must be a non-empty list of {"role": ..., "content": ...} objects')
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidInputError(f"messages[{k}] must be an object with a string 'role' and a text 'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise InvalidInputError(f"messages[{k}]: 'role' must be a non-empty string, got {m.get('role')!r}")
        text = message_text(m.get("content"))
        if text is None:
            got = "no 'content'" if "content" not in m else f"content {m['content']!r}"
            raise InvalidInputError(f"messages[{k}] ({m['role']}): 'content' must be text (a string or text parts), got {got}")
        out.append({**m, "content": text})
    return tuple(out)


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` can render conversations (a Hugging Face tokenizer with a chat template)."""
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def user_turn(text: str) -> list[dict[str, str]]:
    """A conversation of one user message."""
    return [{"role": "user", "content": text}]


def chat_text(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> str:
    """``messages`` rendered with the tokenizer's chat template, ending in the assistant's generation
    prompt. Raises :class:`InvalidInputError` when the tokenizer has no chat template."""
    checked = check_messages(messages)
    if not has_chat_template(tokenizer):
        raise InvalidInputError("chat messages need a tokenizer with a chat template; this one has none")
    return str(tokenizer.apply_chat_template(list(checked), tokenize=False, add_generation_prompt=True))


def chat_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Token ids of :func:`chat_text` (no extra special tokens: the template already holds them)."""
    return list(tokenizer.encode(chat_text(tokenizer, messages), add_special_tokens=False))
