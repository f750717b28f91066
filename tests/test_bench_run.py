"""``bastion bench`` end to end on a tiny random target with the no-training test drafter."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

import bastion

from bastion.bench import runner as bench_runner
from bastion.bench.methods import ARDecoder, build_decoder, parse_method
from bastion.bench.metrics import ALL_DATASETS, sweep_budget
from bastion.bench.reporting import markdown_report, write_report
from bastion.bench.runner import BenchConfig, run_bench
from bastion.contract.errors import InvalidInputError

METHODS = ("ar", "chain", "static", "best-first@4", "best-first@8", "bastion")
TREE_OPTIONS = {"static": {"branching": [2, 2, 1]}}


@pytest.fixture(scope="module")
def pair():
    from bastion.huggingface.causal_lm import HFTarget
    from bastion.testing.drafters import NoisyOracleDrafter
    from bastion.testing.tiny import tiny_model

    torch.set_num_threads(1)
    model = tiny_model("qwen3", seed=0)
    return HFTarget(model), NoisyOracleDrafter(model, block_size=4, noise=1.0, seed=0)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    (root / "gsm8k").mkdir()
    (root / "mt_bench").mkdir()
    (root / "gsm8k" / "test.jsonl").write_text(
        "".join(json.dumps({"question": q, "answer": "#### 0"}) + "\n" for q in ("2+2?", "3*3?", "unused")), encoding="utf-8"
    )
    (root / "mt_bench" / "question.jsonl").write_text(
        "".join(json.dumps({"question_id": 81 + i, "turns": [t, "again"]}) + "\n" for i, t in enumerate(("Hi there", "Tell me"))),
        encoding="utf-8",
    )
    return root


def _recording_build(order: list[str]):
    """A ``build_decoder`` whose decoders append their method's name to ``order`` on every call."""
    real_build = bench_runner.build_decoder

    def recording_build(spec, *args, **kwargs):
        dec = real_build(spec, *args, **kwargs)
        real_generate = dec.generate

        def generate(*a, **k):
            order.append(spec.name)
            return real_generate(*a, **k)

        dec.generate = generate  # type: ignore[method-assign]
        return dec

    return recording_build


@pytest.fixture(scope="module")
def calls(pair, data_dir: Path):
    """Run the benchmark once, recording the order in which decoders are called."""
    order: list[str] = []
    recording_build = _recording_build(order)

    cfg = BenchConfig(
        datasets=("gsm8k", "mt_bench"), methods=METHODS, limit=2, max_new_tokens=10, max_nodes=8,
        warmup_tokens=2, data_dir=str(data_dir), tree_options=TREE_OPTIONS, repeats=1,
    )
    mp = pytest.MonkeyPatch()
    mp.setattr(bench_runner, "build_decoder", recording_build)
    try:
        target, drafter = pair
        run = run_bench(cfg, target, drafter, None, progress=False)
    finally:
        mp.undo()
    return run, order


def test_every_method_runs_every_prompt_interleaved_in_balanced_orders(calls) -> None:
    from bastion.bench.runner import balanced_orders

    run, order = calls
    n = len(METHODS)
    assert order[:n] == list(METHODS)  # the unrecorded warm-up, one call per method
    measured = order[n:]
    assert len(measured) == 4 * n
    for i, row in zip(range(4), balanced_orders(n)):  # prompt i: all methods back to back, in order i
        block = measured[i * n : (i + 1) * n]
        assert block == [METHODS[j] for j in row]
    assert len(run.runs) == 4 * n
    assert {(r.method, r.dataset, r.prompt_id) for r in run.runs} == {
        (m, d, p) for m in METHODS for d, p in [("gsm8k", "0"), ("gsm8k", "1"), ("mt_bench", "81"), ("mt_bench", "82")]
    }


def test_greedy_tree_methods_reproduce_ar_tokens_and_the_check_says_so(calls) -> None:
    run, _ = calls
    ar = {(r.dataset, r.prompt_id): r.tokens for r in run.runs if r.method == "ar"}
    for r in run.runs:
        assert r.tokens == ar[(r.dataset, r.prompt_id)], r.method
        assert 1 <= len(r.tokens) <= 10
    for s in run.stats:
        assert s.equal_to_ref == (None if s.method == "ar" else s.prompts)


