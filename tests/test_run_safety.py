"""``bastion run`` never destroys what it did not write: foreign outputs, input == output, the output
lock, changed inputs or settings, and file-system failures named as bastion errors (exit code 2)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bastion.cli.main import main
from bastion.testing.tiny import TinyPair, save_tiny_pair

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


def _args(pair: TinyPair, inp: Path | str, out: Path | str, *extra: str) -> list[str]:
    return [
        "run", "--input", str(inp), "--output", str(out), "--target", str(pair.target), "--drafter", str(pair.drafter),
        "--max-new-tokens", "4", "--batch-size", "4", "--device", "cpu", "--threads", "1", "--no-progress", *extra,
    ]  # fmt: skip


def _prompts(path: Path, n: int = 3) -> Path:
    path.write_text("".join(json.dumps({"id": i, "prompt": f"Question {i}?"}) + "\n" for i in range(n)), encoding="utf-8")
    return path


def _err(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_an_existing_output_bastion_did_not_write_is_refused_byte_for_byte_unless_overwrite(
    pair: TinyPair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = _prompts(tmp_path / "in.jsonl")
    for content in (b'{"note":1}', b'{"note":1}\n', b"my notes\nline two\n"):
        out = tmp_path / "notes.jsonl"
        out.write_bytes(content)
        assert main(_args(pair, prompts, out)) == 2
        err = _err(capsys)
        assert "notes.jsonl" in err and "--overwrite" in err and "did not write" in err
        assert out.read_bytes() == content  # not cut, not appended to
    assert main(_args(pair, prompts, out, "--overwrite")) == 0
    rows = [json.loads(line) for line in out.read_text().split("\n") if line]
    assert [r["id"] for r in rows] == [0, 1, 2]


def test_an_empty_existing_output_is_written_as_a_fresh_one(pair: TinyPair, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    out.touch()
    assert main(_args(pair, _prompts(tmp_path / "in.jsonl", 2), out)) == 0
    assert len(out.read_text().split("\n")) == 3


def test_the_input_as_output_is_refused_by_name_symlink_or_relative_path(
    pair: TinyPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = _prompts(tmp_path / "in.jsonl", 1)
    before = prompts.read_bytes()
    (tmp_path / "link.jsonl").symlink_to(prompts)
    sub = tmp_path / "sub"
    sub.mkdir()
    monkeypatch.chdir(sub)
    for out in (prompts, tmp_path / "link.jsonl", "../in.jsonl", "../sub/../in.jsonl"):
        assert main(_args(pair, prompts, out)) == 2
        assert "is the input file" in _err(capsys)
    assert main(_args(pair, prompts, prompts, "--overwrite")) == 2  # --overwrite does not make it the output
    assert "is the input file" in _err(capsys)
    assert prompts.read_bytes() == before
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob("*.manifest.json"))


def test_a_second_run_on_the_same_output_fails_at_once_naming_the_first_ones_pid(
    pair: TinyPair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = _prompts(tmp_path / "in.jsonl", 40)
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "bastion", *_args(pair, prompts, out, "--batch-size", "1", "--max-new-tokens", "24")]
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and first.poll() is None and not (out.is_file() and out.stat().st_size):
            time.sleep(0.02)
        assert first.poll() is None, "the first run must still be decoding"
        t0 = time.monotonic()
        assert main(_args(pair, prompts, out)) == 2
        assert time.monotonic() - t0 < 30  # at once: no waiting for the lock, no model loaded
        err = _err(capsys)
        assert f"pid {first.pid}" in err and "being written by another bastion run" in err
    finally:
        first.kill()
        first.wait()


def test_a_resume_with_other_settings_or_a_changed_row_is_refused(pair: TinyPair, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = _prompts(tmp_path / "in.jsonl")
    out = tmp_path / "out.jsonl"
    assert main(_args(pair, prompts, out)) == 0
    before = out.read_bytes()
    assert main(_args(pair, prompts, out, "--temperature", "0.5")) == 2
    assert "other settings (" in _err(capsys) and out.read_bytes() == before
    assert main(_args(pair, prompts, out, "--max-new-tokens", "5")) == 2
    assert "max_new_tokens 4 -> 5" in _err(capsys)
    lines = prompts.read_text().split("\n")
    lines[1] = json.dumps({"id": 1, "prompt": "Another question?"})
    prompts.write_text("\n".join(lines))
    assert main(_args(pair, prompts, out)) == 2
    assert "input line 2 (id 1) is not the request" in _err(capsys) and out.read_bytes() == before
    lines.append(json.dumps({"id": 3, "prompt": "A new row"}))  # rows added to an unchanged input resume
    lines[1] = json.dumps({"id": 1, "prompt": "Question 1?"})
    prompts.write_text("\n".join(lines) + "\n")
    assert main(_args(pair, prompts, out)) == 0
    assert "1 decoded, 3 already done" in _err(capsys)


def test_a_resume_with_another_target_is_refused(pair: TinyPair, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = _prompts(tmp_path / "in.jsonl", 1)
    out = tmp_path / "out.jsonl"
    assert main(_args(pair, prompts, out)) == 0
    assert main(_args(pair, prompts, out, "--dtype", "bfloat16")) == 2
    assert "another model" in _err(capsys)


def test_seed_minus_one_is_refused_like_generate_refuses_it(pair: TinyPair, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out.jsonl"
    assert main(_args(pair, _prompts(tmp_path / "in.jsonl"), out, "--seed", "-1", "--temperature", "0.7")) == 2
    assert "--seed: seed must be an int in [0, 2**64), got -1" in _err(capsys)
    assert not out.exists()


def test_binary_input_is_one_line_error_naming_the_file(pair: TinyPair, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(bytes(range(128, 256)) * 4)
    assert main(_args(pair, garbage, tmp_path / "out.jsonl")) == 2
    err = _err(capsys).strip()
    assert len(err.splitlines()) == 1 and "garbage.bin is not UTF-8 text" in err


def test_an_output_onto_a_directory_or_under_a_file_is_a_bastion_error_naming_it(
    pair: TinyPair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = _prompts(tmp_path / "in.jsonl")
    folder = tmp_path / "results"
    folder.mkdir()
    assert main(_args(pair, prompts, folder)) == 2
    assert "results is a directory" in _err(capsys) and folder.is_dir()
    assert main(_args(pair, prompts, folder, "--overwrite")) == 2
    assert "results is a directory" in _err(capsys) and folder.is_dir()
    assert main(_args(pair, prompts, prompts / "out.jsonl")) == 2
    assert "in.jsonl is not a folder" in _err(capsys)


def test_a_read_only_folder_is_a_bastion_error_naming_the_path(
    pair: TinyPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = _prompts(tmp_path / "in.jsonl")
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if os.geteuid() == 0:  # root ignores the mode bits: answer as the kernel does for everyone else
        import builtins

        def refusing(real: Any) -> Any:
            def opener(path: Any, *args: Any, **kwargs: Any) -> Any:
                if isinstance(path, (str, os.PathLike)) and Path(path).parent == folder:
                    raise PermissionError(errno.EACCES, "Permission denied", str(path))
                return real(path, *args, **kwargs)

            return opener

        monkeypatch.setattr(os, "open", refusing(os.open))
        monkeypatch.setattr(builtins, "open", refusing(builtins.open))
    try:
        assert main(_args(pair, prompts, folder / "out.jsonl")) == 2
    finally:
        folder.chmod(0o755)
    err = _err(capsys)
    assert f"{folder}/out.jsonl" in err and "Permission denied" in err
    assert not (folder / "out.jsonl").exists()


def test_a_full_disk_is_a_bastion_error_naming_the_output(
    pair: TinyPair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import bastion.run.journal as journal

    class FullDisk:
        """``os`` as the row writer sees it on a full disk: every sync fails with ENOSPC."""

        def __getattr__(self, name: str) -> object:
            return getattr(os, name)

        def fsync(self, _fd: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal, "os", FullDisk())
    out = tmp_path / "out.jsonl"
    assert main(_args(pair, _prompts(tmp_path / "in.jsonl"), out)) == 2
    err = _err(capsys)
    assert f"{out}: cannot write it: No space left on device" in err


def test_under_torchrun_a_foreign_output_stops_every_rank_with_one_message(pair: TinyPair, tmp_path: Path) -> None:
    out = tmp_path / "notes.jsonl"
    out.write_bytes(b'{"note":1}\n')
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "bastion",
           *_args(pair, _prompts(tmp_path / "in.jsonl"), out)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and out.read_bytes() == b'{"note":1}\n'
    assert proc.stderr.count("bastion: error:") == 1 and "no manifest" in proc.stderr
    assert proc.stderr.count("exitcode  : 2") == 2  # both ranks exit with 2 (the launcher prints its own traceback)
