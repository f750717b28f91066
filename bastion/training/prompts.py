"""The user's own distillation prompts: a JSONL file with one ``prompt`` or ``messages`` per line.

- ``{"prompt": "..."}`` becomes one user turn under the tokenizer's chat template (the text is fed as it
  is when the tokenizer has none, or with ``"raw": true`` for plain completions such as code);
- ``{"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}`` is rendered with the
  chat template and the generation prompt; a trailing assistant turn is dropped, because the drafter
  learns from what the target itself answers, not from the answer stored in the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bastion.utils.chat import check_messages
from bastion.contract.errors import InvalidInputError
from bastion.utils.files import read_text_file
from bastion.utils.text import split_jsonl_lines

__all__ = ["USER_SOURCE", "read_user_prompts", "render_row"]

#: the ``source`` label of sequences distilled from the user's prompts
USER_SOURCE = "user"


def _chat(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def _has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def render_row(row: Any, tokenizer: Any, where: str) -> str:
    """The prompt text of one JSONL row (see the module doc)."""
    if not isinstance(row, dict):
        raise InvalidInputError(f"{where}: each line must be a JSON object with 'prompt' or 'messages'")
    if "messages" in row:
        try:
            checked = check_messages(row["messages"])  # the rule of every path: no content of None, no empty turn
        except InvalidInputError as exc:
            raise InvalidInputError(f"{where}: {exc}") from None
        msgs = [{"role": m["role"], "content": m["content"]} for m in checked]
        while msgs and msgs[-1]["role"] == "assistant":
            msgs = msgs[:-1]
        if not msgs:
            raise InvalidInputError(f"{where}: 'messages' holds only assistant turns; nothing to prompt with")
        if not _has_template(tokenizer):
            raise InvalidInputError(f"{where}: 'messages' need a tokenizer with a chat template")
        return _chat(tokenizer, msgs)
    if "prompt" in row:
        text = row["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise InvalidInputError(f"{where}: 'prompt' must be a non-empty string")
        if row.get("raw") or not _has_template(tokenizer):
            return text
        return _chat(tokenizer, [{"role": "user", "content": text}])
    raise InvalidInputError(f"{where}: a row needs 'prompt' or 'messages', found {sorted(row)}")


def read_user_prompts(path: str | Path, tokenizer: Any, *, limit: int | None = None) -> list[tuple[str, str]]:
    """``(USER_SOURCE, rendered prompt)`` for every row of the JSONL file at ``path`` (first ``limit``)."""
    path = Path(path)
    text = read_text_file(path, "prompt file")
    out: list[tuple[str, str]] = []
    for n, line in enumerate(split_jsonl_lines(text), start=1):
        if not line.strip():
            continue
        if limit is not None and len(out) >= limit:
            break
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{path}:{n}: not JSON ({exc.msg})") from None
        out.append((USER_SOURCE, render_row(row, tokenizer, f"{path}:{n}")))
    if not out:
        raise InvalidInputError(f"{path} holds no prompts")
    return out
