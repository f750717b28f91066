"""Contract kit: checks a component author runs against their own drafter, tree builder, latency model,
budget controller or verifier.

Each ``check_*`` function exercises the interface contract of :mod:`bastion.contract.interfaces` (types,
shapes, value ranges, prefix closure, determinism, errors on bad input, and for verifiers losslessness)
and raises :class:`AssertionError` with a message naming the component and the broken rule, so the
functions drop straight into a pytest test::

    from bastion.testing import check_drafter

    def test_my_drafter_honours_the_contract():
        check_drafter(MyDrafter(vocab_size=256), vocab_size=256)

Everything runs on the CPU with small random inputs drawn from a fixed seed, so a check that passes once
passes every time.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Callable, Sequence

import torch

from bastion.contract.candidates import CandidateTree
from bastion.contract.interfaces import (
    COMPONENT_INTERFACES,
    BatchStepCosts,
    BudgetController,
    BudgetDecision,
    Drafter,
    LatencyModel,
    TreeBuilder,
    Verifier,
)
from bastion.contract.batch_state import DraftBatch
from bastion.contract.errors import InvalidInputError, TreeValidationError
from bastion.contract.sampling import processed_log_probs, seeded_generator
from bastion.contract.target import Target
from bastion.contract.tree import Tree
from bastion.contract.types import DraftContext, DraftStep, Marginals, SamplingConfig, Verdict
from bastion.testing.stats import DEFAULT_ALPHA, assert_fits

__all__ = [
    "DOCUMENTED_ERRORS",
    "FixedLatencyModel",
    "random_candidate_tree",
    "check_budget_controller",
    "check_component",
    "check_drafter",
    "check_latency_model",
    "check_tree_builder",
    "check_verifier",
]


class FixedLatencyModel(LatencyModel):
    """A latency model with a fixed law, ``base_s + per_token_s * B * W + per_context_s * B * W * S``
    for a batch of ``B`` rows of ``W`` slots after a longest context ``S`` (a single sequence: ``B = 1``,
    ``W = n``), for testing budget controllers. :meth:`observe_batch` records the measurement and
    changes nothing."""

    def __init__(self, base_s: float = 1e-3, per_token_s: float = 2e-5, per_context_s: float = 1e-8) -> None:
        self.base_s, self.per_token_s, self.per_context_s = base_s, per_token_s, per_context_s
        self.observed: list[tuple[int, int, float]] = []  # (B * W, longest context, seconds)

    def predict_batch(self, widths: torch.Tensor, context_lens: Sequence[int]) -> torch.Tensor:
        tokens = widths.double().cpu() * len(context_lens)  # [N] tokens of one forward
        return self.base_s + self.per_token_s * tokens + self.per_context_s * tokens * max(context_lens)

    def observe_batch(self, width: int, context_lens: Sequence[int], seconds: float) -> None:
        self.observed.append((width * len(context_lens), max(context_lens), seconds))


# ---------------------------------------------------------------------------------------------- helpers
def _name(component: object) -> str:
    return type(component).__name__


def _require(ok: bool, component: object, rule: str) -> None:
    if not ok:
        raise AssertionError(f"{_name(component)}: {rule}")


#: what every component must raise for bad input: bastion's documented error for it
#: (:class:`bastion.contract.errors.InvalidInputError`; trees may raise its sibling TreeValidationError)
DOCUMENTED_ERRORS: tuple[type[Exception], ...] = (InvalidInputError, TreeValidationError)


def _require_error(component: object, fn: Callable[[], Any], rule: str) -> None:
    """``fn()`` must raise one of :data:`DOCUMENTED_ERRORS`; any other exception (an IndexError from a
    bug) or none at all breaks ``rule``."""
    try:
        fn()
    except DOCUMENTED_ERRORS:
        return
    except Exception as exc:
        raise AssertionError(
            f"{_name(component)}: {rule}; it raised {type(exc).__name__}: {exc} instead of "
            f"bastion.core.InvalidInputError"
        ) from exc
    raise AssertionError(f"{_name(component)}: {rule}; it raised nothing")


def _check_type(component: object, iface: type) -> None:
    _require(
        isinstance(component, iface),
        component,
        f"must be an instance of bastion.core.{iface.__name__}",
    )


def _random_marginals(gen: torch.Generator, depth: int, vocab: int, allowed: int | None = None) -> Marginals:
    """Peaked random marginals [depth, vocab]; ``allowed`` keeps only that many tokens per depth."""
    logits = torch.randn(depth, vocab, generator=gen) * 3.0  # [K, V]
    if allowed is not None:
        keep = torch.rand(depth, vocab, generator=gen).argsort(dim=-1)[:, :allowed]  # [K, allowed]
        banned = torch.full_like(logits, float("-inf"))
        logits = banned.scatter(1, keep, logits.gather(1, keep))
    return Marginals.from_logits(logits)


def random_candidate_tree(gen: torch.Generator, vocab: int, n: int, root: int = 0, scale: float = 3.0) -> CandidateTree:
    """A random valid candidate tree of ``n`` nodes: each node hangs below a random earlier node with a
    token its siblings do not use, and its log q comes from one peaked random distribution per parent
    (so siblings' probabilities sum to at most 1)."""
    tokens, parents, log_q = [root], [-1], [0.0]
    dists = [torch.log_softmax(torch.randn(vocab, generator=gen) * scale, dim=-1).tolist()]
    used: list[set[int]] = [set()]
    for _ in range(n - 1):
        open_nodes = [i for i in range(len(tokens)) if len(used[i]) < vocab]
        p = open_nodes[int(torch.randint(0, len(open_nodes), (1,), generator=gen))]
        free = [t for t in range(vocab) if t not in used[p]]
        t = free[int(torch.randint(0, len(free), (1,), generator=gen))]
        used[p].add(t)
        tokens.append(t)
        parents.append(p)
        log_q.append(dists[p][t])
        dists.append(torch.log_softmax(torch.randn(vocab, generator=gen) * scale, dim=-1).tolist())
        used.append(set())
    return CandidateTree.from_lists(tokens, parents, log_q)


# ---------------------------------------------------------------------------------------------- drafter
def _check_marginals(drafter: Drafter, m: object, vocab: int, where: str) -> torch.Tensor:
    _require(isinstance(m, Marginals), drafter, f"{where}: propose() must return bastion.core.Marginals, got {type(m).__name__}")
    assert isinstance(m, Marginals)
    lp = m.log_probs
    _require(lp.dim() == 2 and lp.shape[0] >= 1, drafter, f"{where}: marginals must be [K, V] with K >= 1, got {tuple(lp.shape)}")
    _require(lp.shape[1] == vocab, drafter, f"{where}: marginals cover {lp.shape[1]} tokens, vocab_size is {vocab}")
    lp = lp.detach().float().cpu()
    _require(not bool(torch.isnan(lp).any()), drafter, f"{where}: marginals contain NaN")
    _require(not bool(torch.isposinf(lp).any()), drafter, f"{where}: marginals contain +inf")
    norm = torch.logsumexp(lp, dim=-1)  # [K]
    _require(
        bool(torch.allclose(norm, torch.zeros_like(norm), atol=1e-3)),
        drafter,
        f"{where}: every depth must be a normalized log-distribution; logsumexp per depth = {norm.tolist()}",
    )
    return lp


def _check_candidates(drafter: Drafter, c: CandidateTree, vocab: int, root: int, where: str) -> torch.Tensor:
    try:
        c.validate(vocab_size=vocab, root_token=root)
    except TreeValidationError as exc:
        raise AssertionError(f"{_name(drafter)}: {where}: invalid candidate tree: {exc}") from exc
    return torch.stack((c.tokens.cpu().double(), c.parents.cpu().double(), c.log_q.detach().cpu().double()))  # [3, n]


def _check_proposal(drafter: Drafter, p: object, vocab: int, root: int, where: str) -> torch.Tensor:
    """Check one proposal of either kind (and that it is the kind the drafter declares)."""
    _require(
        isinstance(p, (Marginals, CandidateTree)),
        drafter,
        f"{where}: propose() must return bastion.core.Marginals or bastion.core.CandidateTree, got {type(p).__name__}",
    )
    kind = "marginals" if isinstance(p, Marginals) else "candidate_tree"
    declared = drafter.proposes
    _require(
        declared is None or declared == kind,
        drafter,
        f"{where}: declares proposes={declared!r} but propose() returned {kind}",
    )
    if isinstance(p, Marginals):
        return _check_marginals(drafter, p, vocab, where)
    assert isinstance(p, CandidateTree)
    return _check_candidates(drafter, p, vocab, root, where)


def check_drafter(
    drafter: Drafter,
    vocab_size: int | None = None,
    *,
    target: Target | None = None,
    prompt: Sequence[int] | torch.Tensor | None = None,
    feature_dim: int | None = None,
    steps: int = 4,
    seed: int = 0,
) -> None:
    """Check a :class:`~bastion.core.Drafter` through its batch-first method, :meth:`open_batch`.

    Runs ``open_batch([context]) -> (propose, commit) x steps`` twice and checks: the vocabulary size,
    ``feature_layers`` type, the declared proposal kind (``proposes``), the proposals (marginals of
    shape [K, V] that are normalized with no NaN or +inf; or candidate trees rooted at the step's root
    with parents before children, distinct siblings, log q <= 0 and each node's children carrying
    probability <= 1), the same proposals on the second run (determinism), a valid proposal at
    temperature 0.5, and an error for a root token outside the vocabulary. Then a batch of two rows
    (the same prompt, other roots on the second row) must give each row what a batch of one gives it,
    and a batch that :meth:`~bastion.contract.batch_state.DraftBatch.keep` cut to its second row must
    go on as that row alone. A drafter written against the single-sequence methods (``begin``,
    ``propose``, ``commit``) is checked through the default ``open_batch`` that drives them.

    ``target``: bind the drafter to it and take the prompt's features from its prefill (needed by
    drafters that borrow target weights). Without a target, a drafter with non-empty ``feature_layers``
    gets random features of width ``feature_dim``.
    """
    _check_type(drafter, Drafter)
    if target is not None:
        drafter.bind(target)
    vocab = drafter.vocab_size
    _require(isinstance(vocab, int) and vocab >= 1, drafter, f"vocab_size must be a positive int, got {vocab!r}")
    if vocab_size is not None:
        _require(vocab == vocab_size, drafter, f"vocab_size is {vocab}, expected {vocab_size}")
    if target is not None:
        _require(vocab == target.vocab_size, drafter, f"vocab_size {vocab} differs from the target's {target.vocab_size}")
    layers = drafter.feature_layers
    _require(
        isinstance(layers, tuple) and all(isinstance(i, int) and not isinstance(i, bool) for i in layers),
        drafter,
        f"feature_layers must be a tuple of ints, got {layers!r}",
    )
    _require(
        drafter.proposes in (None, "marginals", "candidate_tree"),
        drafter,
        f"proposes must be None, 'marginals' or 'candidate_tree', got {drafter.proposes!r}",
    )
    gen = seeded_generator(seed)
    if prompt is None:  # a short repeating pattern, so context-matching drafters have something to find
        motif = torch.randint(0, vocab, (4,), generator=gen)
        ids = torch.cat([motif, torch.randint(0, vocab, (3,), generator=gen), motif])  # [11]
    else:
        ids = torch.as_tensor(prompt, dtype=torch.long).flatten()
    if target is not None:
        target.reset()
        features = target.prefill(ids[None].to(target.device), layers).features
        ids = ids.to(target.device)
    elif layers:
        _require(
            feature_dim is not None,
            drafter,
            f"needs target features (feature_layers={layers}); pass target= or feature_dim= to check_drafter",
        )
        features = torch.randn(ids.shape[0], int(feature_dim), generator=gen)  # [L, F]
    else:
        features = None
    f_dim = None if features is None else int(features.shape[-1])
    context = DraftContext(tokens=ids, features=features)
    # per row: a root and one accepted token per step, and their features
    roots = [torch.randint(0, vocab, (steps, 2), generator=gen).tolist() for _ in range(2)]
    feats = [
        [None if f_dim is None else torch.randn(2, f_dim, generator=gen).to(device=features.device, dtype=features.dtype) for _ in range(steps)]  # type: ignore[union-attr]
        for _ in range(2)
    ]

    def open_rows(n: int) -> Any:
        batch = drafter.open_batch([context] * n)
        _require(isinstance(batch, DraftBatch), drafter, f"open_batch() must return a bastion DraftBatch, got {type(batch).__name__}")
        return batch

    def rollout(rows: Sequence[int], keep_after: int | None = None) -> list[list[torch.Tensor]]:
        """Proposals of a batch of ``rows`` (indices into ``roots``); with ``keep_after`` the batch keeps
        only its last row after that many steps."""
        batch, live = open_rows(len(rows)), list(rows)
        seen: list[list[torch.Tensor]] = [[] for _ in rows]
        ctx = int(ids.shape[0])
        for i in range(steps):
            if keep_after is not None and i == keep_after:
                batch.keep([len(live) - 1])
                live = live[-1:]
            props = batch.propose([DraftStep(root_token=roots[r][i][0], context_len=ctx, temperature=1.0) for r in live])
            _require(
                isinstance(props, list) and len(props) == len(live),
                drafter,
                f"DraftBatch.propose() must return a list of {len(live)} proposals, got {type(props).__name__} of {len(props) if hasattr(props, '__len__') else '?'}",
            )
            for r, p in zip(live, props):
                seen[rows.index(r)].append(_check_proposal(drafter, p, vocab, roots[r][i][0], f"row {r}, step {i}"))
            batch.commit([torch.tensor(roots[r][i], dtype=torch.long, device=ids.device) for r in live], [feats[r][i] for r in live])
            ctx += 2
        return seen

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-5))

    (first,), (second,) = rollout([0]), rollout([0])
    for i, (a, b) in enumerate(zip(first, second)):
        _require(
            same(a, b),
            drafter,
            f"propose() is not deterministic: two batches opened on the same context and given the same commits "
            f"returned different proposals at step {i}",
        )
    (other,) = rollout([1])
    pair = rollout([0, 1])
    for r, solo in enumerate((first, other)):
        for i, (a, b) in enumerate(zip(solo, pair[r])):
            _require(same(a, b), drafter, f"row {r} of a batch of two proposed differently from a batch of one at step {i}")
    cut = rollout([0, 1], keep_after=1)[1]
    for i, (a, b) in enumerate(zip(other, cut)):
        _require(same(a, b), drafter, f"after keep() the kept row proposed differently from a batch of one at step {i}")
    cold = open_rows(1).propose([DraftStep(root_token=roots[0][0][0], context_len=int(ids.shape[0]), temperature=0.5)])
    _check_proposal(drafter, cold[0] if isinstance(cold, list) and cold else cold, vocab, roots[0][0][0], "temperature 0.5")
    bad = open_rows(1)
    _require_error(
        drafter,
        lambda: bad.propose([DraftStep(root_token=vocab, context_len=int(ids.shape[0]), temperature=1.0)]),
        f"propose() must raise for a root token outside the vocabulary (root_token={vocab})",
    )
    drafter.reset()


