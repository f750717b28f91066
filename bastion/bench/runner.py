"""Runs every method on every prompt, interleaved per prompt, and collects the results.

For each prompt all methods run back to back, in orders from a balanced (Williams) design: over every
``n`` prompts (``2n`` for an odd number ``n`` of methods) each method runs first equally often and runs
right after each other method equally often. Slow drift of the machine (thermal state, other load) and
carry-over effects fall on every method alike: a method run right after a heavy one can be slowed for
its whole run (caches, the memory allocator's state), so a fixed neighbour would bias it.
With ``repeats > 1`` the round over all methods is repeated and each method keeps its fastest run of
the prompt (outputs are identical across repeats; the minimum filters bursts of foreign load).
"""

from __future__ import annotations

import platform
import time
from typing import Any, Callable, Mapping, Sequence

import attrs
import torch
from attrs import field, frozen

from bastion.bench.datasets import Prompt, load_dataset
from bastion.bench.families import split_family
from bastion.bench.methods import AR, ADAPTIVE, Decoder, MethodSpec, build_decoder, default_methods, parse_method
from bastion.bench.metrics import DatasetSummary, MethodStats, PromptRun, aggregate, latency_points, summarize
from bastion.bench.templates import TemplateStyle, encode_prompt
from bastion.utils.checks import check_int, optional_positive_int, positive_int
from bastion.contract.errors import InvalidInputError
from bastion.contract.target import Target
from bastion.contract.types import GenerationResult, SamplingConfig
from bastion.distributed import DistContext, gather_objects, shard

__all__ = ["BenchConfig", "BenchRun", "LatencyFit", "QUICK", "balanced_orders", "load_prompts", "run_bench", "run_bench_temperatures", "fit_latency"]

DEFAULT_DATASETS: tuple[str, ...] = ("gsm8k", "humaneval", "mt_bench")


@frozen
class BenchConfig:
    """What one ``bastion bench`` run measures."""

    datasets: tuple[str, ...] = field(default=DEFAULT_DATASETS, converter=tuple)
    methods: tuple[str, ...] = field(default=default_methods(), converter=tuple)
    limit: int | None = field(default=10, validator=optional_positive_int)  # prompts per dataset
    max_new_tokens: int = field(default=128, validator=positive_int)
    max_nodes: int = field(default=64, validator=positive_int)  # the adaptive controller's N_max
    temperature: float = field(default=0.0, converter=float)
    top_p: float = field(default=1.0, converter=float)  # nucleus filter of sampled runs (AR and speculative alike)
    top_k: int = 0  # top-k filter of sampled runs (0: off)
    seed: int = 0
    template: str = "auto"
    warmup_tokens: int = field(default=16, validator=attrs.validators.ge(0))  # per method, first prompt, unrecorded
    repeats: int = field(default=3, validator=positive_int)  # runs per (prompt, method); the fastest is kept
    data_dir: str | None = None
    tree_options: Mapping[str, Mapping[str, Any]] = field(factory=dict)  # tree builder name -> options
    controller_options: Mapping[str, Mapping[str, Any]] = field(factory=dict)  # budget controller name -> options
    latency_model: str = "roofline"
    verifier: str = "exact"
    component_options: Mapping[str, Mapping[str, Any]] = field(factory=dict)  # "latency_model" / "verifier" -> options

    @methods.validator
    def _check_methods(self, _a: attrs.Attribute, value: tuple[str, ...]) -> None:
        if not value:
            raise InvalidInputError("at least one method is needed")
        if len(set(value)) != len(value):
            raise InvalidInputError(f"methods repeat a name: {list(value)}")

    @datasets.validator
    def _check_datasets(self, _a: attrs.Attribute, value: tuple[str, ...]) -> None:
        if not value:
            raise InvalidInputError("at least one dataset is needed")

    def __attrs_post_init__(self) -> None:
        self.sampling  # the sampling options are checked where every decoder reads them

    @property
    def sampling(self) -> SamplingConfig:
        """The sampling options every method decodes with."""
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)


