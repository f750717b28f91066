"""The chat format of the demo pair: special tokens and a tiny template.

A conversation turn is ``<|user|>\\n{question}\\n<|assistant|>\\n{answer}<|endoftext|>``; the model is
prompted with everything up to and including ``<|assistant|>\\n`` and stops at ``<|endoftext|>``.
"""

from __future__ import annotations

PAD = "<|pad|>"
EOS = "<|endoftext|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
MASK = "<|mask|>"

#: special tokens in id order (ids 0..4)
SPECIAL_TOKENS: tuple[str, ...] = (PAD, EOS, USER, ASSISTANT, MASK)

#: Jinja chat template stored with the tokenizer (for ``tokenizer.apply_chat_template``)
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>\n{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}<|endoftext|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def prompt_text(question: str) -> str:
    """The text the model is prompted with for one user question."""
    return f"{USER}\n{question.strip()}\n{ASSISTANT}\n"


def chat_text(question: str, answer: str) -> str:
    """One full training conversation (prompt + answer + EOS)."""
    return prompt_text(question) + answer.strip() + EOS
