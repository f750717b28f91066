"""A Hugging Face drop-in: bastion as the decoding loop of ``model.generate``.

transformers 5 accepts a callable ``custom_generate``; :func:`speculative` returns one::

    out = model.generate(**inputs, max_new_tokens=128,
                         custom_generate=bastion.hf.speculative("path/or/hub-id-of-drafter"))

``model.generate`` prepares the generation config, the logits processors and the stopping criteria as
usual and hands them to the callable, which decodes with a bastion pipeline built around ``model`` (once
per model) and returns what Hugging Face's own greedy / sample loop returns: the sequences
``[B, L + new]`` (prompt included), or a ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate``.

Honoured: ``max_new_tokens`` / ``max_length``, ``do_sample`` with ``temperature``, ``top_k`` and
``top_p`` (read from the processors ``generate`` built, so the model's own defaults apply exactly as in
plain ``generate``), ``eos_token_id``, ``stop_strings=`` and any other stopping criterion (checked token
by token), ``streamer=`` (``TextStreamer``, ``TextIteratorStreamer``: each step's tokens are put as one
burst), and padded batches with an ``attention_mask`` (decoded through ``Pipeline.generate_batch``;
finished rows are padded with ``pad_token_id`` as Hugging Face does). Greedy output is token-for-token
plain ``model.generate``'s; sampled output follows the same distribution, seeded from torch's global
generator (so ``torch.manual_seed`` makes it reproducible). Logits processors bastion cannot apply
inside tree verification (repetition penalty, min-p, ...) and per-step outputs (scores, logits,
attentions, hidden states) are refused with a clear error.

Stop strings: transformers 5 does not hand a callable ``custom_generate`` the ``tokenizer=`` given to
``generate``, so the drop-in takes ``stop_strings=`` itself and matches them with the tokenizer given to
:func:`speculative` (``tokenizer=tok``), else the one saved beside the model (``model.name_or_path``).
Pass stop strings to ``generate`` as a keyword, not inside a Hugging Face ``GenerationConfig``.

The position limit: a tree needs positions to verify into, so bastion stops drafting at the target's
``max_position_embeddings``; plain ``generate`` goes on past it, and so does the drop-in for one sequence
(the remaining tokens through the model's own one-token-at-a-time loop, as plain ``generate`` decodes
them). A batch row cut there is left short with a ``UserWarning`` that says so.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import Any, Mapping

import torch

from bastion.contract.errors import InvalidInputError
from bastion.contract.registry import Registry, registry as default_registry

__all__ = ["SpeculativeGenerate", "speculative"]

#: per-step outputs of Hugging Face's loop that bastion's tree steps do not produce
_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def speculative(
    drafter: Any,
    *,
    tree_builder: Any = "best-first",
    budget_controller: Any = "bastion",
    latency_model: Any = "roofline",
    verifier: Any = "exact",
    max_nodes: int = 64,
    component_options: Mapping[str, Mapping[str, Any]] | None = None,
    registry: Registry | None = None,
    tokenizer: Any = None,
    config: Any = None,
) -> "SpeculativeGenerate":
    """A ``custom_generate`` callable for ``model.generate`` that decodes with bastion.

    ``drafter`` and every component take what :meth:`bastion.Pipeline.from_pretrained` takes: a
    registered name, a path or hub id (drafter checkpoints, loaded on the model's device and dtype), or an
    instance; ``component_options`` holds options for components given by name, keyed by kind.

    ``tokenizer`` matches stop strings (default: the tokenizer saved beside the model, when it was loaded
    from a directory). ``config``, a :class:`bastion.GenerationConfig`, decides how every call samples
    (its temperature, top_p, top_k and seed in place of ``do_sample`` / ``temperature`` / ``top_k`` /
    ``top_p``; a seed makes sampling repeat whatever torch's global generator holds), adds its stop
    strings, ends at end tokens only with ``stop_on_eos``, and caps the length at its ``max_new_tokens``
    (the shorter of that and the call's ``max_new_tokens`` / ``max_length`` applies)."""
    from bastion.engine.params import GenerationConfig

    if config is not None and not isinstance(config, GenerationConfig):
        raise InvalidInputError(f"config must be a bastion.GenerationConfig, got {type(config).__name__}")
    return SpeculativeGenerate(
        drafter,
        components=dict(tree_builder=tree_builder, budget_controller=budget_controller, latency_model=latency_model, verifier=verifier),
        max_nodes=max_nodes,
        component_options=component_options,
        registry=registry,
        tokenizer=tokenizer,
        config=config,
    )


class SpeculativeGenerate:
    """The callable :func:`speculative` returns; one pipeline per model it is called with."""

    def __init__(
        self,
        drafter: Any,
        *,
        components: Mapping[str, Any],
        max_nodes: int = 64,
        component_options: Mapping[str, Mapping[str, Any]] | None = None,
        registry: Registry | None = None,
        tokenizer: Any = None,
        config: Any = None,
    ) -> None:
        self.drafter = drafter
        self.tokenizer = tokenizer
        self.config = config
        self.components = dict(components)
        self.max_nodes = max_nodes
        self.component_options = {k: dict(v) for k, v in (component_options or {}).items()}
        self.registry = registry or default_registry
        self._pipelines: "weakref.WeakKeyDictionary[torch.nn.Module, Any]" = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"bastion.hf.speculative({self.drafter!r})"

    def pipeline(self, model: torch.nn.Module) -> Any:
        """The bastion pipeline wrapped around ``model`` (built on first use, then reused)."""
        pipe = self._pipelines.get(model)
        if pipe is None:
            from bastion.engine.pipeline import Pipeline, _model_tokenizer, as_target, resolve_drafter

            target = as_target(model)
            opts = {k: dict(v) for k, v in self.component_options.items()}
            drafter = resolve_drafter(self.drafter, target, self.registry, opts.pop("drafter", {}))
            tokenizer = self.tokenizer if self.tokenizer is not None else _model_tokenizer(model, target)
            pipe = Pipeline(target, drafter, **self.components, max_nodes=self.max_nodes, component_options=opts,
                            registry=self.registry, tokenizer=tokenizer)
            self._pipelines[model] = pipe
        return pipe

    def __call__(
        self,
        model: torch.nn.Module,
        input_ids: torch.LongTensor,  # [B, L], left-padded when B > 1
        logits_processor: Any = None,
        stopping_criteria: Any = None,
        generation_config: Any = None,
        synced_gpus: bool = False,
        streamer: Any = None,
        stop_strings: Any = None,  # declared, so generate hands it here (it drops the tokenizer it needs)
        **model_kwargs: Any,
    ) -> Any:
        if generation_config is None:
            raise InvalidInputError("bastion.hf.speculative is a custom_generate for model.generate(...), not a standalone call")
        if streamer is None:
            streamer = _caller_streamer(self)
        _check_config(generation_config)
        sampling = _sampling_from(logits_processor, bool(generation_config.do_sample))
        batch, length = int(input_ids.shape[0]), int(input_ids.shape[1])
        max_new = int(generation_config.max_length) - length
        if max_new < 1:
            raise InvalidInputError(f"max_length {generation_config.max_length} leaves no room after the {length}-token prompt")
        eos = _ids(getattr(generation_config, "_eos_token_tensor", None)) or _ids(generation_config.eos_token_id)
        pad = _ids(getattr(generation_config, "_pad_token_tensor", None)) or _ids(generation_config.pad_token_id)
        stops = list(_stop_list(stop_strings))
        pipe = self.pipeline(model)
        seed: int | None = None
        if self.config is not None:  # a bastion.GenerationConfig: its sampling, stops, end tokens and length
            rule = self.config.sampling
            sampling = {"temperature": rule.temperature, "top_k": rule.top_k, "top_p": rule.top_p}
            seed = rule.seed
            stops += [s for s in self.config.stop if s not in stops]
            max_new = min(max_new, self.config.max_new_tokens)
            if not self.config.stop_on_eos:
                eos, stopping_criteria = [], _without_eos(stopping_criteria)
        if stops:
            stopping_criteria = _with_stop_strings(stopping_criteria, stops, pipe.tokenizer)
        if sampling["temperature"] == 0.0:
            seed = None
        elif seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        # the call's settings, checked once by the rule of every path (bastion.GenerationConfig)
        cfg = _call_config(max_new, sampling, seed)
        with torch.inference_mode():
            if batch == 1:
                rows = [self._decode_one(model, pipe, input_ids, model_kwargs.get("attention_mask"), cfg, stopping_criteria, streamer)]
            else:
                if streamer is not None:
                    raise InvalidInputError("streamers take one sequence at a time; stream a batch of 1")
                rows = self._decode_batch(pipe, input_ids, model_kwargs.get("attention_mask"), cfg, eos, stopping_criteria)
        if streamer is not None:
            streamer.end()
        fill = pad[0] if pad else (eos[0] if eos else 0)
        width = max(len(r) for r in rows)
        new = torch.full((batch, width), fill, dtype=input_ids.dtype, device=input_ids.device)  # [B, new]
        for i, r in enumerate(rows):
            new[i, : len(r)] = torch.tensor(r, dtype=input_ids.dtype)
        sequences = torch.cat([input_ids, new], dim=1)  # [B, L + new]
        if generation_config.return_dict_in_generate:
            from transformers.generation.utils import GenerateDecoderOnlyOutput

            return GenerateDecoderOnlyOutput(sequences=sequences)
        return sequences

    # ------------------------------------------------------------------ decoding
    @staticmethod
    def _decode_one(
        model: torch.nn.Module,
        pipe: Any,
        input_ids: torch.Tensor,  # [1, L]
        attention_mask: torch.Tensor | None,
        cfg: Any,  # GenerationConfig
        stopping_criteria: Any,
        streamer: Any,
    ) -> list[int]:
        max_new, sampling, seed = cfg.max_new_tokens, _sampling_dict(cfg), cfg.sampling.seed
        seq = input_ids  # [1, L + produced]: what the stopping criteria see, as in Hugging Face's loop
        out: list[int] = []
        stopped = False
        if input_ids.shape[1] < pipe.target.max_positions:
            prompt = {"input_ids": input_ids, "attention_mask": attention_mask} if attention_mask is not None else input_ids
            steps = pipe.decode_steps(prompt, config=cfg)
            keep = None
            while True:
                try:
                    tokens, _record = steps.send(keep)
                except StopIteration:
                    break
                keep = None
                for k, tok in enumerate(tokens):  # token by token: stop exactly where Hugging Face's loop would
                    seq = torch.cat([seq, seq.new_tensor([[tok]])], dim=1)
                    if stopping_criteria is not None and bool(stopping_criteria(seq, None).any()):
                        keep = k + 1
                        break
                emitted = tokens if keep is None else tokens[:keep]
                out.extend(emitted)
                if streamer is not None and emitted:
                    streamer.put(torch.tensor(emitted, dtype=torch.long))
                if keep is not None:
                    stopped = True
                    steps.close()
                    break
        if not stopped and len(out) < max_new:  # the position limit came first: go on as plain generate does
            out.extend(_plain_tail(model, seq, max_new - len(out), sampling, seed, stopping_criteria, streamer))
        return out

    @staticmethod
    def _decode_batch(
        pipe: Any,
        input_ids: torch.Tensor,  # [B, L]
        attention_mask: torch.Tensor | None,
        cfg: Any,  # GenerationConfig
        eos: list[int],
        stopping_criteria: Any,
    ) -> list[list[int]]:
        import attrs

        max_new = cfg.max_new_tokens
        prompts = {"input_ids": input_ids, "attention_mask": attention_mask} if attention_mask is not None else input_ids
        # the pipeline may stop at the target's end tokens only when those also end the generation here
        stop_on_eos = pipe.target.eos_token_ids <= frozenset(eos)
        results = pipe.generate_batch(prompts, config=attrs.evolve(cfg, stop_on_eos=stop_on_eos))
        rows = []
        cut = [i for i, res in enumerate(results) if res.stop_reason == "position-limit" and len(res.tokens) < max_new]
        if cut:
            warnings.warn(
                f"bastion.hf.speculative: {len(cut)} of {len(results)} rows reached the target's position limit "
                f"({pipe.target.max_positions} positions) before max_new_tokens and were cut there; plain generate "
                "would go on past it (decode those prompts one at a time, where the drop-in does)",
                UserWarning,
                stacklevel=4,
            )
        for i, res in enumerate(results):
            seq = input_ids[i : i + 1]  # [1, L], padding included, as Hugging Face's criteria see it
            row: list[int] = []
            for tok in res.tokens:
                row.append(tok)
                seq = torch.cat([seq, seq.new_tensor([[tok]])], dim=1)
                if stopping_criteria is not None and bool(stopping_criteria(seq, None).any()):
                    break
            rows.append(row)
        return rows


# ---------------------------------------------------------------------- helpers
def _plain_tail(
    model: torch.nn.Module,
    seq: torch.Tensor,  # [1, T]: the prompt and the tokens so far
    count: int,
    sampling: dict[str, Any],
    seed: int | None,
    stopping_criteria: Any,
    streamer: Any,
) -> list[int]:
    """Up to ``count`` more tokens one at a time through ``model``'s forward with a KV cache, as Hugging
    Face's greedy / sample loop produces them (its temperature / top-k / top-p warpers, multinomial
    draws), past the positions bastion's trees can use."""
    from transformers import DynamicCache, LogitsProcessorList

    from bastion.huggingface.compat import cache_kwargs
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits_processor = LogitsProcessorList()
    if sampling["temperature"] > 0.0:
        if sampling["temperature"] != 1.0:
            logits_processor.append(TemperatureLogitsWarper(sampling["temperature"]))
        if sampling["top_k"]:
            logits_processor.append(TopKLogitsWarper(sampling["top_k"]))
        if sampling["top_p"] < 1.0:
            logits_processor.append(TopPLogitsWarper(sampling["top_p"]))

    device = next(model.parameters()).device
    seq = seq.to(device)
    generator = None
    if sampling["temperature"] > 0.0:
        generator = torch.Generator(device=device)
        generator.manual_seed(int(seed or 0) ^ 0x5EED)
    cache = DynamicCache()
    step_in = seq
    out: list[int] = []
    for _ in range(count):
        logits = model(input_ids=step_in, **cache_kwargs(model, cache)).logits[:, -1, :].float()  # [1, V]
        scores = logits_processor(seq, logits)
        if sampling["temperature"] > 0.0:
            tok = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator).item())
        else:
            tok = int(scores.argmax(dim=-1).item())
        out.append(tok)
        seq = torch.cat([seq, seq.new_tensor([[tok]])], dim=1)
        step_in = seq[:, -1:]
        if streamer is not None:
            streamer.put(torch.tensor([tok], dtype=torch.long))
        if stopping_criteria is not None and bool(stopping_criteria(seq, scores).any()):
            break
    return out


def _call_config(max_new: int, sampling: dict[str, Any], seed: int | None) -> Any:
    """One call's settings as a :class:`bastion.GenerationConfig` (end tokens and stop strings are the
    stopping criteria's, checked token by token here): every value checked by the rule of every path."""
    from bastion.engine.params import GenerationConfig, SamplingParams

    return GenerationConfig(max_new_tokens=max_new, sampling=SamplingParams(**sampling, seed=seed), stop_on_eos=False)


def _sampling_dict(cfg: Any) -> dict[str, Any]:
    sp = cfg.sampling
    return {"temperature": sp.temperature, "top_k": sp.top_k, "top_p": sp.top_p}


def _stop_list(value: Any) -> tuple[str, ...]:
    """``stop_strings=`` checked by the rule of every stop string (non-empty strings, one or a list)."""
    from bastion.utils.text import check_stop_strings

    try:
        return check_stop_strings(value)
    except InvalidInputError as exc:
        raise InvalidInputError(f"stop_strings: {exc}") from None


def _with_stop_strings(criteria: Any, stops: list[str], tokenizer: Any) -> Any:
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import StopStringCriteria

    if tokenizer is None:
        raise InvalidInputError(
            "stop_strings need the model's tokenizer, and transformers does not hand generate's tokenizer= to a "
            "custom_generate: pass it as bastion.hf.speculative(drafter, tokenizer=tok)"
        )
    out = StoppingCriteriaList(list(criteria or ()))
    out.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stops))
    return out


