"""Training a drafter from the user's own chat JSONL, end to end at smoke size: the exported checkpoint
loads through Pipeline.from_pretrained and decodes losslessly, and the held-out acceptance logged during
training equals what `bastion bench` measures on the same prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bastion.cli.main import main
from bastion.contract.errors import InvalidInputError
from bastion.training.chat import chat_text
from bastion.training.prompts import USER_SOURCE, read_user_prompts, render_row

ROWS = [
    {"messages": [{"role": "user", "content": "What is 3 plus 4?"}]},
    {"messages": [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "Seven."}]},
    {"prompt": "Write a haiku about rain."},
    {"prompt": "def add(a, b):\n", "raw": True},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                  {"role": "user", "content": "What is 12 times 2?"}]},
    {"prompt": "List three colours."},
]


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 target saved with a trained chat tokenizer (with a mask token)."""
    from bastion.testing.tiny import save_tiny_target
    from bastion.training.tokenizer import TokenizerConfig, load_tokenizer, train_tokenizer

    root = tmp_path_factory.mktemp("chat-target")
    texts = [chat_text(f"What is {i} plus {i}?", f"It is {2 * i}.") for i in range(60)] + ["def f(x):\n    return x\n"] * 20
    train_tokenizer(texts, root, TokenizerConfig(vocab_size=320))
    tok = load_tokenizer(root)
    save_tiny_target(root, "qwen3", seed=3, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id, bos_token_id=None)
    return root


@pytest.fixture(scope="module")
def tokenizer(chat_target: Path):
    from bastion.training.tokenizer import load_tokenizer

    return load_tokenizer(chat_target)


def test_messages_drop_a_trailing_assistant_turn_and_prompts_become_one_user_turn(tokenizer) -> None:
    with_answer = render_row(ROWS[1], tokenizer, "x")
    assert with_answer == tokenizer.apply_chat_template([ROWS[1]["messages"][0]], tokenize=False, add_generation_prompt=True)
    assert with_answer.endswith("<|assistant|>\n") and "Seven" not in with_answer
    assert render_row(ROWS[2], tokenizer, "x") == "<|user|>\nWrite a haiku about rain.\n<|assistant|>\n"
    assert render_row(ROWS[3], tokenizer, "x") == "def add(a, b):\n"


