"""The roofline latency model: operation counts, device peaks, prediction shape, profiles, registry."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import bastion
from bastion.controllers import ModelCost, RooflineLatency, RooflineParams
from bastion.controllers.latency import devices
from bastion.controllers.latency.devices import DevicePeaks, device_peaks, lookup_gpu
from bastion.core import InvalidInputError, LatencyModel
from bastion.testing.tiny import tiny_config


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BASTION_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("BASTION_NO_DEVICE_PROBE", "1")
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_cost_counts_match_what_a_real_forward_does(arch):
    """Measured on the model itself, not restated: FLOPs from torch's FlopCounterMode over a real
    forward of n tokens after c cached ones (eager attention, so QK^T and PV are counted as matmuls),
    weight bytes from the parameters, KV bytes per context token from the filled cache."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import DynamicCache

    from bastion.huggingface.compat import cache_kwargs
    from bastion.testing.tiny import tiny_model

    model = tiny_model(arch, seed=0, attn_implementation="eager")
    cost = ModelCost.from_config(model.config)
    assert cost.bytes_per_param == 4
    for n, c in ((1, 0), (5, 11), (16, 40)):
        ids = torch.randint(0, 256, (1, c + n), generator=torch.Generator().manual_seed(n))
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            if c:
                model(ids[:, :c], **cache_kwargs(model, cache))
            with FlopCounterMode(display=False) as counter:
                model(ids[:, c:], **cache_kwargs(model, cache))
        # some transformers releases compute the rotary angles as a (tiny) matmul: not model work
        counts = counter.get_flop_counts()
        rotary = sum(sum(v.values()) for k, v in counts.items() if k.endswith("rotary_emb"))
        assert float(cost.flops(n, c)) == pytest.approx(counter.get_total_flops() - rotary, rel=1e-9), (n, c)
        cache_bytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        assert cost.bytes_coeffs[2] * (c + n) == pytest.approx(cache_bytes), "KV bytes per context token"
    embedding = model.get_input_embeddings().weight
    streamed = sum(p.numel() * p.element_size() for p in model.parameters()) - embedding.numel() * embedding.element_size()
    assert cost.weight_bytes == pytest.approx(streamed, rel=0.002)  # Qwen3's tiny q/k norms are left out
    assert cost.bytes_coeffs[0] == cost.weight_bytes
    assert float(cost.bytes(8, 100)) > float(cost.bytes(1, 100)) > cost.weight_bytes


def test_cost_reads_llama_configs_and_dtype_overrides():
    cfg = tiny_config("llama", head_dim=None)
    cost = ModelCost.from_config(cfg, dtype=torch.bfloat16)
    assert cost.head_dim == 64 // 4 and cost.bytes_per_param == 2
    assert ModelCost.from_config(cfg.to_dict()).signature == ModelCost.from_config(cfg).signature
    with pytest.raises(InvalidInputError):
        ModelCost.from_config({"hidden_size": 8})


def test_predictions_grow_with_tree_size_and_context_and_vectorize_exactly():
    model = RooflineLatency(model_config=tiny_config("qwen3", hidden_size=256, intermediate_size=1024), device="cpu", profile=None)
    n = torch.arange(1, 257)
    for ctx in (0, 100, 400):
        many = model.predict_many(n, ctx)
        assert many.shape == (256,) and many.dtype == torch.float64
        single = torch.tensor([model.predict(int(k), ctx) for k in n], dtype=torch.float64)
        assert torch.allclose(many, single, rtol=1e-12)
        assert bool((many[1:] >= many[:-1]).all())
    assert model.predict(64, 4000) > model.predict(64, 10)
    assert isinstance(model, LatencyModel)


def test_known_gpus_come_from_the_table_by_dtype():
    h200 = lookup_gpu("NVIDIA H200", torch.bfloat16)
    assert h200 is not None and h200.source == "table"
    assert h200.bytes_per_s == pytest.approx(4.8e12) and h200.flops_per_s == pytest.approx(989e12)
    assert lookup_gpu("NVIDIA H100 PCIe", torch.float16).bytes_per_s == pytest.approx(2.0e12)
    assert lookup_gpu("NVIDIA H200", torch.float32).flops_per_s < h200.flops_per_s
    assert lookup_gpu("Some Future Accelerator") is None