# ---------------------------------------------------------------------------------------------- tree builder
def check_tree_builder(
    builder: TreeBuilder,
    *,
    vocab_size: int = 32,
    depth: int = 5,
    budgets: Sequence[int] = (1, 2, 3, 8, 40),
    best_first: bool = False,
    seed: int = 0,
) -> None:
    """Check a :class:`~bastion.core.TreeBuilder`.

    For random marginals (dense ones, and sparse ones where most tokens are ``-inf``) and each budget:
    a valid :class:`~bastion.core.Tree` (root first, parents before children so every prefix is
    prefix-closed, distinct siblings, tokens in the vocabulary, finite log scores), the requested root
    token, at most ``max_nodes`` nodes, depth at most K, ``log_scores`` equal to the sum of the path's
    log-probabilities, the same tree when built twice, and an error for ``max_nodes=0``.

    ``best_first=True`` also checks the best-first property: scores never increase along the node order
    and a smaller budget's tree is exactly the first nodes of a larger budget's tree.

    A builder whose ``accepts`` lists ``"candidate_tree"`` is also fed random candidate trees: its trees
    must be valid subtrees of the candidates (every node's path of tokens is a candidate's path) with
    ``log_scores`` the sum of the path's log q (and, with ``best_first``, the same best-first property).
    """
    _check_type(builder, TreeBuilder)
    accepts = getattr(builder, "accepts", frozenset({"marginals"}))
    _require(
        isinstance(accepts, frozenset) and bool(accepts) and accepts <= {"marginals", "candidate_tree"},
        builder,
        f"accepts must be a non-empty frozenset of 'marginals' / 'candidate_tree', got {accepts!r}",
    )
    gen = seeded_generator(seed)
    cases = [
        ("dense", _random_marginals(gen, depth, vocab_size)),
        ("sparse", _random_marginals(gen, 2, vocab_size, allowed=2)),  # at most 1 + 2 + 4 = 7 nodes exist
        ("single depth", _random_marginals(gen, 1, vocab_size)),
    ]
    for label, m in cases:
        root = int(torch.randint(0, vocab_size, (1,), generator=gen))
        trees: list[Tree] = []
        for b in budgets:
            where = f"{label} marginals [K={m.depth}], max_nodes={b}"
            tree = builder.build(m, root_token=root, max_nodes=b)
            _check_tree(builder, tree, m, root, b, vocab_size, where)
            again = builder.build(m, root_token=root, max_nodes=b)
            _require(
                len(again) == len(tree)
                and torch.equal(again.tokens, tree.tokens)
                and torch.equal(again.parents, tree.parents),
                builder,
                f"{where}: build() is not deterministic (two calls returned different trees)",
            )
            trees.append(tree)
        if best_first:
            _check_best_first(builder, trees, budgets, label)
    if "candidate_tree" in accepts:
        for label, n_cand in (("candidate tree", 40), ("root-only candidate tree", 1)):
            cand = random_candidate_tree(gen, vocab_size, n_cand, root=int(torch.randint(0, vocab_size, (1,), generator=gen)))
            trees = []
            for b in budgets:
                where = f"{label} of {n_cand} nodes, max_nodes={b}"
                tree = builder.build(cand, root_token=cand.root_token, max_nodes=b)
                _check_tree_of_candidates(builder, tree, cand, b, vocab_size, where)
                trees.append(tree)
            if best_first:
                _check_best_first(builder, trees, budgets, label)
    _require_error(
        builder,
        lambda: builder.build(cases[0][1], root_token=0, max_nodes=0),
        "build() must raise for max_nodes=0 (a tree has at least its root)",
    )


