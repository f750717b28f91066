"""``bastion run`` end to end on a tiny random pair saved to disk: order, resume after SIGKILL and torn
lines, per-line input errors, stdin/stdout, and a 2-process gloo run under torchrun."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bastion.cli.main import main
from bastion.testing.tiny import TinyPair, save_tiny_pair

REPO = Path(__file__).resolve().parents[1]
N_ROWS = 24
MAX_NEW = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


def _input_rows() -> list[dict]:
    rows: list[dict] = []
    for i in range(N_ROWS):
        if i % 3 == 0:
            rows.append({"id": f"m{i}", "messages": [{"role": "user", "content": f"Tell me about {i} cats."}]})
        else:
            row: dict = {"id": i, "prompt": f"Question {i}: what is {i} times {i + 2}?"}
            if i % 5 == 0:
                row["max_new_tokens"] = 3
            rows.append(row)
    return rows


def _write(path: Path, rows: list[dict], extra_lines: dict[int, str] | None = None) -> Path:
    lines = [json.dumps(r) for r in rows]
    for at, text in sorted((extra_lines or {}).items()):
        lines.insert(at, text)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _args(pair: TinyPair, inp: Path | str, out: Path | str, *extra: str) -> list[str]:
    return [
        "run", "--input", str(inp), "--output", str(out), "--target", str(pair.target), "--drafter", str(pair.drafter),
        "--max-new-tokens", str(MAX_NEW), "--batch-size", "4", "--device", "cpu", "--threads", "1", "--no-progress", *extra,
    ]  # fmt: skip


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").split("\n") if line]


def _adopt(out: Path, written_by: Path) -> None:
    """Give ``out`` the manifest of the run that wrote ``written_by`` (rows copied from there resume)."""
    shutil.copyfile(written_by.with_name(written_by.name + ".manifest.json"), out.with_name(out.name + ".manifest.json"))


def _stable(rows: list[dict]) -> list[tuple]:
    """What must not depend on how the run was split or interrupted (timings and the adaptive budget do)."""
    return [(r["id"], r.get("text"), r.get("token_ids"), r.get("new_tokens"), r.get("stop_reason"), r.get("error")) for r in rows]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("in") / "prompts.jsonl", _input_rows())


@pytest.fixture(scope="module")
def reference_out(pair: TinyPair, prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output of one uninterrupted one-process run."""
    out = tmp_path_factory.mktemp("ref") / "out.jsonl"
    assert main(_args(pair, prompts, out)) == 0
    return out


@pytest.fixture(scope="module")
def reference(reference_out: Path) -> list[dict]:
    """The rows of one uninterrupted one-process run."""
    return _read(reference_out)


def test_one_process_run_writes_one_row_per_input_in_order_matching_single_generate(pair: TinyPair, reference: list[dict]) -> None:
    from bastion import Pipeline
    from bastion.run.encode import messages_ids, prompt_ids

    rows = _input_rows()
    assert [r["id"] for r in reference] == [r["id"] for r in rows]
    pipe = Pipeline.from_pretrained(pair.target, pair.drafter)
    for inp, out in zip(rows, reference):
        assert set(out) == {"id", "text", "token_ids", "new_tokens", "acceptance_length", "mean_budget", "seconds", "stop_reason"}
        assert out["new_tokens"] == len(out["token_ids"]) <= inp.get("max_new_tokens", MAX_NEW)
        assert out["text"] == pipe.tokenizer.decode(out["token_ids"], skip_special_tokens=True)
    for k in (0, 5, 7):  # the oracle: the same prompt decoded alone with Pipeline.generate
        inp = rows[k]
        ids = messages_ids(pipe.tokenizer, inp["messages"]) if "messages" in inp else prompt_ids(pipe.tokenizer, inp["prompt"])
        res = pipe.generate(torch.tensor([ids]), max_new_tokens=inp.get("max_new_tokens", MAX_NEW))
        assert reference[k]["token_ids"] == res.tokens and reference[k]["stop_reason"] == res.stop_reason


