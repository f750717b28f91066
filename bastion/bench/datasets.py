"""Benchmark prompt sets: GSM8K (math), HumanEval (code), MT-bench and Spec-Bench (chat) in their
public formats.

A dataset is named by a spec string ``NAME[=SOURCE]``:

- ``gsm8k`` / ``humaneval`` / ``mt_bench`` / ``spec_bench``: the file of that name under the data
  directory (``gsm8k/test.jsonl``, ``humaneval/HumanEval.jsonl.gz``, ``mt_bench/question.jsonl``,
  ``spec_bench/question.jsonl``, each also read gzipped as ``NAME.gz``); without a data folder, the
  copies bundled in the package (see :func:`bastion.utils.folders.default_data_dir`);
- ``gsm8k=path/to/file.jsonl``: a local JSONL (optionally gzipped) or JSON-array file in that format;
- ``gsm8k=hf:openai/gsm8k:main@test``: a Hugging Face ``datasets`` id, optional config after ``:``
  and split after ``@`` (needs the ``datasets`` package and network access); ``gsm8k=hf`` uses the
  public hub copy of that data set.

Only benchmark splits are read (GSM8K test, HumanEval prompts, MT-bench and Spec-Bench first turns).
Spec-Bench prompts keep their category (13 of them), and a ``limit`` counts prompts per category there,
so a short run still covers every category.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

from attrs import field, frozen

from bastion.utils.folders import DATA_DIR_ENV, data_file, default_data_dir
from bastion.contract.errors import InvalidFileError, InvalidInputError

__all__ = [
    "Domain",
    "Prompt",
    "DatasetFormat",
    "FORMATS",
    "DATA_DIR_ENV",
    "default_data_dir",
    "parse_dataset_spec",
    "load_dataset",
    "read_records",
]

Domain = Literal["math", "code", "chat"]

#: environment variable naming the directory that holds the benchmark data sets


@frozen
class Prompt:
    """One benchmark prompt, before any template is applied."""

    dataset: str  # the dataset label, e.g. "gsm8k"
    domain: Domain
    id: str  # stable id inside the dataset (task id, question id or row index)
    text: str  # the question / code prompt / first chat turn
    category: str | None = None  # the record's own category (MT-bench, Spec-Bench), None where it has none

    def __attrs_post_init__(self) -> None:
        if not self.text.strip():
            raise InvalidInputError(f"{self.dataset} prompt {self.id!r} has empty text")


def _require(row: dict[str, Any], key: str, fmt: str, where: str) -> Any:
    if key not in row:
        raise InvalidInputError(f"{where}: a {fmt} record needs the field {key!r}, found {sorted(row)}")
    return row[key]


def _gsm8k(row: dict[str, Any], index: int, where: str) -> tuple[str, str]:
    return str(index), str(_require(row, "question", "gsm8k", where))


def _humaneval(row: dict[str, Any], index: int, where: str) -> tuple[str, str]:
    return str(row.get("task_id", index)), str(_require(row, "prompt", "humaneval", where))


def _mt_bench(row: dict[str, Any], index: int, where: str) -> tuple[str, str]:
    turns = row.get("turns", row.get("prompt"))  # FastChat files use "turns", some hub copies "prompt"
    if turns is None:
        raise InvalidInputError(f"{where}: an mt_bench record needs the field 'turns', found {sorted(row)}")
    if isinstance(turns, str):
        turns = [turns]
    if not turns:
        raise InvalidInputError(f"{where}: an mt_bench record has no turns")
    return str(row.get("question_id", index)), str(turns[0])  # first turn only


@frozen
class DatasetFormat:
    """How one public data set is stored and which domain (prompt template) it belongs to."""

    name: str
    domain: Domain
    default_file: str  # path below the data directory
    hf_default: str | None  # hub spec used by "NAME=hf" (id[:config][@split]); None: no known hub copy
    extract: Callable[[dict[str, Any], int, str], tuple[str, str]] = field(eq=False, repr=False)
    category_field: str | None = None  # the record field naming its category, if any
    limit_per_category: bool = False  # a limit counts prompts per category, not per dataset


FORMATS: dict[str, DatasetFormat] = {
    f.name: f
    for f in (
        DatasetFormat("gsm8k", "math", "gsm8k/test.jsonl", "openai/gsm8k:main@test", _gsm8k),
        DatasetFormat("humaneval", "code", "humaneval/HumanEval.jsonl.gz", "openai/openai_humaneval@test", _humaneval),
        DatasetFormat("mt_bench", "chat", "mt_bench/question.jsonl", "HuggingFaceH4/mt_bench_prompts@train", _mt_bench,
                      category_field="category"),
        DatasetFormat("spec_bench", "chat", "spec_bench/question.jsonl", None, _mt_bench, category_field="category",
                      limit_per_category=True),
    )
}


def parse_dataset_spec(spec: str) -> tuple[DatasetFormat, str | None]:
    """``NAME[=SOURCE]`` -> (format, source or None for the default file)."""
    name, sep, source = spec.strip().partition("=")
    name = name.strip()
    if name not in FORMATS:
        raise InvalidInputError(f"unknown dataset {name!r}; known formats: {', '.join(FORMATS)} (spec NAME[=PATH|hf:ID])")
    if sep and not source.strip():
        raise InvalidInputError(f"dataset spec {spec!r} has an empty source after '='")
    return FORMATS[name], (source.strip() if sep else None)


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Rows of a JSONL file (``.gz`` allowed) or of a JSON file holding a list of objects."""
    p = Path(path)
    if not p.is_file():
        raise InvalidInputError(
            f"dataset file not found: {p} (point --data-dir or ${DATA_DIR_ENV} at the folder holding gsm8k/, "
            "humaneval/, mt_bench/ and spec_bench/, or pass NAME=PATH / NAME=hf in --datasets)"
        )
    opener: Callable[..., Any] = gzip.open if p.suffix == ".gz" else open
    try:
        with opener(p, "rt", encoding="utf-8") as fh:
            text = fh.read()
    except UnicodeDecodeError as exc:
        raise InvalidFileError(f"{p} is not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}): not a dataset file") from None
    except (OSError, EOFError) as exc:  # a truncated or corrupt gzip file, an unreadable file
        raise InvalidFileError(f"{p} cannot be read: {exc}") from None
    head = text.lstrip()[:1]
    if head == "[":
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidFileError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
        if not all(isinstance(r, dict) for r in rows):
            raise InvalidInputError(f"{p}: a JSON dataset must be a list of objects")
        yield from rows
        return
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{p}:{lineno}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise InvalidInputError(f"{p}:{lineno}: each line must be a JSON object")
        yield row


