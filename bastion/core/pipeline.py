"""The decode loop: draft -> build -> budget -> verify -> commit -> observe.

The pipeline talks to the five stage interfaces (and the :class:`Target` interface) only; concrete
components come from the registry by name or are handed in as instances.
"""

from __future__ import annotations

import numbers
import time
from pathlib import Path
from typing import Any, Mapping

import torch

from bastion.core.checks import check_greedy_verdict, check_int, check_marginals, check_tokenizer, check_verdict
from bastion.core.errors import IncompatibleComponentsError, InvalidFileError, InvalidInputError, TreeValidationError
from bastion.core.interfaces import (
    COMPONENT_INTERFACES,
    BudgetController,
    BudgetDecision,
    Drafter,
    LatencyModel,
    TreeBuilder,
    Verifier,
)
from bastion.core.registry import Registry, registry as default_registry
from bastion.core.running import running_mean
from bastion.core.sampling import PositionalStream, at_position, check_seed, sample_tokens, seeded_generator
from bastion.core.sync import device_sync
from bastion.core.target import Target
from bastion.core.tree import Tree
from bastion.core.types import (
    DraftContext,
    DraftStep,
    GenerationResult,
    Marginals,
    SamplingConfig,
    StageTimings,
    StepFeedback,
    StepOutcome,
    StepRecord,
)

__all__ = ["Pipeline"]

#: weight of the newest step in the running mean of per-step non-verify overhead
_OVERHEAD_EMA = 0.2

#: during a run of plain steps, one verify time in this many goes to the latency model (they all time
#: n = 1, and every observation costs the model a little bookkeeping and, now and then, a refit)
_PLAIN_LATENCY_EVERY = 8


def _check_instance(kind: str, obj: Any) -> Any:
    iface = COMPONENT_INTERFACES[kind]
    if not isinstance(obj, iface):
        raise InvalidInputError(
            f"{kind} must be a registered name or an instance of bastion.core.{iface.__name__}, "
            f"got {type(obj).__name__}"
        )
    return obj


