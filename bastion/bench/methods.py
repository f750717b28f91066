"""The decoding methods a benchmark compares, all built on ONE loaded target and drafter.

Method names (``--methods``):

- ``ar``: the target alone, greedy (or sampled) decoding with its KV cache: the baseline;
- ``chain``: the drafter's top-1 chain, every drafted token verified (DFlash);
- ``static``: a fixed EAGLE-style topology (the ``static`` tree builder), every node verified;
- ``best-first@N``: the best-first tree truncated to a fixed budget of N nodes (DDTree); any registered
  tree builder works as ``NAME@N`` (fixed budget) or ``NAME`` (every node it builds);
- ``bastion``: the best-first tree with the adaptive ``bastion`` budget controller;
- ``eagle3``: EAGLE-3's own tree: an ``eagle3`` drafter's whole candidate tree (at its ``total_token``,
  ``depth`` and ``top_k``, by default 60, 7 and 10) verified every step (the ``full`` controller), as
  EAGLE-3 decodes; it needs an EAGLE-3 drafter (``bastion:eagle3`` runs bastion's controller over the same
  proposals);
- ``BUILDER@CONTROLLER``: any registered tree builder with any registered budget controller (e.g.
  ``static@bastion`` or a plugin's ``my-builder@my-controller``); each component takes the options the
  benchmark holds for its name.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Protocol, Sequence

import attrs
import torch
from attrs import field, frozen

from bastion.engine.plain import decode_plain_batch
from bastion.utils.checks import check_int
from bastion.contract.errors import InvalidInputError
from bastion.engine.pipeline import Pipeline
from bastion.contract.sampling import PositionalStream, at_position, check_seed, sample_tokens
from bastion.utils.sync import device_sync
from bastion.contract.target import Target
from bastion.contract.tree import Tree
from bastion.contract.types import GenerationResult, SamplingConfig, StageTimings, StepRecord

__all__ = [
    "AR",
    "ADAPTIVE",
    "EAGLE3",
    "is_eagle3_drafter",
    "MethodSpec",
    "parse_method",
    "default_methods",
    "Decoder",
    "ARDecoder",
    "build_decoder",
]

AR = "ar"
ADAPTIVE = "bastion"
#: EAGLE-3's own decoding: the whole candidate tree of an ``eagle3`` drafter, verified every step
EAGLE3 = "eagle3"
#: separates a method from its drafter family in a method name (``chain:model``)
FAMILY_SEP = ":"


def split_family(name: str) -> tuple[str, str | None]:
    """``"chain:model"`` -> ``("chain", "model")``; a name without a family -> ``(name, None)``."""
    base, sep, family = name.rpartition(FAMILY_SEP)
    return (base, family) if sep and base and family else (name, None)

#: node cap for builders whose size is set by their own shape (chain, static)
_UNBOUNDED_NODES = 4096


@frozen
class MethodSpec:
    """How to assemble one method's decoder from the shared target and drafter."""

    name: str
    tree_builder: str | None  # None: the autoregressive baseline
    controller: str = "full"  # registered budget controller ("full": verify every built node)
    controller_options: Mapping[str, Any] = field(factory=dict)
    tree_options: Mapping[str, Any] = field(factory=dict)
    max_nodes: int = 64
    drafter: str | None = None  # drafter family (``METHOD:FAMILY``); None: the run's only drafter
    eagle3_only: bool = False  # the method is an EAGLE-3 drafter's own tree (needs that drafter)

    @property
    def is_ar(self) -> bool:
        return self.tree_builder is None


