"""The GPU device check runs end to end on a CPU in its tiny form and reports what it promises."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("device_check", ROOT / "benchmarks" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_tiny_device_check_on_cpu_is_lossless_eager_and_compiled_and_writes_its_report(tmp_path: Path) -> None:
    device_check = _load()
    status = device_check.main(["--tiny", "--device", "cpu", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "device_check.json").read_text())
    (run,) = report["runs"]
    assert status == 0 and run["lossless"]["real"] == 0
    assert run["lossless"]["equal"] + run["lossless"]["near_tie"] == run["lossless"]["prompts"] == 2
    assert abs(sum(run["stages"][k] for k in device_check.STAGES) - 1.0) < 1e-9
    assert {(p["n"]) for p in run["latency"]["points"]} == {1, 4, 16, 64}
    assert "| tiny | fp32 |" in (tmp_path / "device_check.md").read_text()
    compiled = run["compiled"]  # the compiled verify path: measured at its sizes and lossless too
    assert "error" not in compiled, compiled.get("error")
    assert compiled["lossless"]["real"] == 0
    assert compiled["lossless"]["equal"] + compiled["lossless"]["near_tie"] == compiled["lossless"]["prompts"] == 2
    assert {p["n"] for p in compiled["points"]} == {1, 16}
    assert all(p["eager_s"] > 0 and p["compiled_s"] > 0 for p in compiled["points"])
    assert "## compiled verify path" in (tmp_path / "device_check.md").read_text()


def test_device_check_calls_a_first_token_difference_with_a_clear_logit_gap_a_real_mismatch() -> None:
    import torch

    from bastion.testing.tiny import tiny_model

    device_check = _load()
    model = tiny_model("qwen3", seed=3)
    prompt = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        logits = model(prompt).logits[0, -1]
    best, worst = int(logits.argmax()), int(logits.argmin())
    assert device_check.classify_mismatch(model, prompt, [best], [best], 0.02)["kind"] == "equal"
    assert device_check.classify_mismatch(model, prompt, [best], [worst], 0.02)["kind"] == "real"
    assert device_check.classify_mismatch(model, prompt, [best], [worst], 10.0)["kind"] == "near-tie"
