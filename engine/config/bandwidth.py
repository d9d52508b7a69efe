"""The bandwidth profile: what `moelab bench bw` measured on this machine, kept as JSON in the
user cache directory, and read by the engine at start (Bp and Bh for the miss split, the prefill
crossover `moelab bench prefill --crossover` adds).
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

from ..model.spec import ModelSpec

PROFILE_VERSION = 1
# a PCIe lane's one-way rate per generation, in GB/s (after line encoding)
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def profile_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("moelab")) / "bw-profile.json"


def best(profile: dict, kind: str, **match) -> float | None:
    """The highest value of `kind` whose params contain `match`."""
    values = [
        r["value"]
        for r in profile.get("results", [])
        if r["kind"] == kind and all(r["params"].get(k) == v for k, v in match.items())
    ]
    return max(values) if values else None


def device_best(profile: dict, kind: str, index: int) -> float | None:
    """The highest value of `kind` measured on GPU `index` (a row without a GPU index is GPU
    0's: `moelab bench bw` measured only the first GPU before it measured each)."""
    values = [
        r["value"]
        for r in profile.get("results", [])
        if r["kind"] == kind and r["params"].get("gpu_index", 0) == index
    ]
    return max(values) if values else None


def pcie_gbps(generation: int | None, width: int | None) -> float | None:
    """A PCIe link's one-way peak rate in GB/s (None where either is not known)."""
    if generation is None or width is None or generation not in PCIE_LANE_GBPS:
        return None
    return PCIE_LANE_GBPS[generation] * width


def load_profile(
    hidden: int, intermediate: int, dtype: str, path: str | Path | None = None
) -> dict | None:
    """This machine's profile for this expert geometry (`dtype` by name, e.g. bfloat16), or None
    (no profile, another machine's, a stale version)."""
    path = Path(path) if path else profile_path()
    try:
        profile = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if profile.get("profile_version") != PROFILE_VERSION:
        return None
    if profile.get("machine", {}).get("hostname") != socket.gethostname():
        return None
    expert = profile.get("expert", {})
    if (expert.get("hidden"), expert.get("intermediate"), expert.get("dtype")) != (
        hidden,
        intermediate,
        dtype,
    ):
        return None
    return profile


def save_profile(profile: dict, path: str | Path | None = None) -> Path:
    """Write `profile` whole (a reader never sees half of it); returns where."""
    out = Path(path) if path else profile_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=2))
    tmp.replace(out)
    return out


def save_crossover(
    spec: ModelSpec, dtype: str, tokens: int, path: str | Path | None = None
) -> None:
    """Record the prefill crossover measured for `spec`'s experts in `dtype` in the bandwidth
    profile."""
    out = Path(path) if path else profile_path()
    profile = load_profile(spec.hidden_size, spec.moe_intermediate_size, dtype, out)
    if profile is None:
        raise ValueError(
            f"no bandwidth profile for this machine and geometry at {out}; run "
            "`moelab bench bw --model-path ...` first"
        )
    profile["results"] = [r for r in profile["results"] if r["kind"] != "prefill_crossover"]
    profile["results"].append(
        {
            "kind": "prefill_crossover",
            "params": {**profile["expert"], "num_experts": spec.num_experts, "top_k": spec.top_k},
            "value": tokens,
            "unit": "tokens",
        }
    )
    save_profile(profile, out)
