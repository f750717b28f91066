"""Benchmark tables and plots for any method set: no all-"-" tables, no empty or unreadable plots."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
import torch

from bastion.bench.families import families_table, family_summaries
from bastion.bench.reporting import summary_table, targets_table
from bastion.bench.runner import BenchConfig, LatencyFit, run_bench

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
    for name, rows in (
        ("gsm8k/test.jsonl", [{"question": q, "answer": "#### 0"} for q in ("2+2?", "3*3?")]),
        ("mt_bench/question.jsonl", [{"question_id": 81, "category": "writing", "turns": ["Hi there", "again"]}]),
    ):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return root


def _run(pair, data_dir: Path, methods: tuple[str, ...]):
    target, drafter = pair
    cfg = BenchConfig(datasets=("gsm8k", "mt_bench"), methods=methods, limit=1, max_new_tokens=8, max_nodes=8,
                      warmup_tokens=0, repeats=1, data_dir=str(data_dir), tree_options=TREE_OPTIONS)
    return run_bench(cfg, target, drafter, progress=False)


@pytest.fixture(scope="module")
def custom_run(pair, data_dir: Path):
    """The methods of the report: an adaptive controller on the static builder, the chain at a fixed size."""
    return _run(pair, data_dir, ("ar", "static@bastion", "chain@fixed"))


@pytest.fixture(scope="module")
def sweep_run(pair, data_dir: Path):
    return _run(pair, data_dir, ("ar", "chain", "best-first@2", "best-first@4", "bastion"))


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch):
    """The figures the plot functions close, kept open for inspection (they are drawn: saved first)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept: list = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    yield kept
    for fig in kept:
        real_close(fig)


def _cells(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def test_roles_pick_the_adaptive_controller_and_the_chain_whatever_their_names() -> None:
    from bastion.bench.metrics import method_roles

    roles = method_roles(["ar", "static@bastion", "chain@fixed"])
    assert (roles.adaptive, roles.chain, roles.static, roles.sweep) == ("static@bastion", "chain@fixed", None, ())
    default = method_roles(["ar", "chain", "static", "best-first@8", "best-first@4", "bastion"])
    assert (default.adaptive, default.chain, default.static) == ("bastion", "chain", "static")
    assert default.sweep == ((4, "best-first@4"), (8, "best-first@8"))
    assert method_roles(["ar", "static@bastion", "static@4", "best-first@8"]).sweep == ((4, "static@4"),)


def test_summary_and_paper_tables_are_filled_for_a_custom_controller_and_a_fixed_chain(custom_run) -> None:
    for table in (summary_table(custom_run.summary), targets_table(custom_run.stats, custom_run.summary)):
        for row in _cells(table):
            assert sum(c not in ("-", "- / - / - / -") for c in row[1:]) >= 3, row
        assert "static@bastion" in table.splitlines()[0] and "chain@fixed" in table.splitlines()[0]
    by = {(s.method, s.dataset): s for s in custom_run.stats}
    for d in custom_run.summary:
        assert d.adaptive_method == "static@bastion" and d.chain_method == "chain@fixed"
        assert d.bastion_speedup == by[("static@bastion", d.dataset)].speedup
        assert d.chain_accept == by[("chain@fixed", d.dataset)].acceptance_length
        assert d.accept_vs_chain == pytest.approx(d.bastion_accept / d.chain_accept)


def test_drafter_family_table_is_filled_for_a_custom_controller_and_a_fixed_chain(custom_run) -> None:
    renamed = [attrs.evolve(s, method=f"{s.method}:dflash") if s.method != "ar" else s for s in custom_run.stats]
    summaries = family_summaries(renamed, ["dflash"])
    assert all(d.bastion_speedup is not None and d.chain_speedup is not None for d in summaries["dflash"])
    for row in _cells(families_table(summaries)):
        assert "- / -x" not in row[2] and "- / -x" not in row[4], row


def _plot_lines(ax) -> list:
    return [ln for ln in ax.get_lines() if len(ln.get_xdata()) > 0]


def test_acceptance_plot_draws_every_method_of_a_run_without_a_sweep(custom_run, figures, tmp_path: Path) -> None:
    from bastion.bench.plots import plot_acceptance_vs_budget

    plot_acceptance_vs_budget(custom_run, tmp_path / "a.png")
    fig = figures[-1]
    titled = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in titled] == ["gsm8k", "mt_bench"]
    for ax in titled:  # the acceptance-length panel of each dataset
        drawn = sorted(float(y) for ln in _plot_lines(ax) for y in ln.get_ydata())
        want = sorted(s.acceptance_length for s in custom_run.stats if s.dataset == ax.get_title() and s.method != "ar")
        assert drawn == pytest.approx(want)