#: the ``--quick`` configuration: a few prompts per dataset, a short sweep
QUICK = dict(limit=3, max_new_tokens=64, methods=default_methods((8, 32)), warmup_tokens=8, repeats=1)


@frozen
class LatencyFit:
    """The adaptive pipeline's latency model (as calibrated at the end of the run) against the verify
    times measured for every tree method of the run (all verify through the same target forward)."""

    points: list[tuple[int, int, float]] = field(eq=False)  # (budget, context_len, measured seconds)
    predicted: list[float] = field(eq=False)  # model prediction at each point
    mean_abs_rel_error: float | None


@frozen
class BenchRun:
    """Everything one run measured."""

    config: BenchConfig
    specs: tuple[MethodSpec, ...]
    prompts: tuple[Prompt, ...] = field(eq=False)
    runs: tuple[PromptRun, ...] = field(eq=False)
    stats: tuple[MethodStats, ...] = field(eq=False)
    summary: tuple[DatasetSummary, ...] = field(eq=False)
    latency: LatencyFit | None = field(eq=False)
    latency_model: Any = field(eq=False, repr=False)  # the adaptive pipeline's model, for the fit plot
    meta: dict[str, Any] = field(eq=False)


def load_prompts(config: BenchConfig) -> list[Prompt]:
    prompts: list[Prompt] = []
    for spec in config.datasets:
        prompts.extend(load_dataset(spec, limit=config.limit, data_dir=config.data_dir))
    return prompts


def fit_latency(model: Any, points: Sequence[tuple[int, int, float]]) -> LatencyFit:
    """Predictions of ``model`` (a LatencyModel) at the measured points, and the mean |rel. error|."""
    pts = [p for p in points if p[2] > 0]
    predicted = [float(model.predict(n, c)) for n, c, _ in pts]
    errs = [abs(p - s) / s for p, (_, _, s) in zip(predicted, pts)]
    return LatencyFit(points=pts, predicted=predicted, mean_abs_rel_error=(sum(errs) / len(errs)) if errs else None)