def _check_tree_shape(builder: TreeBuilder, tree: object, root: int, budget: int, vocab: int, where: str) -> Tree:
    """A valid :class:`Tree` with the root token first and at most ``budget`` nodes."""
    _require(isinstance(tree, Tree), builder, f"{where}: build() must return bastion.core.Tree, got {type(tree).__name__}")
    assert isinstance(tree, Tree)
    try:
        tree.validate(vocab_size=vocab)
    except Exception as exc:
        raise AssertionError(f"{_name(builder)}: {where}: invalid tree: {exc}") from exc
    _require(int(tree.tokens[0]) == root, builder, f"{where}: node 0 must be the root token {root}, got {int(tree.tokens[0])}")
    _require(1 <= len(tree) <= budget, builder, f"{where}: tree has {len(tree)} nodes, allowed 1..{budget}")
    return tree


def _check_tree(builder: TreeBuilder, tree: object, m: Marginals, root: int, budget: int, vocab: int, where: str) -> None:
    tree = _check_tree_shape(builder, tree, root, budget, vocab, where)
    _require(tree.max_depth <= m.depth, builder, f"{where}: tree depth {tree.max_depth} exceeds the K={m.depth} marginals")
    lp = m.log_probs.double()  # [K, V]
    parents, depths, tokens = tree.parents.tolist(), tree.depths.tolist(), tree.tokens.tolist()
    expected = [0.0] * len(tree)
    for i in range(1, len(tree)):
        expected[i] = expected[parents[i]] + float(lp[depths[i] - 1, tokens[i]])
    got = tree.log_scores.double().cpu()
    _require(
        bool(torch.allclose(got, torch.tensor(expected, dtype=torch.float64), atol=1e-4, rtol=1e-4)),
        builder,
        f"{where}: log_scores must be log rho, the sum of log q_k along each node's path (root 0.0)",
    )


