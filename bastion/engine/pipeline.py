"""The pipeline: a target, the five stage components and their configuration, and the decoding calls.

The pipeline decodes nothing itself: every call (``generate``, ``stream``, ``chat``, ``decode_steps``,
``generate_batch``, ``stream_batch``) runs its requests on a :class:`bastion.engine.Engine` of its own
(one decode loop: draft -> build -> decide -> verify -> commit), a single generation as a batch of one on
the models' own single-sequence state when no other generation holds it. Components come from the
registry by name or are handed in as instances and are called through the five stage interfaces and
the :class:`Target` interface. At the plugin boundary the pipeline checks what it does not trust: a
component is *built in* when its class lives in a ``bastion.*`` module; trees of builders that are not
built in (or do not declare valid trees) are validated, verdicts of verifiers that are not built in
are checked against the target at T = 0, and drafters that are not built in get copies of the prompt.
"""

from __future__ import annotations

import numbers
import threading
from pathlib import Path
from typing import Any, Callable, Generator, Iterator, Mapping, Sequence

import attrs
import torch

from bastion.engine.costs import BatchCosts
from bastion.engine.blame import blame
from bastion.contract.candidates import CandidateTree, check_pairing
from bastion.utils.chat import chat_ids, user_turn
from bastion.utils.checks import check_int, check_marginals, check_max_nodes, check_token_ids, check_tokenizer
from bastion.utils.dtypes import parse_dtype
from bastion.contract.errors import IncompatibleComponentsError, InvalidFileError, InvalidInputError
from bastion.contract.interfaces import (
    COMPONENT_INTERFACES,
    BudgetController,
    Drafter,
    LatencyModel,
    TreeBuilder,
    Verifier,
)
from bastion.contract.registry import Registry, registry as default_registry
from bastion.contract.target import Target
from bastion.engine.engine import Engine
from bastion.engine.params import GenerationConfig, SamplingParams, generation_config
from bastion.contract.types import (
    DraftContext,
    DraftStep,
    GenerationResult,
    Marginals,
    StepRecord,
)

__all__ = ["BatchTextStream", "GenerationConfig", "Pipeline", "Prompt", "SamplingParams", "TextStream", "as_target", "prompt_rows", "resolve_drafter"]

#: what generate / stream / chat take as a prompt: token ids ([1, L] or [L] tensor, list of ints), a
#: mapping / ``BatchEncoding`` with ``input_ids`` (and ``attention_mask``), text, or chat messages
Prompt = Any


