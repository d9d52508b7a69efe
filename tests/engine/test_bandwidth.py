"""The bandwidth profile: written whole, read back only for this machine and geometry."""

from __future__ import annotations

import socket

import pytest

from moelab.engine.config.bandwidth import (
    PROFILE_VERSION,
    best,
    device_best,
    load_profile,
    pcie_gbps,
    save_crossover,
    save_profile,
)
from moelab.engine.model.spec import ModelSpec
from moelab.engine.model.synth import make_config


def profile(hostname: str | None = None) -> dict:
    expert = {"hidden": 64, "intermediate": 32, "dtype": "bfloat16", "expert_bytes": 12288}
    return {
        "profile_version": PROFILE_VERSION,
        "machine": {"hostname": hostname or socket.gethostname()},
        "expert": expert,
        "results": [
            {"kind": "cpu_experts", "params": {**expert, "threads": 2}, "value": 3.0},
            {"kind": "cpu_experts", "params": {**expert, "threads": 4}, "value": 5.0},
        ],
    }


def test_a_profile_reads_back_for_this_machine_and_geometry_only(tmp_path):
    path = save_profile(profile(), tmp_path / "bw" / "profile.json")
    loaded = load_profile(64, 32, "bfloat16", path)
    assert loaded is not None and best(loaded, "cpu_experts") == 5.0
    assert best(loaded, "cpu_experts", threads=2) == 3.0 and best(loaded, "h2d_pinned") is None
    assert load_profile(64, 32, "float32", path) is None  # another geometry
    save_profile(profile("elsewhere"), path)
    assert load_profile(64, 32, "bfloat16", path) is None  # another machine's
    assert load_profile(64, 32, "bfloat16", tmp_path / "none.json") is None


def test_the_prefill_crossover_is_recorded_once_in_the_profile(tmp_path):
    spec = ModelSpec.from_config(
        make_config("qwen3_moe", "tiny", {"hidden_size": 64, "moe_intermediate_size": 32})
    )
    path = tmp_path / "profile.json"
    with pytest.raises(ValueError, match="run `moelab bench bw"):
        save_crossover(spec, "bfloat16", 64, path)
    save_profile(profile(), path)
    save_crossover(spec, "bfloat16", 64, path)
    save_crossover(spec, "bfloat16", 32, path)
    loaded = load_profile(64, 32, "bfloat16", path)
    assert loaded is not None
    match = {"num_experts": spec.num_experts, "top_k": spec.top_k}
    assert best(loaded, "prefill_crossover", **match) == 32
    assert sum(r["kind"] == "prefill_crossover" for r in loaded["results"]) == 1


def test_each_gpus_rate_reads_back_as_its_own(tmp_path):
    """`moelab bench bw` measures the copy on each GPU; an engine on cuda:1 reads cuda:1's, and
    a row of a profile that named no GPU is the first GPU's."""
    measured = profile()
    expert = measured["expert"]
    measured["results"] += [
        {"kind": "h2d_pinned", "params": {**expert, "gpu_index": 0}, "value": 25.0},
        {"kind": "h2d_pinned", "params": {**expert, "gpu_index": 1}, "value": 6.1},
    ]
    loaded = load_profile(64, 32, "bfloat16", save_profile(measured, tmp_path / "p.json"))
    assert loaded is not None
    assert device_best(loaded, "h2d_pinned", 1) == 6.1
    assert device_best(loaded, "h2d_pinned", 0) == 25.0
    assert device_best(loaded, "h2d_pinned", 2) is None
    older = profile()
    older["results"].append({"kind": "h2d_pinned", "params": expert, "value": 12.0})
    assert device_best(older, "h2d_pinned", 0) == 12.0


def test_a_pcie_links_peak_follows_its_generation_and_width():
    assert pcie_gbps(4, 16) == pytest.approx(31.5, abs=0.01)
    assert pcie_gbps(3, 8) == pytest.approx(7.88)
    assert pcie_gbps(None, 16) is None and pcie_gbps(9, 16) is None