def _check_tree_of_candidates(builder: TreeBuilder, tree: object, cand: CandidateTree, budget: int, vocab: int, where: str) -> None:
    tree = _check_tree_shape(builder, tree, cand.root_token, budget, vocab, where)
    c_tokens, c_parents, c_logq = cand.host_lists()
    child_of = {(p, t): i for i, (p, t) in enumerate(zip(c_parents, c_tokens)) if p >= 0}
    match, expected = [0], [0.0]
    for i, (p, t) in enumerate(zip(tree.parents.tolist()[1:], tree.tokens.tolist()[1:]), start=1):
        c = child_of.get((match[p], t))
        _require(c is not None, builder, f"{where}: node {i} (token {t}) is not a candidate below its parent's candidate")
        match.append(c)
        expected.append(expected[p] + c_logq[c])
    _require(
        bool(torch.allclose(tree.log_scores.double().cpu(), torch.tensor(expected, dtype=torch.float64), atol=1e-4, rtol=1e-4)),
        builder,
        f"{where}: log_scores must be log rho, the sum of the candidates' log q along each node's path",
    )


def _check_best_first(builder: TreeBuilder, trees: list[Tree], budgets: Sequence[int], label: str) -> None:
    for b, tree in zip(budgets, trees):
        s = tree.log_scores[1:]
        _require(
            bool((s[1:] <= s[:-1] + 1e-6).all()) if s.numel() > 1 else True,
            builder,
            f"{label} marginals, max_nodes={b}: best-first trees list nodes in non-increasing score order",
        )
    big = trees[-1]
    for b, tree in zip(budgets, trees):
        n = len(tree)
        _require(
            n <= len(big) and torch.equal(big.tokens[:n], tree.tokens) and torch.equal(big.parents[:n], tree.parents),
            builder,
            f"{label} marginals: the max_nodes={b} tree must be the first {n} nodes of the max_nodes={budgets[-1]} tree",
        )