def parse_method(
    name: str,
    *,
    max_nodes: int = 64,
    tree_options: Mapping[str, Mapping[str, Any]] | None = None,
    controller_options: Mapping[str, Mapping[str, Any]] | None = None,
    known_trees: tuple[str, ...] | None = None,
    known_controllers: tuple[str, ...] | None = None,
) -> MethodSpec:
    """Turn a method name (see the module doc) into a :class:`MethodSpec`.

    ``max_nodes`` is the adaptive controllers' N_max; ``tree_options`` / ``controller_options`` map a
    tree builder / controller name to the options it is created with (e.g. the static topology);
    ``known_trees`` / ``known_controllers`` are the registered names (looked up in the registry when None).
    """
    name = name.strip()
    opts = tree_options or {}
    copts = controller_options or {}
    if not name:
        raise InvalidInputError("empty method name")
    base, family = split_family(name)
    if family is not None:  # METHOD:FAMILY runs METHOD with that drafter family
        spec = parse_method(base, max_nodes=max_nodes, tree_options=tree_options, controller_options=controller_options,
                            known_trees=known_trees, known_controllers=known_controllers)
        return attrs.evolve(spec, name=name, drafter=family)
    if name == AR:
        return MethodSpec(AR, None)
    if name == EAGLE3:  # every candidate the drafter proposes: best-first over them, all verified
        return MethodSpec(EAGLE3, "best-first", controller="full", max_nodes=_UNBOUNDED_NODES, eagle3_only=True)
    if name == ADAPTIVE:
        return MethodSpec(ADAPTIVE, "best-first", controller="bastion", tree_options=dict(opts.get("best-first", {})),
                          controller_options=dict(copts.get("bastion", {})), max_nodes=max_nodes)
    from bastion import registry

    if known_trees is None:
        known_trees = tuple(registry.names("tree_builder"))
    tree, sep, suffix = name.partition("@")
    if tree not in known_trees:
        raise InvalidInputError(
            f"unknown method {name!r}: use ar, bastion, eagle3, or a tree builder ({', '.join(known_trees) or 'none registered'}) "
            "optionally with @N for a fixed budget of N nodes or @CONTROLLER for a registered budget controller"
        )
    if not sep:
        return MethodSpec(name, tree, controller="full", tree_options=dict(opts.get(tree, {})), max_nodes=_UNBOUNDED_NODES)
    if suffix.lstrip("-").isdigit():
        budget = int(suffix)
        if budget < 1:
            raise InvalidInputError(f"method {name!r}: the budget must be >= 1")
        return MethodSpec(
            name, tree, controller="fixed", controller_options={"budget": budget}, tree_options=dict(opts.get(tree, {})), max_nodes=budget
        )
    if known_controllers is None:
        known_controllers = tuple(registry.names("budget_controller"))
    if suffix not in known_controllers:
        raise InvalidInputError(
            f"method {name!r}: after '@' give an integer budget or a budget controller "
            f"({', '.join(known_controllers) or 'none registered'})"
        )
    return MethodSpec(
        name, tree, controller=suffix, controller_options=dict(copts.get(suffix, {})), tree_options=dict(opts.get(tree, {})),
        max_nodes=max_nodes,
    )


def is_eagle3_drafter(drafter: Any) -> bool:
    """Whether ``drafter`` is an ``eagle3`` drafter (whose own tree the ``eagle3`` method verifies)."""
    from bastion.drafters.eagle3.drafter import Eagle3Drafter

    return isinstance(drafter, Eagle3Drafter)


def default_methods(budgets: tuple[int, ...] = (4, 8, 16, 32, 64)) -> tuple[str, ...]:
    """``ar, chain, static, best-first@N for each budget, bastion``."""
    return (AR, "chain", "static", *(f"best-first@{b}" for b in budgets), ADAPTIVE)


