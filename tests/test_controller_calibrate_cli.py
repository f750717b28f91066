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
        "--repeats", "1", "--profile", str(profile), "--plot", str(plot), "--force",
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


def test_calibration_points_keep_the_requested_context_as_their_series(tiny_qwen3_dir):
    from bastion.controllers.latency.calibrate import calibrate
    from bastion.huggingface.causal_lm import HFTarget

    result = calibrate(HFTarget.from_pretrained(tiny_qwen3_dir), sizes=(1, 4, 16), context_lens=(8, 32), repeats=1, warmup=0)
    series = [p.series for p in result.points]
    assert sorted(set(series)) == [8, 32] and series.count(8) == series.count(32) == 3
    assert all(p.context_len >= p.series for p in result.points)  # the committed context drifts; the series does not


def test_a_poor_fit_is_reported_with_advice_and_saved_only_with_force(tiny_qwen3_dir, tmp_path, monkeypatch, capsys):
    import bastion.controllers.latency.calibrate as cal

    monkeypatch.setenv("BASTION_NO_DEVICE_PROBE", "1")
    real = cal.calibrate

    def noisy(target, sizes, contexts, repeats=3):
        res = real(target, (1, 4), (8,), repeats=1, warmup=0)
        points = (cal.CalibrationPoint(1, 8, 1e-7, 8), cal.CalibrationPoint(4, 8, 10.0, 8))
        return cal.CalibrationResult(res.model, points, res.fit)

    monkeypatch.setattr(cal, "calibrate", noisy)
    profile = tmp_path / "profiles.json"
    argv = ["calibrate", "--target", str(tiny_qwen3_dir), "--profile", str(profile), "--no-plot"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "the fit is poor" in err and "--repeats" in err and "not saved" in err
    assert not profile.exists()
    assert main([*argv, "--force"]) == 0 and profile.exists()
