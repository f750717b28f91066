"""Hugging Face causal LM as a bastion :class:`~bastion.contract.target.Target`.

The adapter owns one ``DynamicCache`` of committed tokens whose layers are preallocated and filled in
place (:mod:`bastion.huggingface.kv_slab`). A tree forward appends all ``n`` tree nodes
to that cache under a 4D attention mask (context fully visible, tree part ancestor-only) with positions
``context_len + depth``; :meth:`HFTarget.commit` then moves the ``m`` accepted entries into the slots right
after the context and drops the rest. Only ``m`` entries per layer move, so the commit cost does not grow
with the context length.
"""

from __future__ import annotations

from pathlib import Path
import importlib.util
from typing import Any, Iterable, Mapping, Union

import torch

from bastion.huggingface.batched import HFTargetBatch
from bastion.utils.checks import check_device
from bastion.huggingface.compiled_verify import CompileOptions, StaticVerify, compile_options
from bastion.utils.dtypes import auto_dtype, parse_dtype
from bastion.contract.errors import IncompatibleComponentsError, InvalidFileError, InvalidInputError
from bastion.utils.files import FLOAT_DTYPES, TensorInfo, check_weights_folder, float_weight_error, read_json_object
from bastion.huggingface.configs import check_model_size, physical_memory
from bastion.huggingface.compat import cache_kwargs
from bastion.huggingface.kv_slab import slab_cache
from bastion.contract.target import Target
from bastion.contract.tree import Tree
from bastion.contract.types import TargetOutput

__all__ = [
    "HFTarget",
    "SUPPORTED_ATTENTION",
    "DeviceMap",
    "compute_in_auto_dtype",
    "single_device",
    "require_accelerate",
    "load_checked_causal_lm",
    "check_finite_weights",
]

#: a Hugging Face ``device_map``: a strategy name, one device, or module name -> device
DeviceMap = Union[str, int, torch.device, Mapping[str, Union[str, int, torch.device]]]

_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")

#: attention implementations that honour a custom 4D (additive) attention mask
SUPPORTED_ATTENTION: tuple[str, ...] = ("sdpa", "eager")

_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _check_attention(impl: str | None) -> str:
    impl = impl or "eager"
    if impl not in SUPPORTED_ATTENTION:
        raise IncompatibleComponentsError(
            f"attention implementation {impl!r} cannot take the custom tree attention mask that tree "
            f"verification needs; use one of {list(SUPPORTED_ATTENTION)} (attn_implementation='sdpa')"
        )
    return impl


def _as_device(value: str | int | torch.device) -> torch.device:
    if isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    try:
        return torch.device(value)
    except (RuntimeError, TypeError):
        raise InvalidInputError(
            f"device_map entry {value!r} is not a device; use a device name (cpu, cuda:0), a GPU index or one of {list(_STRATEGIES)}"
        ) from None


def single_device(device_map: DeviceMap) -> torch.device | None:
    """The one device ``device_map`` places the whole model on, or None when it spreads it (a strategy
    such as ``"auto"``, or a dict naming several devices, ``"disk"`` included)."""
    if isinstance(device_map, str) and device_map in _STRATEGIES:
        return None
    if isinstance(device_map, Mapping):
        if not device_map:
            raise InvalidInputError("device_map is an empty dict; map module names to devices, e.g. {'': 'cuda:0'}")
        values = {str(v) if not isinstance(v, int) else f"cuda:{v}" for v in device_map.values()}
        if len(values) > 1 or "disk" in values:
            return None
        return _as_device(next(iter(device_map.values())))
    return _as_device(device_map)


def require_accelerate(device_map: DeviceMap) -> None:
    """Raise a clear error when ``device_map`` needs the optional ``accelerate`` package and it is missing."""
    if importlib.util.find_spec("accelerate") is None:
        raise IncompatibleComponentsError(
            f"device_map={device_map!r} places the target over several devices through Hugging Face accelerate, "
            "which is not installed: pip install 'bastion[multi-device]' (or pip install accelerate)"
        )


def _as_ids(value: Any) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, Iterable):
        return {int(v) for v in value if v is not None}
    return set()


#: the attribute of a Hugging Face model that holds its feature hooks (:class:`_LayerTap`)
_TAP_ATTR = "_bastion_feature_tap"


