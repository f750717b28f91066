"""Pieces of the training recipe: corpus split, schedule, tokenizer, resumable target training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bastion.training.chat import EOS, MASK, SPECIAL_TOKENS, chat_text, prompt_text
from bastion.training.corpus import Document, split_documents
from bastion.training.loop import lr_at


def test_split_is_stable_and_disjoint() -> None:
    docs = [Document("chat", f"doc {i}") for i in range(400)]
    a_train, a_held = split_documents(docs, 0.1)
    b_train, b_held = split_documents(list(reversed(docs)), 0.1)
    assert {d.text for d in a_held} == {d.text for d in b_held}
    assert not {d.text for d in a_train} & {d.text for d in a_held}
    assert len(a_train) + len(a_held) == 400 and 10 <= len(a_held) <= 80


def test_lr_warms_up_then_decays_to_floor() -> None:
    lrs = [lr_at(s, peak=1.0, warmup=10, total=100) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(x >= y - 1e-12 for x, y in zip(lrs[10:], lrs[11:]))
    assert lrs[100] == pytest.approx(0.1)


def test_chat_text_is_prompt_plus_answer_and_eos() -> None:
    assert chat_text(" Q? ", "A. ") == prompt_text("Q?") + "A." + EOS


@pytest.fixture(scope="module")
def small_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from bastion.training.tokenizer import TokenizerConfig, load_tokenizer, train_tokenizer

    texts = [chat_text(f"What is {i} plus {i}?", f"It is {2 * i}.") for i in range(60)] + ["def f(x):\n    return x\n"] * 20
    out = train_tokenizer(texts, tmp_path_factory.mktemp("tok"), TokenizerConfig(vocab_size=320))
    return load_tokenizer(out)


def test_tokenizer_keeps_special_tokens_whole_and_round_trips(small_tokenizer) -> None:
    tok = small_tokenizer
    assert [tok.convert_ids_to_tokens(i) for i in range(len(SPECIAL_TOKENS))] == list(SPECIAL_TOKENS)
    assert tok.mask_token == MASK and tok.eos_token == EOS
    text = chat_text("What is 7 plus 7?", "It is 14.\n  def g(): pass")
    ids = tok.encode(text)
    assert ids[-1] == tok.eos_token_id and tok.decode(ids) == text


def _windows(n: int, vocab: int) -> np.ndarray:
    return (np.arange(n) * 7 % vocab).astype(np.uint16)


def test_resumed_target_training_matches_uninterrupted(small_tokenizer, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from bastion.training.loop import load_checkpoint
    from bastion.training.target_model import TargetConfig, train_target

    tok = small_tokenizer
    stream, held = _windows(4000, len(tok)), _windows(200, len(tok))
    kw = dict(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64, max_positions=64,
              seq_len=16, batch_size=2, warmup=1, save_every=2, eval_windows=2)
    straight = tmp_path / "straight"
    train_target(TargetConfig(steps=4, **kw), tok, stream, held, straight, log=lambda *_: None)
    resumed = tmp_path / "resumed"
    train_target(TargetConfig(steps=2, **kw), tok, stream, held, resumed, log=lambda *_: None)
    state = load_checkpoint(resumed / "checkpoint.pt")
    assert state is not None and state["step"] == 2  # the 4-step run below resumes from here
    train_target(TargetConfig(steps=4, **kw), tok, stream, held, resumed, log=lambda *_: None)
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4).flatmap(lambda w: st.tuples(st.just(w), st.lists(st.integers(1, 300), min_size=w, max_size=8 * w).filter(lambda xs: len(xs) % w == 0))))
def test_rank_slots_split_the_batch_evenly_in_count_and_about_evenly_in_tokens(case: tuple[int, list[int]]) -> None:
    from bastion.training.drafter import rank_slots

    world, lengths = case
    shares = [rank_slots(lengths, r, world) for r in range(world)]
    assert sorted(j for share in shares for j in share) == list(range(len(lengths)))  # every slot exactly once
    assert {len(share) for share in shares} == {len(lengths) // world}
    tokens = [sum(lengths[j] for j in share) for share in shares]
    assert max(tokens) - min(tokens) <= max(lengths) - min(lengths)
    assert rank_slots(lengths, 0, 1) == list(range(len(lengths)))


def test_rank_slots_deal_in_snake_order_so_two_ranks_get_equal_tokens_where_pairs_allow() -> None:
    from bastion.training.drafter import rank_slots

    lengths = [7, 10, 8, 9, 64, 61, 62, 63]  # round-robin by length would give rank 0 four tokens more
    assert [sum(lengths[j] for j in rank_slots(lengths, r, 2)) for r in range(2)] == [142, 142]