#: during a run of plain steps, one step in this many is reported to the latency model and the budget
#: controller (the steps are all alike: n = 1, no draft; every report costs a little bookkeeping and,
#: in the latency model, now and then a refit, which a plain step cannot afford)
_PLAIN_REPORT_EVERY = 32


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
        target: Target | torch.nn.Module,
        drafter: Drafter | str,
        *,
        tree_builder: TreeBuilder | str = "best-first",
        budget_controller: BudgetController | str = "bastion",
        latency_model: LatencyModel | str = "roofline",
        verifier: Verifier | str = "exact",
        max_nodes: int = 64,
        tokenizer: Any = None,
        validate_trees: bool | None = None,
        strict_verdicts: bool | None = None,
        component_options: Mapping[str, Mapping[str, Any]] | None = None,
        registry: Registry | None = None,
    ) -> None:
        target = as_target(target)
        max_nodes = check_max_nodes(check_int("max_nodes", max_nodes), target)
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
            elif opts.get(kind):
                raise InvalidInputError(
                    f"component_options[{kind!r}] given for a {kind} passed as an instance "
                    f"({type(value).__name__}); options apply to components given by name: create the "
                    "instance with them instead"
                )
            return _check_instance(kind, value)

        self.drafter: Drafter = resolve("drafter", drafter)
        self.tree_builder: TreeBuilder = resolve("tree_builder", tree_builder)
        self.budget_controller: BudgetController = resolve("budget_controller", budget_controller)
        self.latency_model: LatencyModel = resolve("latency_model", latency_model)
        self.verifier: Verifier = resolve("verifier", verifier)
        for flag, value in (("validate_trees", validate_trees), ("strict_verdicts", strict_verdicts)):
            if value is not None and not isinstance(value, bool):
                raise InvalidInputError(f"{flag} must be True, False or None (the default: on for plugin components), got {value!r}")
        if validate_trees is None:  # built-in builders that guarantee valid trees declare it; check all others
            validate_trees = not (self.tree_builder.builds_valid_trees and _builtin(self.tree_builder))
        self.validate_trees = bool(validate_trees)
        if strict_verdicts is None:  # a verifier that is not bastion's own is checked at its boundary
            strict_verdicts = not _builtin(self.verifier)
        #: also check greedy verdicts against the target's argmax (one extra transfer of n ints per step)
        self.strict_verdicts = bool(strict_verdicts)
        #: a drafter that is not bastion's own gets copies of the prompt tokens (it cannot write into the caller's)
        self.copy_contexts = not _builtin(self.drafter)
        self.latency_model.bind(target)
        self.drafter.bind(target)
        if self.drafter.vocab_size != target.vocab_size:
            raise IncompatibleComponentsError(
                f"drafter vocabulary ({self.drafter.vocab_size}) differs from the target's ({target.vocab_size})"
            )
        self._batch_costs = BatchCosts()  # batched steps' measured non-verify seconds, per batch size
        if self.drafter.proposes is not None:  # a declared proposal kind is checked now, else at the first step
            check_pairing(self.tree_builder, self.drafter.proposes, self.drafter)
        self._lent_buckets = False  # compile_verify gave the controller the compiled path's buckets
        #: held by the one generation decoding on the target's and drafter's own single-sequence state;
        #: a generation that finds it taken decodes on an engine batch of its own instead
        self._solo = threading.Lock()
        #: one step at a time on the models (generations from several threads interleave their steps)
        self._step_lock = threading.RLock()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        target: str | Path | Target | torch.nn.Module,
        drafter: str | Path | Drafter,
        *,
        tree_builder: TreeBuilder | str = "best-first",
        budget_controller: BudgetController | str = "bastion",
        latency_model: LatencyModel | str = "roofline",
        verifier: Verifier | str = "exact",
        device: str | torch.device | None = None,
        dtype: torch.dtype | str = "auto",
        max_nodes: int = 64,
        tokenizer: Any = None,
        attn_implementation: str = "sdpa",
        strict_verdicts: bool | None = None,
        device_map: Any = None,
        validate_trees: bool | None = None,
        component_options: Mapping[str, Mapping[str, Any]] | None = None,
        registry: Registry | None = None,
        compile: Any = None,
    ) -> "Pipeline":
        """Load a target and a drafter, then assemble the pipeline.

        ``target``: a local directory or hub id, a loaded Hugging Face causal LM (used as it is, on its
        own device and dtype), or a :class:`Target`. ``drafter``: a registered drafter name, an instance,
        or a checkpoint dir or hub id that a registered drafter claims (see
        :meth:`bastion.core.Drafter.claims_checkpoint`), loaded on the target's device and dtype.
        ``dtype="auto"`` keeps the checkpoint's dtype (but computes a float16 checkpoint on a CPU in
        float32, see :func:`bastion.utils.dtypes.auto_dtype`); ``device`` defaults to ``"cpu"`` for targets loaded
        here. The tokenizer is loaded from the target's directory when it has one.

        ``device_map`` (``"auto"``, ``"balanced"``, ``"sequential"``, a device, or a module-to-device
        dict) places the target through Hugging Face / accelerate instead of ``device``; the drafter then
        runs where the target's feature layers end up. Maps over several devices need ``accelerate``.

        ``compile`` (off by default): ``True``, a mapping of
        :class:`~bastion.huggingface.compiled_verify.CompileOptions` fields or options switch on the compiled
        verify path (see :meth:`compile_verify`)."""
        from bastion.huggingface.causal_lm import HFTarget

        reg = registry or default_registry
        opts = {k: dict(v) for k, v in (component_options or {}).items()}
        if isinstance(target, (str, Path)):
            target_path = str(target)
            target = HFTarget.from_pretrained(
                target_path, device=device or "cpu", dtype=dtype, attn_implementation=attn_implementation,
                device_map=device_map,
            )
            if tokenizer is None:
                tokenizer = _load_tokenizer(target_path, target.vocab_size)
        else:
            if tokenizer is None:
                model = target if isinstance(target, torch.nn.Module) else getattr(target, "model", None)
                tokenizer = _model_tokenizer(model, target)
            target = as_target(target)
        drafter = resolve_drafter(drafter, target, reg, opts.pop("drafter", {}))
        pipe = cls(
            target,
            drafter,
            tree_builder=tree_builder,
            budget_controller=budget_controller,
            latency_model=latency_model,
            verifier=verifier,
            max_nodes=max_nodes,
            tokenizer=tokenizer,
            strict_verdicts=strict_verdicts,
            validate_trees=validate_trees,
            component_options=opts,
            registry=reg,
        )
        if compile:
            pipe.compile_verify(compile)
        return pipe

    def compile_verify(self, options: Any = True) -> Any:
        """Switch the target's compiled verify path on (``True``, a mapping of
        :class:`~bastion.huggingface.compiled_verify.CompileOptions` fields, or options) or off (``False``).

        The compiled graphs (CUDA graphs on CUDA) are per tree-size bucket, and the budget controller
        chooses among the same sizes: a controller with its own ``buckets`` lends them to the compiled
        path; one without (``buckets=None``) is given the compiled path's buckets. Returns the options in
        force (None: off). Switching off gives a controller that was given buckets its own back (none).
        Off by default until measured on the hardware at hand."""
        from bastion.huggingface.compiled_verify import compile_options

        switch = getattr(self.target, "compile_verify", None)
        if switch is None:
            raise IncompatibleComponentsError(
                f"the target {type(self.target).__name__} has no compiled verify path (HFTarget has one)"
            )
        opts = compile_options(options)
        if self._lent_buckets:  # the controller got the compiled path's buckets: give it back its own (none)
            self.budget_controller.use_buckets(None)  # type: ignore[attr-defined]
            self._lent_buckets = False
        if opts is None:
            return switch(None)
        own = getattr(self.budget_controller, "buckets", None)
        if own:
            opts = attrs.evolve(opts, buckets=tuple(own))
        elif hasattr(self.budget_controller, "use_buckets"):
            self.budget_controller.use_buckets(opts.buckets)
            self._lent_buckets = True
        return switch(opts)

    @classmethod
    def demo(cls, drafter: str = "dflash", **kwargs: Any) -> "Pipeline":
        """The embedded trained demo pair (target + tokenizer + a drafter) as a pipeline: ``drafter``
        ``"dflash"`` (the block drafter) or ``"model"`` (the autoregressive one).

        The models ship in float16 to keep the package small; on the CPU they are loaded as float32 (the
        dtype they were trained in, and much faster there) unless ``dtype=`` says otherwise, except the
        DFlash drafter on a CPU with native bfloat16 arithmetic, which runs in bfloat16 (see
        :func:`bastion.demo.demo_drafter_options`; ``component_options={"drafter": {"dtype": ...}}``
        overrides it)."""
        from bastion.demo import demo_drafter, demo_drafter_options, demo_paths

        device = kwargs.get("device") or "cpu"
        if str(device).startswith("cpu"):
            kwargs.setdefault("dtype", torch.float32)
        float32 = parse_dtype(kwargs.get("dtype"), allow_auto=True) == torch.float32
        defaults = demo_drafter_options(drafter, device) if float32 else {}
        if defaults:  # the user's own drafter options win
            options = {k: dict(v) for k, v in (kwargs.get("component_options") or {}).items()}
            options["drafter"] = {**defaults, **options.get("drafter", {})}
            kwargs["component_options"] = options
        return cls.from_pretrained(demo_paths().target, demo_drafter(drafter), **kwargs)

    # ------------------------------------------------------------------ inspection
    def draft(self, input_ids: Prompt) -> Marginals | CandidateTree:
        """The proposal (marginals or a candidate tree) the drafter makes right after prefilling
        ``input_ids`` [1, L], rooted at the target's greedy next token."""
        ids = self._prompt_ids(input_ids)
        self.target.reset()
        self.drafter.reset()
        pre = self.target.prefill(ids, self.drafter.feature_layers)
        root = int(pre.logits[-1].argmax())
        self.drafter.begin(DraftContext(tokens=ids[0], features=pre.features))
        return self.drafter.propose(DraftStep(root_token=root, context_len=self.target.context_len, temperature=1.0))

    # ------------------------------------------------------------------ decoding
    def generate(
        self,
        input_ids: Prompt,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_on_eos: bool = True,
        stop: str | Sequence[str] | None = None,
        on_step: Callable[[StepRecord], Any] | None = None,
        config: GenerationConfig | None = None,
    ) -> GenerationResult:
        """Decode up to ``max_new_tokens`` new tokens after the prompt; lossless w.r.t. the target's own
        greedy decoding (temperature 0) or sampling distribution (temperature > 0).

        ``config``: a :class:`~bastion.GenerationConfig` with every setting at once (keyword arguments
        given beside it, other than their defaults, override its fields).

        ``input_ids``: LongTensor [1, L] (or [L], a list of ids, a mapping / ``BatchEncoding`` with
        ``input_ids`` and optionally ``attention_mask``, plain text, or chat messages). ``stop``: stop
        strings (the generation ends where the first appears; needs a tokenizer). ``on_step`` is called
        with each step's :class:`StepRecord` as it commits.

        Each call has its own state: generations running at once on one pipeline (live streams, threads)
        each give their solo output; one decodes on the target's own state, the others on engine
        batches of their own, and their steps take turns on the models."""
        ids, cfg = self._prepare(input_ids, config, max_new_tokens, temperature, seed, top_p, top_k, stop, stop_on_eos, on_step)
        run = self._session(ids, cfg, on_step, emit_text=False)
        while True:
            try:
                next(run)
            except StopIteration as done:
                return done.value

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_on_eos: bool = True,
        stop: str | Sequence[str] | None = None,
        on_step: Callable[[StepRecord], Any] | None = None,
        config: GenerationConfig | None = None,
    ) -> "TextStream":
        """Like :meth:`generate`, but yield the text as each step commits (a burst of tokens per step).

        ``prompt`` takes what :meth:`generate` takes; text is encoded as it is and chat messages (a list
        of ``{"role", "content"}`` dicts) through the chat template. The joined chunks equal the
        result's ``text``; the full :class:`GenerationResult` is the stream's ``result`` once it is
        exhausted; ``on_step`` receives each :class:`StepRecord`. Prompt errors raise here, not on the
        first ``next()``."""
        if self.tokenizer is None:
            raise InvalidInputError("stream() yields text and needs a tokenizer; this pipeline has none")
        ids, cfg = self._prepare(prompt, config, max_new_tokens, temperature, seed, top_p, top_k, stop, stop_on_eos, on_step)
        return TextStream(self._session(ids, cfg, on_step, emit_text=True))

    def chat(
        self,
        messages: str | Sequence[Mapping[str, str]],
        max_new_tokens: int = 256,
        temperature: float = 0.0,
        seed: int | None = None,
        **kwargs: Any,
    ) -> GenerationResult:
        """Answer chat ``messages`` (a list of ``{"role", "content"}`` dicts, or one user message as text)
        through the tokenizer's chat template; the answer is ``result.text``. Takes :meth:`generate`'s
        keyword options (``stop``, ``on_step``, ``top_p``...)."""
        return self.generate(self.encode_chat(messages), max_new_tokens, temperature, seed, **kwargs)

    def decode_steps(
        self,
        prompt: Prompt,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_on_eos: bool = True,
        config: GenerationConfig | None = None,
    ) -> Generator[tuple[list[int], StepRecord | None], int | None, GenerationResult]:
        """The decode loop as a generator, for integrations that decide themselves when to stop.

        Yields ``(tokens, record)`` per commit: the new tokens and the step's :class:`StepRecord` (None
        for the first token, sampled from the prefill). ``send(k)`` keeps only the first ``k`` of the
        tokens just yielded and ends the generation; the generator's return value (``StopIteration.value``)
        is the :class:`GenerationResult`. Like :meth:`generate` it has its own state and decodes beside
        other live generations on the pipeline."""
        ids, cfg = self._prepare(prompt, config, max_new_tokens, temperature, seed, top_p, top_k, None, stop_on_eos, None)
        if cfg.stop:
            raise InvalidInputError("decode_steps() takes no stop strings: the caller decides where to stop (send(k))")
        self._check_can_start()
        return self._locked(self._one_request(ids, cfg, None, False, _commit_pairs))

    def _locked(self, gen: Generator[Any, Any, Any]) -> Generator[Any, Any, Any]:
        """``gen`` with each of its steps (every ``send``) taken under the pipeline's step lock."""
        value: Any = None
        try:
            while True:
                with self._step_lock:
                    try:
                        item = gen.send(value)
                    except StopIteration:
                        raise
                    except Exception as exc:  # noqa: BLE001 - re-raised, naming the component that broke
                        error = blame(exc, self.components, self.registry)
                        if error is exc:
                            raise
                        raise error from exc
                value = yield item
        except StopIteration as done:
            return done.value
        finally:
            gen.close()

    @property
    def components(self) -> dict[str, Any]:
        """The pipeline's target and five components, by kind."""
        return {
            "target": self.target, "drafter": self.drafter, "tree_builder": self.tree_builder,
            "budget_controller": self.budget_controller, "latency_model": self.latency_model, "verifier": self.verifier,
        }

    def _prepare(
        self,
        prompt: Prompt,
        config: GenerationConfig | None,
        max_new_tokens: int,
        temperature: float,
        seed: int | None,
        top_p: float,
        top_k: int,
        stop: str | Sequence[str] | None,
        stop_on_eos: bool,
        on_step: Callable[[StepRecord], Any] | None,
    ) -> tuple[torch.Tensor, GenerationConfig]:
        """Check a generation's arguments -> (ids [1, L], its one :class:`GenerationConfig`)."""
        ids = self._prompt_ids(prompt)
        cfg = self.generation_config(
            config, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, top_p=top_p, top_k=top_k,
            stop=stop, stop_on_eos=stop_on_eos,
        )
        if on_step is not None and not callable(on_step):
            raise InvalidInputError(f"on_step must be callable, got {type(on_step).__name__}")
        return ids, cfg

    def generation_config(self, config: GenerationConfig | None = None, **kwargs: Any) -> GenerationConfig:
        """The checked :class:`GenerationConfig` of a call (``config`` and/or keyword arguments), also
        checked against this pipeline (a sampling verifier for T > 0, a tokenizer for stop strings)."""
        if "max_new_tokens" in kwargs:
            kwargs["max_new_tokens"] = check_int("max_new_tokens", kwargs["max_new_tokens"])
        cfg = generation_config(config, **kwargs)
        if not cfg.sampling.greedy and not self.verifier.supports_sampling:
            raise InvalidInputError(f"verifier {type(self.verifier).__name__} supports greedy decoding only")
        if cfg.stop and self.tokenizer is None:
            raise InvalidInputError("stop strings need a tokenizer; this pipeline has none")
        return cfg

    def _session(
        self,
        ids: torch.Tensor,  # [1, L]
        cfg: GenerationConfig,
        on_step: Callable[[StepRecord], Any] | None,
        *,
        emit_text: bool,
    ) -> Generator[str, None, GenerationResult]:
        """One generation as a generator of text chunks (only when ``emit_text``) returning the result."""
        self._check_can_start()
        return self._locked(self._one_request(ids, cfg, on_step, emit_text, _text_chunks))

    def _batched_target(self) -> bool:
        """Whether the target has batched state (it implements ``open_batch``)."""
        return self.target.open_batch.__func__ is not Target.open_batch  # type: ignore[attr-defined]

    def _check_can_start(self) -> None:
        """Refuse, at creation, a second live generation on a target that decodes one sequence at a time."""
        if self._solo.locked() and not self._batched_target():
            raise InvalidInputError(
                f"another generation is decoding on this pipeline, and its target {type(self.target).__name__} has "
                "no batched state to decode a second one beside it; finish the first (or use generate_batch)"
            )

    def _one_request(
        self,
        ids: torch.Tensor,  # [1, L]
        cfg: GenerationConfig,
        on_step: Callable[[StepRecord], Any] | None,
        emit_text: bool,
        view: Callable[[Engine, Any], Generator[Any, Any, GenerationResult]],
    ) -> Generator[Any, Any, GenerationResult]:
        """One generation as a batch of one in an engine of its own: on the target's and drafter's own
        single-sequence state when no other generation holds it (claimed at the first step), else on
        batched states of its own; ``view`` turns the engine's steps into what the caller iterates."""
        solo = self._solo.acquire(blocking=False)
        try:
            if not solo:
                self._check_can_start()
            engine = Engine(self, solo=solo)
            request = engine.add(ids, cfg, text=emit_text, on_step=on_step)
            return (yield from view(engine, request))
        finally:
            if solo:
                self._solo.release()

    def _with_text(self, result: GenerationResult) -> GenerationResult:
        if result.text is None and self.tokenizer is not None:
            return attrs.evolve(result, text=self.decode(result.tokens))
        return result

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
        stop: str | Sequence[str] | None = None,
        on_step: Callable[[int, StepRecord], Any] | None = None,
        config: GenerationConfig | None = None,
    ) -> list[GenerationResult]:
        """Decode every prompt of ``prompts`` (token-id sequences of any lengths: lists, 1-D or [1, L]
        tensors, a padded [B, L] tensor or mapping with an ``attention_mask``, texts, chat message lists)
        -> one :class:`GenerationResult` per prompt, in order. Each row's output is what
        :meth:`generate` gives for that prompt alone (greedy), and every row samples the target's
        distribution at T > 0 (row i seeded with ``seed + i``).

        All rows decode together in one :class:`~bastion.engine.Engine`: one target forward and one
        drafter call per step, one tree width for the whole batch chosen by the budget controller;
        finished rows leave. ``stop`` strings end a row where they first appear; ``on_step(i, record)``
        is called with row i's :class:`StepRecord` as each step commits (:meth:`stream_batch` yields
        the rows' text). One prompt decodes through :meth:`generate` (a batch of one costs what one
        sequence costs); a target without batched state decodes the rows one after another."""
        rows, cfg = self._prepare_batch(prompts, config, max_new_tokens, temperature, seed, top_p, top_k, stop, stop_on_eos, on_step)
        if len(rows) == 1 or not self._batched_target():
            return [
                self.generate(ids, config=self._row_config(cfg, i), on_step=None if on_step is None else _row_callback(on_step, i))
                for i, ids in enumerate(rows)
            ]
        engine, requests = self._batch_engine(rows, cfg, on_step, text=False)
        with self._step_lock:
            engine.run()
        return [self._row_result(r) for r in requests]

    def stream_batch(
        self,
        prompts: Any,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        seed: int | None = None,
        *,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_on_eos: bool = True,
        stop: str | Sequence[str] | None = None,
        on_step: Callable[[int, StepRecord], Any] | None = None,
        config: GenerationConfig | None = None,
    ) -> "BatchTextStream":
        """Like :meth:`generate_batch`, but yield ``(i, text)`` as each step commits row i's text (a
        row's chunks join to its result's ``text``); the stream's ``results`` hold the rows'
        :class:`GenerationResult` once it is exhausted. Needs a tokenizer; prompt errors raise here."""
        if self.tokenizer is None:
            raise InvalidInputError("stream_batch() yields text and needs a tokenizer; this pipeline has none")
        rows, cfg = self._prepare_batch(prompts, config, max_new_tokens, temperature, seed, top_p, top_k, stop, stop_on_eos, on_step)
        if not self._batched_target():
            raise InvalidInputError(f"stream_batch() needs a target with batched state; {type(self.target).__name__} has none")
        engine, requests = self._batch_engine(rows, cfg, on_step, text=True)
        return BatchTextStream(self._locked(self._batch_chunks(engine, requests)))

    def _batch_chunks(self, engine: Engine, requests: list[Any]) -> Generator[tuple[int, str], None, list[GenerationResult]]:
        index = {id(r): i for i, r in enumerate(requests)}
        while not engine.idle:
            for update in engine.step():
                if update.error is not None:
                    raise update.error
                if update.text:
                    yield index[id(update.request)], update.text
        return [self._row_result(r) for r in requests]

    def _prepare_batch(
        self,
        prompts: Any,
        config: GenerationConfig | None,
        max_new_tokens: int,
        temperature: float,
        seed: int | None,
        top_p: float,
        top_k: int,
        stop: str | Sequence[str] | None,
        stop_on_eos: bool,
        on_step: Callable[[int, StepRecord], Any] | None,
    ) -> tuple[list[torch.Tensor], GenerationConfig]:
        """Check a batch's prompts and settings -> (rows, each [1, L_i], the shared config)."""
        if isinstance(prompts, str):
            raise InvalidInputError("generate_batch() takes a list of prompts; for one text prompt use generate()")
        prompts = prompt_rows(prompts)
        if _is_messages(prompts):
            raise InvalidInputError("generate_batch() takes a list of prompts; wrap one chat conversation in a list")
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise InvalidInputError("prompts must be a non-empty list of token-id sequences, texts or chat message lists")
        devices = {p.device for p in prompts if isinstance(p, torch.Tensor)}
        if len(devices) > 1:
            first = next(p.device for p in prompts if isinstance(p, torch.Tensor))
            bad = next(i for i, p in enumerate(prompts) if isinstance(p, torch.Tensor) and p.device != first)
            raise InvalidInputError(f"prompt {bad}: on {prompts[bad].device}, but earlier prompts are on {first}; put all prompts on one device")
        rows = []
        for i, prompt in enumerate(prompts):
            try:
                rows.append(self._row_ids(prompt))
            except InvalidInputError as exc:
                raise InvalidInputError(f"prompt {i}: {exc}") from None
        cfg = self.generation_config(
            config, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, top_p=top_p, top_k=top_k,
            stop=stop, stop_on_eos=stop_on_eos,
        )
        if on_step is not None and not callable(on_step):
            raise InvalidInputError(f"on_step must be callable, got {type(on_step).__name__}")
        return rows, cfg

    def _row_ids(self, prompt: Any) -> torch.Tensor:
        if isinstance(prompt, str) or _is_messages(prompt):
            return self._prompt_ids(prompt)
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
            prompt = prompt[None]
        return self._check_prompt(prompt)

    @staticmethod
    def _row_config(cfg: GenerationConfig, i: int) -> GenerationConfig:
        """Row i's settings: the batch's, seeded with ``seed + i`` when seeded."""
        seed = cfg.sampling.seed
        return cfg if seed is None or i == 0 else attrs.evolve(cfg, sampling=cfg.sampling.with_seed(seed + i))

    def _batch_engine(
        self, rows: list[torch.Tensor], cfg: GenerationConfig, on_step: Callable[[int, StepRecord], Any] | None, *, text: bool
    ) -> tuple[Engine, list[Any]]:
        engine = Engine(self, prefill_tokens=max(int(r.shape[1]) for r in rows) * len(rows))  # every row in one prefill
        requests = [
            engine.add(ids, self._row_config(cfg, i), text=text, on_step=None if on_step is None else _row_callback(on_step, i))
            for i, ids in enumerate(rows)
        ]
        return engine, requests

    def _row_result(self, request: Any) -> GenerationResult:
        if request.error is not None:
            raise request.error
        return self._with_text(request.result)

    # ------------------------------------------------------------------ helpers
    def _fit_proposal(self, proposal: Any, root: int, max_depth: int) -> Marginals | CandidateTree:
        """Check the proposal's kind against the tree builder and cut it to ``max_depth`` (never draft past
        the position limit or the token budget)."""
        if isinstance(proposal, CandidateTree):
            check_pairing(self.tree_builder, "candidate_tree", self.drafter)
            if self.validate_trees or not type(self.drafter).__module__.startswith("bastion."):
                proposal.validate(vocab_size=self.target.vocab_size, root_token=root)
            return proposal.prune_depth(max_depth)
        marginals = check_marginals(proposal, self.target.vocab_size, self.drafter)
        check_pairing(self.tree_builder, "marginals", self.drafter)
        return marginals if marginals.depth <= max_depth else Marginals(marginals.log_probs[:max_depth])

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
                f"prompt has {input_ids.shape[1]} tokens; the target accepts at most {self.target.max_positions} positions "
                "(a Hugging Face config's max_position_embeddings), leaving no room to generate"
            )
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.target.vocab_size:
            raise InvalidInputError(f"token ids must lie in [0, {self.target.vocab_size}), found [{lo}, {hi}]")
        return input_ids.to(device=self.target.device, dtype=torch.long)

    def _prompt_ids(self, prompt: Prompt) -> torch.Tensor:
        """Any accepted prompt form -> a checked LongTensor [1, L] on the target's device."""
        if isinstance(prompt, str):
            return self._check_prompt(self.encode(prompt))
        if _is_messages(prompt):
            return self._check_prompt(self.encode_chat(prompt))
        rows = prompt_rows(prompt) if isinstance(prompt, (Mapping, torch.Tensor)) else prompt
        if isinstance(rows, list) and rows is not prompt:
            if len(rows) != 1:
                raise InvalidInputError(
                    f"generate() decodes one prompt [1, L], got a batch of {len(rows)}; use generate_batch() for several"
                )
            rows = rows[0]
        if isinstance(rows, torch.Tensor) and rows.dim() == 1:
            rows = rows[None]
        return self._check_prompt(rows)

    def encode(self, text: str) -> torch.Tensor:
        """Tokenize ``text`` as it is (no chat template) -> LongTensor[1, L]."""
        if self.tokenizer is None:
            raise InvalidInputError("this pipeline has no tokenizer; pass input_ids instead")
        if not isinstance(text, str):
            raise InvalidInputError(f"encode() takes a string, got {type(text).__name__}")
        return torch.tensor([self.tokenizer.encode(text)], dtype=torch.long)

    def encode_chat(self, messages: str | Sequence[Mapping[str, str]]) -> torch.Tensor:
        """Chat ``messages`` (``[{"role": "user", "content": ...}, ...]``, or one user message as text)
        through the tokenizer's chat template, ready for the assistant's answer -> LongTensor[1, L]."""
        if self.tokenizer is None:
            raise InvalidInputError("this pipeline has no tokenizer; pass input_ids instead")
        if isinstance(messages, str):
            messages = user_turn(messages)
        if not _is_messages(messages):
            raise InvalidInputError('chat messages must be text or a list of {"role": ..., "content": ...} dicts')
        return torch.tensor([chat_ids(self.tokenizer, messages)], dtype=torch.long)

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Token ids -> text (special tokens such as end-of-turn markers left out unless asked for). Ids
        outside the target's vocabulary, floats, bools and strings raise :class:`InvalidInputError` (a
        tokenizer drops an unknown id silently)."""
        if self.tokenizer is None:
            raise InvalidInputError("this pipeline has no tokenizer")
        ids = check_token_ids(tokens, self.target.vocab_size)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class TextStream(Iterator[str]):
    """The text chunks of one generation, as its steps commit; ``result`` holds the
    :class:`GenerationResult` once the stream is exhausted (None before)."""

    def __init__(self, session: Generator[str, None, GenerationResult]) -> None:
        self._session = session
        self.result: GenerationResult | None = None
        self._done = False

    def __iter__(self) -> "TextStream":
        return self

    def __next__(self) -> str:
        if self._done:
            raise StopIteration
        try:
            return next(self._session)
        except StopIteration as done:
            self.result, self._done = done.value, True
            raise StopIteration from None


class BatchTextStream(Iterator[tuple[int, str]]):
    """The ``(row, text)`` chunks of a batch as its steps commit; ``results`` holds one
    :class:`GenerationResult` per row once the stream is exhausted (None before)."""

    def __init__(self, chunks: Generator[tuple[int, str], None, list[GenerationResult]]) -> None:
        self._chunks = chunks
        self.results: list[GenerationResult] | None = None
        self._done = False

    def __iter__(self) -> "BatchTextStream":
        return self

    def __next__(self) -> tuple[int, str]:
        if self._done:
            raise StopIteration
        try:
            return next(self._chunks)
        except StopIteration as done:
            self.results, self._done = done.value, True
            raise StopIteration from None


def as_target(target: Any) -> Target:
    """``target`` as a :class:`Target`: a Target is returned as it is; a loaded Hugging Face causal LM is
    wrapped in :class:`~bastion.huggingface.causal_lm.HFTarget`."""
    if isinstance(target, Target):
        return target
    if isinstance(target, torch.nn.Module) and hasattr(target, "config"):
        from bastion.huggingface.causal_lm import HFTarget

        return HFTarget(target)
    raise InvalidInputError(
        f"target must be a bastion.core.Target or a loaded Hugging Face causal LM (wrapped in "
        f"bastion.huggingface.causal_lm.HFTarget), got {type(target).__name__}; Pipeline.from_pretrained also "
        "takes a directory or hub id"
    )


def resolve_drafter(
    drafter: Any, target: Target, registry: Registry, options: Mapping[str, Any] | None = None
) -> Drafter:
    """A drafter given as a registered name (created with ``options``), a checkpoint directory or hub id
    that a registered drafter claims (loaded on the target's device and dtype), or an instance (returned
    as it is)."""
    opts = dict(options or {})
    if isinstance(drafter, (str, Path)):
        name = str(drafter)
        if name in registry.names("drafter"):
            return registry.create("drafter", name, **opts)
        if not Path(name).exists() and "/" not in name:  # neither a name, a directory nor a hub id
            registry.info("drafter", name)  # raises with the registered names, near names and blocked plugins
        claimant = registry.drafter_for_checkpoint(name)
        return registry.create(
            "drafter", claimant, **{"checkpoint": name, "device": target.device, "dtype": target.dtype, **opts}
        )
    if opts:
        raise InvalidInputError(
            f"drafter options {sorted(opts)} given for a drafter passed as an instance ({type(drafter).__name__}); "
            "create the instance with them instead"
        )
    return drafter


def prompt_rows(prompts: Any) -> Any:
    """Normalise batch-shaped prompt forms: a mapping / ``BatchEncoding`` with ``input_ids`` (and
    ``attention_mask``) or a 2-D tensor [B, L] -> a list of 1-D rows with padding removed (rows whose mask
    has zeros keep only their unmasked positions). Anything else is returned as it is."""
    mask = None
    if isinstance(prompts, Mapping):
        if "input_ids" not in prompts:
            raise InvalidInputError(f"a prompt mapping needs 'input_ids', got keys {sorted(map(str, prompts))}")
        mask = prompts.get("attention_mask")
        prompts = prompts["input_ids"]
        if not isinstance(prompts, torch.Tensor):
            prompts = torch.as_tensor(prompts)
        if prompts.dim() == 1:
            prompts = prompts[None]
    if not isinstance(prompts, torch.Tensor) or prompts.dim() != 2:
        return prompts
    if mask is None:
        return list(prompts)
    mask = torch.as_tensor(mask)
    if mask.shape != prompts.shape:
        raise InvalidInputError(f"attention_mask shape {tuple(mask.shape)} differs from input_ids {tuple(prompts.shape)}")
    keep = mask.to(torch.bool).cpu()  # [B, L]
    return [row[k.to(row.device)] for row, k in zip(prompts, keep)]


def _text_chunks(engine: Engine, request: Any) -> Generator[str, None, GenerationResult]:
    """A batch of one's steps as its text chunks -> its result (errors raised, text decoded)."""
    while not engine.idle:
        for update in engine.step():
            if update.error is not None:
                raise update.error
            if update.text:
                yield update.text
    return engine.pipe._with_text(request.result)


