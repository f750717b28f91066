"""Training files and folders: a resume checkpoint without the model or of another shape, a corrupt or
truncated feature folder, ``train drafter --out`` onto a file and ``calibrate --profile`` onto a folder.
Before, these were ``KeyError: 'model'``, a raw ``state_dict`` error, a ``JSONDecodeError``, "mmap length
is greater than file size", a failure after training, and temporary files in the folder's parent."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from bastion.cli.main import main
from bastion.core import InvalidFileError
from bastion.training.loop import resume, save_checkpoint


def _model_opt(width: int = 4):
    model = torch.nn.Linear(width, 3)
    return model, torch.optim.AdamW(model.parameters())


def test_resume_from_a_checkpoint_without_the_model_names_the_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, step=3, elapsed=1.0)
    with pytest.raises(InvalidFileError, match="model") as err:
        resume(path, *_model_opt())
    assert str(path) in str(err.value)


def test_resume_from_a_checkpoint_of_another_shape_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    other, opt = _model_opt(width=7)
    save_checkpoint(path, model=other.state_dict(), optimizer=opt.state_dict(), step=3, elapsed=1.0)
    with pytest.raises(InvalidFileError, match="weight") as err:
        resume(path, *_model_opt())
    assert str(path) in str(err.value)


def _features(tmp_path: Path) -> Path:
    from bastion.training.features import DATA, DONE, META

    folder = tmp_path / "features"
    folder.mkdir()
    (folder / META).write_text(json.dumps({"layer_ids": [0], "width": 4, "offsets": [0, 3, 5], "dtype": "float32"}))
    np.zeros((5, 4), dtype=np.float32).tofile(folder / DATA)
    np.ones(2, dtype=np.uint8).tofile(folder / DONE)
    return folder


def test_a_good_feature_folder_opens(tmp_path: Path) -> None:
    from bastion.training.features import FeatureStore

    assert FeatureStore.open(_features(tmp_path), layer_ids=(0,), sequences=2).width == 4


@pytest.mark.parametrize("damage", ["not-json", "array", "width", "offsets", "truncated"])
def test_a_corrupt_or_truncated_feature_folder_names_the_file(tmp_path: Path, damage: str) -> None:
    from bastion.training.features import DATA, META, FeatureStore

    folder = _features(tmp_path)
    meta = json.loads((folder / META).read_text())
    if damage == "not-json":
        (folder / META).write_text('{"layer_ids": [0], "wid')
    elif damage == "array":
        (folder / META).write_text("[1, 2]")
    elif damage == "width":
        (folder / META).write_text(json.dumps({**meta, "width": "4"}))
    elif damage == "offsets":
        (folder / META).write_text(json.dumps({**meta, "offsets": [0, 5, 3]}))
    else:
        (folder / DATA).write_bytes((folder / DATA).read_bytes()[:20])
    with pytest.raises(InvalidFileError, match=DATA if damage == "truncated" else META):
        FeatureStore.open(folder)


def test_train_drafter_onto_an_existing_file_fails_before_loading_anything(tmp_path: Path, capsys, monkeypatch) -> None:
    import bastion.training.frozen as frozen

    def never(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(frozen, "load_frozen_target", never)
    out = tmp_path / "out.txt"
    out.write_text("keep me")
    code = main(["train", "drafter", "--target", str(tmp_path / "t"), "--data", str(tmp_path / "d.pt"), "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "out.txt" in err and "not a folder" in err
    assert len(err.strip().splitlines()) == 1 and out.read_text() == "keep me"


def test_calibrate_profile_folder_writes_inside_it(tiny_qwen3_dir, tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("BASTION_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("BASTION_NO_DEVICE_PROBE", "1")
    folder = tmp_path / "profiles"
    folder.mkdir()
    code = main(["calibrate", "--target", str(tiny_qwen3_dir), "--sizes", "1,4", "--contexts", "8",
                 "--repeats", "1", "--profile", str(folder), "--force"])
    assert code == 0
    assert (folder / "latency_profiles.json").is_file()
    assert {p.name for p in tmp_path.iterdir()} <= {"cache", "profiles"}  # nothing written beside the folder