class Pipeline:
    """A speculative decoding pipeline: a target plus the five stage components."""

    def __init__(
        self,
        target: Target,
        drafter: Drafter | str,
        *,
        tree_builder: TreeBuilder | str = "best-first",
        budget_controller: BudgetController | str = "bastion",
        latency_model: LatencyModel | str = "roofline",
        verifier: Verifier | str = "exact",
        max_nodes: int = 64,
        tokenizer: Any = None,
        validate_trees: bool | None = None,
        strict_verdicts: bool = False,
        component_options: Mapping[str, Mapping[str, Any]] | None = None,
        registry: Registry | None = None,
    ) -> None:
        if not isinstance(target, Target):
            raise InvalidInputError(f"target must implement bastion.core.Target, got {type(target).__name__}")
        max_nodes = check_int("max_nodes", max_nodes)
        self.registry = registry or default_registry
        opts = {k: dict(v) for k, v in (component_options or {}).items()}
        unknown = set(opts) - set(COMPONENT_INTERFACES)
        if unknown:
            raise InvalidInputError(
                f"component_options has unknown kinds {sorted(unknown)}; kinds are {list(COMPONENT_INTERFACES)}"
            )
        self.target = target
        self.tokenizer = tokenizer
        self.max_nodes = max_nodes

        def resolve(kind: str, value: Any) -> Any:
            if isinstance(value, str):
                value = self.registry.create(kind, value, **opts.get(kind, {}))
            return _check_instance(kind, value)

        self.drafter: Drafter = resolve("drafter", drafter)
        self.tree_builder: TreeBuilder = resolve("tree_builder", tree_builder)
        self.budget_controller: BudgetController = resolve("budget_controller", budget_controller)
        self.latency_model: LatencyModel = resolve("latency_model", latency_model)
        self.verifier: Verifier = resolve("verifier", verifier)
        if validate_trees is None:  # builders that guarantee valid trees declare it; check all others
            validate_trees = not self.tree_builder.builds_valid_trees
        self.validate_trees = bool(validate_trees)
        #: also check greedy verdicts against the target's argmax (one extra transfer of n ints per step)
        self.strict_verdicts = bool(strict_verdicts)
        self.latency_model.bind(target)
        self.drafter.bind(target)
        if self.drafter.vocab_size != target.vocab_size:
            raise IncompatibleComponentsError(
                f"drafter vocabulary ({self.drafter.vocab_size}) differs from the target's ({target.vocab_size})"
            )
        self._overhead_s = 0.0
        self._plain_steps = 0  # consecutive plain steps so far
        dev = target.device
        # parents, depths and log scores of a root-only tree (the plain step)
        self._root_only = (
            torch.full((1,), -1, dtype=torch.long, device=dev),
            torch.zeros(1, dtype=torch.long, device=dev),
            torch.zeros(1, dtype=torch.float32, device=dev),
        )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | Target,
        drafter: str | Path | Drafter,
        *,
        tree_builder: TreeBuilder | str = "best-first",
        budget_controller: BudgetController | str = "bastion",
        latency_model: LatencyModel | str = "roofline",
        verifier: Verifier | str = "exact",
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_nodes: int = 64,
        tokenizer: Any = None,
        attn_implementation: str = "sdpa",
        strict_verdicts: bool = False,
        device_map: Any = None,
        component_options: Mapping[str, Mapping[str, Any]] | None = None,
        registry: Registry | None = None,
    ) -> "Pipeline":
        """Load a target (local dir or hub id) and a drafter (a registered drafter name, an instance, or
        a checkpoint dir or hub id that a registered drafter claims, see
        :meth:`bastion.core.Drafter.claims_checkpoint`), then assemble the pipeline.

        ``device_map`` (``"auto"``, ``"balanced"``, ``"sequential"``, a device, or a module-to-device
        dict) places the target through Hugging Face / accelerate instead of ``device``; the drafter then
        runs where the target's feature layers end up. Maps over several devices need ``accelerate``."""
        from bastion.core.hf_target import HFTarget

        reg = registry or default_registry
        if not isinstance(target, Target):
            target_path = str(target)
            target = HFTarget.from_pretrained(
                target_path, device=device, dtype=dtype, attn_implementation=attn_implementation, device_map=device_map
            )
            if tokenizer is None:
                tokenizer = _load_tokenizer(target_path, target.vocab_size)
        if isinstance(drafter, (str, Path)):
            drafter_options = dict((component_options or {}).get("drafter", {}))
            name = str(drafter)
            if name in reg.names("drafter"):
                drafter = reg.create("drafter", name, **drafter_options)
            else:
                claimant = reg.drafter_for_checkpoint(name)
                drafter = reg.create(
                    "drafter", claimant, **{"checkpoint": name, "device": device, "dtype": dtype, **drafter_options}
                )
        return cls(
            target,
            drafter,
            tree_builder=tree_builder,
            budget_controller=budget_controller,
            latency_model=latency_model,
            verifier=verifier,
            max_nodes=max_nodes,
            tokenizer=tokenizer,
            strict_verdicts=strict_verdicts,
            component_options={k: v for k, v in (component_options or {}).items() if k != "drafter"},
            registry=reg,
        )

    @classmethod
    def demo(cls, **kwargs: Any) -> "Pipeline":
        """The embedded trained demo pair (target + DFlash drafter + tokenizer) as a pipeline."""
        from bastion.demo import demo_paths

        paths = demo_paths()
        return cls.from_pretrained(paths.target, paths.drafter, **kwargs)

    # ------------------------------------------------------------------ inspection
    def draft(self, input_ids: torch.Tensor) -> Marginals:
        """The marginals the drafter proposes right after prefilling ``input_ids`` [1, L], rooted at the
        target's greedy next token."""
        ids = self._check_prompt(input_ids)
        self.target.reset()
        self.drafter.reset()
        pre = self.target.prefill(ids, self.drafter.feature_layers)
        root = int(pre.logits[-1].argmax())
        self.drafter.begin(DraftContext(tokens=ids[0], features=pre.features))
        return self.drafter.propose(DraftStep(root_token=root, context_len=self.target.context_len, temperature=1.0))

    # ------------------------------------------------------------------ decoding
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
        """Decode up to ``max_new_tokens`` new tokens after ``input_ids`` [1, L]; lossless w.r.t. the
        target's own greedy decoding (temperature 0) or sampling distribution (temperature > 0)."""
        ids = self._check_prompt(input_ids)
        max_new_tokens = check_int("max_new_tokens", max_new_tokens)
        sampling = SamplingConfig(temperature=temperature, top_p=top_p, top_k=top_k)
        if not sampling.greedy and not self.verifier.supports_sampling:
            raise InvalidInputError(f"verifier {type(self.verifier).__name__} supports greedy decoding only")
        seed = None if seed is None else check_seed(seed)
        stream = None if sampling.greedy else PositionalStream.from_seed(seed)
        generator = self._generator(stream)
        draft_temperature = 1.0 if sampling.greedy else sampling.temperature
        eos = self.target.eos_token_ids if stop_on_eos else frozenset()
        layers = self.drafter.feature_layers

        t_start = time.perf_counter()
        self.target.reset()
        self.drafter.reset()
        pre = self.target.prefill(ids, layers)
        root = int(sample_tokens(pre.logits[-1], at_position(sampling, stream, ids.shape[1]), generator))
        self.drafter.begin(DraftContext(tokens=ids[0], features=pre.features))
        self.budget_controller.begin(sampling)
        self._sync()
        prefill_s = time.perf_counter() - t_start

        out: list[int] = [root]
        steps: list[StepRecord] = []
        stop_reason = "eos" if root in eos else "length"
        while len(out) < max_new_tokens and root not in eos:
            ctx = self.target.context_len
            room = self.target.max_positions - ctx - 1  # deepest node position (ctx + depth) must stay in range
            if room < 0:
                break
            # a tree of depth d emits at most d + 1 tokens: never draft deeper than the tokens still wanted
            max_depth = min(room, max_new_tokens - len(out) - 1)
            drafting = max_depth >= 1 and self.budget_controller.speculate()
            outcome = self._step(root, ctx, max_depth, sampling, generator, draft_temperature, stream, drafting=drafting)
            record, verdict = outcome.record, outcome.verdict
            emitted = list(verdict.emitted)[: max_new_tokens - len(out)]
            for i, tok in enumerate(emitted):
                if tok in eos:
                    emitted = emitted[: i + 1]
                    stop_reason = "eos"
                    break
            out.extend(emitted)
            steps.append(record if len(emitted) == record.emitted else _with_emitted(record, len(emitted)))
            root = verdict.bonus_token
            if stop_reason == "eos":
                break
        self._sync()
        return GenerationResult(
            tokens=out[:max_new_tokens],
            steps=tuple(steps),
            prompt_len=int(ids.shape[1]),
            prefill_s=prefill_s,
            wall_s=time.perf_counter() - t_start,
            stop_reason=stop_reason if len(out) < max_new_tokens or stop_reason == "eos" else "length",
        )

    def generate_batch(
        self,
        prompts: Any,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_on_eos: bool = True,
    ) -> list[GenerationResult]:
        """Decode every prompt of ``prompts`` (token-id sequences of any lengths: lists, 1-D tensors or
        [1, L] tensors) -> one :class:`GenerationResult` per prompt, in order. Each row's output is what
        :meth:`generate` gives for that prompt alone. (Reference path: rows are decoded one after another.)"""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidInputError("prompts must be a non-empty list of token-id sequences")
        rows = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
                prompt = prompt[None]
            try:
                rows.append(self._check_prompt(prompt))
            except InvalidInputError as exc:
                raise InvalidInputError(f"prompt {i}: {exc}") from None
        results = []
        for i, ids in enumerate(rows):
            row_seed = None if seed is None else int(seed) + i
            results.append(
                self.generate(ids, max_new_tokens, temperature, row_seed, top_p=top_p, top_k=top_k, stop_on_eos=stop_on_eos)
            )
        return results

    def _step(
        self,
        root: int,
        ctx: int,
        max_depth: int,
        sampling: SamplingConfig,
        generator: torch.Generator | None,
        draft_temperature: float,
        stream: PositionalStream | None = None,
        *,
        drafting: bool = True,
    ) -> StepOutcome:
        """One decode step: speculative (draft, build, decide n, verify) when ``drafting`` and there is
        room to draft, else plain (the target alone verifies the root: one token, no draft)."""
        layers = self.drafter.feature_layers
        t0 = time.perf_counter()
        decision: BudgetDecision | None = None
        drafting = drafting and max_depth >= 1  # one token left to emit or no position to draft into: plain
        if not drafting:
            tree = Tree(torch.tensor([root], device=self.target.device), *self._root_only)
            n = 1
            t1 = t2 = t3 = time.perf_counter()
        else:
            marginals = self.drafter.propose(DraftStep(root_token=root, context_len=ctx, temperature=draft_temperature))
            marginals = check_marginals(marginals, self.target.vocab_size, self.drafter)
            if marginals.depth > max_depth:  # never draft past the position limit or the token budget
                marginals = Marginals(marginals.log_probs[:max_depth])
            t1 = time.perf_counter()
            tree = self.tree_builder.build(marginals, root_token=root, max_nodes=self.max_nodes)
            if self.validate_trees:
                _validate_built(tree, root, self.target.vocab_size)
            t2 = time.perf_counter()
            decision = self.budget_controller.decide(tree.log_scores, ctx, self.latency_model, self._overhead_s)
            n = _checked_size(self.budget_controller, decision, len(tree))
            tree = tree.truncate(n)
            t3 = time.perf_counter()
        out = self.target.forward_tree(tree, layers)
        self._sync()
        t4 = time.perf_counter()
        if stream is not None:  # node i samples position ctx + depth_i + 1: the same draw whatever the tree
            sampling = stream.for_tree(sampling, ctx, tree.depths)
        verdict = self.verifier.verify(tree, out.logits, sampling, generator)
        check_verdict(verdict, tree, self.target.vocab_size, self.verifier)  # cheap, always on
        if self.strict_verdicts and sampling.greedy:
            check_greedy_verdict(verdict, tree, out.logits, self.verifier)
        t5 = time.perf_counter()
        nodes = verdict.accepted_nodes
        self.target.commit(nodes)
        if drafting:
            self.drafter.commit(tree.tokens[nodes], None if out.features is None else out.features[nodes])
        else:  # the drafter stays current from the features the plain forward already produced
            self.drafter.commit(tree.tokens, out.features)
        self._sync()
        t6 = time.perf_counter()
        self._plain_steps = 0 if drafting else self._plain_steps + 1
        # plain steps all time n = 1: the first of a run and then one in _PLAIN_LATENCY_EVERY will do
        if drafting or (self._plain_steps - 1) % _PLAIN_LATENCY_EVERY == 0:
            self.latency_model.observe(n, ctx, t4 - t3)
        non_verify = (t3 - t0) + (t6 - t4)
        self.budget_controller.observe(
            StepFeedback(
                drafted=drafting,
                log_scores=tree.log_scores,
                accepted_nodes=nodes,
                context_len=ctx,
                verify_s=t4 - t3,
                overhead_s=non_verify,
            )
        )
        if drafting:  # the controller's overhead is a speculative step's: plain steps do not dilute it
            self._overhead_s = running_mean(self._overhead_s, non_verify, _OVERHEAD_EMA)
        t7 = time.perf_counter()
        record = StepRecord(
            budget=n,
            accepted=verdict.num_accepted,
            emitted=verdict.num_accepted + 1,
            context_len=ctx,
            predicted_accept=tree.accept_score() if drafting else 1.0,
            predicted_speedup=None if decision is None else decision.predicted_speedup,
            timings=StageTimings(
                draft=t1 - t0, tree=t2 - t1, controller=t3 - t2, verify=t4 - t3, accept=t5 - t4, commit=t6 - t5, other=t7 - t6
            ),
            calibrated_accept=None if decision is None else decision.calibrated_accept,
            drafted=drafting,
        )
        return StepOutcome(record=record, verdict=verdict)

    # ------------------------------------------------------------------ helpers
    def _check_prompt(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(input_ids, (list, tuple)):
            bad = [t for t in input_ids if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
            if bad:
                raise InvalidInputError(f"token ids must be ints, got {bad[0]!r} ({type(bad[0]).__name__})")
            input_ids = torch.tensor([[int(t) for t in input_ids]], dtype=torch.long)
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InvalidInputError(
                f"input_ids must be a LongTensor of shape [1, L], got {getattr(input_ids, 'shape', type(input_ids).__name__)}"
            )
        if input_ids.shape[1] == 0:
            raise InvalidInputError("input_ids is empty: the prompt needs at least one token")
        if input_ids.dtype not in (torch.long, torch.int, torch.int32, torch.int16):
            raise InvalidInputError(f"input_ids must hold integer token ids, got {input_ids.dtype}")
        if input_ids.shape[1] >= self.target.max_positions:
            raise InvalidInputError(
                f"prompt has {input_ids.shape[1]} tokens; the target accepts at most {self.target.max_positions} "
                "positions, leaving no room to generate"
            )
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.target.vocab_size:
            raise InvalidInputError(f"token ids must lie in [0, {self.target.vocab_size}), found [{lo}, {hi}]")
        return input_ids.to(device=self.target.device, dtype=torch.long)

    def _generator(self, stream: PositionalStream | None) -> torch.Generator | None:
        """A generator for verifiers that draw by themselves instead of through ``sampling.uniforms``."""
        if stream is None:
            return None
        return seeded_generator(stream.seed, self.target.device)

    def _sync(self) -> None:
        device_sync(self.target.device)

    def encode(self, text: str) -> torch.Tensor:
        """Tokenize ``text`` with the pipeline's tokenizer -> LongTensor[1, L]."""
        if self.tokenizer is None:
            raise InvalidInputError("this pipeline has no tokenizer; pass input_ids instead")
        return torch.tensor([self.tokenizer.encode(text)], dtype=torch.long)

    def decode(self, tokens: list[int]) -> str:
        if self.tokenizer is None:
            raise InvalidInputError("this pipeline has no tokenizer")
        return self.tokenizer.decode(tokens)


def _with_emitted(record: StepRecord, emitted: int) -> StepRecord:
    import attrs

    return attrs.evolve(record, emitted=emitted)


def _checked_size(controller: BudgetController, decision: object, n_max: int) -> int:
    """The tree size of a controller's decision, checked against 1 <= n <= n_max."""
    name = type(controller).__name__
    if not isinstance(decision, BudgetDecision):
        raise InvalidInputError(f"budget controller {name}.decide returned {type(decision).__name__}, not a BudgetDecision")
    n = decision.n
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= n_max:
        raise InvalidInputError(f"budget controller {name} returned {n!r}; need 1 <= n <= {n_max}")
    return n


def _validate_built(tree: Tree, root: int, vocab_size: int) -> None:
    tree.validate(vocab_size=vocab_size)
    if int(tree.tokens[0]) != root:
        raise TreeValidationError(f"root first: node 0 holds token {int(tree.tokens[0])}, expected the root {root}")


#: files whose presence means a folder ships a tokenizer
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _load_tokenizer(path: str, vocab_size: int) -> Any:
    """The tokenizer stored with the target at ``path``, checked against the target's vocabulary; None
    when there is none (the pipeline then works on token ids). Tokenizer files that exist but cannot be
    loaded raise :class:`InvalidFileError` with the loader's own message."""
    from transformers import AutoTokenizer

    local = Path(path).expanduser()
    if local.is_dir() and not any((local / name).is_file() for name in _TOKENIZER_FILES):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as exc:
        if not local.is_dir():  # a hub repository without tokenizer files
            return None
        raise InvalidFileError(f"the tokenizer files in {path} cannot be loaded: {exc}") from exc
    except Exception as exc:  # tokenizers raise their own exception types for corrupt files
        raise InvalidFileError(f"the tokenizer files in {path} cannot be loaded: {type(exc).__name__}: {exc}") from exc
    check_tokenizer(tokenizer, vocab_size, path)
    return tokenizer