def balanced_orders(n: int) -> list[list[int]]:
    """Orders of ``n`` methods (indices) in which each runs first equally often and right after each
    other method equally often: a Williams design, ``n`` orders for even ``n`` and ``2n`` (each order
    and its reverse) for odd ``n``."""
    n = check_int("methods", n)
    first = [0] + [(k + 1) // 2 if k % 2 else n - k // 2 for k in range(1, n)]  # 0, 1, n-1, 2, n-2, ...
    rows = [[(j + k) % n for j in first] for k in range(n)]
    return rows if n % 2 == 0 or n == 1 else rows + [row[::-1] for row in rows]


def run_bench(
    config: BenchConfig,
    target: Target,
    drafter: Any,
    tokenizer: Any = None,
    *,
    progress: bool = True,
    registry: Any = None,
    ctx: DistContext | None = None,
    prompts: Sequence[Prompt] | None = None,
    before_run: Callable[[int], None] | None = None,
) -> BenchRun | None:
    """Run ``config`` on one loaded ``target`` and ``drafter`` shared by every method (or a mapping of
    drafter family -> drafter, for methods named ``METHOD:FAMILY``). Under torchrun
    (``ctx`` of several ranks) each rank measures its round-robin share of the prompts on its own device
    and rank 0 returns the pooled run (the other ranks return None). ``prompts``: already loaded with
    :func:`load_prompts` (e.g. checked before the models were loaded). ``before_run``: called with the
    round's index (``prompt * repeats + repeat``, the same for every method of the round) right before
    each timed run, e.g. :meth:`~bastion.bench.contention.Contention.align`."""
    specs = tuple(
        parse_method(m, max_nodes=config.max_nodes, tree_options=config.tree_options, controller_options=config.controller_options)
        for m in config.methods
    )
    if not any(s.is_ar for s in specs):
        raise InvalidInputError("the methods must include 'ar': speedups are measured against it in the same run")
    if config.template not in ("auto", "chat", "plain"):
        raise InvalidInputError(f"template must be auto, chat or plain, got {config.template!r}")
    def build_all() -> dict[str, Decoder]:
        return {
            s.name: build_decoder(s, target, _drafter_of(s, drafter), tokenizer, registry, latency_model=config.latency_model,
                                  verifier=config.verifier, component_options=config.component_options)
            for s in specs
        }

    decoders = build_all()
    prompts = list(prompts) if prompts is not None else load_prompts(config)
    style: TemplateStyle = config.template  # type: ignore[assignment]
    room = target.max_positions - config.max_new_tokens - 1
    if room < 1:
        raise InvalidInputError(
            f"max_new_tokens {config.max_new_tokens} leaves no room for a prompt in the target's {target.max_positions} positions"
        )
    encoded = [encode_prompt(p, tokenizer, target.vocab_size, style, max_tokens=room) for p in prompts]

    sampling = {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k}
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t0 = time.perf_counter()
    if config.warmup_tokens > 0:  # first-call costs (allocations, kernel selection) stay out of the figures
        for name, dec in decoders.items():
            dec.generate(encoded[0], max_new_tokens=config.warmup_tokens, seed=config.seed, **sampling)
        # and out of what the adaptive components learn: the measured methods start from fresh state
        # over the warmed target and drafter (a warm-up's cold steps once taught bastion's gate that
        # drafting costs more than it does, and it decoded the whole run plainly)
        decoders = build_all()
    warmup_s = time.perf_counter() - t0

    runs: list[PromptRun] = []
    names = [s.name for s in specs]
    orders = balanced_orders(len(names))
    mine = shard(range(len(prompts)), ctx) if ctx is not None else list(range(len(prompts)))
    bar = _progress(len(mine) * len(names) * config.repeats, progress and (ctx is None or ctx.is_main))
    try:
        for i in mine:
            prompt, ids = prompts[i], encoded[i]
            order = [names[j] for j in orders[i % len(orders)]]
            fastest: dict[str, GenerationResult] = {}
            for r in range(config.repeats):  # whole rounds, so a burst of load hits every method alike
                for name in order:
                    bar.set_postfix_str(f"{prompt.dataset} {name}", refresh=False)
                    if before_run is not None:
                        before_run(i * config.repeats + r)
                    res = decoders[name].generate(ids, max_new_tokens=config.max_new_tokens, seed=config.seed + i, **sampling)
                    if name not in fastest or res.wall_s < fastest[name].wall_s:
                        fastest[name] = res
                    bar.update(1)
            runs.extend(PromptRun(method=n, dataset=prompt.dataset, prompt_id=prompt.id, result=fastest[n]) for n in order)
    finally:
        bar.close()
    total_s = time.perf_counter() - t0
    if ctx is not None and ctx.distributed:
        pooled = _pool(runs, total_s, prompts, ctx)
        if pooled is None:
            return None
        runs, total_s = pooled

    # keep the configured method order in every table, whatever order each prompt ran them in
    order = {n: k for k, n in enumerate(names)}
    runs_sorted = sorted(runs, key=lambda r: order[r.method])
    stats = aggregate(runs_sorted, reference=AR, check_equal=config.temperature == 0.0)
    adaptive = decoders.get(ADAPTIVE) or next((d for n, d in decoders.items() if split_family(n)[0] == ADAPTIVE), None)
    lat_model = getattr(adaptive, "latency_model", None)
    fit = None
    if lat_model is not None:
        fit = fit_latency(lat_model, latency_points(runs, exclude=[s.name for s in specs if s.is_ar]))
    meta = {
        "device": str(target.device),
        "dtype": str(target.dtype).replace("torch.", ""),
        "drafter_dtype": drafter_dtype(drafter),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "prompts": len(prompts),
        "ranks": ctx.world_size if ctx is not None else 1,
        "repeats": config.repeats,
        "warmup_s": warmup_s,
        "total_s": total_s,
        "started": started,
    }
    return BenchRun(
        config=config,
        specs=specs,
        prompts=tuple(prompts),
        runs=tuple(runs_sorted),
        stats=tuple(stats),
        summary=tuple(summarize(stats, adaptive=ADAPTIVE)),
        latency=fit,
        latency_model=lat_model,
        meta=meta,
    )


def drafter_dtype(drafter: Any) -> str | None:
    """The dtype the drafter runs in (``"bfloat16"``), or ``family:dtype`` pairs for a mapping of drafters;
    None when a drafter does not say (no ``model`` with a ``dtype``)."""
    if isinstance(drafter, Mapping):
        named = {k: drafter_dtype(v) for k, v in drafter.items()}
        return ", ".join(f"{k}: {v}" for k, v in named.items() if v) or None
    dtype = getattr(getattr(drafter, "model", None), "dtype", None)
    return str(dtype).replace("torch.", "") if isinstance(dtype, torch.dtype) else None


def _pool(runs: list[PromptRun], total_s: float, prompts: list[Prompt], ctx: DistContext) -> tuple[list[PromptRun], float] | None:
    """Every rank's runs on rank 0, in prompt order, with the slowest rank's time (None elsewhere)."""
    gathered = gather_objects((runs, total_s), ctx)
    if gathered is None:
        return None
    where = {(p.dataset, p.id): k for k, p in enumerate(prompts)}
    pooled = sorted((r for rank_runs, _ in gathered for r in rank_runs), key=lambda r: where[(r.dataset, r.prompt_id)])
    return pooled, max(t for _, t in gathered)


def run_bench_temperatures(
    config: BenchConfig,
    temperatures: Sequence[float],
    target: Target,
    drafter: Any,
    tokenizer: Any = None,
    *,
    progress: bool = True,
    registry: Any = None,
    ctx: DistContext | None = None,
    prompts: Sequence[Prompt] | None = None,
    before_run: Callable[[int], None] | None = None,
) -> list[BenchRun] | None:
    """:func:`run_bench` of ``config`` at each temperature in turn, on the same loaded models and prompts
    (every method's decoder is built afresh per temperature, so nothing learnt at one carries over).
    Under torchrun rank 0 returns the pooled runs and the other ranks None."""
    temps = [float(t) for t in temperatures]
    if not temps:
        raise InvalidInputError("at least one temperature is needed")
    if len(set(temps)) != len(temps):
        raise InvalidInputError(f"temperatures repeat a value: {temps}")
    runs = [
        run_bench(attrs.evolve(config, temperature=t), target, drafter, tokenizer, progress=progress, registry=registry, ctx=ctx,
                  prompts=prompts, before_run=before_run)
        for t in temps
    ]
    return None if any(r is None for r in runs) else [r for r in runs if r is not None]


def _drafter_of(spec: MethodSpec, drafter: Any) -> Any:
    """The drafter a method runs with: ``drafter`` itself, or its family's entry when ``drafter`` maps
    family names to drafters (``bastion bench --drafters``)."""
    if not isinstance(drafter, Mapping):
        return drafter
    if spec.drafter is None:
        return next(iter(drafter.values()))
    if spec.drafter not in drafter:
        raise InvalidInputError(f"method {spec.name!r} names drafter {spec.drafter!r}; the run has {', '.join(drafter)}")
    return drafter[spec.drafter]


class _NoBar:
    def set_postfix_str(self, *_a: Any, **_k: Any) -> None: ...
    def update(self, *_a: Any) -> None: ...
    def close(self) -> None: ...


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="bench", unit="gen", dynamic_ncols=True)
