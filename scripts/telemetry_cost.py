"""Host time the decode telemetry adds per step (counting, what-if stream, windows, miss fit).

Usage: python scripts/telemetry_cost.py CHECKPOINT_DIR [STEPS]   (all experts resident; prints
one line). Synthesize a 48-layer geometry first, e.g. `moelab synth --out /tmp/deep --preset tiny
--set num_hidden_layers=48 --set num_experts=128 --set num_experts_per_tok=8
--set mlp_only_layers=[]`.
"""

from __future__ import annotations

import sys
import time

import torch

from moelab.engine.args import build_parser
from moelab.engine.engine import Engine


def main() -> None:
    args = build_parser().parse_args(
        ["--model-path", sys.argv[1], "--device", "cpu", "--moe-cache-rate", "1.0"]
    )
    engine = Engine(args)
    moe, telemetry = engine.moe, engine.telemetry
    spec = engine.spec
    routing = moe.resident_routing
    for layer in range(spec.num_moe_layers):  # what a decode step's router leaves in the record
        record = routing.record(layer, 1)
        assert record is not None
        record.copy_(torch.randperm(spec.num_experts)[: spec.top_k].to(torch.int32))
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 5000
    t0 = time.perf_counter()
    for _ in range(steps):
        moe.after_decode_step(moe.snapshot_decode_ids(1))
        telemetry.on_step(decode_tokens=1, prefill_tokens=0, step_s=0.002)
    moe.count_backlog()
    assert int(moe.counters.reads.sum()) == steps * spec.num_moe_layers * spec.top_k
    per_step_us = (time.perf_counter() - t0) / steps * 1e6
    engine.close()
    print(
        f"telemetry host cost per decode step ({spec.num_moe_layers} MoE layers, batch 1): "
        f"{per_step_us:.1f} us"
    )


if __name__ == "__main__":
    main()
