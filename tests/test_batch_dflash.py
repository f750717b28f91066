"""Batched DFlash drafting: one draft forward for every row gives each row's single-sequence marginals,
and a DFlash pipeline decodes a batch losslessly."""

from __future__ import annotations

import pytest
import torch

import bastion
from bastion.huggingface.causal_lm import HFTarget
from bastion.contract.types import DraftContext, DraftStep
from bastion.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashDraftModel
from bastion.testing.tiny import tiny_model

LENGTHS = (1, 7, 3, 20, 40)


@pytest.fixture(scope="module")
def pair() -> tuple[HFTarget, DFlashDrafter]:
    target = HFTarget(tiny_model("qwen3", seed=0))
    torch.manual_seed(3)
    cfg = DFlashConfig.for_target(target.config, num_layers=2, block_size=5, target_layer_ids=(0, 1), mask_token_id=255)
    drafter = DFlashDrafter(DFlashDraftModel(cfg))
    drafter.bind(target)
    return target, drafter


def _prompts() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 255, (n,), generator=gen) for n in LENGTHS]


def _single_row(target: HFTarget, drafter: DFlashDrafter, tokens: torch.Tensor, extra: list[int]) -> torch.Tensor:
    """Row alone: prefill, commit ``extra`` tokens one step, then propose -> log probs [K, V]."""
    ids = torch.cat([tokens, torch.tensor(extra, dtype=torch.long)])
    out = target.prefill(ids[None], drafter.feature_layers)
    drafter.begin(DraftContext(tokens, out.features[: len(tokens)]))
    if extra:
        drafter.commit(ids[len(tokens) :], out.features[len(tokens) :])
    root = int(out.logits[-1].argmax())
    return drafter.propose(DraftStep(root_token=root, context_len=len(ids))).log_probs


def test_batched_draft_logits_equal_each_rows_single_sequence_draft(pair):
    target, drafter = pair
    prompts = _prompts()
    state, pre = target.open_batch(prompts, drafter.feature_layers)
    drafts = drafter.open_batch([DraftContext(p, f) for p, f in zip(prompts, pre.features)])
    roots = pre.last_logits.argmax(-1).tolist()
    batch = drafts.propose([DraftStep(root_token=r, context_len=len(p)) for r, p in zip(roots, prompts)])
    for p, m in zip(prompts, batch):
        torch.testing.assert_close(m.log_probs, _single_row(target, drafter, p, []), atol=1e-5, rtol=0)
    # commit a different number of tokens per row (ragged growth), drop a row, propose again
    extra = [[roots[i]] + [7] * i for i in range(len(prompts))]
    feats = []
    for p, e in zip(prompts, extra):
        out = target.prefill(torch.cat([p, torch.tensor(e)])[None], drafter.feature_layers)
        feats.append(out.features[len(p) :])
    drafts.commit([torch.tensor(e) for e in extra], feats)
    keep = [4, 0, 2]
    drafts.keep(keep)
    steps, expect = [], []
    for i in keep:
        ids = torch.cat([prompts[i], torch.tensor(extra[i])])
        logits = target.prefill(ids[None]).logits[-1]
        steps.append(DraftStep(root_token=int(logits.argmax()), context_len=len(ids)))
        expect.append(_single_row(target, drafter, prompts[i], extra[i]))
    for m, ref in zip(drafts.propose(steps), expect):
        torch.testing.assert_close(m.log_probs, ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("controller", ["fixed", "bastion"])
def test_dflash_batch_decodes_every_row_as_alone(pair, controller):
    target, drafter = pair
    opts = {"budget": 8} if controller == "fixed" else {}
    pipe = bastion.Pipeline(target, drafter, budget_controller=bastion.registry.create("budget_controller", controller, **opts), max_nodes=16)
    prompts = _prompts()
    for p, res in zip(prompts, pipe.generate_batch(prompts, max_new_tokens=12)):
        assert res.tokens == pipe.generate(p[None], max_new_tokens=12).tokens


def test_plain_steps_stacked_by_commit_next_propose_what_per_row_commits_propose(pair):
    target, drafter = pair
    prompts = _prompts()
    state, pre = target.open_batch(prompts, drafter.feature_layers)
    contexts = [DraftContext(p, f) for p, f in zip(prompts, pre.features)]
    stacked, per_row = drafter.open_batch(contexts), drafter.open_batch(contexts)
    roots = pre.last_logits.argmax(-1)  # [B]
    rows = list(range(len(prompts)))
    for step in range(3):  # plain steps: one token and its features per row
        out = state.forward_next(roots, drafter.feature_layers)
        state.commit_next()
        feats = out.features[:, 0]  # [B, F]
        stacked.commit_next(roots, feats)
        per_row.commit([roots[i : i + 1] for i in range(len(rows))], [feats[i : i + 1] for i in range(len(rows))])
        roots = out.logits[:, 0].argmax(-1)
        if step == 1:  # a row leaves while plain features are still pending
            keep = [3, 0, 4, 1]
            for s in (state, stacked, per_row):
                s.keep(keep)
            roots, rows = roots[keep], [rows[k] for k in keep]
    steps = [DraftStep(root_token=int(r), context_len=c) for r, c in zip(roots, state.context_lens)]
    for mine, ref in zip(stacked.propose(steps), per_row.propose(steps)):
        torch.testing.assert_close(mine.log_probs, ref.log_probs, atol=1e-6, rtol=0)


def test_a_batch_of_one_drafts_the_single_sequence_marginals_and_rows_joining_it_stay_exact(pair):
    """A batch of one takes the single-sequence drafter's lean pass (the step's few new positions
    projected in the block's own pass, the block's keys/values in scratch slots past the row); after
    several such steps its marginals still equal the single drafter's, and so do a joining row's."""
    target, drafter = pair
    prompts = _prompts()
    first, second = prompts[3], prompts[1]
    state, pre = target.open_batch([first], drafter.feature_layers)
    drafts = drafter.open_batch([DraftContext(first, pre.features[0])])
    committed: list[int] = []
    root = int(pre.last_logits[0].argmax())
    for step in range(4):
        ids = torch.cat([first, torch.tensor(committed, dtype=torch.long)])
        (m,) = drafts.propose([DraftStep(root_token=root, context_len=len(ids), max_depth=3 if step == 2 else None)])
        want = _single_row(target, drafter, first, committed)
        torch.testing.assert_close(m.log_probs, want[: m.depth], atol=1e-5, rtol=0)
        new = [root] + [11] * step  # 1..4 tokens committed per step
        out = target.prefill(torch.cat([ids, torch.tensor(new)])[None], drafter.feature_layers)
        drafts.commit([torch.tensor(new)], [out.features[len(ids) :]])
        committed += new
        root = int(out.logits[-1].argmax())
    state2, pre2 = target.open_batch([second], drafter.feature_layers)
    drafts.extend(drafter.open_batch([DraftContext(second, pre2.features[0])]))
    ids = torch.cat([first, torch.tensor(committed, dtype=torch.long)])
    rows = drafts.propose([DraftStep(root_token=root, context_len=len(ids)),
                           DraftStep(root_token=int(pre2.last_logits[0].argmax()), context_len=len(second))])
    torch.testing.assert_close(rows[0].log_probs, _single_row(target, drafter, first, committed), atol=1e-5, rtol=0)
    torch.testing.assert_close(rows[1].log_probs, _single_row(target, drafter, second, []), atol=1e-5, rtol=0)
