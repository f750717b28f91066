"""``bastion bench --drafters``: both drafter families in one run, one table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bastion.bench.families import families_table, family_methods, family_summaries, split_family
from bastion.bench.methods import parse_method
from bastion.bench.reporting import markdown_report
from bastion.bench.runner import BenchConfig, run_bench
from bastion.contract.errors import InvalidInputError

ACCEPTS = {"chain": frozenset({"marginals", "candidate_tree"}), "best-first": frozenset({"marginals", "candidate_tree"}),
           "static": frozenset({"marginals"})}


class _Kind:
    def __init__(self, proposes):
        self.proposes = proposes


def test_methods_expand_over_families_and_skip_pairings_a_builder_declines():
    drafters = {"dflash": _Kind("marginals"), "model": _Kind("candidate_tree")}
    got = family_methods(("ar", "chain", "static", "best-first@8", "bastion"), drafters, ACCEPTS)
    assert got == ("ar", "chain:dflash", "chain:model", "static:dflash", "best-first@8:dflash",
                   "best-first@8:model", "bastion:dflash", "bastion:model")
    with pytest.raises(InvalidInputError, match="no method pairs"):
        family_methods(("static",), {"model": _Kind("candidate_tree")}, ACCEPTS)


def test_family_suffixes_parse_into_the_method_and_its_drafter():
    assert split_family("best-first@8:model") == ("best-first@8", "model")
    assert split_family("bastion") == ("bastion", None)
    spec = parse_method("best-first@8:model", known_trees=("best-first",))
    assert (spec.name, spec.tree_builder, spec.controller, spec.max_nodes, spec.drafter) == ("best-first@8:model", "best-first", "fixed", 8, "model")
    assert parse_method("bastion:dflash").drafter == "dflash" and parse_method("bastion").drafter is None


@pytest.fixture(scope="module")
def family_run(tmp_path_factory: pytest.TempPathFactory):
    from bastion.huggingface.causal_lm import HFTarget
    from bastion.drafters.model import ModelDrafter
    from bastion.testing.drafters import NoisyOracleDrafter
    from bastion.testing.tiny import tiny_model

    root = tmp_path_factory.mktemp("data")
    (root / "gsm8k").mkdir()
    (root / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n", encoding="utf-8")
    model = tiny_model("qwen3", seed=0)
    drafters = {"block": NoisyOracleDrafter(model, block_size=4, noise=1.0, seed=0), "model": ModelDrafter(tiny_model("qwen3", seed=0, num_hidden_layers=1), depth=3)}
    methods = family_methods(("ar", "chain", "best-first@4", "bastion"), drafters, ACCEPTS)
    cfg = BenchConfig(datasets=("gsm8k",), methods=methods, limit=1, max_new_tokens=12, warmup_tokens=0, repeats=1,
                      data_dir=str(root), template="plain")
    return run_bench(cfg, HFTarget(model), drafters, None, progress=False)


def test_one_run_decodes_every_family_losslessly_and_reports_them_in_one_table(family_run):
    names = {s.method for s in family_run.stats}
    assert {"chain:block", "chain:model", "best-first@4:model", "bastion:block", "bastion:model"} <= names
    assert all(s.equal_rate == 1.0 for s in family_run.stats if s.method != "ar")
    summaries = family_summaries(family_run.stats, ["block", "model"])
    assert [d.best_fixed_budget for d in summaries["model"]][0] == 4
    table = families_table(summaries)
    assert table.count("| model |") == table.count("| block |") >= 1
    report = markdown_report(family_run)
    assert "### Drafter families" in report and "bastion / best fixed" in report


def test_a_method_naming_an_absent_family_is_rejected(tmp_path: Path):
    from bastion.bench.runner import _drafter_of

    with pytest.raises(InvalidInputError, match="names drafter 'x'; the run has a"):
        _drafter_of(parse_method("chain:x"), {"a": object()})
