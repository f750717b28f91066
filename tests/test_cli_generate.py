"""``bastion generate`` and ``bastion bench`` from a user's seat: JSON output, stdin prompts, stop strings,
plugin components chosen by name with options, and quiet output."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

import bastion
import bastion.engine.pipeline as pipeline_module
from bastion.cli.main import main
from bastion.contract.registry import Registry

PROMPT = "What is 2+3?"

#: a plugin with a budget controller that takes an option and a tree builder (a chain under a new name)
TEST_PLUGIN = '''
from bastion.contract.hookspecs import hookimpl
from bastion.contract.interfaces import BudgetController
from bastion.trees.chain import ChainBuilder

CHOSEN = []


class HalfController(BudgetController):
    """Verify ceil(fraction * n) nodes."""

    def __init__(self, fraction=0.5):
        self.fraction = float(fraction)

    def choose(self, log_scores, context_len, latency, overhead_s):
        n = max(1, min(len(log_scores), -(-int(len(log_scores) * self.fraction * 1000) // 1000)))
        CHOSEN.append((self.fraction, n, len(log_scores)))
        return n


class TestChain(ChainBuilder):
    pass


@hookimpl
def bastion_register_components(register):
    register("budget_controller", "test-half", HalfController, description="half the tree (test plugin)")
    register("tree_builder", "test-chain", TestChain, description="chain (test plugin)")
'''


@pytest.fixture
def test_plugin(fake_plugin_dist, monkeypatch):
    """A fresh default registry that discovers the test plugin through its entry point."""
    module = fake_plugin_dist("bastion-test-components", "bastion_test_components", TEST_PLUGIN)
    fresh = Registry()
    monkeypatch.setattr(bastion, "registry", fresh)
    monkeypatch.setattr(pipeline_module, "default_registry", fresh)
    assert fresh.info("budget_controller", "test-half").source == "bastion-test-components"
    import importlib

    return importlib.import_module(module)


def _generate_json(capsys, *argv: str) -> dict:
    assert main(["generate", "--max-new-tokens", "12", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_json_prints_one_object_with_text_tokens_and_statistics(capsys):
    data = _generate_json(capsys, "--prompt", PROMPT)
    assert data["new_tokens"] == len(data["tokens"]) == 12 and data["stop_reason"] == "length"
    pipe = bastion.Pipeline.demo()
    assert data["tokens"] == pipe.chat(PROMPT, max_new_tokens=12).tokens
    assert data["text"] == pipe.decode(data["tokens"]) and data["acceptance_length"] >= 1.0
    assert {"tokens_per_second", "mean_budget", "steps", "prompt_tokens", "wall_s"} <= set(data)


def test_generate_reads_the_prompt_from_stdin_or_a_file(capsys, monkeypatch, tmp_path: Path):
    direct = _generate_json(capsys, "--prompt", PROMPT)
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT))
    assert _generate_json(capsys, "--prompt", "-")["tokens"] == direct["tokens"]
    (tmp_path / "p.txt").write_text(PROMPT, encoding="utf-8")
    assert _generate_json(capsys, "--prompt-file", str(tmp_path / "p.txt"))["tokens"] == direct["tokens"]
    raw = _generate_json(capsys, "--prompt", PROMPT, "--raw")
    assert raw["prompt_tokens"] < direct["prompt_tokens"]  # no chat template around the prompt


def test_generate_stops_at_a_stop_string_and_streams_only_the_text_before_it(capsys):
    full = _generate_json(capsys, "--prompt", PROMPT, "--max-new-tokens", "30")
    assert "\n" in full["text"]
    cut = _generate_json(capsys, "--prompt", PROMPT, "--max-new-tokens", "30", "--stop", "\n")
    assert cut["stop_reason"] == "stop" and cut["text"] == full["text"].split("\n")[0]
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "30", "--stop", "\n"]) == 0
    out = capsys.readouterr()
    assert out.out == cut["text"] + "\n" and out.err.startswith("tokens=")


def test_generate_takes_a_plugin_controller_and_builder_by_name_with_options(capsys, test_plugin):
    data = _generate_json(capsys, "--prompt", PROMPT, "--tree-builder", "test-chain", "--budget-controller", "test-half",
                          "--controller-option", "fraction=0.25")
    assert test_plugin.CHOSEN and {f for f, _, _ in test_plugin.CHOSEN} == {0.25}
    assert data["tokens"] == bastion.Pipeline.demo().chat(PROMPT, max_new_tokens=12).tokens  # still lossless


def test_generate_rejects_options_for_a_component_it_does_not_use(capsys):
    assert main(["generate", "--prompt", PROMPT, "--tree-option", "static.branching=[2]"]) == 2
    assert "tree builder options for static, but the tree builder is best-first" in capsys.readouterr().err


def test_bench_pairs_a_plugin_builder_with_a_plugin_controller(capsys, test_plugin, tmp_path: Path):
    data = tmp_path / "data"
    (data / "gsm8k").mkdir(parents=True)
    (data / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n", encoding="utf-8")
    out = tmp_path / "bench"
    rc = main(["bench", "--datasets", "gsm8k", "--data-dir", str(data), "--limit", "1", "--max-new-tokens", "8",
               "--methods", "ar,test-chain@test-half", "--controller-option", "test-half.fraction=0.5",
               "--warmup-tokens", "0", "--repeats", "1", "--out", str(out), "--no-progress", "--no-plots"])
    assert rc == 0
    captured = capsys.readouterr()
    assert "| test-chain@test-half |" in captured.out and "noisy" in captured.err
    stats = json.loads((out / "results.json").read_text())["stats"]
    assert [s["method"] for s in stats] == ["ar", "test-chain@test-half"]
    assert {f for f, _, _ in test_plugin.CHOSEN} == {0.5}


def test_bench_checks_its_data_files_before_loading_any_model(capsys, tmp_path: Path, monkeypatch):
    from bastion.cli import bench_cmd

    monkeypatch.setattr(bench_cmd, "load_pair", lambda args, device=None: pytest.fail("models loaded before the data check"))
    assert main(["bench", "--datasets", "gsm8k", "--data-dir", str(tmp_path / "none"), "--no-progress"]) == 2
    assert "gsm8k" in capsys.readouterr().err


def test_generate_is_quiet_by_default_and_verbose_shows_weight_loading(capfd):
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "4"]) == 0
    assert "Loading weights" not in capfd.readouterr().err
    assert main(["generate", "--prompt", PROMPT, "--max-new-tokens", "4", "--verbose"]) == 0
    assert "Loading weights" in capfd.readouterr().err


def test_generate_with_several_prompts_honours_json_stop_and_stdin_and_keeps_statistics_off_stdout(capsys, monkeypatch):
    second = "Name a prime."
    singles = [_generate_json(capsys, "--prompt", p, "--max-new-tokens", "30") for p in (PROMPT, second)]
    assert main(["generate", "--prompt", PROMPT, "--prompt", second, "--max-new-tokens", "30", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["tokens"] for r in rows] == [s["tokens"] for s in singles]
    cut = [_generate_json(capsys, "--prompt", p, "--max-new-tokens", "30", "--stop", "\n") for p in (PROMPT, second)]
    monkeypatch.setattr("sys.stdin", io.StringIO(second))
    assert main(["generate", "--prompt", PROMPT, "--prompt", "-", "--max-new-tokens", "30", "--stop", "\n", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["text"], r["stop_reason"]) for r in rows] == [(c["text"], c["stop_reason"]) for c in cut]
    assert main(["generate", "--prompt", PROMPT, "--prompt", second, "--max-new-tokens", "30", "--stop", "\n"]) == 0
    out = capsys.readouterr()
    assert out.out == "".join(f"--- prompt {i + 1} ---\n{c['text']}\n" for i, c in enumerate(cut))  # text only
    assert "tok/s=" in out.err and "tok/s=" not in out.out


def test_generate_refuses_an_empty_prompt_among_several(capsys):
    assert main(["generate", "--prompt", PROMPT, "--prompt", "  ", "--max-new-tokens", "4"]) == 2
    assert "--prompt 2 is empty" in capsys.readouterr().err
