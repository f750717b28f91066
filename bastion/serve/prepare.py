"""From a checked request to what the engine takes: the prompt's token ids and a
:class:`~bastion.engine.GenerationConfig`.

These functions use the pipeline's tokenizer, so they run on the engine thread (the one thread that
touches the pipeline). They raise :class:`~bastion.serve.errors.BadRequestError` naming the field for an
empty prompt, a prompt that leaves no room in the context window, token ids outside the vocabulary and a
``max_tokens`` that does not fit.
"""

from __future__ import annotations

from typing import Any

import attrs

from bastion.contract.errors import InvalidInputError
from bastion.engine import GenerationConfig, SamplingParams
from bastion.serve.errors import BadRequestError
from bastion.serve.protocol import ChatRequest, CompletionRequest

__all__ = ["Prepared", "chat_inputs", "completion_inputs", "generation_settings"]

#: the longest chat answer a request without max_tokens gets (besides what the context window leaves)
DEFAULT_CHAT_MAX_TOKENS = 256


@attrs.frozen
class Prepared:
    """One request ready for the engine."""

    prompt_ids: list[int]
    config: GenerationConfig


def _checked_prompt(pipe: Any, ids: list[int], param: str) -> list[int]:
    limit = int(pipe.target.max_positions)
    if not ids:
        raise BadRequestError(f"{param} is empty: the prompt needs at least one token", param=param, code="empty_prompt")
    if len(ids) >= limit:
        raise BadRequestError(
            f"This model's maximum context length is {limit} tokens; the prompt has {len(ids)} tokens, leaving no room "
            "to generate", param=param, code="context_length_exceeded",
        )
    vocab = int(pipe.target.vocab_size)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise BadRequestError(f"{param}: token id {bad} is outside the vocabulary [0, {vocab})", param=param, code="invalid_token")
    return ids


def _checked_limit(pipe: Any, prompt_len: int, max_tokens: int, param: str) -> int:
    limit = int(pipe.target.max_positions)
    if prompt_len + max_tokens > limit:
        raise BadRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested {prompt_len + max_tokens} "
            f"tokens ({prompt_len} in the prompt, {max_tokens} in the completion). Please reduce the prompt or {param}.",
            param=param, code="context_length_exceeded",
        )
    return max_tokens


def generation_settings(req: CompletionRequest | ChatRequest, max_tokens: int) -> GenerationConfig:
    """The engine's settings for a request's sampling fields (:class:`BadRequestError` when the engine's
    own checks refuse them)."""
    try:
        sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0), seed=req.seed)
        return GenerationConfig(max_new_tokens=max_tokens, sampling=sampling, stop=req.stops(), stop_on_eos=not req.ignore_eos)
    except InvalidInputError as exc:
        raise BadRequestError(str(exc), code="invalid_value") from None


def completion_inputs(pipe: Any, req: CompletionRequest) -> Prepared:
    """A completions request: text encoded as it is (no chat template), or its token ids."""
    prompt = req.prompt_value()
    ids = list(pipe.encode(prompt)[0].tolist()) if isinstance(prompt, str) else list(prompt)
    ids = _checked_prompt(pipe, ids, "prompt")
    max_tokens = _checked_limit(pipe, len(ids), int(req.max_tokens or 16), "max_tokens")
    return Prepared(ids, generation_settings(req, max_tokens))


def chat_inputs(pipe: Any, req: ChatRequest, default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS) -> Prepared:
    """A chat request through the target's chat template; without a token limit the answer may use
    what the context window leaves, at most ``default_max_tokens``."""
    conversation = req.conversation()
    try:
        ids = list(pipe.encode_chat(conversation)[0].tolist())
    except InvalidInputError as exc:
        raise BadRequestError(str(exc), param="messages") from None
    ids = _checked_prompt(pipe, ids, "messages")
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    asked = req.token_limit()
    if asked is None:
        max_tokens = min(default_max_tokens, int(pipe.target.max_positions) - len(ids))
    else:
        max_tokens = _checked_limit(pipe, len(ids), asked, param)
    return Prepared(ids, generation_settings(req, max_tokens))