def _without_eos(criteria: Any) -> Any:
    from transformers import StoppingCriteriaList
    from transformers.generation.stopping_criteria import EosTokenCriteria

    return StoppingCriteriaList([c for c in (criteria or ()) if not isinstance(c, EosTokenCriteria)])


def _check_config(config: Any) -> None:
    if int(getattr(config, "num_beams", 1) or 1) > 1:
        raise InvalidInputError("bastion.hf.speculative decodes one sequence per prompt; num_beams > 1 is not supported")
    if int(getattr(config, "num_return_sequences", 1) or 1) > 1:
        raise InvalidInputError("num_return_sequences > 1 is not supported by bastion.hf.speculative")
    asked = [name for name in _UNSUPPORTED_OUTPUTS if getattr(config, name, False)]
    if asked and config.return_dict_in_generate:
        raise InvalidInputError(
            f"bastion.hf.speculative returns sequences only; {', '.join(asked)} are not produced by tree verification"
        )


def _sampling_from(processors: Any, do_sample: bool) -> dict[str, Any]:
    """temperature / top_k / top_p exactly as the processors ``generate`` built will apply them."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    sampling: dict[str, Any] = {"temperature": 1.0 if do_sample else 0.0, "top_k": 0, "top_p": 1.0}
    unsupported = []
    for proc in processors or ():
        if isinstance(proc, TemperatureLogitsWarper):
            sampling["temperature"] = float(proc.temperature)
        elif isinstance(proc, TopKLogitsWarper):
            sampling["top_k"] = int(proc.top_k)
        elif isinstance(proc, TopPLogitsWarper):
            sampling["top_p"] = float(proc.top_p)
        else:
            unsupported.append(type(proc).__name__)
    if unsupported:
        raise InvalidInputError(
            f"bastion.hf.speculative cannot apply {', '.join(unsupported)} inside tree verification; it honours "
            "do_sample, temperature, top_k and top_p (drop the other generation options)"
        )
    if not do_sample:
        sampling = {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    return sampling


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _caller_streamer(fn: Any) -> Any:
    """The ``streamer=`` given to ``model.generate``. transformers 5 passes a callable ``custom_generate``
    only the keyword arguments its own loops do not declare, and ``streamer`` is one of theirs, so it is
    read from the ``generate`` frame that is calling ``fn`` (the frame whose ``custom_generate`` is it)."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            break
        if frame.f_locals.get("custom_generate") is fn:
            return frame.f_locals.get("streamer")
        frame = frame.f_back
    return None