class _LayerTap:
    """Forward hooks that keep the outputs of the requested decoder layers while armed.

    ``final_norm``: the module whose output stands for the last layer (Hugging Face reports the
    final-norm output as the last hidden state), or None to tap the last layer itself. The hooks stay
    registered between forwards (registering and removing them on every step cost more than asking
    Hugging Face for every hidden state); disarmed, each returns at once. Hooks and tap are plain
    objects, so a model that carries them still pickles and deep-copies (the copy's hooks feed the
    copy's tap)."""

    def __init__(self, layers: torch.nn.ModuleList, layer_ids: tuple[int, ...], final_norm: torch.nn.Module | None = None) -> None:
        self.layer_ids = layer_ids
        self.final_norm = final_norm
        self.outputs: dict[int, torch.Tensor] = {}
        self.armed = False
        last = len(layers) - 1
        modules = {i: (final_norm if i == last and final_norm is not None else layers[i]) for i in set(layer_ids)}
        self._handles = [modules[i].register_forward_hook(_Keep(self, i)) for i in sorted(modules)]

    def arm(self) -> None:
        self.outputs = {}
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def take(self) -> dict[int, torch.Tensor]:
        """The outputs kept by the last armed forward; the tap holds none after (no tensor outlives its use)."""
        out, self.outputs = self.outputs, {}
        return out

    def close(self) -> None:
        self.armed = False
        self.outputs = {}
        for h in self._handles:
            h.remove()
        self._handles = []


class _Keep:
    """The forward hook of one tapped module: while its tap is armed, keep the module's output."""

    __slots__ = ("tap", "index")

    def __init__(self, tap: _LayerTap, index: int) -> None:
        self.tap, self.index = tap, index

    def __call__(self, _module: torch.nn.Module, _args: Any, output: Any) -> None:
        if self.tap.armed:
            self.tap.outputs[self.index] = output[0] if isinstance(output, tuple) else output  # [B, n, H]


