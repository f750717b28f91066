"""The data sets bundled in the package: `bench` and `train --smoke` work with no data folder, the copies
equal the public files, each has its licence, and the training slice holds no benchmark prompt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from bastion.bench.datasets import FORMATS, load_dataset, read_records
from bastion.utils.folders import DATA_DIR_ENV, bundled_data_dir, data_file, default_data_dir, is_bundled

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = bundled_data_dir()
TRAIN_FILES = ("gsm8k/train.jsonl.gz", "alpaca_eval/Meta-Llama-3-70B-Instruct.model_outputs.json.gz")


def _offline_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != DATA_DIR_ENV}
    env.update(BASTION_CACHE_DIR=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    return env


def test_bench_quick_and_train_smoke_run_with_no_data_folder(tmp_path: Path) -> None:
    assert not (tmp_path / "data").exists() and not (tmp_path / ".." / "shared" / "data").exists()
    env = _offline_env(tmp_path)
    bench = [sys.executable, "-m", "bastion", "bench", "--quick", "--limit", "1", "--max-new-tokens", "8", "--methods",
             "ar,bastion", "--warmup-tokens", "0", "--threads", "1", "--no-plots", "--no-progress", "--out", "bench"]
    done = subprocess.run(bench, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "bench" / "results.json").read_text())
    assert sorted({p["dataset"] for p in results["prompts"]}) == ["gsm8k", "humaneval", "mt_bench"]
    train = [sys.executable, "-m", "bastion", "train", "all", "--smoke", "--out", "run", "--threads", "1"]
    done = subprocess.run(train, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "run" / "export" / "drafter" / "model.safetensors").is_file()
    assert not (tmp_path / "data").exists()


def test_without_a_data_folder_the_bundled_copies_are_found_and_explicit_folders_win(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert is_bundled(default_data_dir())
    mine = tmp_path / "mine"
    (mine / "gsm8k").mkdir(parents=True)
    (mine / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "mine?"}) + "\n", encoding="utf-8")
    assert [p.text for p in load_dataset("gsm8k", data_dir=mine)] == ["mine?"]
    monkeypatch.setenv(DATA_DIR_ENV, str(mine))
    assert [p.text for p in load_dataset("gsm8k")] == ["mine?"]


def test_training_without_smoke_refuses_the_bundled_slice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from bastion.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    assert main(["train", "tokenizer", "--out", str(tmp_path / "tok")]) == 2
    assert "only a small slice of the training sets, for --smoke" in capsys.readouterr().err
    assert not (tmp_path / "tok").exists()


def _files() -> list[Path]:
    return sorted(p for p in BUNDLED.rglob("*") if p.is_file() and p.name not in ("LICENSE", "README.md"))


def test_every_bundled_set_has_its_licence_and_source_and_ships_as_package_data() -> None:
    readme = (BUNDLED / "README.md").read_text(encoding="utf-8")
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["bastion"]
    shipped = {p for pattern in patterns for p in (ROOT / "bastion").glob(pattern)}
    assert len(_files()) == 6
    for f in _files():
        rel = f.relative_to(BUNDLED).as_posix()
        assert (f.parent / "LICENSE").is_file(), rel
        assert f"`{rel}`" in readme, rel
        assert f in shipped and f.parent / "LICENSE" in shipped, rel
    assert sum(f.stat().st_size for f in BUNDLED.rglob("*") if f.is_file()) < 1_000_000  # the package stays small


def test_bundled_training_slice_holds_no_benchmark_prompt() -> None:
    bench = {p.text.strip() for name in FORMATS for p in load_dataset(name, data_dir=BUNDLED)}
    train = [r["question"] for r in read_records(BUNDLED / TRAIN_FILES[0])]
    train += [r["instruction"] for r in read_records(BUNDLED / TRAIN_FILES[1])]
    assert len(train) == 64 + 32 and not bench.intersection(t.strip() for t in train)


def test_bundled_benchmark_sets_equal_the_public_files(shared_data: Path) -> None:
    for name in FORMATS:
        assert load_dataset(name, data_dir=BUNDLED) == load_dataset(name, data_dir=shared_data), name
    assert len(load_dataset("spec_bench", data_dir=BUNDLED)) == 480


def test_bundled_training_slice_is_the_head_of_the_training_splits(shared_data: Path) -> None:
    gsm = list(read_records(data_file(shared_data, "gsm8k/train.jsonl")))
    assert list(read_records(BUNDLED / TRAIN_FILES[0])) == gsm[:64]
    alpaca = json.loads((shared_data / "alpaca_eval" / "Meta-Llama-3-70B-Instruct.model_outputs.json").read_text())
    assert list(read_records(BUNDLED / TRAIN_FILES[1])) == alpaca[:32]
    first = sorted(p.name for p in (shared_data / "alpaca_eval").glob("*.json"))[0]
    assert first == "Meta-Llama-3-70B-Instruct.model_outputs.json"  # the file a --smoke run reads first
