"""Documents of the mixed training corpus and the prompts used for distillation.

Sources (all public, none of them a benchmark split):

- ``code``: the Python standard library's own source files (tests excluded),
- ``math``: GSM8K train questions with their worked answers, in the chat format,
- ``chat``: AlpacaEval instructions with each listed model's response, in the chat format.

Each document gets a stable hash-based split so the held-out slice never changes between runs. Files
are read plain or gzipped (``NAME.gz``, as the package's bundled slice ships them).
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
from pathlib import Path
from typing import Iterator, Sequence

import attrs

from bastion.utils.folders import data_file, default_data_dir
from bastion.contract.errors import InvalidInputError
from bastion.training.chat import EOS, chat_text, prompt_text

__all__ = [
    "Document",
    "default_data_dir",
    "stdlib_files",
    "load_documents",
    "split_documents",
    "distill_prompts",
    "render_prompt",
    "heldout_prompts",
]

SOURCES: tuple[str, ...] = ("code", "math", "chat")
_CALC = re.compile(r"<<[^>]*>>")  # GSM8K calculator annotations, e.g. <<48/2=24>>


@attrs.frozen
class Document:
    source: str = attrs.field(validator=attrs.validators.in_(SOURCES))
    text: str


def _require(path: Path) -> Path:
    if not path.exists():
        raise InvalidInputError(f"training data not found: {path} (set --data-dir or $BASTION_DATA_DIR)")
    return path


def stdlib_files(max_bytes: int = 200_000) -> list[Path]:
    """Source files of this interpreter's standard library, tests and site-packages excluded, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test", "__pycache__", "lib2to3", "turtledemo"}
    files = [
        p
        for p in root.rglob("*.py")
        if not skip.intersection(p.relative_to(root).parts) and p.stat().st_size <= max_bytes
    ]
    return sorted(files)


def _rows(data_dir: Path, relpath: str) -> list[dict]:
    from bastion.bench.datasets import read_records

    return list(read_records(_require(data_file(data_dir, relpath))))


def _gsm8k(data_dir: Path, split: str) -> list[dict]:
    return _rows(data_dir, f"gsm8k/{split}.jsonl")


def _alpaca(data_dir: Path) -> list[dict]:
    """Every ``alpaca_eval/*.json`` (or ``*.json.gz``) file's rows, files in name order."""
    from bastion.bench.datasets import read_records

    folder = _require(data_dir / "alpaca_eval")
    rows: list[dict] = []
    for path in sorted([*folder.glob("*.json"), *folder.glob("*.json.gz")], key=lambda f: f.name.removesuffix(".gz")):
        rows.extend(read_records(path))
    return rows


def clean_gsm8k_answer(answer: str) -> str:
    return _CALC.sub("", answer)


def load_documents(data_dir: Path, *, limit_per_source: int | None = None) -> list[Document]:
    """All training documents in a fixed order (code, then math, then chat)."""
    docs: list[Document] = []
    for i, path in enumerate(stdlib_files()):
        if limit_per_source is not None and i >= limit_per_source:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            docs.append(Document("code", text + EOS))
    for row in _gsm8k(data_dir, "train")[:limit_per_source]:
        docs.append(Document("math", chat_text(row["question"], clean_gsm8k_answer(row["answer"]))))
    for row in _alpaca(data_dir)[:limit_per_source]:
        if row.get("output"):
            docs.append(Document("chat", chat_text(row["instruction"], row["output"])))
    return docs


def _bucket(text: str) -> float:
    h = hashlib.sha1(text.encode("utf-8", errors="replace")).digest()
    return int.from_bytes(h[:8], "big") / 2**64


def split_documents(docs: Sequence[Document], heldout_fraction: float = 0.01) -> tuple[list[Document], list[Document]]:
    """(train, held-out) by a stable hash of each document's text."""
    if not 0.0 <= heldout_fraction < 1.0:
        raise InvalidInputError(f"heldout_fraction must lie in [0, 1), got {heldout_fraction}")
    train, held = [], []
    for d in docs:
        (held if _bucket(d.text) < heldout_fraction else train).append(d)
    return train, held


def _code_prefixes(limit: int | None) -> Iterator[str]:
    """Prompts for code: a file's text up to and including one ``def`` line and its first body line."""
    count = 0
    for path in stdlib_files():
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)
        for j, line in enumerate(lines):
            if line.lstrip().startswith("def ") and line.rstrip().endswith(":") and j + 1 < len(lines):
                start = max(0, j - 12)
                yield "".join(lines[start : j + 2])
                count += 1
                if limit is not None and count >= limit:
                    return
                break


def distill_prompts(data_dir: Path, *, per_source: int) -> list[tuple[str, str]]:
    """``(source, text)`` pairs from the TRAINING sources, for the target's own continuations: raw code
    snippets for ``code``, bare questions / instructions for ``math`` and ``chat`` (render them with
    :func:`render_prompt`)."""
    prompts: list[tuple[str, str]] = [("code", p) for p in _code_prefixes(per_source)]
    prompts += [("math", r["question"]) for r in _gsm8k(data_dir, "train")[:per_source]]
    seen: set[str] = set()
    chat: list[tuple[str, str]] = []
    for r in _alpaca(data_dir):
        if r["instruction"] not in seen:
            seen.add(r["instruction"])
            chat.append(("chat", r["instruction"]))
    prompts += chat[:per_source]
    return prompts


def render_prompt(tokenizer, source: str, text: str) -> str:
    """Code is continued as it is; questions become one user turn under the tokenizer's chat template
    (the demo format when the tokenizer has none)."""
    if source == "code":
        return text
    if getattr(tokenizer, "chat_template", None):
        return str(tokenizer.apply_chat_template([{"role": "user", "content": text.strip()}], tokenize=False, add_generation_prompt=True))
    return prompt_text(text)


def heldout_prompts(data_dir: Path, *, per_domain: int = 10) -> list[tuple[str, str]]:
    """``(domain, prompt text)`` for evaluation: GSM8K test questions, HumanEval prompts, MT-bench first
    turns. Never used for training."""
    out: list[tuple[str, str]] = [("gsm8k", prompt_text(r["question"])) for r in _gsm8k(data_dir, "test")[:per_domain]]
    out += [("humaneval", r["prompt"]) for r in _rows(data_dir, "humaneval/HumanEval.jsonl.gz")[:per_domain]]
    out += [("mt_bench", prompt_text(r["turns"][0])) for r in _rows(data_dir, "mt_bench/question.jsonl")[:per_domain]]
    return out
