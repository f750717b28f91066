"""Locating and reading EAGLE-3 checkpoints: a folder (or hub id) with ``config.json`` and safetensors.

Two weight layouts are read and normalised to one set of names:

- SafeAILab / SpecForge: ``fc.weight``, ``midlayer.*`` (the decoder layer), ``norm.weight``,
  ``lm_head.weight``, ``d2t`` (int64 [draft_vocab]: target id = draft id + d2t[draft id]), ``t2d`` (bool
  [vocab], not needed for drafting) and optionally ``embed_tokens.weight``;
- vLLM's renamed layout: ``layers.0.*`` for ``midlayer.*`` and ``draft_id_to_target_id`` for ``d2t``
  (either may carry a ``model.`` prefix).

Every tensor is checked against ``config.json`` before the network is built: a missing or wrongly shaped
one raises :class:`InvalidFileError` naming the file and the tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from attrs import field, frozen

from bastion.contract.errors import InvalidFileError
from bastion.utils.files import read_json_object, read_safetensors_header, safetensors_files
from bastion.drafters.checkpoints import load_safetensors_file, resolve_checkpoint_folder
from bastion.drafters.eagle3.config import CONFIG_NAME, Eagle3Config

__all__ = ["Eagle3Checkpoint", "resolve_eagle3_dir", "is_eagle3_checkpoint", "load_eagle3_checkpoint", "normalise_name"]

_INDEX_NAME = "model.safetensors.index.json"
#: names whose tensors drafting never reads (dropped after loading)
_UNUSED = ("t2d",)


def resolve_eagle3_dir(path: str | Path, *, config_only: bool = False) -> Path:
    """A local checkpoint folder for ``path``: itself when it is a directory, else a hub snapshot (see
    :func:`bastion.drafters.checkpoints.resolve_checkpoint_folder`)."""
    return resolve_checkpoint_folder(path, "EAGLE-3", config_name=CONFIG_NAME, index_name=_INDEX_NAME, config_only=config_only)


def normalise_name(name: str) -> str:
    """A tensor name of either layout in the SafeAILab spelling (``midlayer.*``, ``d2t``)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.startswith("layers.0."):
        name = "midlayer." + name[len("layers.0.") :]
    if name == "draft_id_to_target_id":
        name = "d2t"
    return name


def _looks_eagle3(data: dict[str, Any], folder: Path | None) -> bool:
    archs = data.get("architectures") or []
    if isinstance(archs, list) and any(isinstance(a, str) and "eagle3" in a.lower() for a in archs):
        return True
    if folder is None or "draft_vocab_size" not in data or "dflash_config" in data:
        return False
    # an EAGLE-3 config under a plain architecture name: recognised by its weights (headers only)
    names = set()
    for path in safetensors_files(folder, index_name=_INDEX_NAME):
        names.update(normalise_name(k) for k in read_safetensors_header(path))
    return "fc.weight" in names and "midlayer.self_attn.q_proj.weight" in names


