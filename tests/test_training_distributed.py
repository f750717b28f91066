"""Data-parallel drafter training under torchrun (gloo, CPU): the same drafter as one process, resumable
after one rank is killed; precomputed features train the same drafter as online ones."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from bastion.cli.main import main

REPO = Path(__file__).resolve().parents[1]
STEPS = 40


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random target and a distilled file of its own greedy continuations (12 sequences)."""
    from bastion.testing.tiny import save_tiny_target, tiny_model
    from bastion.training.loop import save_checkpoint

    root = tmp_path_factory.mktemp("ddp")
    save_tiny_target(root / "target", "qwen3", seed=0)
    model = tiny_model("qwen3", seed=0)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(12):
        prompt = torch.randint(3, 250, (6 + i % 5,), generator=gen)  # [P]
        out = model.generate(input_ids=prompt[None], attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)[0]
        rows.append({"index": i, "source": "user", "ids": out.tolist(), "prompt_len": len(prompt)})
    save_checkpoint(root / "distill.pt", done=len(rows), rows=rows)
    return root


def _args(pair: Path, out: Path, *extra: str) -> list[str]:
    return ["train", "drafter", "--target", str(pair / "target"), "--data", str(pair / "distill.pt"), "--out", str(out),
            "--mask-token-id", "255", "--device", "cpu", "--threads", "1", "--draft-layers", "1", "--block-size", "4",
            "--anchors", "8", "--seqs-per-step", "4", "--draft-steps", str(STEPS), "--warmup-steps", "2",
            "--draft-save-every", "1", "--heldout-seqs", "0", "--no-eval", *extra]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def one_process(pair: Path) -> Path:
    out = pair / "one"
    assert main(_args(pair, out)) == 0
    return out


def _torchrun(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "bastion", *args]


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _worker_of_rank(launcher: int, rank: int) -> int | None:
    """The pid of the torchrun worker with ``RANK=rank`` below the launcher process (from /proc)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = re.search(r"^PPid:\s+(\d+)", status, re.M)
        if ppid and int(ppid.group(1)) == launcher and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank's process through /proc")
def test_two_gloo_ranks_train_the_one_process_drafter_and_resume_after_a_rank_is_killed(pair: Path, one_process: Path) -> None:
    out = pair / "two"
    launcher = subprocess.Popen(_torchrun(_args(pair, out)), env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoint.pt").exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        victim = _worker_of_rank(launcher.pid, 1)
        assert victim is not None, "rank 1 not found"
        os.kill(victim, signal.SIGKILL)
        assert launcher.wait(timeout=120) != 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert not (out / "model.safetensors").exists(), "the run finished before rank 1 was killed"

    done = subprocess.run(_torchrun(_args(pair, out)), env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    resumed = re.search(r"resumed from step (\d+)", done.stdout + done.stderr)
    assert resumed is not None and 1 <= int(resumed.group(1)) < STEPS
    a, b = _weights(one_process), _weights(out)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    # the optimizer moments match too: the same gradients, not only weights that ended up close
    from bastion.training.loop import load_checkpoint

    opt_a = load_checkpoint(one_process / "checkpoint.pt")["optimizer"]["state"]
    opt_b = load_checkpoint(out / "checkpoint.pt")["optimizer"]["state"]
    for i in opt_a:
        torch.testing.assert_close(opt_b[i]["exp_avg"], opt_a[i]["exp_avg"], rtol=1e-3, atol=1e-6)


def test_precomputed_features_train_the_same_drafter_as_online_features(pair: Path, one_process: Path) -> None:
    feats = pair / "features"
    assert main(["train", "features", "--target", str(pair / "target"), "--data", str(pair / "distill.pt"),
                 "--out", str(feats), "--device", "cpu", "--threads", "1"]) == 0
    out = pair / "from-disk"
    assert main(_args(pair, out, "--features", str(feats))) == 0
    a, b = _weights(one_process), _weights(out)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=0)


def test_global_batch_must_split_evenly_over_the_ranks(pair: Path) -> None:
    from bastion.contract.errors import InvalidInputError
    from bastion.distributed import DistContext
    from bastion.training.distill import load_continuations
    from bastion.training.drafter import DrafterTrainConfig, train_drafter
    from bastion.training.frozen import load_frozen_target

    target = load_frozen_target(pair / "target", "cpu")
    seqs = load_continuations(pair / "distill.pt")
    with pytest.raises(InvalidInputError, match="multiple of the number of ranks"):
        train_drafter(target, seqs, [0, 1], [], DrafterTrainConfig(seqs_per_step=3), 255, pair / "bad",
                      ctx=DistContext(rank=0, world_size=2))
