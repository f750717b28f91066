"""Prompt templates per domain and prompt encoding.

Math and chat prompts are instructions: with a tokenizer that carries a chat template they become one
user turn followed by the assistant's generation prompt; without one they use a plain text template.
Code prompts (HumanEval) are completions: the function header and docstring are fed as they are.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from attrs import frozen

from bastion.bench.datasets import Domain, Prompt
from bastion.utils.chat import chat_text, has_chat_template, user_turn
from bastion.contract.errors import InvalidInputError

__all__ = ["TemplateStyle", "PromptTemplate", "TEMPLATES", "render_prompt", "encode_prompt", "byte_encode"]

#: "auto": chat template where the domain is an instruction and the tokenizer has one, else plain
TemplateStyle = Literal["auto", "chat", "plain"]


@frozen
class PromptTemplate:
    domain: Domain
    plain: str  # str.format pattern with a {text} field
    instruction: bool  # True: a user turn under a chat template; False: fed as a raw completion


TEMPLATES: dict[str, PromptTemplate] = {
    "math": PromptTemplate("math", "Question: {text}\nAnswer:", instruction=True),
    "code": PromptTemplate("code", "{text}", instruction=False),
    "chat": PromptTemplate("chat", "User: {text}\nAssistant:", instruction=True),
}


def render_prompt(prompt: Prompt, tokenizer: Any = None, style: TemplateStyle = "auto") -> str:
    """The text fed to the target for ``prompt`` (before tokenization)."""
    if style not in ("auto", "chat", "plain"):
        raise InvalidInputError(f"template style must be auto, chat or plain, got {style!r}")
    tpl = TEMPLATES[prompt.domain]
    use_chat = style == "chat" or (style == "auto" and tpl.instruction and has_chat_template(tokenizer))
    if use_chat:
        if not has_chat_template(tokenizer):
            raise InvalidInputError("template style 'chat' needs a tokenizer with a chat template")
        text = prompt.text.strip() if tpl.instruction else tpl.plain.format(text=prompt.text)
        return chat_text(tokenizer, user_turn(text))
    return tpl.plain.format(text=prompt.text)


def byte_encode(text: str, vocab_size: int) -> list[int]:
    """Token ids for a target without a tokenizer (test models): UTF-8 bytes folded into the vocab."""
    return [b % vocab_size for b in text.encode("utf-8")]


def encode_prompt(
    prompt: Prompt,
    tokenizer: Any,
    vocab_size: int,
    style: TemplateStyle = "auto",
    max_tokens: int | None = None,
) -> torch.Tensor:
    """LongTensor[1, L] of the rendered prompt. Longer prompts keep their last ``max_tokens`` tokens
    (the end holds the question and the generation prompt)."""
    text = render_prompt(prompt, tokenizer, style)
    if tokenizer is None:
        ids = byte_encode(text, vocab_size)
    else:
        chat = style == "chat" or (style == "auto" and TEMPLATES[prompt.domain].instruction and has_chat_template(tokenizer))
        # a chat template already contains any special tokens the model expects
        ids = list(tokenizer.encode(text, add_special_tokens=not chat))
    if max_tokens is not None and len(ids) > max_tokens:
        ids = ids[-max_tokens:]
    if not ids:
        raise InvalidInputError(f"{prompt.dataset} prompt {prompt.id!r} encodes to no tokens")
    return torch.tensor([ids], dtype=torch.long)