def is_eagle3_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` (local folder or hub id) holds an EAGLE-3 checkpoint: a ``config.json`` naming an
    ``*Eagle3*`` architecture, or (local folders) one with ``draft_vocab_size`` whose weights hold
    ``fc.weight`` and a decoder layer. Never raises."""
    try:
        folder = resolve_eagle3_dir(path, config_only=True)
        data = read_json_object(folder / CONFIG_NAME)
        return _looks_eagle3(data, folder if Path(path).expanduser().is_dir() else None)
    except Exception:
        return False


@frozen
class Eagle3Checkpoint:
    """A checkpoint read from disk and checked against its config (tensor names normalised)."""

    config: Eagle3Config
    state: dict[str, torch.Tensor] = field(eq=False)  # normalised name -> tensor (t2d dropped)
    files: dict[str, Path] = field(eq=False)  # normalised name -> the file it came from
    folder: Path


def expected_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Normalised tensor name -> shape every EAGLE-3 checkpoint of ``cfg`` holds (``d2t`` and
    ``embed_tokens.weight`` are checked separately: both may be absent)."""
    h, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, cfg.feature_size),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (q, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, q),
        "midlayer.mlp.gate_proj.weight": (inter, h),
        "midlayer.mlp.up_proj.weight": (inter, h),
        "midlayer.mlp.down_proj.weight": (h, inter),
        "norm.weight": (h,),
        "lm_head.weight": (cfg.draft_vocab_size, h),
    }
    if cfg.attention_bias:
        shapes.update(
            {
                "midlayer.self_attn.q_proj.bias": (q,),
                "midlayer.self_attn.k_proj.bias": (kv,),
                "midlayer.self_attn.v_proj.bias": (kv,),
                "midlayer.self_attn.o_proj.bias": (h,),
            }
        )
    if cfg.mlp_bias:
        shapes.update(
            {"midlayer.mlp.gate_proj.bias": (inter,), "midlayer.mlp.up_proj.bias": (inter,), "midlayer.mlp.down_proj.bias": (h,)}
        )
    return shapes


def _check_d2t(cfg: Eagle3Config, state: dict[str, torch.Tensor], files: dict[str, Path], folder: Path) -> None:
    d2t = state.get("d2t")
    if d2t is None:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise InvalidFileError(
                f"{folder}: tensor d2t (or draft_id_to_target_id) is missing; it maps the {cfg.draft_vocab_size} draft "
                f"tokens into the target's {cfg.vocab_size}"
            )
        return
    where = files["d2t"]
    if tuple(d2t.shape) != (cfg.draft_vocab_size,) or d2t.is_floating_point() or d2t.dtype == torch.bool:
        raise InvalidFileError(
            f"{where}: tensor d2t must be an integer tensor of shape ({cfg.draft_vocab_size},) (draft_vocab_size), "
            f"got {d2t.dtype} {tuple(d2t.shape)}"
        )
    target_ids = torch.arange(cfg.draft_vocab_size, dtype=torch.long) + d2t.long()  # [draft_vocab]
    lo, hi = int(target_ids.min()), int(target_ids.max())
    if lo < 0 or hi >= cfg.vocab_size:
        raise InvalidFileError(
            f"{where}: tensor d2t maps draft tokens to target ids in [{lo}, {hi}], outside the vocabulary "
            f"[0, {cfg.vocab_size}) of config.json"
        )
    if int(torch.unique(target_ids).numel()) != cfg.draft_vocab_size:
        raise InvalidFileError(f"{where}: tensor d2t maps two draft tokens to the same target id")


def load_eagle3_checkpoint(path: str | Path) -> Eagle3Checkpoint:
    """Read and check the checkpoint at ``path`` (local folder or hub id)."""
    folder = resolve_eagle3_dir(path)
    cfg = Eagle3Config.from_dict(read_json_object(folder / CONFIG_NAME), folder / CONFIG_NAME)
    paths = safetensors_files(folder, index_name=_INDEX_NAME)
    if not paths:
        raise InvalidFileError(f"{folder}: EAGLE-3 checkpoint has no .safetensors weights")
    state: dict[str, torch.Tensor] = {}
    files: dict[str, Path] = {}
    for file in paths:
        for raw, tensor in load_safetensors_file(file).items():
            name = normalise_name(raw)
            if name.endswith("rotary_emb.inv_freq") or name in _UNUSED:
                continue
            if name in state:
                raise InvalidFileError(f"{file}: tensor {raw} duplicates {name} of {files[name]}")
            state[name], files[name] = tensor, file
    expected = expected_shapes(cfg)
    where = paths[0] if len(paths) == 1 else folder
    missing = [k for k in expected if k not in state]
    if missing:
        raise InvalidFileError(f"{where}: tensor {', '.join(missing)} missing from the EAGLE-3 checkpoint")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            what = ""
            if name == "fc.weight":
                what = f" ([hidden_size, 3 x target_hidden_size {cfg.target_hidden_size}])"
            elif name == "lm_head.weight":
                what = " ([draft_vocab_size, hidden_size])"
            raise InvalidFileError(
                f"{files[name]}: tensor {name} has shape {tuple(state[name].shape)}, config.json gives {shape}{what}"
            )
        if not state[name].is_floating_point():
            raise InvalidFileError(f"{files[name]}: tensor {name} must be floating point, got {state[name].dtype}")
    embed = state.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise InvalidFileError(
            f"{files['embed_tokens.weight']}: tensor embed_tokens.weight has shape {tuple(embed.shape)}, config.json "
            f"gives {(cfg.vocab_size, cfg.hidden_size)} ([vocab_size, hidden_size])"
        )
    _check_d2t(cfg, state, files, folder)
    unexpected = sorted(set(state) - set(expected) - {"d2t", "embed_tokens.weight"})
    if unexpected:
        raise InvalidFileError(f"{files[unexpected[0]]}: unexpected tensor {', '.join(unexpected)} in the EAGLE-3 checkpoint")
    return Eagle3Checkpoint(config=cfg, state=state, files=files, folder=folder)
