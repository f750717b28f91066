"""Bench methods over EAGLE-3 proposals: ``eagle3`` (EAGLE-3's own tree, every candidate verified) and
``bastion:eagle3`` (bastion's controller over the same candidates), beside other families in one run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_eagle3_drafter import _target, draft_model

import bastion
from bastion.bench.families import families_table, family_methods, family_summaries, own_tree
from bastion.bench.methods import build_decoder, parse_method
from bastion.bench.runner import BenchConfig, run_bench
from bastion.contract.errors import InvalidInputError
from bastion.huggingface.causal_lm import HFTarget
from bastion.drafters.eagle3 import Eagle3Drafter

ACCEPTS = {"chain": frozenset({"marginals", "candidate_tree"}), "best-first": frozenset({"marginals", "candidate_tree"}),
           "static": frozenset({"marginals"})}


class _Kind:
    def __init__(self, proposes: str) -> None:
        self.proposes = proposes


def _eagle3(**kw) -> Eagle3Drafter:
    return Eagle3Drafter(draft_model(), **kw)


def test_the_eagle3_method_verifies_every_candidate_with_the_full_controller():
    spec = parse_method("eagle3")
    assert (spec.tree_builder, spec.controller, spec.eagle3_only, spec.tree_options) == ("best-first", "full", True, {})
    # the pipeline holds exactly the drafter's whole tree (total_token nodes)
    assert build_decoder(spec, HFTarget(_target()), _eagle3(total_token=24)).max_nodes == 24
    assert parse_method("eagle3:eagle3").drafter == "eagle3" and parse_method("bastion:eagle3").controller == "bastion"


def test_the_eagle3_method_refuses_a_drafter_that_is_not_eagle3s():
    from bastion.drafters.model import ModelDrafter
    from bastion.testing.tiny import tiny_model

    target = HFTarget(_target())
    with pytest.raises(InvalidInputError, match="EAGLE-3 drafter's own candidate tree; the drafter is ModelDrafter"):
        build_decoder(parse_method("eagle3"), target, ModelDrafter(tiny_model("llama", seed=0, vocab_size=256), depth=2))


def test_families_get_their_own_default_tree_beside_bastion_and_eagle3_pairs_with_eagle3_drafters_only():
    drafters = {"dflash": _Kind("marginals"), "eagle3": _eagle3(), "model": _Kind("candidate_tree")}
    assert [own_tree(d) for d in drafters.values()] == ["chain", "eagle3", "chain"]
    got = family_methods(("ar", "chain", "static", "best-first@8", "bastion"), drafters, ACCEPTS)
    assert got == ("ar", "chain:dflash", "chain:eagle3", "chain:model", "static:dflash", "best-first@8:dflash",
                   "best-first@8:eagle3", "best-first@8:model", "bastion:dflash", "bastion:eagle3", "bastion:model",
                   "eagle3:eagle3")
    # without bastion nothing is added; asked for, eagle3 still runs with the EAGLE-3 family only
    assert family_methods(("ar", "chain"), drafters, ACCEPTS) == ("ar", "chain:dflash", "chain:eagle3", "chain:model")
    assert family_methods(("eagle3",), drafters, ACCEPTS) == ("eagle3:eagle3",)


def test_the_eagle3_tree_holds_total_token_nodes_and_bastion_picks_subtrees_of_it():
    target = HFTarget(_target())
    drafter = _eagle3(total_token=24, depth=3, top_k=4)
    prompt = torch.tensor([[5, 17, 33, 2, 90]])
    own = build_decoder(parse_method("eagle3"), target, drafter)
    res = own.generate(prompt, max_new_tokens=16)
    budgets = [s.budget for s in res.steps if s.drafted]
    # every step verifies the whole candidate tree (near the end, cut to the tokens left to emit)
    assert budgets[0] == 24 and max(budgets) == 24
    ours = build_decoder(parse_method("bastion"), target, drafter)
    mine = ours.generate(prompt, max_new_tokens=16)
    assert mine.tokens == res.tokens  # the same greedy tokens: the target's own
    assert max(s.budget for s in mine.steps) <= 24


@pytest.fixture(scope="module")
def three_families(tmp_path_factory: pytest.TempPathFactory):
    from bastion.drafters.model import ModelDrafter
    from bastion.testing.drafters import NoisyOracleDrafter
    from bastion.testing.tiny import tiny_model

    root = tmp_path_factory.mktemp("data")
    (root / "gsm8k").mkdir()
    (root / "gsm8k" / "test.jsonl").write_text(json.dumps({"question": "2+2?", "answer": "#### 4"}) + "\n", encoding="utf-8")
    model = _target()
    drafters = {
        "block": NoisyOracleDrafter(model, block_size=4, noise=1.0, seed=0),
        "eagle3": _eagle3(total_token=20, depth=3, top_k=4),
        "model": ModelDrafter(tiny_model("llama", seed=0, num_hidden_layers=1, vocab_size=256), depth=3),
    }
    accepts = {n: bastion.registry.create("tree_builder", n).accepts for n in bastion.registry.names("tree_builder")}
    methods = family_methods(("ar", "chain", "best-first@4", "bastion"), drafters, accepts)
    cfg = BenchConfig(datasets=("gsm8k",), methods=methods, limit=1, max_new_tokens=12, warmup_tokens=0, repeats=1,
                      data_dir=str(root), template="plain")
    return run_bench(cfg, HFTarget(model), drafters, None, progress=False)


def test_one_run_decodes_three_families_losslessly_with_each_familys_own_tree_in_the_table(three_families):
    names = {s.method for s in three_families.stats}
    assert {"eagle3:eagle3", "bastion:eagle3", "chain:eagle3", "bastion:block", "bastion:model"} <= names
    assert all(s.equal_rate == 1.0 for s in three_families.stats if s.method != "ar")
    summaries = family_summaries(three_families.stats, ["block", "eagle3", "model"])
    e3 = summaries["eagle3"][0]
    assert e3.own_method == "eagle3" and e3.own_accept is not None and e3.own_accept > 1.0
    assert summaries["block"][0].own_method == "chain" and summaries["block"][0].own_accept == summaries["block"][0].chain_accept
    eagle_stats = next(s for s in three_families.stats if s.method == "eagle3:eagle3" and s.dataset == "gsm8k")
    assert max(eagle_stats.budget_hist) == 20  # EAGLE-3's own tree: all total_token nodes verified
    table = families_table(summaries)
    assert "own default tree" in table and "| eagle3 | gsm8k |" in table and "eagle3: " in table