def test_speedups_are_ratios_of_throughput_measured_in_the_same_run(calls) -> None:
    run, _ = calls
    for s in run.stats:
        mine = [r for r in run.runs if r.method == s.method and (s.dataset == ALL_DATASETS or r.dataset == s.dataset)]
        ref = [r for r in run.runs if r.method == "ar" and (s.dataset == ALL_DATASETS or r.dataset == s.dataset)]
        tps = sum(len(r.tokens) for r in mine) / sum(r.result.wall_s for r in mine)
        ref_tps = sum(len(r.tokens) for r in ref) / sum(r.result.wall_s for r in ref)
        assert s.tokens_per_s == pytest.approx(tps)
        assert s.speedup == pytest.approx(tps / ref_tps)
        steps = [st for r in mine for st in r.result.steps]
        assert s.acceptance_length == pytest.approx(sum(st.accepted + 1 for st in steps) / len(steps))


def test_budgets_follow_each_method_and_the_summary_picks_the_sweeps_best(calls) -> None:
    run, _ = calls
    by = {(s.method, s.dataset): s for s in run.stats}
    for ds in ("gsm8k", "mt_bench"):
        assert set(by[("ar", ds)].budget_hist) == {1}
        assert max(by[("best-first@4", ds)].budget_hist) <= 4
        assert max(by[("best-first@8", ds)].budget_hist) <= 8
        assert max(by[("bastion", ds)].budget_hist) <= 8  # max_nodes caps the adaptive tree
        assert max(by[("chain", ds)].budget_hist) <= 5  # root + block of 4
        assert max(by[("static", ds)].budget_hist) <= 1 + 2 + 4 + 4
    for d in run.summary:
        sweep = {sweep_budget(s.method): s.speedup for s in run.stats if s.dataset == d.dataset and sweep_budget(s.method)}
        assert d.best_fixed_speedup == max(sweep.values())
        assert sweep[d.best_fixed_budget] == d.best_fixed_speedup
        assert d.bastion_speedup == by[("bastion", d.dataset)].speedup
        assert d.beat_chain == (d.bastion_speedup > d.chain_speedup)
    assert run.latency is not None and len(run.latency.points) == sum(
        len(r.result.steps) for r in run.runs if r.method != "ar"
    )


def test_report_writes_markdown_json_csv_and_png_files(calls, tmp_path: Path) -> None:
    run, _ = calls
    files = write_report(run, tmp_path / "out")
    names = {f.name for f in files}
    assert {"results.md", "results.json", "stats.csv", "summary.csv", "prompts.csv"} <= names
    assert {"speedup.png", "acceptance_vs_budget.png", "latency_fit.png", "stages.png"} <= names
    for f in files:
        assert f.is_file() and f.stat().st_size > 0
        if f.suffix == ".png":
            assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["config"]["methods"] == list(METHODS)
    assert len(data["stats"]) == len(METHODS) * 3  # two datasets + "all"
    assert len(data["prompts"]) == 4 * len(METHODS)
    assert all(p["equal_to_ar"] in (True, None) for p in data["prompts"])
    rows = list(csv.DictReader((tmp_path / "out" / "stats.csv").open()))
    assert [(r["method"], r["dataset"]) for r in rows] == [(s.method, s.dataset) for s in run.stats]
    md = markdown_report(run)
    assert "| gsm8k | bastion |" in md and "matched best" in md
    assert (tmp_path / "out" / "results.md").read_text() == md


def test_ar_decoder_matches_hf_generate_through_the_target_interface(pair) -> None:
    target, _ = pair
    ids = torch.tensor([[5, 9, 17, 33]])
    ref = target.model.generate(ids, max_new_tokens=12, do_sample=False)[0, 4:].tolist()
    calls: list[int] = []
    forward_tree = target.forward_tree

    def counted(tree, *args, **kwargs):
        calls.append(len(tree))
        return forward_tree(tree, *args, **kwargs)

    target.forward_tree = counted  # type: ignore[method-assign]
    try:
        res = ARDecoder(target).generate(ids, max_new_tokens=12)
    finally:
        del target.forward_tree
    assert res.tokens == ref
    assert calls == [1] * 11, "one single-node forward_tree per token after the prefill"
    assert all(s.budget == 1 and s.accepted == 0 for s in res.steps)


