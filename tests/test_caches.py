"""Optional caches never stop a run: profile saves are locked, merged and atomic under concurrency; a
corrupt or wrongly typed profile file warns and is ignored everywhere and calibrate rewrites it; the
training token cache is written atomically and validated on reuse."""

from __future__ import annotations

import json
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

from bastion.controllers.latency.profiles import read_profiles, save_profile
from bastion.utils.files import CacheWarning

PROCESSES, THREADS, PER_THREAD = 3, 4, 10

def _save_many(path: Path, device: str, threads: int, per_thread: int) -> None:
    """``threads`` threads each saving ``per_thread`` distinct profiles to ``path``."""

    def work(t: int) -> None:
        for i in range(per_thread):
            save_profile(path, device, f"model{t}-{i}", {"params": {"i": i}})

    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def test_concurrent_profile_saves_from_processes_and_threads_keep_every_entry(tmp_path: Path) -> None:
    import multiprocessing

    path = tmp_path / "latency_profiles.json"
    ctx = multiprocessing.get_context("fork")  # children only write files: no torch work after the fork
    procs = [ctx.Process(target=_save_many, args=(path, f"dev{p}", THREADS, PER_THREAD)) for p in range(PROCESSES)]
    for p in procs:
        p.start()
    _save_many(path, "local", THREADS, PER_THREAD)  # and threads of this process at the same time
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0] * PROCESSES
    profiles = json.loads(path.read_text())["profiles"]  # valid JSON at the end
    devices = [f"dev{p}" for p in range(PROCESSES)] + ["local"]
    expected = {f"{d}::model{t}-{i}" for d in devices for t in range(THREADS) for i in range(PER_THREAD)}
    assert set(profiles) == expected
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]  # no temp file left behind


@pytest.mark.parametrize(
    "content", ["{not json", "", '["a list"]', '{"profiles": []}', '{"profiles": {"cpu::m": "oops"}}']
)
def test_corrupt_or_wrong_typed_profile_file_warns_and_reads_as_empty(tmp_path: Path, content: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.warns(CacheWarning):
        assert read_profiles(path) == {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CacheWarning)  # the save reads the broken file once more
        save_profile(path, "cpu", "m", {"params": {"a_c": 1.0}})  # a save repairs it
    assert set(read_profiles(path)) == {"cpu::m"}


def _latency_key(target_dir: Path) -> str:
    from transformers import AutoConfig

    from bastion.controllers import RooflineLatency
    from bastion.controllers.latency.profiles import profile_key

    m = RooflineLatency(model_config=AutoConfig.from_pretrained(target_dir), device="cpu", profile=None)
    return profile_key(m.device_label, m.cost.signature)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    folder.mkdir()
    monkeypatch.setenv("BASTION_CACHE_DIR", str(folder))
    monkeypatch.setenv("BASTION_NO_DEVICE_PROBE", "1")
    return folder


def _calibrate(target_dir: Path, cache: Path) -> int:
    from bastion.cli.main import main

    return main(["calibrate", "--target", str(target_dir), "--sizes", "1,4", "--contexts", "8", "--repeats", "1",
                 "--force", "--plot", str(cache / "c.png")])  # save whatever the fit quality on a busy machine


def test_calibrate_rewrites_a_corrupt_profile_file(tiny_qwen3_dir, cache, capsys) -> None:
    pytest.importorskip("matplotlib")
    path = cache / "latency_profiles.json"
    path.write_text("{not json")
    with pytest.warns(CacheWarning, match="not valid JSON"):
        assert _calibrate(tiny_qwen3_dir, cache) == 0
    assert set(json.loads(path.read_text())["profiles"]) == {_latency_key(tiny_qwen3_dir)}


def test_wrong_typed_profile_entry_warns_is_ignored_by_pipelines_and_calibrate_rewrites_it(tiny_qwen3_dir, cache, capsys) -> None:
    pytest.importorskip("matplotlib")
    import torch

    import bastion
    from bastion.testing.drafters import NoisyOracleDrafter
    from bastion.testing.tiny import tiny_model

    path = cache / "latency_profiles.json"
    key = _latency_key(tiny_qwen3_dir)
    path.write_text(json.dumps({"profiles": {key: {"params": {"a_c": "fast"}, "peaks": [1]}}}))
    with pytest.warns(CacheWarning, match="malformed"):
        pipe = bastion.Pipeline.from_pretrained(tiny_qwen3_dir, NoisyOracleDrafter(tiny_model("qwen3", seed=0), block_size=2))
    assert len(pipe.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3).tokens) == 3
    assert _calibrate(tiny_qwen3_dir, cache) == 0
    entry = json.loads(path.read_text())["profiles"][key]  # calibrate rewrote it
    assert isinstance(entry["params"]["a_c"], float) and isinstance(entry["peaks"], dict)


def test_corrupt_profile_cache_does_not_stop_the_demo_pipeline_generate_or_bench(cache, capsys) -> None:
    import torch

    import bastion
    from bastion.cli.main import main

    (cache / "latency_profiles.json").write_text('{"profiles": 12')
    with pytest.warns(CacheWarning):
        pipe = bastion.Pipeline.demo()
    assert len(pipe.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=3).tokens) == 3
    with pytest.warns(CacheWarning):
        assert main(["generate", "--prompt", "Hi", "--max-new-tokens", "2"]) == 0
    from bastion.cli.bench_cmd import load_pair
    from bastion.cli.main import build_parser

    with pytest.warns(CacheWarning):
        target, _drafter, _tok = load_pair(build_parser().parse_args(["bench", "--quick"]))  # bench's model loading
    assert target.vocab_size > 0


# ------------------------------------------------------------------ training token cache
def test_truncated_token_cache_is_rebuilt_not_reused(tmp_path: Path) -> None:
    from bastion.training.tokens import cached_token_array

    calls = []

    def build() -> np.ndarray:
        calls.append(1)
        return np.arange(1000, dtype=np.uint16) % 300

    path = tmp_path / "tokens-abc.npy"
    first = cached_token_array(path, build, vocab_size=300)
    assert len(calls) == 1 and path.exists()
    assert np.array_equal(cached_token_array(path, build, vocab_size=300), first) and len(calls) == 1  # reused
    blob = path.read_bytes()
    for broken in (blob[: len(blob) // 2], b"", b"garbage" * 10):
        path.write_bytes(broken)
        with pytest.warns(CacheWarning, match="tokens-abc.npy"):
            again = cached_token_array(path, build, vocab_size=300)
        assert np.array_equal(again, first)
    assert len(calls) == 4  # rebuilt each time the cache was broken
    np.save(path, np.array([5, 400], dtype=np.uint16))  # ids outside the vocabulary: foreign file
    with pytest.warns(CacheWarning, match="outside the tokenizer's vocabulary"):
        assert np.array_equal(cached_token_array(path, build, vocab_size=300), first) and len(calls) == 5
    assert not [f for f in tmp_path.iterdir() if f.name.endswith(".tmp")]
