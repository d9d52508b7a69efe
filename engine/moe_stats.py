"""What the offloaded MoE step counts and times: per-layer decode counters, the CPU jobs'
own timing, and the host's stages between two captured pieces."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class CpuJobTimes:
    """What the CPU expert workers did in decode steps, timed by the native kernel itself."""

    jobs: int = 0
    weight_bytes: int = 0
    start_s: float = 0.0  # queueing to the first task taken: the workers' reaction time
    run_s: float = 0.0  # first task taken to last task done

    def add(self, weight_bytes: int, seconds: tuple[float, float] | None) -> None:
        if seconds is None:
            return
        self.jobs += 1
        self.weight_bytes += weight_bytes
        self.start_s += seconds[0]
        self.run_s += seconds[1]

    def to_dict(self) -> dict:
        return {
            "jobs": self.jobs,
            "weight_bytes": self.weight_bytes,
            "gbps": self.weight_bytes / self.run_s / 1e9 if self.run_s else None,
            "start_us_mean": 1e6 * self.start_s / self.jobs if self.jobs else None,
            "run_us_mean": 1e6 * self.run_s / self.jobs if self.jobs else None,
        }


@dataclass(slots=True)
class StagedStepTimes:
    """Where the host's time goes in offloaded decode layer steps between two captured pieces.

    The chain of one layer step is serial: the piece's graph is launched (`replay_s`), the host
    waits for its routing (`sync_s`: the piece's GPU work still running, which includes waiting
    for the previous layer's fills and CPU job, then the routing's store), decides hits, fills and
    CPU work and starts the CPU job (`plan_s`), queues the fills and the routes' slots
    (`fill_s`); then the next piece is launched, without waiting for the CPU job (its first kernel
    does, on the GPU), and only then does the host count the step (`count_s`, `after_launch`).
    Timed by the host's clock, a few reads of it per layer step; with the native planner on CUDA,
    plan and fill are the planner's own timing inside its one call.
    """

    layer_steps: int = 0
    split_misses: int = 0  # misses split between the copy and the CPU
    replay_s: float = 0.0
    sync_s: float = 0.0
    plan_s: float = 0.0
    fill_s: float = 0.0
    count_s: float = 0.0

    STAGES = ("replay", "sync", "plan", "fill", "count")

    def to_dict(self) -> dict:
        """Microseconds per layer step of each stage, and their sum."""
        n = self.layer_steps
        per_step = {
            f"{s}_us": 1e6 * getattr(self, f"{s}_s") / n if n else None for s in self.STAGES
        }
        total = sum(v for v in per_step.values() if v is not None) if n else None
        return {"layer_steps": n, "split_misses": self.split_misses, **per_step, "total_us": total}


@dataclass(slots=True)
class LayerCounters:
    """Decode counters per MoE layer: expert reads and where each one ran."""

    reads: np.ndarray
    hits: np.ndarray
    fills: np.ndarray
    cpu: np.ndarray
    picks: np.ndarray  # [layers, experts]: how often each expert was routed to

    @classmethod
    def zeros(cls, layers: int, experts: int) -> LayerCounters:
        z = lambda: np.zeros(layers, dtype=np.int64)  # noqa: E731
        return cls(z(), z(), z(), z(), np.zeros((layers, experts), dtype=np.int64))