def test_ar_decoder_samples_with_the_pipelines_options_and_stream(pair) -> None:
    target, drafter = pair
    ids = torch.tensor([[5, 9, 17, 33]])
    pipe = build_decoder(parse_method("best-first@4"), target, drafter)
    for options in ({"temperature": 0.9, "top_k": 3}, {"temperature": 1.3, "top_p": 0.6}):
        ar = ARDecoder(target).generate(ids, max_new_tokens=10, seed=11, **options)
        assert ar.tokens == pipe.generate(ids, max_new_tokens=10, seed=11, **options).tokens, options
    greedy = ARDecoder(target).generate(ids, max_new_tokens=10).tokens
    assert ARDecoder(target).generate(ids, max_new_tokens=10, temperature=1.0, top_k=1, seed=3).tokens == greedy


def test_method_names_parse_into_builders_and_controllers() -> None:
    trees = ("best-first", "chain", "static", "beam")
    assert parse_method("ar", known_trees=trees).is_ar
    bf = parse_method("best-first@16", known_trees=trees)
    assert (bf.tree_builder, bf.controller, dict(bf.controller_options), bf.max_nodes) == ("best-first", "fixed", {"budget": 16}, 16)
    ours = parse_method("bastion", max_nodes=128, known_trees=trees)
    assert (ours.tree_builder, ours.controller, ours.max_nodes) == ("best-first", "bastion", 128)
    chain = parse_method("chain", known_trees=trees)
    assert chain.controller == "full" and chain.tree_builder == "chain"
    assert bastion.registry.create("budget_controller", "full").choose(torch.zeros(7), 0, None, 0.0) == 7  # type: ignore[arg-type]
    for bad, msg in (("nope", "unknown method"), ("best-first@x", "integer"), ("best-first@0", ">= 1"), ("", "empty")):
        with pytest.raises(InvalidInputError, match=msg):
            parse_method(bad, known_trees=trees)


def test_config_rejects_runs_that_cannot_be_compared(pair, data_dir: Path) -> None:
    target, drafter = pair
    with pytest.raises(InvalidInputError, match="include 'ar'"):
        run_bench(BenchConfig(methods=("chain",), data_dir=str(data_dir), datasets=("gsm8k",)), target, drafter, progress=False)
    with pytest.raises(InvalidInputError, match="repeat"):
        BenchConfig(methods=("ar", "ar"))
    with pytest.raises(InvalidInputError, match="limit"):
        BenchConfig(limit=0)


