"""An opt-in compiled verify path for :class:`~bastion.huggingface.causal_lm.HFTarget`.

The eager verify forward has shapes that change every step (the tree size ``n`` and the context length),
so neither ``torch.compile`` nor CUDA graphs can reuse their work across steps. This path makes every
shape static:

* the key/value cache is a fixed-capacity slab per layer (:class:`SlotLayer`) written with
  ``index_copy_`` at slots read from ONE shared device scalar (the context length), so a step changes a
  tensor's value, never a shape or a Python constant the graph was specialised on;
* a tree of ``n`` nodes is padded to the smallest **bucket** size ``b >= n`` (the budget controller's
  size buckets, so the controller chooses exactly the captured sizes); pad nodes see only themselves and
  no real node sees them, so real rows compute exactly what they compute unpadded;
* the token, position and mask inputs are persistent per-bucket buffers (``[1, b]``, ``[1, b]``,
  ``[1, 1, b, capacity]``) updated in place: the mask's columns hold the whole slab (context visible,
  the tree block ancestor-only, every later slot masked out).

With these, ``torch.compile`` compiles one graph per bucket, and on CUDA ``mode="reduce-overhead"``
captures one CUDA graph per bucket and replays it. Trees larger than the largest bucket run the same
static forward eagerly. The path is off by default until it is measured on the hardware at hand
(``benchmarks/device_check.py`` measures it).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import attrs
import torch
from transformers.cache_utils import DynamicCache, StaticLayer

from bastion.utils.checks import options_object
from bastion.contract.errors import IncompatibleComponentsError, InvalidInputError
from bastion.huggingface.compat import cache_kwarg

__all__ = ["CompileOptions", "DEFAULT_BUCKETS", "SlotLayer", "StaticVerify", "compile_options"]

#: tree sizes that get their own compiled graph by default (powers of two up to 512)
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

#: cache slots allocated by default (grown by doubling, up to the target's positions, when a request needs more)
_DEFAULT_CAPACITY = 4096


def _check_buckets(_inst: Any, _attr: Any, value: tuple[int, ...]) -> None:
    if not value or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in value):
        raise InvalidInputError(f"compile buckets must be a non-empty list of positive tree sizes, got {value!r}")


def _check_capacity(_inst: Any, _attr: Any, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 2):
        raise InvalidInputError(f"compile capacity must be an int >= 2 (cache slots), got {value!r}")


def _sorted_sizes(value: Any) -> tuple[int, ...]:
    try:
        return tuple(sorted({int(b) for b in value}))
    except (TypeError, ValueError):
        raise InvalidInputError(f"compile buckets must be a list of tree sizes, got {value!r}") from None


@attrs.frozen
class CompileOptions:
    """How the compiled verify path compiles.

    ``buckets``: tree sizes with their own graph (a tree is padded to the smallest bucket that holds it).
    ``backend`` / ``mode``: passed to ``torch.compile``; ``mode=None`` picks ``"reduce-overhead"`` (CUDA
    graphs) on CUDA and the default mode elsewhere. ``capacity``: cache slots allocated at the first
    prefill (default ``min(4096, max positions)``; doubled, up to the target's positions, when a request
    needs more, which recompiles). ``cuda_graphs=False`` keeps ``torch.compile`` but never captures CUDA
    graphs (``mode="default"``)."""

    buckets: tuple[int, ...] = attrs.field(default=DEFAULT_BUCKETS, converter=_sorted_sizes, validator=_check_buckets)
    backend: str = "inductor"
    mode: str | None = None
    capacity: int | None = attrs.field(default=None, validator=_check_capacity)
    cuda_graphs: bool = True

    def compile_mode(self, device: torch.device) -> str | None:
        if self.mode is not None:
            return self.mode
        return "reduce-overhead" if device.type == "cuda" and self.cuda_graphs else None

    def bucket(self, n: int) -> int:
        """The padded size of an ``n``-node tree: the smallest bucket >= n, else n itself (eager)."""
        return next((b for b in self.buckets if b >= n), n)


def compile_options(value: "CompileOptions | bool | Mapping[str, Any] | None") -> CompileOptions | None:
    """``True`` -> default options, a mapping -> ``CompileOptions(**mapping)``, ``False``/``None`` -> off."""
    return options_object("compile", value, CompileOptions)


class SlotLayer(StaticLayer):
    """A fixed-capacity key/value layer that writes a forward's ``k`` new entries at slots
    ``start .. start + k - 1``, where ``start`` is a device scalar SHARED by every layer of the cache and
    set once per forward by its owner. ``keys`` / ``values`` are always the whole ``[1, H_kv, capacity, D]``
    slabs (the attention mask hides the unused slots). Lengths live with the owner: ``crop`` does nothing."""

    def __init__(self, max_cache_len: int, start: torch.Tensor) -> None:
        super().__init__(max_cache_len=max_cache_len)
        self.start = start  # [] long, shared

    def allocate(self, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.device = device
        self.batch_size, self.num_heads, self.k_head_dim, self.v_head_dim = 1, num_heads, head_dim, head_dim
        shape = (1, num_heads, self.max_cache_len, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        torch._dynamo.mark_static_address(self.keys)
        torch._dynamo.mark_static_address(self.values)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        k = key_states.shape[-2]
        slots = torch.arange(k, device=self.start.device) + self.start  # [k]
        self.keys.index_copy_(2, slots, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, slots, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_seq_length(self) -> Any:
        return self.start

    def crop(self, tokens_to_remove: int) -> None:
        """Lengths are the owner's (masked slots are never read): nothing to do."""