# ---------------------------------------------------------------------------------------------- latency model
def check_latency_model(
    model: LatencyModel,
    *,
    n_tokens: Sequence[int] = (1, 2, 8, 32, 128),
    context_lens: Sequence[int] = (1, 64, 1024),
    batch_sizes: Sequence[int] = (1, 2, 4),
    monotone: bool = True,
    calibration: bool = False,
) -> None:
    """Check a :class:`~bastion.core.LatencyModel` through its batch-first methods.

    ``predict_batch`` returns a tensor [N] of finite, positive seconds for batches of each size in
    ``batch_sizes`` (rows at the context lengths given); the single-sequence ``predict`` agrees with a
    batch of one row; with ``monotone`` a single sequence's predictions never decrease as the tree grows; after
    ``observe_batch`` has been fed measurements of one row from a linear law, predictions stay finite,
    positive (and, for one row, monotone); a NaN measurement is rejected with :class:`~bastion.core.InvalidInputError`
    or ignored, never allowed to poison later predictions. With ``calibration`` the one-row predictions
    must also land within a factor of 2 of the law it observed. A model written against the
    single-sequence methods is checked through the batch-first defaults that call them.
    """
    _check_type(model, LatencyModel)
    widths = torch.tensor(list(n_tokens), dtype=torch.long)  # [N]

    def sweep(stage: str) -> None:
        for c in context_lens:
            for b in batch_sizes:
                ctxs = [c] * b
                where = f"{stage}: predict_batch({list(n_tokens)}, {b} rows at context {c})"
                times = model.predict_batch(widths, ctxs)
                _require(
                    isinstance(times, torch.Tensor) and tuple(times.shape) == (len(n_tokens),),
                    model,
                    f"{where} must return a tensor [N], got {getattr(times, 'shape', type(times).__name__)}",
                )
                t = times.double().cpu()
                _require(bool(torch.isfinite(t).all() and (t > 0).all()), model, f"{where} = {t.tolist()}; need a finite value > 0 for each width")
                if monotone and b == 1:
                    _require(bool((t[1:] >= t[:-1] * (1 - 1e-9)).all()), model, f"{where} = {t.tolist()} decreases as the tree grows")
            one = model.predict_batch(widths, [c]).double().cpu()
            single = torch.tensor([model.predict(n, c) for n in n_tokens], dtype=torch.float64)
            _require(
                bool(torch.allclose(one, single, rtol=1e-5, atol=1e-12)),
                model,
                f"{stage}: predict() disagrees with predict_batch() of one row at context {c}",
            )

    sweep("before observe")

    def law(n: int, c: int) -> float:
        return 2e-3 + 3e-5 * n + 1e-8 * n * c

    for _ in range(8):
        for n in n_tokens:
            for c in context_lens:
                model.observe_batch(n, [c], law(n, c))
    sweep("after observe")
    if calibration:
        for n in n_tokens:
            for c in context_lens:
                t, want = float(model.predict_batch(torch.tensor([n]), [c])[0]), law(n, c)
                _require(
                    want / 2 <= t <= want * 2,
                    model,
                    f"calibration: after observing {want:.3g}s at (n={n}, context={c}) it predicts {t:.3g}s",
                )
    try:
        model.observe_batch(n_tokens[0], [context_lens[0]], float("nan"))
    except DOCUMENTED_ERRORS:
        pass  # rejecting the measurement is fine; any other exception is a bug
    except Exception as exc:
        raise AssertionError(
            f"{_name(model)}: observe_batch() of a NaN measurement raised {type(exc).__name__}: {exc}; "
            "ignore it or raise bastion.core.InvalidInputError"
        ) from exc
    t = float(model.predict_batch(torch.tensor([n_tokens[0]]), [context_lens[0]])[0])
    _require(math.isfinite(t) and t > 0, model, f"a NaN measurement poisoned predict_batch(): got {t!r}")