class Decoder(Protocol):
    """What the benchmark runs: :class:`bastion.Pipeline` and :class:`ARDecoder` both qualify."""

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> GenerationResult: ...

    def generate_batch(
        self,
        prompts: Sequence[torch.Tensor],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> list[GenerationResult]: ...


class ARDecoder:
    """Plain autoregressive decoding through the :class:`Target` interface: prefill, then one
    single-node tree per token (``forward_tree`` + ``commit``), the same code path and sampling options
    (temperature, top-p, top-k, the seeded positional stream) as the pipeline's verify step.
    Timed like :meth:`bastion.Pipeline.generate`: the clock covers the prefill and every step.
    """

    def __init__(self, target: Target) -> None:
        self.target = target

    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_on_eos: bool = True,
    ) -> GenerationResult:
        max_new_tokens = check_int("max_new_tokens", max_new_tokens)
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            raise InvalidInputError(f"input_ids must be a non-empty LongTensor [1, L], got {tuple(input_ids.shape)}")
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
        # the seeded positional stream: the same seed gives the same tokens as bastion.Pipeline.generate
        seed = None if seed is None else check_seed(seed)
        stream = None if sampling.greedy else PositionalStream.from_seed(seed)
        ids = input_ids.to(self.target.device, torch.long)
        eos = self.target.eos_token_ids if stop_on_eos else frozenset()
        with torch.inference_mode():
            return self._run(ids, max_new_tokens, sampling, stream, eos)

    def generate_batch(
        self,
        prompts: Sequence[torch.Tensor],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_on_eos: bool = True,
    ) -> list[GenerationResult]:
        """Plain batched decoding: one target forward per step for every active row (the same padded
        cache as the batched pipeline, finished rows leave); row i is seeded with ``seed + i``. One
        prompt, or a target without batched state, decodes through :meth:`generate` row by row."""
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise InvalidInputError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
        rows = [p.reshape(1, -1).to(self.target.device, torch.long) for p in prompts]
        seed = None if seed is None else check_seed(seed)
        seeds = [None if seed is None else seed + i for i in range(len(rows))]
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
        out = None if len(rows) == 1 else decode_plain_batch(self.target, rows, max_new_tokens, sampling, seeds, stop_on_eos)
        if out is None:  # one prompt (as the pipeline: the single-sequence loop) or no batched state
            out = [
                self.generate(r, max_new_tokens, temperature, s, top_p=top_p, top_k=top_k, stop_on_eos=stop_on_eos)
                for r, s in zip(rows, seeds)
            ]
        return out

    def _run(
        self,
        ids: torch.Tensor,
        max_new: int,
        sampling: SamplingConfig,
        stream: PositionalStream | None,
        eos: frozenset[int],
    ) -> GenerationResult:
        target = self.target
        keep_root = torch.zeros(1, dtype=torch.long, device=ids.device)  # [1]: commit node 0
        t_start = time.perf_counter()
        target.reset()
        pre = target.prefill(ids)
        tok = int(sample_tokens(pre.logits[-1], at_position(sampling, stream, ids.shape[1])))
        self._sync()
        prefill_s = time.perf_counter() - t_start
        out, steps = [tok], []
        while len(out) < max_new and tok not in eos and target.context_len + 1 < target.max_positions:
            ctx = target.context_len
            t0 = time.perf_counter()
            node = Tree.from_parents(torch.tensor([tok], device=ids.device), [-1])
            logits = target.forward_tree(node).logits[0]  # [V]
            target.commit(keep_root)
            tok = int(sample_tokens(logits, at_position(sampling, stream, ctx + 1)))  # host sync: the EOS check needs it
            t1 = time.perf_counter()
            out.append(tok)
            steps.append(_ar_step(ctx, t1 - t0, time.perf_counter() - t1))
        self._sync()
        return GenerationResult(
            tokens=out[:max_new],
            steps=tuple(steps),
            prompt_len=int(ids.shape[1]),
            prefill_s=prefill_s,
            wall_s=time.perf_counter() - t_start,
            stop_reason="eos" if out and out[-1] in eos else ("length" if len(out) >= max_new else "position-limit"),
        )

    def _sync(self) -> None:
        device_sync(self.target.device)


def _ar_step(ctx: int, forward_s: float, other_s: float) -> StepRecord:
    return StepRecord.plain(ctx, StageTimings(verify=forward_s, other=other_s))


def _node_cap(spec: MethodSpec, target: Target, drafter: Any) -> int:
    """The pipeline's ``max_nodes`` for ``spec``: an EAGLE-3 drafter's ``total_token`` for its own tree
    (exactly its whole tree); for builders sized by their own shape (chain, static), the node cap bounded by
    the target's positions (a tree never holds more nodes than the target has positions); else the spec's."""
    if spec.eagle3_only:
        return int(drafter.total_token)
    positions = int(getattr(target, "max_positions", 0) or 0)
    if spec.max_nodes == _UNBOUNDED_NODES and positions > 1:
        return min(spec.max_nodes, positions)
    return spec.max_nodes


def build_decoder(
    spec: MethodSpec,
    target: Target,
    drafter: Any,
    tokenizer: Any = None,
    registry: Any = None,
    *,
    latency_model: str = "roofline",
    verifier: str = "exact",
    component_options: Mapping[str, Mapping[str, Any]] | None = None,
) -> Decoder:
    """The decoder of ``spec`` over the shared ``target`` and ``drafter`` instances; ``latency_model``
    and ``verifier`` are registered names, created with ``component_options[kind]``."""
    if spec.is_ar:
        return ARDecoder(target)
    if spec.eagle3_only and not is_eagle3_drafter(drafter):
        raise InvalidInputError(
            f"method {spec.name!r} verifies an EAGLE-3 drafter's own candidate tree; the drafter is "
            f"{type(drafter).__name__} (load an EAGLE-3 checkpoint, e.g. --drafters eagle3)"
        )
    from bastion import registry as default_registry

    reg = registry or default_registry
    assert spec.tree_builder is not None
    tree = reg.create("tree_builder", spec.tree_builder, **dict(spec.tree_options))
    controller = reg.create("budget_controller", spec.controller, **dict(spec.controller_options))
    return Pipeline(
        target=target,
        drafter=drafter,
        tree_builder=tree,
        budget_controller=controller,
        latency_model=latency_model,
        verifier=verifier,
        max_nodes=_node_cap(spec, target, drafter),
        tokenizer=tokenizer,
        component_options={k: v for k, v in (component_options or {}).items() if k in ("latency_model", "verifier")},
        registry=reg,
    )
