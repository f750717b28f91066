"""``bastion calibrate`` measures, fits, saves a profile pipelines pick up, and plots."""

from __future__ import annotations

import json

import pytest

from bastion.cli.main import main
from bastion.controllers import RooflineLatency


def test_calibrate_saves_a_profile_that_a_pipeline_latency_model_loads(tiny_qwen3_dir, tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setenv("BASTION_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("BASTION_NO_DEVICE_PROBE", "1")
    profile, plot = tmp_path / "profiles.json", tmp_path / "curve.png"
    code = main([
        "calibrate", "--target", str(tiny_qwen3_dir), "--sizes", "1,4,16", "--contexts", "8,32",
        "--repeats", "1", "--profile", str(profile), "--plot", str(plot),
    ])
    assert code == 0
    out = capsys.readouterr().out
    assert "fit error: median" in out and "profile saved" in out
    assert plot.stat().st_size > 1000 and plot.read_bytes()[:4] == b"\x89PNG"
    entries = json.loads(profile.read_text())["profiles"]
    assert len(entries) == 1
    (entry,) = entries.values()
    # the same construction the pipeline uses (model_config + device) finds the saved parameters
    from transformers import AutoConfig

    model = RooflineLatency(model_config=AutoConfig.from_pretrained(tiny_qwen3_dir), device="cpu", profile=profile)
    assert model.params.as_dict() == pytest.approx(entry["params"])
    assert model.peaks.source == "profile"


def test_calibrate_rejects_bad_size_lists(capsys):
    with pytest.raises(SystemExit):
        main(["calibrate", "--sizes", "0,4"])
    assert "integers >= 1" in capsys.readouterr().err