# ---------------------------------------------------------------------------------------------- budget controller
def check_budget_controller(
    controller: BudgetController,
    latency: LatencyModel | None = None,
    *,
    sizes: Sequence[int] = (1, 2, 5, 64, 300),
    context_lens: Sequence[int] = (1, 200, 4000),
    overheads: Sequence[float] = (0.0, 1e-3, 0.05),
    deterministic: bool = True,
    seed: int = 0,
) -> None:
    """Check a :class:`~bastion.core.BudgetController` through its batch-first methods.

    ``begin_batch`` and ``speculate_batch`` (which must return a bool) run for batches of one and three
    rows. For best-first score vectors (non-increasing log rho, root 0.0) of several sizes, context
    lengths and overheads, ``decide_width`` of one row returns a :class:`~bastion.core.BudgetDecision`
    with an ``int`` n, 1 <= n <= n_max, a finite (or no) predicted speedup, leaves ``log_scores``
    untouched and returns the same n for the same inputs (unless ``deterministic=False``), which the
    single-sequence ``choose`` returns too; for three rows of different sizes, 1 <= n <= the largest.
    ``decide_width`` must raise for an empty score vector. ``latency`` defaults to
    :class:`FixedLatencyModel`. A controller written against the single-sequence methods (``choose``
    or ``decide``) is checked through the batch-first defaults that call them.
    """
    _check_type(controller, BudgetController)
    latency = latency or FixedLatencyModel()
    gen = seeded_generator(seed)
    costs = BatchStepCosts(overhead_s=1e-3, draft_s=1e-3, plain_s=1e-3)
    for rows in (1, 3):
        controller.begin_batch(SamplingConfig(temperature=0.0), rows)
        ok = controller.speculate_batch([context_lens[0]] * rows, latency, costs)
        _require(isinstance(ok, bool), controller, f"speculate_batch() of {rows} rows must return a bool, got {type(ok).__name__}")
    controller.begin_batch(SamplingConfig(temperature=0.0), 1)

    def scores_of(n_max: int) -> torch.Tensor:
        steps = torch.rand(n_max - 1, generator=gen) * 2.0  # per-node drop in log rho
        return torch.cat([torch.zeros(1), -torch.cumsum(steps, 0)])  # [n_max], root 0.0, non-increasing

    def checked_n(where: str, method: str, n: object, rows: list[torch.Tensor], before: list[torch.Tensor]) -> int:
        top = max(len(r) for r in rows)
        _require(isinstance(n, int) and not isinstance(n, bool), controller, f"{where}: {method} must return a Python int, got {type(n).__name__}")
        assert isinstance(n, int)
        _require(1 <= n <= top, controller, f"{where}: {method} returned {n}; need 1 <= n <= {top}")
        _require(all(torch.equal(r, b) for r, b in zip(rows, before)), controller, f"{where}: {method} modified log_scores in place")
        return n

    def decision_of(where: str, rows: list[torch.Tensor], ctxs: list[int], ov: float) -> int:
        before = [r.clone() for r in rows]
        decision = controller.decide_width(rows, ctxs, latency, ov, 0.0)
        _require(
            isinstance(decision, BudgetDecision),
            controller,
            f"{where}: decide_width() must return a BudgetDecision, got {type(decision).__name__}",
        )
        n = checked_n(where, "decide_width()", decision.n, rows, before)
        s = decision.predicted_speedup
        _require(
            s is None or (isinstance(s, (int, float)) and math.isfinite(s)),
            controller,
            f"{where}: decide_width().predicted_speedup must be None or finite, got {s!r}",
        )
        return n

    def chosen(where: str, scores: torch.Tensor, c: int, ov: float) -> int:
        """The single-sequence adapter ``choose``, checked like ``decide_width``."""
        before = [scores.clone()]
        return checked_n(where, "choose()", controller.choose(scores, c, latency, ov), [scores], before)

    for n_max in sizes:
        scores = scores_of(n_max)
        for c in context_lens:
            for ov in overheads:
                where = f"one row, n_max={n_max}, context_len={c}, overhead_s={ov}"
                n = decision_of(where, [scores], [c], ov)
                k = chosen(where, scores, c, ov)
                if deterministic:
                    again = decision_of(where, [scores], [c], ov)
                    _require(again == n, controller, f"{where}: decide_width() returned {n} then {again} for the same inputs")
                    k_again = chosen(where, scores, c, ov)
                    _require(k_again == k, controller, f"{where}: choose() returned {k} then {k_again} for the same inputs")
                    _require(k == n, controller, f"{where}: choose() returned {k}, decide_width() of one row {n}")
    controller.begin_batch(SamplingConfig(temperature=0.0), 3)
    for ov in overheads:
        rows = [scores_of(n) for n in (3, 40, 1)]
        decision_of(f"three rows of 3, 40 and 1 nodes, overhead_s={ov}", rows, [5, 900, 60], ov)
    controller.begin_batch(SamplingConfig(temperature=0.0), 1)
    _require_error(
        controller,
        lambda: controller.decide_width([torch.zeros(0)], [1], latency, 0.0, 0.0),
        "decide_width() must raise for empty log_scores (a tree has at least its root)",
    )


# ---------------------------------------------------------------------------------------------- verifier
#: the tree used by the verifier checks: root 0 with children 1, 2, 3; grandchildren below 1 and 2
_V_TOKENS = [0, 1, 2, 3, 1, 4, 5, 2]
_V_PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4]


