"""Text as tokens commit: incremental detokenization and stop strings.

:class:`TextTracker` receives the new tokens of each decode step and returns the text that may be shown
now. It decodes the whole output each time (a token's text can depend on its neighbours), holds back a
trailing incomplete character (``\\ufffd``) and any tail that could still grow into a stop string, and
reports where the first stop string starts so the caller can end the generation there.
"""

from __future__ import annotations

from typing import Any, Sequence

from bastion.contract.errors import InvalidInputError

__all__ = ["TextTracker", "check_stop_strings", "split_jsonl_lines"]


def check_stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings (one string or a list / tuple of them); anything else
    raises :class:`InvalidInputError` naming ``stop``."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        items: tuple[object, ...] = (stop,)
    elif isinstance(stop, (list, tuple)):
        items = tuple(stop)
    else:
        raise InvalidInputError(f"stop must be a string or a list of strings, got {stop!r} ({type(stop).__name__})")
    for s in items:
        if not isinstance(s, str) or not s:
            raise InvalidInputError(f"stop strings must be non-empty strings, got {s!r}")
    return items  # type: ignore[return-value]


def split_jsonl_lines(text: str) -> list[str]:
    """The lines of JSON Lines ``text``: split at ``\\n`` only (``\\r\\n`` ends work too), never at the
    other separators ``str.splitlines`` knows (U+2028, U+0085, ...), which JSON strings may hold raw."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


class TextTracker:
    """The decoded text of a growing token list, released only once it is final.

    ``push(tokens)`` appends a step's tokens and returns the newly releasable text; ``stopped`` turns true
    once a stop string appeared (the text then ends right before it, and :attr:`stop_tokens` is the number
    of tokens needed to produce it); ``finish()`` releases whatever was held back.
    """

    def __init__(self, tokenizer: Any, stop: str | Sequence[str] | None = None, *, skip_special_tokens: bool = True) -> None:
        if tokenizer is None:
            raise InvalidInputError("text output needs a tokenizer; this pipeline has none (pass tokenizer=)")
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stop = check_stop_strings(stop)
        self._longest = max((len(s) for s in self._stop), default=0)
        self.tokens: list[int] = []
        self.text = ""  # the full text so far (up to a stop string once stopped)
        self._released = 0  # characters of ``text`` handed out
        self.stopped = False
        self.stop_tokens: int | None = None

    def push(self, tokens: Sequence[int]) -> str:
        """Add one step's tokens; return the text that became final."""
        if self.stopped:
            return ""
        for tok in tokens:  # token by token only while a stop string is possible: find the exact cut
            self.tokens.append(int(tok))
            if self._stop:
                self._update()
                if self.stopped:
                    return self._release(final=True)
        if not self._stop:
            self._update()
        return self._release(final=False)

    def finish(self) -> str:
        """Release everything held back (the generation is over)."""
        return self._release(final=True)

    def _update(self) -> None:
        text = self._tok.decode(self.tokens, skip_special_tokens=self._skip)
        if self._stop:
            # a stop string can only newly appear at the end: search the tail that could hold it
            start = max(0, len(self.text) - self._longest)
            hits = [i for i in (text.find(s, start) for s in self._stop) if i >= 0]
            if hits:
                text = text[: min(hits)]
                self.stopped = True
                self.stop_tokens = len(self.tokens)
        self.text = text

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            if self.text.endswith("\ufffd"):  # an incomplete multi-byte character
                end -= 1
            end = min(end, len(self.text) - self._held_for_stop())
        end = max(end, self._released)
        out = self.text[self._released : end]
        self._released = end
        return out

    def _held_for_stop(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