def test_two_gloo_ranks_under_torchrun_write_exactly_the_one_process_output(
    pair: TinyPair, prompts: Path, reference: list[dict], tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "bastion", *_args(pair, prompts, out)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _stable(_read(out)) == _stable(reference)
    assert "2 ranks" in proc.stderr and f"{N_ROWS} decoded" in proc.stderr
    assert not (tmp_path / "out.jsonl.parts").exists()  # the parts are gone once merged


def test_sigkill_part_way_then_rerun_equals_an_uninterrupted_run(
    pair: TinyPair, prompts: Path, reference: list[dict], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "bastion", *_args(pair, prompts, out, "--batch-size", "1")]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            if out.is_file() and out.read_bytes().count(b"\n") >= 3:
                break
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    done_before = out.read_bytes().count(b"\n")
    assert 3 <= done_before < N_ROWS, "the kill must land part-way"
    assert main(_args(pair, prompts, out)) == 0
    assert f"{N_ROWS - done_before} decoded, {done_before} already done" in capsys.readouterr().err  # only the rest
    rows = _read(out)
    assert len({json.dumps(r["id"]) for r in rows}) == len(rows) == N_ROWS
    assert _stable(rows) == _stable(reference)


def test_a_torn_last_line_is_redone_not_kept(
    pair: TinyPair, prompts: Path, reference: list[dict], reference_out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    lines = [json.dumps(r) for r in reference[:10]]
    out.write_text("\n".join(lines[:9]) + "\n" + lines[9][: len(lines[9]) // 2], encoding="utf-8")  # a crash mid-write
    _adopt(out, reference_out)
    assert main(_args(pair, prompts, out)) == 0
    err = capsys.readouterr().err
    assert "dropped a torn last line" in err and f"{N_ROWS - 9} decoded, 9 already done" in err
    assert _stable(_read(out)) == _stable(reference)


def _bad_input(path: Path) -> Path:
    rows = _input_rows()[:6]
    rows.insert(4, {"id": rows[1]["id"], "prompt": "a duplicate"})  # line 6 (after the malformed line)
    rows.append({"id": "long", "prompt": "many words " * 200})  # line 9 (after the malformed line below)
    return _write(path, rows, {2: '{"id": 99, "prompt": "unterminated'})  # line 3


def test_malformed_duplicate_and_too_long_lines_stop_the_run_naming_each_line(
    pair: TinyPair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    assert main(_args(pair, _bad_input(tmp_path / "bad.jsonl"), out)) == 2
    err = capsys.readouterr().err
    assert "3 input lines cannot be decoded" in err
    assert "input line 3: malformed JSON" in err
    assert "input line 6: duplicate id 1 (first on line 2)" in err
    assert "input line 9: prompt too long" in err
    assert not out.exists()


def test_on_error_skip_writes_error_rows_in_place_and_decodes_the_rest(
    pair: TinyPair, reference: list[dict], tmp_path: Path
) -> None:
    out = tmp_path / "out.jsonl"
    assert main(_args(pair, _bad_input(tmp_path / "bad.jsonl"), out, "--on-error", "skip")) == 0
    rows = _read(out)
    assert [r.get("line") for r in rows] == [None, None, 3, None, None, 6, None, None, 9]
    assert [r["id"] for r in rows if "error" in r] == [None, 1, "long"]
    good = [r for r in rows if "error" not in r]
    assert _stable(good) == _stable(reference[:6])
    # a rerun keeps every decoded row and writes each error row once
    assert main(_args(pair, tmp_path / "bad.jsonl", out, "--on-error", "skip")) == 0
    assert _stable(_read(out)) == _stable(rows)


def test_stdin_to_stdout_streams_rows_in_input_order(
    pair: TinyPair, reference: list[dict], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = _input_rows()[:5]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(json.dumps(r) + "\n" for r in rows)))
    assert main(_args(pair, "-", "-")) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert _stable(out) == _stable(reference[:5])


def test_an_output_holding_ids_of_another_input_is_refused_and_kept(
    pair: TinyPair, prompts: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out.jsonl"
    other = _write(tmp_path / "other.jsonl", [{"id": "stranger", "prompt": "Hello"}])
    assert main(_args(pair, other, out)) == 0
    before = out.read_bytes()
    assert main(_args(pair, prompts, out)) == 2
    assert "'stranger', which is not in the input" in capsys.readouterr().err
    assert out.read_bytes() == before


def test_sampled_rows_depend_on_seed_and_line_only_not_on_batch_size_or_resume(pair: TinyPair, prompts: Path, tmp_path: Path) -> None:
    sampled = ("--temperature", "0.9", "--seed", "3")
    a, b, c, d = (tmp_path / f"{k}.jsonl" for k in "abcd")
    assert main(_args(pair, prompts, a, *sampled)) == 0
    assert main(_args(pair, prompts, b, *sampled, "--batch-size", "3")) == 0
    c.write_text("".join(line + "\n" for line in a.read_text().split("\n")[:7]))  # a run that stopped after 7 rows
    _adopt(c, a)
    assert main(_args(pair, prompts, c, *sampled, "--batch-size", "5")) == 0
    assert _stable(_read(b)) == _stable(_read(a)) == _stable(_read(c))
    assert main(_args(pair, prompts, d, "--temperature", "0.9", "--seed", "4")) == 0
    assert _stable(_read(d)) != _stable(_read(a))


def test_part_files_left_by_a_killed_multi_rank_launch_are_resumed_by_one_process(
    pair: TinyPair, prompts: Path, reference: list[dict], reference_out: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bastion.run import part_path

    out = tmp_path / "out.jsonl"
    _adopt(out, reference_out)
    half = N_ROWS // 2
    for rank, rows in ((0, reference[:4]), (1, reference[half : half + 5])):  # what two ranks had written
        part = part_path(out, rank, 2)
        part.parent.mkdir(exist_ok=True)
        part.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"id": "torn', encoding="utf-8")
    assert main(_args(pair, prompts, out)) == 0
    assert f"{N_ROWS - 9} decoded, 9 already done" in capsys.readouterr().err
    assert _stable(_read(out)) == _stable(reference)
    assert not part_path(out, 0, 2).parent.exists()


def test_an_empty_input_is_a_clear_error(pair: TinyPair, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert main(_args(pair, empty, tmp_path / "out.jsonl")) == 2
    assert "holds no rows" in capsys.readouterr().err