def _commit_pairs(engine: Engine, request: Any) -> Generator[tuple[list[int], StepRecord | None], int | None, GenerationResult]:
    """A batch of one's steps as ``(tokens, record)`` per commit (record None for the first token, drawn
    from the prefill); ``send(k)`` keeps the first ``k`` of the tokens just yielded and ends it."""
    while not engine.idle:
        for update in engine.step():
            if update.error is not None:
                raise update.error
            if not update.tokens:
                continue
            record = request.steps[-1] if request.steps else None
            keep = yield list(update.tokens), record
            if keep is not None:
                request.stop_after(len(request.tokens) - len(update.tokens) + _check_keep(keep, len(update.tokens)))
    return request.result


def _check_keep(keep: Any, emitted: int) -> int:
    """The ``k`` of ``decode_steps(...).send(k)``: an int in [0, tokens just yielded]."""
    if isinstance(keep, bool) or not isinstance(keep, numbers.Integral) or not 0 <= int(keep) <= emitted:
        raise InvalidInputError(f"send(k) keeps the first k of the {emitted} tokens just yielded: k must be an int in [0, {emitted}], got {keep!r}")
    return int(keep)


def _is_messages(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, Mapping) and "role" in m for m in value)


def _row_callback(on_step: Callable[[int, StepRecord], Any], i: int) -> Callable[[StepRecord], Any]:
    """``on_step`` bound to row ``i``: called as ``on_step(i, record)``."""
    return lambda record: on_step(i, record)


def _builtin(component: object) -> bool:
    return type(component).__module__.startswith("bastion.")


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


def _model_tokenizer(model: Any, target: Target) -> Any:
    """The tokenizer saved next to a model loaded from a local directory (``model.name_or_path``), or
    None: a loaded model never sends the pipeline to the hub."""
    path = getattr(model, "name_or_path", None)
    if not path or not Path(str(path)).expanduser().is_dir():
        return None
    try:
        return _load_tokenizer(str(path), target.vocab_size)
    except InvalidFileError:
        return None
