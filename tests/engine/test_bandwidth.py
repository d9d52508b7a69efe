"""The bandwidth profile: written whole, read back only for this machine and geometry."""

from __future__ import annotations

import socket

import pytest

from moelab.engine.config.bandwidth import (
    PROFILE_VERSION,
    best,
    load_profile,
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