class HFTarget(Target):
    """Any ``AutoModelForCausalLM`` (batch size 1) as the verifying target model.

    ``features`` are the concatenation, in the requested order, of Hugging Face ``hidden_states[i + 1]``
    for each requested layer id ``i`` (the output of decoder layer ``i``; for the last layer, Hugging Face
    reports the final-norm output, and so does this adapter).
    """

    def __init__(self, model: Any, *, compile: CompileOptions | bool | dict[str, Any] | None = None) -> None:
        try:
            import transformers  # noqa: F401
        except ImportError as exc:  # pragma: no cover - transformers is a hard dependency
            raise ImportError("HFTarget needs the 'transformers' package") from exc
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise InvalidInputError(f"HFTarget wraps a Hugging Face causal LM, got {type(model).__name__}")
        self.attn_implementation = _check_attention(getattr(model.config, "_attn_implementation", None))
        self.model = model.eval()
        self._base = model.base_model
        self._layers = getattr(self._base, "layers", None)
        if not isinstance(self._layers, torch.nn.ModuleList):
            raise IncompatibleComponentsError(
                f"{type(model).__name__}: cannot find its decoder layers (expected a ModuleList at .layers)"
            )
        norm = getattr(self._base, "norm", None)
        self._final_norm: torch.nn.Module | None = norm if isinstance(norm, torch.nn.Module) else None
        cfg = model.config
        self._max_positions = next((int(getattr(cfg, k)) for k in _POSITION_KEYS if getattr(cfg, k, None)), 0)
        if self._max_positions < 2:
            raise IncompatibleComponentsError(
                f"{type(model).__name__}: the config gives no maximum position count ({', '.join(_POSITION_KEYS)})"
            )
        self._eos = frozenset(_as_ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None)) | _as_ids(cfg.eos_token_id))
        self._vocab = int(model.get_output_embeddings().weight.shape[0])
        self._cache: Any = None
        self._ctx = 0  # committed tokens in the cache
        self._pending = 0  # uncommitted tree nodes at the cache tail
        self._mask_buf: torch.Tensor | None = None  # [1, 1, rows, cols] persistent tree mask (see _tree_mask)
        self._mask_block: tuple[int, int, int] | None = None  # (rows, first col, end col) written last
        self._static: StaticVerify | None = None  # the opt-in compiled verify path (see compile_verify)
        self._layers_ok: tuple[int, ...] | None = None  # the last feature-layer tuple found valid
        self.compile_verify(compile)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        path_or_id: str | Path,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        attn_implementation: str = "sdpa",
        device_map: DeviceMap | None = None,
        compile: CompileOptions | bool | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> "HFTarget":
        """Load a causal LM from a local directory or a hub id (no remote code). ``device_map`` places it
        through Hugging Face / accelerate instead of ``device`` (``"auto"``, ``"balanced"``,
        ``"sequential"`` or a module-to-device dict): a map naming one device needs nothing more, a map
        over several devices needs the ``accelerate`` package. ``compile`` switches on the compiled
        verify path (see :meth:`compile_verify`; off by default).

        ``dtype="auto"`` keeps the checkpoint's dtype, except a float16 checkpoint placed on a CPU, which
        computes in float32 (see :func:`bastion.utils.dtypes.auto_dtype`; logged on ``bastion.dtype``); a
        dtype named here is used as it is."""
        _check_attention(attn_implementation)
        device = check_device(device)
        dtype = parse_dtype(dtype, allow_auto=True) or "auto"  # any name bastion accepts ("bf16", "fp32", ...)
        from transformers import AutoModelForCausalLM

        single = device if device_map is None else single_device(device_map)
        if single is not None:
            single = check_device(single)
        else:
            require_accelerate(device_map)
            kwargs["device_map"] = device_map
        model = load_checked_causal_lm(
            path_or_id, "the target model", dtype=dtype, attn_implementation=attn_implementation,
            memory_bound=single is not None, **kwargs,
        )
        if single is None:
            check_finite_weights(model, path_or_id)
            return cls(model, compile=compile)
        model = model.to(single)
        if dtype == "auto":
            model = compute_in_auto_dtype(model, single, f"target {str(path_or_id)!r}")
        check_finite_weights(model, path_or_id)
        return cls(model, compile=compile)

    def compile_verify(self, options: CompileOptions | bool | dict[str, Any] | None = True) -> CompileOptions | None:
        """Switch the compiled verify path on (``True``, a mapping of :class:`CompileOptions` fields, or
        options) or off (``False`` / ``None``); returns the options in force. Verify forwards then run on
        a fixed-capacity cache with trees padded to bucket sizes, through ``torch.compile`` (and CUDA
        graphs per bucket on CUDA). Off by default: measure it first (``benchmarks/device_check.py``).
        Takes effect from the next prefill."""
        opts = compile_options(options)
        if opts is None:
            self._static = None
        else:
            if single_device_of(self.model) is None:
                raise IncompatibleComponentsError("the compiled verify path needs the whole target on one device")
            self._static = StaticVerify(self.model, opts, self._max_positions)
        self.reset()
        return opts

    @property
    def compiled(self) -> CompileOptions | None:
        """The compiled verify path's options, or None when verify runs eagerly (the default)."""
        return None if self._static is None else self._static.options

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.get_output_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.get_output_embeddings().weight.dtype

    @property
    def max_positions(self) -> int:
        return self._max_positions

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def context_len(self) -> int:
        return self._ctx

    @property
    def cache(self) -> Any:
        """The underlying ``DynamicCache`` (read-only use: tests and benchmarks inspect it)."""
        return self._cache

    def feature_device(self, feature_layers: tuple[int, ...] = ()) -> torch.device:
        if not feature_layers:
            return self.device
        layer = self._layers[max(int(i) for i in feature_layers)]
        return next((p.device for p in layer.parameters()), self.device)

    def input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def output_head(self) -> torch.nn.Module:
        return self.model.get_output_embeddings()

    # ------------------------------------------------------------------ decoding
    def reset(self) -> None:
        self._cache = None
        self._ctx = 0
        self._pending = 0

    @torch.inference_mode()
    def prefill(
        self, input_ids: torch.Tensor, feature_layers: tuple[int, ...] = (), *, all_logits: bool = False
    ) -> TargetOutput:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise InvalidInputError(
                f"input_ids must be a LongTensor [1, L], got {getattr(input_ids, 'shape', type(input_ids).__name__)}"
            )
        length = int(input_ids.shape[1])
        if length < 1:
            raise InvalidInputError("input_ids is empty: the prompt needs at least one token")
        if length > self._max_positions:
            raise InvalidInputError(f"prompt has {length} tokens; the target accepts at most {self._max_positions} positions")
        self.reset()
        if self._static is None:
            cache = slab_cache(self.model.config)  # preallocated: a step copies only its own new entries
        else:  # fixed-capacity slots written from slot 0
            cache = self._static.new_cache(self.device, self.dtype, length)
            self._static.set_start(0)
        ids = input_ids.to(self.device, torch.long)
        # decoding needs only the last position's logits: [L, V] for a long prompt on a large vocabulary
        # would be gigabytes (9.7 GB at 32k tokens on 152k), so the head runs on the last position only
        logits, features = self._forward(ids, None, None, cache, feature_layers, logits_to_keep=0 if all_logits else 1)
        self._cache = cache
        self._ctx = length
        return TargetOutput(logits=logits, features=features)

    @torch.inference_mode()
    def forward_tree(self, tree: Tree, feature_layers: tuple[int, ...] = ()) -> TargetOutput:
        if self._cache is None:
            raise InvalidInputError("forward_tree() needs a prefilled context; call prefill() first")
        self._drop_pending()
        n, ctx = len(tree), self._ctx
        if ctx + tree.max_depth >= self._max_positions:  # deepest node sits at position ctx + depth
            raise InvalidInputError(
                f"tree of depth {tree.max_depth} after {ctx} committed tokens exceeds the target's "
                f"{self._max_positions} positions"
            )
        dev = self.device
        tokens = tree.tokens.to(dev)  # [n]
        positions = tree.position_ids(ctx).to(dev)[None]  # [1, n]
        if self._static is not None:
            self._check_layers(feature_layers)
            logits, features, _slots = self._static.forward(tokens, positions[0], tree.ancestor_mask().to(dev), ctx, tuple(feature_layers))
            self._pending = n
            return TargetOutput(logits=logits, features=features)
        # a lone root (a plain step) sees the whole context: the model's own causal mask says exactly that
        mask = None if n == 1 else self._tree_mask(tree.ancestor_mask().to(dev), ctx)  # [1, 1, n, ctx + n]
        logits, features = self._forward(tokens[None], mask, positions, self._cache, feature_layers)
        self._pending = n
        return TargetOutput(logits=logits, features=features)

    @torch.inference_mode()
    def commit(self, accepted_nodes: torch.Tensor) -> None:
        """Keep the cache entries of ``accepted_nodes`` [m] (root first, increasing node order) right after
        the context and drop every other tree node. Moves m entries per layer, never the whole cache."""
        if self._pending == 0:
            raise InvalidInputError("commit() without a pending tree: call forward_tree() first")
        nodes = torch.as_tensor(accepted_nodes, dtype=torch.long)
        m, n, ctx = int(nodes.numel()), self._pending, self._ctx
        if nodes.dim() != 1 or not 1 <= m <= n:
            raise InvalidInputError(f"accepted_nodes must be a 1-D tensor of 1..{n} node indices, got shape {tuple(nodes.shape)}")
        if nodes.device.type == "cpu":  # host indices: check them for free, skip the move when already in place
            if int(nodes[0]) != 0 or (m > 1 and not bool((nodes[1:] > nodes[:-1]).all())) or int(nodes[-1]) >= n:
                raise InvalidInputError(f"accepted_nodes must start at the root (0) and increase below {n}, got {nodes.tolist()}")
            in_place = int(nodes[-1]) == m - 1  # the path is nodes 0..m-1 (a chain prefix): nothing moves
        else:
            in_place = False
        if not in_place and m > 1:
            src_on: dict[torch.device, torch.Tensor] = {}  # [m - 1] cache slots of the accepted nodes, per device
            for keys, values in self._layer_tensors():
                src = src_on.get(keys.device)
                if src is None:
                    src = src_on[keys.device] = nodes[1:].to(keys.device) + ctx
                # keys / values: [1, H_kv, ctx + n, D]; gather m - 1 rows first, then write them in place
                keys[:, :, ctx + 1 : ctx + m] = keys.index_select(2, src)
                values[:, :, ctx + 1 : ctx + m] = values.index_select(2, src)
        if n > m:
            self._cache.crop(-(n - m))  # slices the tail off; no copy
        self._ctx = ctx + m
        self._pending = 0

    # ------------------------------------------------------------------ internals
    def _drop_pending(self) -> None:
        if self._pending:
            self._cache.crop(-self._pending)
            self._pending = 0

    def _layer_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(layer.keys, layer.values) for layer in self._cache.layers]

    def open_batch(self, prompts: Any, feature_layers: tuple[int, ...] = ()) -> Any:
        state = HFTargetBatch(self)
        return state, state.prefill(prompts, feature_layers)

    def _tree_mask(self, ancestors: torch.Tensor, ctx: int) -> torch.Tensor:
        """Additive float mask [1, 1, n, ctx + n]: 0 where attention is allowed, dtype-min elsewhere (the
        context is fully visible; inside the tree each node sees itself and its ancestors).

        A view of one persistent buffer whose rows are padded to a multiple of 64 columns (aligned for
        attention kernels): each step clears the previous step's tree block and writes its own, so no
        step allocates or fills an [n, ctx + n] mask."""
        n = int(ancestors.shape[0])
        buf = self._mask_buf
        if buf is None or buf.shape[2] < n or buf.shape[3] < ctx + n or buf.dtype != self.dtype or buf.device != ancestors.device:
            rows = _round_up(max(n, 64 if buf is None else buf.shape[2]), 64)
            cols = _round_up(max(ctx + n, 2 * (0 if buf is None else buf.shape[3])), 64)
            buf = torch.zeros(1, 1, rows, cols, dtype=self.dtype, device=ancestors.device)
            self._mask_buf, self._mask_block = buf, None
        elif self._mask_block is not None:  # the previous tree block is context (or unused) now: visible
            rows_prev, lo, hi = self._mask_block
            buf[0, 0, :rows_prev, lo:hi] = 0
        block = buf[0, 0, :n, ctx : ctx + n]  # [n, n]
        block.zero_()
        block.masked_fill_(~ancestors, torch.finfo(self.dtype).min)
        self._mask_block = (n, ctx, ctx + n)
        return buf[:, :, :n, : ctx + n]

    def _forward(
        self,
        ids: torch.Tensor,  # [1, n]
        mask: torch.Tensor | None,  # [1, 1, n, ctx + n] or None (plain causal prefill)
        positions: torch.Tensor | None,  # [1, n]
        cache: Any,
        feature_layers: tuple[int, ...],
        logits_to_keep: int = 0,  # 0: every position; k: the last k positions
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits, features = self.forward_rows(ids, mask, positions, cache, feature_layers, logits_to_keep)
        return logits[0], None if features is None else features[0]  # [n, V], [n, F]

    def _check_layers(self, feature_layers: tuple[int, ...]) -> tuple[int, ...]:
        if not feature_layers:
            return ()
        if feature_layers is self._layers_ok:  # the drafter's own tuple, checked at an earlier step
            return feature_layers
        layers = tuple(int(i) for i in feature_layers)
        n_layers = len(self._layers)
        bad = [i for i in layers if not 0 <= i < n_layers]
        if bad:
            raise IncompatibleComponentsError(f"feature layer ids {bad} out of range: the target has {n_layers} layers")
        if isinstance(feature_layers, tuple) and layers == feature_layers:
            self._layers_ok = feature_layers
        return layers

    def _tap_for(self, layers: tuple[int, ...]) -> _LayerTap:
        """The persistent hooks for ``layers`` (replacing those of another layer set). They belong to the
        model, not to this adapter, so every target over one model shares one set."""
        tap = getattr(self.model, _TAP_ATTR, None)
        if tap is None or tap.layer_ids != layers or tap.final_norm is not self._final_norm:
            if tap is not None:
                tap.close()
            tap = _LayerTap(self._layers, layers, self._final_norm)
            object.__setattr__(self.model, _TAP_ATTR, tap)  # a plain attribute, not a registered submodule
        return tap

    def forward_rows(
        self,
        ids: torch.Tensor,  # [B, n]
        mask: torch.Tensor | None,  # [B, 1, n, S + n] additive, or None (plain causal)
        positions: torch.Tensor | None,  # [B, n]
        cache: Any,
        feature_layers: tuple[int, ...],
        logits_to_keep: torch.Tensor | int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One model forward over a batch of rows -> logits [B, n', V] (``n'`` = n, or the kept
        positions) and features [B, n, F] (or None). Used by the batched state."""
        layers = self._check_layers(feature_layers)
        last = len(self._layers) - 1
        # the last layer's HF hidden state is the final-norm output: tap the final norm for it, or, in a
        # model without one at ``.norm``, ask HF for every hidden state (slower: it keeps them all)
        want_all = last in layers and self._final_norm is None
        tap = self._tap_for(layers) if layers and not want_all else None
        if tap is not None:
            tap.arm()
        try:
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                **cache_kwargs(self.model, cache),
                output_hidden_states=want_all,
                logits_to_keep=logits_to_keep,
            )
        finally:
            if tap is not None:
                tap.disarm()
        logits = out.logits  # [B, n, V]
        if not layers:
            return logits, None
        if want_all:
            feats = [out.hidden_states[i + 1] for i in layers]  # each [B, n, H]
        else:
            kept = tap.take()
            feats = [kept[i] for i in layers]
        return logits, torch.cat(feats, dim=-1)  # [B, n, F]


def compute_in_auto_dtype(model: Any, device: torch.device | str, what: str) -> Any:
    """``model`` (a Hugging Face model loaded with dtype ``auto``) cast to the dtype ``auto`` computes in
    on ``device`` (:func:`bastion.utils.dtypes.auto_dtype`), its config saying so; the choice is logged
    naming ``what``. Unchanged when the stored dtype stays."""
    choice = auto_dtype(model.dtype, device)
    if choice.dtype is None:
        return model
    model = model.to(choice.dtype)
    model.config.dtype = choice.dtype
    choice.log(what)
    return model


def single_device_of(model: torch.nn.Module) -> torch.device | None:
    """The one device all of ``model``'s parameters live on, or None when they are spread."""
    devices = {p.device for p in model.parameters()}
    return next(iter(devices)) if len(devices) == 1 else None


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


# ---------------------------------------------------------------------------------------------- checked loading
_DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def _bytes_per_param(dtype: Any, raw: Mapping[str, Any], headers: Mapping[str, tuple[Path, TensorInfo]]) -> int:
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    stated = str(raw.get("dtype") or raw.get("torch_dtype") or "").replace("torch.", "")
    if stated in _DTYPE_BYTES:
        return _DTYPE_BYTES[stated]
    if headers:
        return {"F64": 8, "F32": 4}.get(next(iter(headers.values()))[1].dtype, 2)
    return 4


def _weights_name(headers: Mapping[str, tuple[Path, TensorInfo]], folder: Path) -> str:
    files = sorted({str(path) for path, _ in headers.values()})
    return ", ".join(files) if files else str(folder)


def _lookup(headers: Mapping[str, tuple[Path, TensorInfo]], name: str, prefix: str) -> tuple[str, Path, TensorInfo] | None:
    """The header entry of the model tensor ``name`` (Hugging Face may add or drop the base model prefix)."""
    for key in (name, f"{prefix}.{name}", name[len(prefix) + 1 :] if name.startswith(prefix + ".") else None):
        if key and key in headers:
            return (key, *headers[key])
    return None


def load_checked_causal_lm(path_or_id: str | Path, what: str, *, memory_bound: bool = True, **kwargs: Any) -> Any:
    """``AutoModelForCausalLM.from_pretrained(path_or_id, **kwargs)``, complete or refused.

    Before anything is built, a local folder's ``config.json`` sizes must be ints >= 1 and describe a model
    no larger than its weights (and, with ``memory_bound``, than this machine's memory); a DFlash drafter
    folder is refused. After loading, a tensor the model needs but the files lack (a tied head is not
    needed), a tensor the model does not have, a shape mismatch, and a floating weight stored as integers
    or bools raise :class:`InvalidFileError` naming the file and the tensor: none of them is ever
    initialised at random or cast. Other load failures raise :class:`InvalidInputError` naming ``what``."""
    from transformers import AutoModelForCausalLM

    folder = Path(path_or_id).expanduser()
    headers: dict[str, tuple[Path, TensorInfo]] = {}
    raw: dict[str, Any] = {}
    if folder.is_dir():
        headers = check_weights_folder(folder)  # broken files are named before HF reads them
        config_path = folder / "config.json"
        if config_path.is_file():
            raw = read_json_object(config_path)
            if isinstance(raw.get("dflash_config"), dict):
                raise InvalidFileError(
                    f"{config_path}: a DFlash drafter checkpoint (it has a dflash_config section), not a causal LM; "
                    "load it as a drafter: registry.create('drafter', 'dflash', checkpoint=...)"
                )
            check_model_size(
                raw,
                config_path,
                stored={k: info.shape for k, (_, info) in headers.items()} if headers else None,
                bytes_per_param=_bytes_per_param(kwargs.get("dtype"), raw, headers),
                limit_bytes=physical_memory() if memory_bound else None,
            )
    kwargs.setdefault("ignore_mismatched_sizes", True)  # mismatches come back in the loading info, refused below
    try:
        model, info = AutoModelForCausalLM.from_pretrained(str(path_or_id), output_loading_info=True, **kwargs)
    except MemoryError:
        raise
    except Exception as exc:  # missing files, unknown model types, bad hub ids, configs HF cannot build
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")
        raise InvalidInputError(f"cannot load {what} {str(path_or_id)!r}: {type(exc).__name__}: {first}") from exc
    check_loading_info(model, info, folder if folder.is_dir() else path_or_id, headers)
    return model


def check_loading_info(model: Any, info: Mapping[str, Any], source: Any, headers: Mapping[str, tuple[Path, TensorInfo]]) -> None:
    """Refuse what Hugging Face's loading report (``output_loading_info=True``) lists, and floating weights
    stored as integers or bools (read from ``headers``), as :class:`InvalidFileError` naming file and tensor."""
    where = _weights_name(headers, Path(str(source)))
    prefix = str(getattr(model, "base_model_prefix", "") or "model")
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda k: str(k[0]))
    if mismatched:
        key, stored, wanted = (list(mismatched[0]) + [None, None])[:3]
        hit = _lookup(headers, str(key), prefix)
        raise InvalidFileError(
            f"{hit[1] if hit else where}: tensor {key!r} has shape {tuple(stored) if stored else '?'} but the "
            f"config gives {tuple(wanted) if wanted else '?'}"
            + (f" ({len(mismatched) - 1} more mismatched)" if len(mismatched) > 1 else "")
        )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise InvalidFileError(
            f"{where}: lacks tensor{'s' if len(missing) > 1 else ''} {', '.join(repr(k) for k in missing[:5])}"
            + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            + " that the model needs; refused rather than initialised at random"
        )
    unexpected = sorted(info.get("unexpected_keys") or ())
    if unexpected:
        hit = _lookup(headers, unexpected[0], prefix)
        raise InvalidFileError(
            f"{hit[1] if hit else where}: holds tensor{'s' if len(unexpected) > 1 else ''} "
            f"{', '.join(repr(k) for k in unexpected[:5])} that the model does not have (another architecture, or "
            "a config that does not match the weights)"
        )
    if headers:
        state = model.state_dict()
        for name, (path, tinfo) in headers.items():
            if tinfo.dtype in FLOAT_DTYPES:
                continue
            for key in (name, f"{prefix}.{name}", name[len(prefix) + 1 :] if name.startswith(prefix + ".") else ""):
                tensor = state.get(key)
                if tensor is not None and tensor.is_floating_point():
                    raise float_weight_error(path, name, tinfo)


def check_finite_weights(model: torch.nn.Module, source: Any, *, chunk: int = 1 << 24) -> None:
    """Every floating parameter of ``model`` must be finite; a NaN or infinite weight raises
    :class:`InvalidFileError` naming ``source`` (and the file, for a local folder) and the tensor, so a
    broken target is blamed at load instead of its drafter at the first step. One pass over the weights
    on their device, in chunks of ``chunk`` elements, with one host sync per device."""
    flags: dict[torch.device, torch.Tensor] = {}
    params = [(n, p) for n, p in model.named_parameters() if p.is_floating_point() and p.device.type != "meta"]
    with torch.no_grad():
        for _, p in params:
            flag = flags.get(p.device)
            for part in p.detach().reshape(-1).split(chunk):
                bad = ~torch.isfinite(part).all()
                flag = bad if flag is None else flag | bad
            flags[p.device] = flag
        if not any(bool(f) for f in flags.values() if f is not None):
            return
        for name, p in params:
            if not bool(torch.isfinite(p.detach()).all()):
                folder = Path(str(source)).expanduser()
                where = str(source)
                if folder.is_dir():
                    headers = check_weights_folder(folder)
                    hit = _lookup(headers, name, str(getattr(model, "base_model_prefix", "") or "model"))
                    where = str(hit[1]) if hit else _weights_name(headers, folder)
                raise InvalidFileError(f"{where}: tensor {name!r} holds NaN or infinite values; the model cannot decode")