def test_cpu_probe_is_measured_once_then_cached(isolated_cache, monkeypatch):
    monkeypatch.delenv("BASTION_NO_DEVICE_PROBE")
    calls = []

    def fake_probe(dev, dtype, **kw):
        calls.append(dev)
        return DevicePeaks(3e10, 7e9, name="probe-cpu", source="probe")

    monkeypatch.setattr(devices, "probe_device", fake_probe)
    first = device_peaks("cpu", torch.float32)
    second = device_peaks("cpu", torch.float32)
    assert len(calls) == 1
    assert (first.source, second.source) == ("probe", "cache")
    assert second.flops_per_s == pytest.approx(3e10) and second.bytes_per_s == pytest.approx(7e9)
    assert (isolated_cache / "device_peaks.json").exists()


def test_real_cpu_probe_is_quick_and_positive():
    peaks = devices.probe_device("cpu", torch.float32, budget_s=0.2)
    assert peaks.flops_per_s > 1e8 and peaks.bytes_per_s > 1e8 and peaks.source == "probe"


def test_probe_can_be_disabled_by_environment():
    peaks = device_peaks("cpu")
    assert peaks.source == "default"


def test_profile_round_trips_keyed_by_device_and_model(tmp_path):
    path = tmp_path / "profiles.json"
    cfg = tiny_config("qwen3")
    params = RooflineParams(1.4, 2e-3, 1.1, 3e-3)
    model = RooflineLatency(model_config=cfg, device="cpu", params=params, peak_flops=5e10, bandwidth=8e9, profile=path)
    model.save_profile()
    other = RooflineLatency(model_config=tiny_config("qwen3", hidden_size=128), device="cpu", params=params, profile=path)
    other.save_profile()
    data = json.loads(path.read_text())
    assert len(data["profiles"]) == 2
    loaded = RooflineLatency(model_config=cfg, device="cpu", profile=path)
    assert loaded.params == params
    assert loaded.peaks.flops_per_s == pytest.approx(5e10) and loaded.peaks.source == "profile"
    assert loaded.predict(7, 30) == pytest.approx(model.predict(7, 30))
    fresh = RooflineLatency(model_config=tiny_config("qwen3", num_hidden_layers=3), device="cpu", profile=path)
    assert fresh.params == fresh.prior and fresh.params != params  # no profile for that model


def test_malformed_profile_file_warns_and_falls_back_to_the_prior(tmp_path):
    from bastion.utils.files import CacheWarning

    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.warns(CacheWarning, match="not valid JSON"):
        model = RooflineLatency(model_config=tiny_config("qwen3"), device="cpu", profile=path)
    assert model.params == model.prior


def test_registry_creates_roofline_with_the_pipelines_options():
    assert "roofline" in bastion.registry.names("latency_model")
    model = bastion.registry.create("latency_model", "roofline", model_config=tiny_config("qwen3"), device="cpu")
    assert isinstance(model, RooflineLatency) and model.predict(4, 10) > 0
    unbound = bastion.registry.create("latency_model", "roofline", device="cpu")
    with pytest.raises(InvalidInputError, match="bind it to a target"):
        unbound.predict(4, 10)
    with pytest.raises(InvalidInputError):
        RooflineLatency(model_config=tiny_config("qwen3"), half_life=0.0)


def test_warmup_probe_feeds_observations_and_fits():
    cost = ModelCost.from_config(tiny_config("qwen3"))
    model = RooflineLatency(cost=cost, device="cpu", peak_flops=1e9, bandwidth=1e9, profile=None)
    planted = RooflineParams(2.0, 1e-3, 1.5, 2e-3)

    def measure(n: int, c: int) -> float:
        x_c, x_m = model.ideal_times(np.array([n]), c)
        return float(planted.predict(x_c, x_m)[0])

    fit = model.warmup(measure, sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256), context_lens=(0, 200))
    assert fit is not None and fit.median_rel_error < 0.01
    assert model.n_observations == 18
    for n in (1, 16, 256):
        assert model.predict(n, 100) == pytest.approx(measure(n, 100), rel=0.02)