def _hub_records(source: str) -> Iterable[dict[str, Any]]:
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        raise InvalidInputError(
            f"dataset source {source!r} needs the Hugging Face 'datasets' package: pip install 'bastion[hf]'"
        ) from None
    ident, _, split = source.partition("@")
    repo, _, config = ident.partition(":")
    return datasets.load_dataset(repo, config or None, split=split or "test")


def load_dataset(spec: str, limit: int | None = None, data_dir: str | Path | None = None) -> list[Prompt]:
    """Load the prompts of ``spec`` (see the module doc) in file order: at most ``limit`` of them, or at
    most ``limit`` of each category for a format that counts per category (Spec-Bench)."""
    if limit is not None and limit < 1:
        raise InvalidInputError(f"limit must be >= 1, got {limit}")
    fmt, source = parse_dataset_spec(spec)
    rows: Iterable[dict[str, Any]]
    if source == "hf" or (source is not None and source.startswith("hf:")):
        hub = fmt.hf_default if source == "hf" else source[3:]
        if hub is None:
            raise InvalidInputError(f"no hub copy of {fmt.name} is known: pass {fmt.name}=hf:ID[:CONFIG][@SPLIT] or a file")
        where, rows = f"hf:{hub}", _hub_records(hub)
    else:
        path = Path(source) if source is not None else data_file(data_dir or default_data_dir(), fmt.default_file)
        where, rows = str(path), read_records(path)
    prompts: list[Prompt] = []
    per_category: dict[str | None, int] = {}
    for i, row in enumerate(rows):
        if limit is not None and not fmt.limit_per_category and len(prompts) >= limit:
            break
        record = dict(row)
        category = None if fmt.category_field is None or record.get(fmt.category_field) is None else str(record[fmt.category_field])
        if limit is not None and fmt.limit_per_category and per_category.get(category, 0) >= limit:
            continue
        pid, text = fmt.extract(record, i, f"{where} row {i}")
        per_category[category] = per_category.get(category, 0) + 1
        prompts.append(Prompt(dataset=fmt.name, domain=fmt.domain, id=pid, text=text, category=category))
    if not prompts:
        raise InvalidInputError(f"dataset {spec!r} ({where}) holds no prompts")
    return prompts
