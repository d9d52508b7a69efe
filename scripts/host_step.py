"""The host's work a step of overlapped decode, with the device's part taken away.

Usage: python scripts/host_step.py [--layers N] [--steps N] [--profile] [-- ENGINE FLAGS...]
Builds an engine of the tiny synthetic geometry with N layers (default 12) on the CPU, gives it
whole-step decode graphs whose replays do nothing, and times the step loop at batch 1: the
scheduler, the graphs' inputs, the routing snapshot, the landing of the step before (its tokens,
the counters, telemetry, the stop checks). What a GPU host adds on top is the driver's part: the
graph's launch, the inputs' copy, the tokens' copy back and the event's wait. With overlapped
decode the host prepares the next step while one runs, so a host slower than the device sets the
step (docs/performance.md, "Known gaps"). --profile prints the loop's cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

from moelab.engine.config.config import EngineConfig
from moelab.engine.runtime.engine import Engine
from moelab.engine.runtime.graphs import DecodeGraphs
from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.synth_checkpoint import synthesize


class NoOpGraph:
    """A captured step whose replay does nothing: the capture runs the work once for its
    outputs, which keep their values."""

    def __init__(self, pool: object | None = None, stream: object | None = None) -> None:
        self.pool = pool

    def capture(self, work):
        return work()

    def replay(self) -> None:
        pass


def main() -> None:
    argv = sys.argv[1:]
    engine_flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    with tempfile.TemporaryDirectory(prefix="host-step-") as folder:
        run(Path(folder), args, engine_flags)


def run(folder: Path, args: argparse.Namespace, engine_flags: list[str]) -> None:
    """Synthesize the model into `folder`, then time (and profile) the step loop."""
    checkpoint = synthesize(
        folder / "model", preset="tiny", seed=3, overrides={"num_hidden_layers": args.layers}
    )
    config = EngineConfig.from_flags(
        ["--model-path", str(checkpoint), "--device", "cpu", "--bank-dir", str(folder / "bank"),
         "--moe-cpu-threads", "1", *engine_flags]
    )  # fmt: skip
    engine = Engine(config)
    try:
        graphs = DecodeGraphs(
            engine.model, 1, engine.max_context, piecewise=False, graph_factory=NoOpGraph
        )
        graphs.capture()
        stepper = engine.stepper
        stepper.graphs = graphs
        stepper.overlap_decode = True
        tokens = 50 + 2 * args.steps
        seq = engine.add([5, 6, 7, 8], SamplingParams(max_tokens=tokens, ignore_eos=True))
        for _ in range(50):  # past the prompt's step, into overlapped decode
            stepper.step()
        if not stepper.in_flight:
            raise SystemExit("the steps did not overlap: no step was left in flight")
        t0 = time.perf_counter()
        for _ in range(args.steps):
            stepper.step()
        step_us = (time.perf_counter() - t0) / args.steps * 1e6
        print(f"host work a step: {step_us:.1f} us over {args.steps} steps, {args.layers} layers")
        print(f"tokens handed out: {len(seq.output_ids)}")
        if args.profile:
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.steps):
                stepper.step()
            profile.disable()
            pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    finally:
        engine.close()


if __name__ == "__main__":
    main()
