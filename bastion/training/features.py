"""Target features for drafter training: computed online from the frozen target, or read from disk.

The drafter reads the concatenated outputs of target layers ``target_layer_ids`` for every position of
a training sequence (``[1, L, F]``, ``F = len(layer_ids) * hidden``). Two sources give the same tensor:

- :class:`OnlineFeatures` runs the frozen target once per sequence per step (no disk, target forward
  every step);
- :class:`FeatureStore` holds them precomputed (``bastion train features``): one flat memory-mapped
  array ``[total tokens, F]`` in the target's dtype plus per-sequence offsets, written once (by every
  rank, each its share of the sequences, resumable through a per-sequence ``done`` flag) and then read
  without any target forward.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import torch
from tqdm import tqdm

from bastion.utils.dtypes import dtype_name as core_dtype_name
from bastion.contract.errors import InvalidFileError, InvalidInputError
from bastion.utils.files import read_json_object
from bastion.distributed import DistContext, barrier
from bastion.training.distill import DistillSequence

__all__ = ["FeatureSource", "OnlineFeatures", "FeatureStore", "target_features", "write_features"]

META = "features.json"
DATA = "features.bin"
DONE = "done.bin"

#: numpy storage for each feature dtype (bfloat16 is kept bit for bit as int16)
_STORAGE = {"float32": np.float32, "float16": np.float16, "bfloat16": np.int16}


class FeatureSource(Protocol):
    """Features ``[1, L, F]`` of the sequence at ``index`` of the distilled data."""

    def features(self, index: int, seq: DistillSequence, device: torch.device) -> torch.Tensor: ...


@torch.no_grad()
def target_features(target, ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """Features of every position of ``ids`` [L]: concatenated decoder-layer outputs -> [1, L, F]."""
    device = target.get_input_embeddings().weight.device
    out = target(input_ids=ids[None].to(device, non_blocking=True), output_hidden_states=True, use_cache=False)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


class OnlineFeatures:
    """One frozen-target forward per sequence, every time it is drawn."""

    def __init__(self, target, layer_ids: Sequence[int]) -> None:
        self.target = target
        self.layer_ids = tuple(layer_ids)

    def features(self, index: int, seq: DistillSequence, device: torch.device) -> torch.Tensor:
        return target_features(self.target, seq.ids, self.layer_ids).to(device)


def _dtype_name(dtype: torch.dtype) -> str:
    try:
        name = core_dtype_name(dtype)
    except InvalidInputError:
        name = str(dtype)
    if name not in _STORAGE:
        raise InvalidInputError(f"features of dtype {name} cannot be stored; use float32, float16 or bfloat16")
    return name


class FeatureStore:
    """Precomputed features on disk (see the module doc)."""

    def __init__(self, directory: Path, meta: dict) -> None:
        self.directory = Path(directory)
        self.meta = meta
        self.layer_ids = tuple(int(i) for i in meta["layer_ids"])
        self.width = int(meta["width"])
        self.offsets = [int(o) for o in meta["offsets"]]  # len = sequences + 1
        self.dtype = str(meta["dtype"])
        total = self.offsets[-1]
        self._data = np.memmap(self.directory / DATA, dtype=_STORAGE[self.dtype], mode="r", shape=(max(total, 1), self.width))

    @classmethod
    def open(cls, directory: Path, *, layer_ids: Sequence[int] | None = None, sequences: int | None = None) -> "FeatureStore":
        directory = Path(directory)
        if not (directory / META).is_file():
            raise InvalidInputError(f"{directory} holds no precomputed features (run `bastion train features`)")
        meta = _checked_meta(directory)
        try:
            done = np.fromfile(directory / DONE, dtype=np.uint8)
        except OSError as exc:
            raise InvalidFileError(f"{directory / DONE}: cannot read it ({exc})") from exc
        if len(done) != len(meta["offsets"]) - 1:
            raise InvalidFileError(f"{directory / DONE}: {len(done)} entries for {len(meta['offsets']) - 1} sequences; re-run `bastion train features`")
        if not done.all():
            raise InvalidInputError(f"{directory}: features of {int((done == 0).sum())} sequences are missing; re-run `bastion train features`")
        store = cls(directory, meta)
        if layer_ids is not None and tuple(layer_ids) != store.layer_ids:
            raise InvalidInputError(f"{directory} holds features of target layers {list(store.layer_ids)}, the drafter reads {list(layer_ids)}")
        if sequences is not None and sequences != len(store.offsets) - 1:
            raise InvalidInputError(f"{directory} holds features of {len(store.offsets) - 1} sequences, the data has {sequences}")
        return store

    def features(self, index: int, seq: DistillSequence, device: torch.device) -> torch.Tensor:
        lo, hi = self.offsets[index], self.offsets[index + 1]
        if hi - lo != len(seq.ids):
            raise InvalidInputError(f"stored features of sequence {index} cover {hi - lo} tokens, the sequence has {len(seq.ids)}")
        t = torch.from_numpy(np.array(self._data[lo:hi]))
        if self.dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        return t[None].to(device)  # [1, L, F]


def write_features(
    target, seqs: Sequence[DistillSequence], layer_ids: Sequence[int], out_dir: Path, ctx: DistContext = DistContext()
) -> FeatureStore:
    """Compute and store the features of every sequence (resumable; rank r writes sequences r, r + W, ...)."""
    out_dir = Path(out_dir)
    layer_ids = tuple(int(i) for i in layer_ids)
    hidden = int(target.config.hidden_size)
    dtype = _dtype_name(target.get_input_embeddings().weight.dtype)
    offsets = np.concatenate([[0], np.cumsum([len(s.ids) for s in seqs])]).tolist()
    meta = {"layer_ids": list(layer_ids), "width": hidden * len(layer_ids), "dtype": dtype, "offsets": offsets}
    if ctx.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        old = json.loads((out_dir / META).read_text()) if (out_dir / META).is_file() else None
        if old != meta:  # a fresh store (or one for other data / layers): start over
            np.memmap(out_dir / DATA, dtype=_STORAGE[dtype], mode="w+", shape=(max(offsets[-1], 1), meta["width"])).flush()
            np.zeros(len(seqs), dtype=np.uint8).tofile(out_dir / DONE)
            (out_dir / META).write_text(json.dumps(meta))
    barrier(ctx)
    data = np.memmap(out_dir / DATA, dtype=_STORAGE[dtype], mode="r+", shape=(max(offsets[-1], 1), meta["width"]))
    done = np.memmap(out_dir / DONE, dtype=np.uint8, mode="r+", shape=(len(seqs),))
    mine = [i for i in range(ctx.rank, len(seqs), ctx.world_size) if not done[i]]
    for i in tqdm(mine, desc="features", mininterval=10.0, disable=not ctx.is_main):
        feats = target_features(target, seqs[i].ids, layer_ids)[0].cpu()  # [L, F]
        if dtype == "bfloat16":
            feats = feats.view(torch.int16)
        data[offsets[i] : offsets[i + 1]] = feats.numpy()
        data.flush()  # the features reach the file before the flag that says so
        done[i] = 1
        done.flush()
    del data, done
    barrier(ctx)
    return FeatureStore.open(out_dir, layer_ids=layer_ids, sequences=len(seqs))


def _checked_meta(directory: Path) -> dict[str, Any]:
    """``features.json`` of a feature folder, checked field by field, and the data file's size checked
    against it: a corrupt or truncated folder raises :class:`InvalidFileError` naming the file."""
    path = directory / META
    meta = read_json_object(path)
    offsets = meta.get("offsets")
    if not isinstance(meta.get("dtype"), str) or meta["dtype"] not in _STORAGE:
        raise InvalidFileError(f"{path}: field dtype must be one of {sorted(_STORAGE)}, got {meta.get('dtype')!r}")
    width = meta.get("width")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise InvalidFileError(f"{path}: field width must be an int >= 1, got {width!r}")
    if (
        not isinstance(offsets, list)
        or not offsets
        or any(isinstance(o, bool) or not isinstance(o, int) for o in offsets)
        or offsets[0] != 0
        or any(b < a for a, b in zip(offsets, offsets[1:]))
    ):
        raise InvalidFileError(f"{path}: field offsets must be a non-decreasing list of ints from 0")
    layer_ids = meta.get("layer_ids")
    if not isinstance(layer_ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in layer_ids):
        raise InvalidFileError(f"{path}: field layer_ids must be a list of ints, got {layer_ids!r}")
    need = max(offsets[-1], 1) * width * np.dtype(_STORAGE[meta["dtype"]]).itemsize
    data = directory / DATA
    have = data.stat().st_size if data.is_file() else -1
    if have < need:
        raise InvalidFileError(
            f"{data}: truncated or missing: {path} describes {offsets[-1]} tokens x {width} {meta['dtype']} "
            f"({need} bytes), the file has {max(have, 0)}; re-run `bastion train features`"
        )
    return meta