def test_bench_command_runs_end_to_end_and_writes_its_outputs(pair, data_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from bastion.cli import bench_cmd
    from bastion.cli.main import main

    seen = {}

    def fake_load(args, device=None):
        seen.update(target=args.target, drafter=args.drafter, device=args.device, dtype=args.dtype)
        return (*pair, None)

    monkeypatch.setattr(bench_cmd, "load_pair", fake_load)
    out = tmp_path / "bench"
    rc = main([
        "bench", "--target", "T", "--drafter", "D", "--datasets", "gsm8k", "--data-dir", str(data_dir), "--limit", "1",
        "--max-new-tokens", "6", "--methods", "ar,chain,best-first@4,bastion", "--max-nodes", "8",
        "--warmup-tokens", "0", "--repeats", "1", "--out", str(out), "--no-progress", "--no-plots",
    ])
    assert rc == 0
    assert seen == {"target": "T", "drafter": "D", "device": "auto", "dtype": "auto"}
    stdout = capsys.readouterr().out
    assert "| gsm8k | best-first@4 |" in stdout
    data = json.loads((out / "results.json").read_text())
    assert [s["method"] for s in data["stats"]] == ["ar", "chain", "best-first@4", "bastion"]
    assert not list(out.glob("*.png"))


def test_quick_flag_sets_a_short_run_and_explicit_flags_override_it() -> None:
    from bastion.cli.bench_cmd import build_config
    from bastion.cli.main import build_parser

    args = build_parser().parse_args(["bench", "--quick"])
    cfg = build_config(args)
    assert cfg.limit == 3 and cfg.max_new_tokens == 64 and cfg.repeats == 1 and cfg.methods == ("ar", "chain", "static", "best-first@8", "best-first@32", "bastion")
    args = build_parser().parse_args(["bench", "--quick", "--limit", "5", "--budgets", "2,4", "--tree-option", "static.branching=[3,1]"])
    cfg = build_config(args)
    assert cfg.limit == 5 and "best-first@2" in cfg.methods and dict(cfg.tree_options) == {"static": {"branching": [3, 1]}}
    sampled = build_config(build_parser().parse_args(["bench", "--temperature", "0.7", "--top-p", "0.9", "--top-k", "5"]))
    assert (sampled.sampling.temperature, sampled.sampling.top_p, sampled.sampling.top_k) == (0.7, 0.9, 5)
    with pytest.raises(InvalidInputError, match="top_p"):
        build_config(build_parser().parse_args(["bench", "--temperature", "0.7", "--top-p", "0"]))
    full = build_config(build_parser().parse_args(["bench"]))
    assert full.limit == 10 and full.repeats == 3 and [sweep_budget(m) for m in full.methods if sweep_budget(m)] == [4, 8, 16, 32, 64]


def test_repeats_run_whole_rounds_and_keep_each_methods_fastest_run(pair, data_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bastion.contract.types import GenerationResult

    walls = {"ar": iter([0.9, 0.5, 0.7] * 2), "chain": iter([0.3, 0.4, 0.2] * 2)}
    order: list[str] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name

        def generate(self, ids, max_new_tokens=64, temperature=0.0, seed=None, *, top_p=1.0, top_k=0):
            order.append(self.name)
            return GenerationResult(tokens=[7], steps=(), prompt_len=int(ids.shape[1]), prefill_s=0.0,
                                    wall_s=next(walls[self.name]), stop_reason="length")

    monkeypatch.setattr(bench_runner, "build_decoder", lambda spec, *a, **k: Fake(spec.name))
    cfg = BenchConfig(datasets=("gsm8k",), methods=("ar", "chain"), limit=2, repeats=3, warmup_tokens=0, data_dir=str(data_dir))
    target, drafter = pair
    run = run_bench(cfg, target, drafter, progress=False)
    assert order == ["ar", "chain"] * 3 + ["chain", "ar"] * 3  # rounds of all methods, in balanced orders per prompt
    assert [(r.method, r.result.wall_s) for r in run.runs] == [("ar", 0.5), ("ar", 0.5), ("chain", 0.2), ("chain", 0.2)]
    assert run.meta["repeats"] == 3


def test_temperatures_run_every_method_at_each_temperature_side_by_side(pair, data_dir: Path, tmp_path: Path) -> None:
    from bastion.bench.reporting import write_temperatures_report
    from bastion.bench.runner import run_bench_temperatures

    cfg = BenchConfig(datasets=("gsm8k",), methods=("ar", "best-first@4", "bastion"), limit=2, max_new_tokens=8,
                      max_nodes=8, warmup_tokens=0, repeats=1, data_dir=str(data_dir))
    target, drafter = pair
    runs = run_bench_temperatures(cfg, (0.0, 1.0), target, drafter, progress=False)
    assert [r.config.temperature for r in runs] == [0.0, 1.0]
    for r in runs:
        assert {x.method for x in r.runs} == {"ar", "best-first@4", "bastion"} and len(r.runs) == 6
    text, files = write_temperatures_report(runs, tmp_path, plots=True)
    side_by_side = text.split("\n## T = ", 1)[0]  # the combined table comes before the per-temperature reports
    header = side_by_side.split("\n| method |", 1)[1].split("\n", 1)[0]
    assert "T=0 speedup" in header and "T=1 speedup" in header
    rows = [line for line in side_by_side.splitlines() if line.startswith("| ")][1:]  # below the header
    assert [r.split("|")[1].strip() for r in rows] == ["ar", "best-first@4", "bastion"]
    assert all(r.count("|") == 2 + 3 * 2 for r in rows)  # method + 3 columns per temperature
    for t in ("T0", "T1"):
        assert (tmp_path / t / "results.json").exists() and (tmp_path / t / "results.md").exists()
    assert (tmp_path / "T1" / "reliability.png") in files  # bastion calibrates: its reliability is plotted
    with pytest.raises(InvalidInputError):
        run_bench_temperatures(cfg, (1.0, 1.0), target, drafter, progress=False)


def test_bastion_records_calibrated_predictions_and_ar_records_plain_steps(pair, data_dir: Path) -> None:
    cfg = BenchConfig(datasets=("gsm8k",), methods=("ar", "bastion"), limit=1, max_new_tokens=8, warmup_tokens=0,
                      repeats=1, temperature=1.0, data_dir=str(data_dir))
    target, drafter = pair
    run = run_bench(cfg, target, drafter, progress=False)
    by = {s.method: s for s in run.stats}
    assert by["ar"].drafted_share == 0.0 and by["ar"].reliability is None
    ours = [st for r in run.runs if r.method == "bastion" for st in r.result.steps if st.drafted]
    assert ours and all(st.calibrated_accept is not None for st in ours)
    raw, cal, realized = by["bastion"].reliability
    assert raw == pytest.approx(sum(st.predicted_accept for st in ours) / len(ours))
    assert realized == pytest.approx(sum(st.accepted + 1 for st in ours) / len(ours))
    assert "calibrated A_cal" in markdown_report(run)


def test_reliability_points_are_bin_means_of_equal_step_counts() -> None:
    from bastion.bench.plots import reliability_points

    pts = reliability_points([4.0, 1.0, 2.0, 3.0], [1.0, 1.0, 2.0, 4.0], bins=2)
    assert pts == [(1.5, 1.5, 2), (3.5, 2.5, 2)]
    assert reliability_points([], [], bins=3) == []


def test_cli_temperatures_flag_parses_a_list() -> None:
    from bastion.cli.main import build_parser

    args = build_parser().parse_args(["bench", "--temperatures", "0,0.7,1"])
    assert args.temperatures == (0.0, 0.7, 1.0)


@pytest.mark.parametrize("methods", [("ar", "chain", "bastion"), ("ar", "chain", "best-first@4", "bastion")])
def test_each_method_follows_every_other_method_equally_often_within_prompts(pair, methods) -> None:
    """A method run right after a heavy one can be slowed for its whole run (caches, the allocator's
    state): rotating one fixed order would always put the same method after the same neighbour."""
    from collections import Counter

    from bastion.bench.datasets import Prompt

    n = len(methods)
    rows = n if n % 2 == 0 else 2 * n  # a balanced design needs n orders (n even) or 2n (n odd)
    prompts = [Prompt(dataset="gsm8k", domain="math", id=str(i), text=f"question {i}?") for i in range(rows)]
    order: list[str] = []
    recording_build = _recording_build(order)

    cfg = BenchConfig(datasets=("gsm8k",), methods=methods, limit=None, max_new_tokens=2, max_nodes=4,
                      warmup_tokens=0, repeats=1)
    mp = pytest.MonkeyPatch()
    mp.setattr(bench_runner, "build_decoder", recording_build)
    try:
        target, drafter = pair
        run_bench(cfg, target, drafter, None, progress=False, prompts=prompts)
    finally:
        mp.undo()
    blocks = [order[i * n : (i + 1) * n] for i in range(rows)]
    assert all(sorted(b) == sorted(methods) for b in blocks)  # every prompt runs every method once
    follows = Counter((a, b) for block in blocks for a, b in zip(block, block[1:]))
    assert set(follows) == {(a, b) for a in methods for b in methods if a != b}, follows
    assert len(set(follows.values())) == 1, follows
    assert Counter(b[0] for b in blocks) == Counter({m: rows // n for m in methods})  # each starts equally often


@pytest.mark.parametrize("n", range(1, 9))
def test_balanced_orders_start_with_and_follow_each_method_equally_often(n) -> None:
    from collections import Counter

    from bastion.bench.runner import balanced_orders

    rows = balanced_orders(n)
    assert len(rows) == (n if n % 2 == 0 or n == 1 else 2 * n)
    assert all(sorted(r) == list(range(n)) for r in rows)
    assert len(set(Counter(r[0] for r in rows).values())) == 1
    follows = Counter((a, b) for r in rows for a, b in zip(r, r[1:]))
    assert set(follows) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert n == 1 or len(set(follows.values())) == 1


def test_balanced_orders_reject_a_count_below_one() -> None:
    from bastion.bench.runner import balanced_orders

    with pytest.raises(InvalidInputError):
        balanced_orders(0)


def test_the_measured_methods_start_from_fresh_adaptive_state_after_the_warm_up(pair, data_dir: Path) -> None:
    from bastion.controllers import BastionController

    made: list[BastionController] = []

    class Counting(BastionController):
        def __init__(self, **kw) -> None:
            super().__init__(**kw)
            self.begun = 0
            made.append(self)

        def begin(self, sampling) -> None:
            self.begun += 1
            super().begin(sampling)

    reg = bastion.registry
    reg.register("budget_controller", "counting-bench-test", Counting)
    cfg = BenchConfig(datasets=("gsm8k",), methods=("ar", "best-first@counting-bench-test"), limit=2, max_new_tokens=6,
                      warmup_tokens=3, repeats=1, data_dir=str(data_dir))
    target, drafter = pair
    run_bench(cfg, target, drafter, progress=False)
    assert len(made) == 2  # one for the warm-up, a fresh one for the measured runs
    warm, measured = made
    assert warm.begun == 1 and measured.begun == 2  # the measured controller heard nothing of the warm-up