def _kv_shape(config: Any) -> tuple[int, int]:
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
    return heads, head_dim


@attrs.define
class _Bucket:
    """Persistent static inputs of one bucket size ``b``."""

    ids: torch.Tensor  # [1, b] long
    positions: torch.Tensor  # [1, b] long
    mask: torch.Tensor  # [1, 1, b, capacity] additive
    allowed: torch.Tensor  # [b, b] bool: the tree block's visibility (pads: themselves only)
    eye: torch.Tensor  # [b, b] bool
    ctx: int | None = None  # context the mask was last written for


class StaticVerify:
    """Owns the static cache, the per-bucket buffers and the compiled forward of one target model."""

    def __init__(self, model: torch.nn.Module, options: CompileOptions, max_positions: int) -> None:
        self.model = model
        self.options = options
        self.max_positions = int(max_positions)
        config = model.config
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * int(config.num_hidden_layers)
        if any(t != "full_attention" for t in layer_types):
            raise IncompatibleComponentsError(
                "the compiled verify path needs full attention in every layer; this model has "
                f"{sorted(set(layer_types))}: run it without compile"
            )
        self._heads, self._head_dim = _kv_shape(config)
        cap = options.capacity or min(_DEFAULT_CAPACITY, self.max_positions)
        self.capacity = max(2, min(int(cap), self.max_positions + max(options.buckets)))
        self._cache: DynamicCache | None = None
        self._start: torch.Tensor | None = None
        self._buckets: dict[int, _Bucket] = {}
        self._compiled: Callable[..., Any] | None = None
        self._layers_key: tuple[int, ...] | None = None

    # ------------------------------------------------------------------ cache
    def new_cache(self, device: torch.device, dtype: torch.dtype, need: int) -> DynamicCache:
        """The cache of :class:`SlotLayer` (allocated once, reused by every request) with room for a
        context of ``need`` tokens plus the largest bucket (slots grow by doubling)."""
        room = need + max(self.options.buckets)
        cache = self._cache
        if cache is None or self._start is None or self._start.device != device or cache.layers[0].keys.dtype != dtype:
            while self.capacity < room:
                self.capacity *= 2
            self._start = torch.zeros((), dtype=torch.long, device=device)
            torch._dynamo.mark_static_address(self._start)
            cache = DynamicCache(config=self.model.config)
            cache.layers = [SlotLayer(self.capacity, self._start) for _ in range(int(self.model.config.num_hidden_layers))]
            for layer in cache.layers:
                layer.allocate(self._heads, self._head_dim, dtype, device)
            self._cache = cache
            self._buckets.clear()
        else:
            self.ensure_capacity(room)
        return cache

    def ensure_capacity(self, need: int) -> None:
        """Grow the slabs (copying the filled part) so that ``need`` slots fit; growing recompiles."""
        if need <= self.capacity:
            return
        if self._cache is None:
            raise InvalidInputError("the compiled verify cache is not allocated: prefill first")
        device = self._cache.layers[0].keys.device
        old = self.capacity
        while self.capacity < need:
            self.capacity *= 2
        for layer in self._cache.layers:
            keys, values = layer.keys, layer.values
            layer.max_cache_len = self.capacity
            layer.allocate(self._heads, self._head_dim, keys.dtype, device)
            layer.keys[:, :, :old] = keys
            layer.values[:, :, :old] = values
        self._buckets.clear()

    def set_start(self, start: int) -> None:
        assert self._start is not None
        self._start.fill_(start)  # a scalar write: no host read

    # ------------------------------------------------------------------ verify
    def forward(
        self,
        tokens: torch.Tensor,  # [n] long on the device
        positions: torch.Tensor,  # [n] long on the device
        ancestors: torch.Tensor,  # [n, n] bool on the device
        ctx: int,
        feature_layers: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Verify an ``n``-node tree after ``ctx`` committed tokens -> (logits [n, V], features [n, F] or
        None, slots written = the bucket size)."""
        n = int(tokens.shape[0])
        b = self.options.bucket(n)
        self.ensure_capacity(ctx + b)
        buf = self._bucket(b, tokens.device)
        buf.ids[0, :n].copy_(tokens)
        buf.positions[0, :n].copy_(positions)
        self._write_mask(buf, ancestors, ctx, b)
        self.set_start(ctx)
        run = self._runner(feature_layers) if b in self.options.buckets else _verify_forward
        if run is not _verify_forward and self.options.compile_mode(tokens.device) == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the cache changed outside the graph since the last replay
        logits, feats = run(self.model, buf.ids, buf.positions, buf.mask, self._cache, tuple(feature_layers),
                            cache_kwarg(self.model))
        # a replayed CUDA graph overwrites its outputs at the next replay: keep copies of the real rows
        logits = logits[0, :n].clone()  # [n, V]
        feats = None if feats is None else feats[0, :n].clone()  # [n, F]
        return logits, feats, b

    def _bucket(self, b: int, device: torch.device) -> _Bucket:
        buf = self._buckets.get(b)
        if buf is None:
            dtype = self._cache.layers[0].keys.dtype  # type: ignore[union-attr]
            buf = _Bucket(
                ids=torch.zeros(1, b, dtype=torch.long, device=device),
                positions=torch.zeros(1, b, dtype=torch.long, device=device),
                mask=torch.full((1, 1, b, self.capacity), torch.finfo(dtype).min, dtype=dtype, device=device),
                allowed=torch.zeros(b, b, dtype=torch.bool, device=device),
                eye=torch.eye(b, dtype=torch.bool, device=device),
            )
            for t in (buf.ids, buf.positions, buf.mask):
                torch._dynamo.mark_static_address(t)
            self._buckets[b] = buf
        return buf

    def _write_mask(self, buf: _Bucket, ancestors: torch.Tensor, ctx: int, b: int) -> None:
        """Context [0, ctx) visible, the tree block [ctx, ctx + b) as ``allowed``, later slots masked."""
        n = int(ancestors.shape[0])
        lowest = torch.finfo(buf.mask.dtype).min
        rows = buf.mask[0, 0]  # [b, capacity]
        if buf.ctx is None or ctx < buf.ctx:  # a new request: rewrite the whole buffer
            rows.fill_(lowest)
            rows[:, :ctx] = 0
        else:  # the previous block's columns up to ctx are context now; the rest is rewritten below
            rows[:, buf.ctx : ctx] = 0
        buf.allowed.copy_(buf.eye)
        buf.allowed[:n, :n] = ancestors
        block = rows[:, ctx : ctx + b]  # [b, b]
        block.fill_(lowest)
        block.masked_fill_(buf.allowed, 0)
        buf.ctx = ctx

    def _runner(self, feature_layers: tuple[int, ...]) -> Callable[..., Any]:
        if self._compiled is None:
            import torch._dynamo

            # one graph per bucket (and feature-layer choice): raise dynamo's per-function recompile limit
            need = 2 * len(self.options.buckets) + 8
            cfg = torch._dynamo.config
            for name in ("recompile_limit", "cache_size_limit"):
                if hasattr(cfg, name) and getattr(cfg, name) < need:
                    setattr(cfg, name, need)
            if hasattr(cfg, "accumulated_recompile_limit") and cfg.accumulated_recompile_limit < 4 * need:
                cfg.accumulated_recompile_limit = 4 * need
            device = self._cache.layers[0].keys.device  # type: ignore[union-attr]
            self._compiled = torch.compile(
                _verify_forward, backend=self.options.backend, mode=self.options.compile_mode(device), dynamic=False
            )
        return self._compiled


def _verify_forward(
    model: torch.nn.Module,
    ids: torch.Tensor,  # [1, b]
    positions: torch.Tensor,  # [1, b]
    mask: torch.Tensor,  # [1, 1, b, capacity]
    cache: DynamicCache,
    feature_layers: tuple[int, ...],
    cache_key: str,  # the model's cache keyword (a constant to the compiler)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One target forward over a padded tree -> logits [1, b, V] and features [1, b, F] (or None):
    Hugging Face ``hidden_states[i + 1]`` per requested layer ``i``, like the eager path."""
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        output_hidden_states=bool(feature_layers),
        **{cache_key: cache},
    )
    if not feature_layers:
        return out.logits, None
    return out.logits, torch.cat([out.hidden_states[i + 1] for i in feature_layers], dim=-1)

