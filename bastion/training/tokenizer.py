"""Train a byte-level BPE tokenizer with the chat / drafter special tokens and save it in the Hugging
Face format (``tokenizer.json`` + ``tokenizer_config.json``), loadable with ``AutoTokenizer``."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import attrs

from bastion.training.chat import CHAT_TEMPLATE, EOS, MASK, PAD, SPECIAL_TOKENS

__all__ = ["TokenizerConfig", "train_tokenizer", "load_tokenizer"]


@attrs.frozen
class TokenizerConfig:
    vocab_size: int = attrs.field(default=8192, validator=attrs.validators.ge(len(SPECIAL_TOKENS) + 256))
    min_frequency: int = attrs.field(default=2, validator=attrs.validators.ge(1))


def train_tokenizer(texts: Iterable[str], out_dir: Path, config: TokenizerConfig = TokenizerConfig(), *, length: int | None = None) -> Path:
    """Fit the BPE merges on ``texts`` and write the tokenizer to ``out_dir``; returns ``out_dir``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        pad_token=PAD,
        mask_token=MASK,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (EOS, PAD, MASK)],
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(out_dir)
    return out_dir


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