@pytest.fixture
def sweep_figure(sweep_run, figures, tmp_path: Path):
    from bastion.bench.plots import plot_acceptance_vs_budget

    plot_acceptance_vs_budget(sweep_run, tmp_path / "a.png")
    return figures[-1]


def test_acceptance_plot_has_one_y_axis_per_panel(sweep_figure) -> None:
    positions = [tuple(round(v, 6) for v in ax.get_position().bounds) for ax in sweep_figure.axes]
    assert len(set(positions)) == len(positions)  # no twin axes sharing one panel


def test_acceptance_plot_marks_single_methods_in_colours_no_line_has(sweep_figure) -> None:
    from matplotlib.colors import to_rgba

    checked = 0
    for ax in sweep_figure.axes:
        lines = [ln for ln in _plot_lines(ax) if ln.get_linestyle() not in ("None", "none", "")]
        points = [ln for ln in _plot_lines(ax) if ln.get_linestyle() in ("None", "none", "")]
        line_colours = {to_rgba(ln.get_color()) for ln in lines}
        assert all(to_rgba(p.get_color()) not in line_colours for p in points)
        checked += len(points)
    assert checked >= 4  # bastion and chain in both panels of each dataset


def test_acceptance_plot_keeps_its_legend_off_every_panel(sweep_figure) -> None:
    renderer = sweep_figure.canvas.get_renderer()
    legends = [*sweep_figure.legends, *(ax.get_legend() for ax in sweep_figure.axes if ax.get_legend() is not None)]
    assert legends
    for legend in legends:
        box = legend.get_window_extent(renderer)
        assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in sweep_figure.axes)


class _SawtoothModel:
    """A latency model whose prediction at one context jumps up and down with N."""

    def predict(self, n_tokens: int, context_len: int) -> float:
        return 1e-3 * (1 + n_tokens % 3) + 1e-6 * context_len


def test_latency_plot_draws_the_model_at_the_measured_steps_not_as_a_sawtooth_line(sweep_run, figures, tmp_path: Path) -> None:
    from bastion.bench.plots import plot_latency_fit

    model = _SawtoothModel()
    points = [(n, c, 1e-3 * n) for n in (1, 2, 3, 4, 5, 6, 8) for c in (10, 40)]
    fit = LatencyFit(points=points, predicted=[model.predict(n, c) for n, c, _ in points], mean_abs_rel_error=0.1)
    assert plot_latency_fit(attrs.evolve(sweep_run, latency=fit, latency_model=model), tmp_path / "l.png") is not None
    ax = figures[-1].axes[0]
    for ln in _plot_lines(ax):
        if ln.get_linestyle() not in ("None", "none", "") and len(ln.get_ydata()) > 2:
            ys = [float(y) for y in ln.get_ydata()]
            assert all(b >= a for a, b in zip(ys, ys[1:])) or all(b <= a for a, b in zip(ys, ys[1:])), ys
    drawn = {tuple(round(float(v), 9) for v in xy) for coll in ax.collections for xy in coll.get_offsets()}
    assert {(float(n), round(1e3 * model.predict(n, c), 9)) for n, c, _ in points} <= drawn


def test_batch_sweep_plots_label_the_batch_sizes_plainly(figures, tmp_path: Path) -> None:
    from bastion.bench.batch_sizes import BatchPoint, BatchSweep, write_batch_report

    sizes, methods = (1, 2, 4, 8), ("ar", "bastion")
    points = tuple(
        BatchPoint(batch_size=b, method=m, tokens=10 * b, seconds=1.0, tokens_per_s=10.0 * b, speedup=1.0,
                   mean_width=1.0 if m == "ar" else 4.0, acceptance=1.0, equal_to_ar=True)
        for b in sizes for m in methods
    )
    sweep = BatchSweep(config=BenchConfig(), batch_sizes=sizes, methods=methods, points=points, meta={})
    write_batch_report(sweep, tmp_path)
    assert len(figures) == 2  # throughput and width
    for fig in figures:
        ax = fig.axes[0]
        labels = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        assert labels == ["1", "2", "4", "8"]