def _check_verdict(verifier: Verifier, tree: Tree, v: object, vocab: int, where: str) -> list[int]:
    _require(isinstance(v, Verdict), verifier, f"{where}: verify() must return bastion.core.Verdict, got {type(v).__name__}")
    assert isinstance(v, Verdict)
    path = [int(i) for i in v.accepted_nodes.tolist()]
    _require(len(path) >= 1 and path[0] == 0, verifier, f"{where}: accepted_nodes must start at the root (0), got {path}")
    parents = tree.parents.tolist()
    for a, b in zip(path, path[1:]):
        _require(0 <= b < len(tree) and parents[b] == a, verifier, f"{where}: accepted_nodes {path} is not a root-to-node path")
    tokens = tree.tokens.tolist()
    _require(
        list(v.accepted_tokens) == [tokens[i] for i in path[1:]],
        verifier,
        f"{where}: accepted_tokens {list(v.accepted_tokens)} do not match the tokens of accepted_nodes {path}",
    )
    _require(0 <= v.bonus_token < vocab, verifier, f"{where}: bonus_token {v.bonus_token} outside [0, {vocab})")
    return path


def check_verifier(
    verifier: Verifier,
    *,
    vocab_size: int = 6,
    trials: int = 2000,
    alpha: float = DEFAULT_ALPHA,
    seed: int = 0,
) -> None:
    """Check a :class:`~bastion.core.Verifier` through its batch-first method, ``verify_batch``.

    Greedy (temperature 0): on a fixed tree with random target logits, a batch of one row's verdict is
    exactly the greedy walk (follow the child whose token is the target's argmax; the bonus is the argmax
    where the walk stops), with a well-formed path; in a batch of three rows (the tree, a root-only tree
    and the tree again, logits padded to the widest) each row's verdict is its own greedy walk, and so is
    ``next_tokens`` for plain steps. Sampling (when ``supports_sampling``): verdicts are well formed,
    repeat for the same generator seed, never emit a token top-k filtering removed, and are lossless:
    over ``trials`` draws the joint distribution of the first two emitted tokens must fit the target's
    own (chi-square goodness of fit at false-alarm rate ``alpha``, see :mod:`bastion.testing.stats`:
    the acceptance region follows from ``trials``; more trials detect smaller deviations). Logits with
    fewer slots than the tree, or for another number of rows, must raise
    :class:`~bastion.core.InvalidInputError`. A verifier written against the single-sequence ``verify``
    is checked through the default ``verify_batch`` that calls it.
    """
    _check_type(verifier, Verifier)
    _require(vocab_size >= 6, verifier, "check_verifier needs vocab_size >= 6 (its test tree uses tokens 0..5)")
    tree = Tree.from_parents(_V_TOKENS, _V_PARENTS)
    n = len(tree)
    kids = tree.children_lists()
    tokens = tree.tokens.tolist()
    gen = seeded_generator(seed)
    greedy = SamplingConfig(temperature=0.0)
    for trial in range(24):
        logits = torch.randn(n, vocab_size, generator=gen)  # [n, V]
        if trial % 2 == 0:  # make the walk go deep half the time
            for node in range(n):
                if kids[node]:
                    logits[node, tokens[kids[node][trial // 2 % len(kids[node])]]] += 10.0
        node, want = 0, [0]
        while True:
            best = int(logits[node].argmax())
            nxt = [c for c in kids[node] if tokens[c] == best]
            if not nxt:
                break
            node = nxt[0]
            want.append(node)
        where = f"greedy trial {trial}"
        v = _verify_one(verifier, tree, logits, greedy, None, where)
        path = _check_verdict(verifier, tree, v, vocab_size, where)
        _require(path == want, verifier, f"{where}: accepted path {path}, the target's greedy walk is {want}")
        bonus = int(logits[want[-1]].argmax())
        _require(v.bonus_token == bonus, verifier, f"{where}: bonus_token {v.bonus_token}, the target's argmax is {bonus}")
        _check_greedy_batch(verifier, tree, logits, v, vocab_size, where)
    _require_error(
        verifier,
        lambda: verifier.verify_batch([tree], torch.randn(1, n - 1, vocab_size), [greedy], [None]),
        f"verify_batch() must raise when logits have {n - 1} slots for a tree of {n} nodes",
    )
    _require_error(
        verifier,
        lambda: verifier.verify_batch([tree], torch.randn(2, n, vocab_size), [greedy], [None]),
        "verify_batch() must raise when logits hold 2 rows for 1 tree",
    )
    if verifier.supports_sampling:
        _check_sampling(verifier, tree, vocab_size, trials, alpha, gen)


def _verify_one(
    verifier: Verifier, tree: Tree, logits: torch.Tensor, sampling: SamplingConfig, generator: torch.Generator | None, where: str
) -> Verdict:
    """The verdict of a batch of one row (``logits`` [n, V])."""
    verdicts = verifier.verify_batch([tree], logits[None], [sampling], [generator])
    _require(
        isinstance(verdicts, list) and len(verdicts) == 1,
        verifier,
        f"{where}: verify_batch() of one row must return a list of one verdict, got {type(verdicts).__name__}",
    )
    return verdicts[0]


def _check_greedy_batch(verifier: Verifier, tree: Tree, logits: torch.Tensor, solo: Verdict, vocab: int, where: str) -> None:
    """Rows of a padded greedy batch (the tree, a root-only tree, the tree) get their own verdicts, and
    ``next_tokens`` the argmax after each root."""
    n = logits.shape[0]
    root = Tree.from_parents([int(tree.tokens[0])], [-1])
    pad = -logits[1:]  # padding slots: meaningless values, whatever they hold
    batch = torch.stack([logits, torch.cat([logits[:1], pad]), logits])  # [3, n, V]
    greedy = SamplingConfig(temperature=0.0)
    verdicts = verifier.verify_batch([tree, root, tree], batch, [greedy] * 3, [None] * 3)
    _require(isinstance(verdicts, list) and len(verdicts) == 3, verifier, f"{where}: verify_batch() of three rows must return three verdicts")
    for i, want in enumerate((solo, None, solo)):
        row_tree = root if want is None else tree
        path = _check_verdict(verifier, row_tree, verdicts[i], vocab, f"{where}, batch row {i}")
        if want is None:
            _require(path == [0], verifier, f"{where}, batch row {i}: a root-only tree accepted {path}")
            want_bonus = int(logits[0].argmax())
        else:
            _require(path == want.accepted_nodes.tolist(), verifier, f"{where}, batch row {i}: path {path} differs from a batch of one's")
            want_bonus = want.bonus_token
        _require(verdicts[i].bonus_token == want_bonus, verifier, f"{where}, batch row {i}: bonus {verdicts[i].bonus_token}, want {want_bonus}")
    nxt = verifier.next_tokens([int(tree.tokens[0])] * 2, torch.stack([logits[0], logits[1]]), [greedy] * 2, [None] * 2)
    want_next = [int(logits[0].argmax()), int(logits[1].argmax())]
    _require(list(nxt) == want_next, verifier, f"{where}: next_tokens() returned {list(nxt)}, the target's argmax is {want_next}")


def _check_sampling(
    verifier: Verifier, tree: Tree, vocab: int, trials: int, alpha: float, gen: torch.Generator
) -> None:
    n = len(tree)
    kids = tree.children_lists()
    tokens = tree.tokens.tolist()
    logits = torch.randn(n, vocab, generator=gen) * 1.5  # [n, V]
    for node in range(n):  # give drafted children real probability so acceptance paths get exercised
        for c in kids[node]:
            logits[node, tokens[c]] += 1.0
    sampling = SamplingConfig(temperature=1.0)
    p = processed_log_probs(logits, sampling).exp().double()  # [n, V]
    exact: dict[tuple[int, ...], float] = {}
    for x1 in range(vocab):
        child = [c for c in kids[0] if tokens[c] == x1]
        if not child:
            exact[(x1,)] = float(p[0, x1])
        else:
            for x2 in range(vocab):
                exact[(x1, x2)] = float(p[0, x1] * p[child[0], x2])
    seen: Counter[tuple[int, ...]] = Counter()
    g = seeded_generator(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    for t in range(trials):
        v = _verify_one(verifier, tree, logits, sampling, g, f"sampling trial {t}")
        _check_verdict(verifier, tree, v, vocab, f"sampling trial {t}")
        seen[tuple(v.emitted[:2])] += 1
    try:
        assert_fits(seen, exact, alpha=alpha, what="the first two emitted tokens")
    except AssertionError as exc:
        raise AssertionError(f"{_name(verifier)}: not lossless at temperature 1: {exc}") from None
    runs = []
    for _ in range(2):
        g2 = seeded_generator(1234)
        runs.append([_verify_one(verifier, tree, logits, sampling, g2, "seeded run").emitted for _ in range(20)])
    _require(runs[0] == runs[1], verifier, "sampling verdicts differ for the same generator seed")
    top2 = SamplingConfig(temperature=1.0, top_k=2)
    allowed = set(torch.topk(logits[0], 2).indices.tolist())
    for t in range(50):
        v = _verify_one(verifier, tree, logits, top2, g, f"top_k=2 trial {t}")
        _check_verdict(verifier, tree, v, vocab, f"top_k=2 trial {t}")
        _require(
            v.emitted[0] in allowed,
            verifier,
            f"top_k=2: emitted token {v.emitted[0]} at the root, outside the target's top-2 {sorted(allowed)}",
        )


# ---------------------------------------------------------------------------------------------- by name
#: the check for each interface (the kinds themselves come from ``COMPONENT_INTERFACES``)
_CHECKS: dict[type, Callable[..., None]] = {
    Drafter: check_drafter,
    TreeBuilder: check_tree_builder,
    LatencyModel: check_latency_model,
    BudgetController: check_budget_controller,
    Verifier: check_verifier,
}


def check_component(kind: str, name: str, *, options: dict[str, Any] | None = None, registry: Any = None, **check_kwargs: Any) -> Any:
    """Create registered component ``name`` of ``kind`` (with ``options``) through the registry, as a
    pipeline would, and run the matching ``check_*`` on it with ``check_kwargs``. Returns the instance."""
    if registry is None:
        from bastion.contract.registry import registry as default_registry

        registry = default_registry
    if kind not in COMPONENT_INTERFACES:
        raise AssertionError(f"unknown component kind {kind!r}; kinds are {', '.join(COMPONENT_INTERFACES)}")
    names = registry.names(kind)
    if name not in names:
        raise AssertionError(f"no {kind} named {name!r} is registered; registered: {', '.join(names) or 'none'}")
    component = registry.create(kind, name, **(options or {}))
    _CHECKS[COMPONENT_INTERFACES[kind]](component, **check_kwargs)
    return component
