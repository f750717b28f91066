"""Security: no file bastion reads can run code or make it allocate without bound."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from bastion.contract.errors import BastionError


class _RunsCode:
    """Unpickling this calls ``os.mkdir(marker)``: proof that loading ran foreign code."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _crafted(path: Path, marker: Path) -> None:
    with open(path, "wb") as f:
        pickle.dump({"done": 0, "rows": [], "x": _RunsCode(marker)}, f, protocol=2)


@pytest.mark.parametrize("name", ["checkpoint.pt", "distill.pt"])
def test_load_checkpoint_refuses_pickle_that_runs_code(tmp_path: Path, name: str) -> None:
    from bastion.training.loop import load_checkpoint

    marker = tmp_path / "pwned"
    path = tmp_path / name
    _crafted(path, marker)
    with pytest.raises(BastionError, match=name):
        load_checkpoint(path)
    assert not marker.exists()


def test_load_continuations_refuses_pickle_that_runs_code(tmp_path: Path) -> None:
    from bastion.training.distill import load_continuations

    marker = tmp_path / "pwned"
    path = tmp_path / "distill.pt"
    _crafted(path, marker)
    with pytest.raises(BastionError):
        load_continuations(path)
    assert not marker.exists()


def test_real_checkpoints_round_trip_through_safe_loading(tmp_path: Path) -> None:
    from bastion.training.loop import load_checkpoint, save_checkpoint

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path / "checkpoint.pt", model=model.state_dict(), optimizer=opt.state_dict(), step=3, elapsed=1.5)
    state = load_checkpoint(tmp_path / "checkpoint.pt")
    assert state is not None and state["step"] == 3
    torch.testing.assert_close(state["model"]["weight"], model.weight.detach())
    save_checkpoint(tmp_path / "distill.pt", done=1, rows=[{"source": "gsm8k", "ids": [1, 2, 3], "prompt_len": 2}])
    state = load_checkpoint(tmp_path / "distill.pt")
    assert state is not None and state["rows"][0]["ids"] == [1, 2, 3]