@pytest.mark.parametrize("row, message", [
    ({"text": "hi"}, "needs 'prompt' or 'messages'"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "only assistant turns"),
    ({"prompt": "  "}, "non-empty string"),
])
def test_bad_rows_are_clear_errors_naming_file_and_line(tokenizer, tmp_path: Path, row: dict, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(InvalidInputError, match=rf"p\.jsonl:2: .*{message}"):
        read_user_prompts(path, tokenizer)


@pytest.fixture(scope="module")
def user_run(chat_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("user-run")
    prompts = root / "prompts.jsonl"
    chats = [{"messages": [{"role": "user", "content": f"What is {i} plus {i + 1}?"}]} for i in range(12)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS + chats))
    (root / "heldout.jsonl").write_text("".join(json.dumps({"question": f"What is {i} plus {i + 1}?"}) + "\n" for i in range(40, 44)))
    common = ["--target", str(chat_target), "--device", "cpu", "--threads", "1", "--smoke"]
    assert main(["train", "distill", *common, "--prompts", str(prompts), "--max-new-tokens", "32", "--out", str(root / "distill.pt")]) == 0
    assert main(["train", "drafter", *common, "--data", str(root / "distill.pt"), "--out", str(root / "drafter"),
                 "--draft-steps", "30", "--draft-lr", "1e-2", "--anchors", "16", "--eval-every", "15",
                 "--eval-datasets", f"gsm8k={root / 'heldout.jsonl'}", "--eval-limit", "4",
                 "--eval-max-new-tokens", "24", "--eval-budgets", "4,8"]) == 0
    assert main(["train", "export", "--drafter", str(root / "drafter"), "--dtype", "bfloat16", "--out", str(root / "export")]) == 0
    return root


def test_user_prompts_are_distilled_from_the_targets_own_greedy_answers(user_run: Path, chat_target: Path) -> None:
    from bastion.training.distill import load_continuations

    seqs = load_continuations(user_run / "distill.pt")
    assert {s.source for s in seqs} == {USER_SOURCE} and len(seqs) == len(ROWS) + 12
    model = __import__("transformers").AutoModelForCausalLM.from_pretrained(str(chat_target))
    seq = seqs[0]
    greedy = model.generate(input_ids=seq.ids[None, : seq.prompt_len], attention_mask=torch.ones(1, seq.prompt_len, dtype=torch.long),
                            max_new_tokens=len(seq.ids) - seq.prompt_len, do_sample=False)[0]
    assert greedy.tolist() == seq.ids.tolist()


def test_exported_drafter_from_user_data_loads_in_the_pipeline_and_is_lossless(user_run: Path, chat_target: Path) -> None:
    from safetensors import safe_open

    from bastion import registry
    from bastion.bench.methods import ARDecoder
    from bastion.engine.pipeline import Pipeline

    assert not (user_run / "export" / "target").exists()  # a drafter for an existing target ships alone
    with safe_open(str(user_run / "export" / "drafter" / "model.safetensors"), "pt") as fh:
        assert {fh.get_tensor(k).dtype for k in fh.keys()} == {torch.bfloat16}
    pipe = Pipeline.from_pretrained(chat_target, user_run / "export" / "drafter",
                                    budget_controller=registry.create("budget_controller", "fixed", budget=8))
    ids = pipe.encode("<|user|>\nWhat is 5 plus 6?\n<|assistant|>\n")
    assert pipe.generate(ids, max_new_tokens=20).tokens == ARDecoder(pipe.target).generate(ids, max_new_tokens=20).tokens


def test_held_out_acceptance_logged_in_training_equals_bastion_bench(user_run: Path, chat_target: Path) -> None:
    summary = json.loads((user_run / "drafter" / "train_summary.json").read_text())
    assert [e["step"] for e in summary["acceptance"]] == [15, 30]
    final = summary["acceptance"][-1]
    assert final["lossless"] is True and final["best-first@8"] > 1.0  # the drafter gets tokens accepted
    out = user_run / "bench"
    assert main(["bench", "--target", str(chat_target), "--drafter", str(user_run / "drafter"),
                 "--datasets", f"gsm8k={user_run / 'heldout.jsonl'}", "--limit", "4", "--max-new-tokens", "24",
                 "--methods", "ar,chain,best-first@4,best-first@8",
                 "--repeats", "1", "--warmup-tokens", "0", "--no-plots", "--no-progress", "--out", str(out)]) == 0
    stats = json.loads((out / "results.json").read_text())["stats"]
    bench = {s["method"]: s["acceptance_length"] for s in stats if s["method"] != "ar"}
    assert bench.keys() == {"chain", "best-first@4", "best-first@8"}
    for method, value in bench.items():
        assert final[method] == pytest.approx(value, abs=1e-4)


def test_distillation_split_over_two_ranks_merges_into_the_one_process_file(chat_target: Path, tokenizer, tmp_path: Path) -> None:
    from bastion.distributed import DistContext
    from bastion.training.distill import DistillConfig, distill_part, generate_continuations, load_continuations, merge_parts
    from bastion.training.frozen import load_frozen_target

    model = load_frozen_target(chat_target, "cpu")
    prompts = [(USER_SOURCE, render_row(r, tokenizer, "x")) for r in ROWS]
    cfg = DistillConfig(max_new_tokens=8, batch_size=2)
    one = generate_continuations(model, tokenizer, prompts, tmp_path / "one.pt", cfg)
    for rank in (1, 0):  # what each rank of a two-rank run writes, then rank 0's merge
        distill_part(model, tokenizer, prompts, tmp_path / "two.pt", cfg, DistContext(rank=rank, world_size=2))
    assert (tmp_path / "two.part1of2.pt").is_file() and not (tmp_path / "two.pt").exists()
    merge_parts(tmp_path / "two.pt", len(prompts), 2)
    two = load_continuations(tmp_path / "two.pt")
    assert [s.ids.tolist() for s in two] == [s.ids.tolist() for s in one]
    assert [s.prompt_len for s in two] == [s.prompt_len for s in one]
    assert not list(tmp_path.glob("two.part*"))
