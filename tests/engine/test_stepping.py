"""The step loop (engine/runtime/stepping.py): a part built from the engine's parts, owning its
state."""

from __future__ import annotations

import pytest

from moelab.engine.runtime.sampling import SamplingParams
from moelab.engine.runtime.stepping import Stepper
from moelab.engine.synth_checkpoint import synthesize

from .reference import make_engine

PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return synthesize(tmp_path_factory.mktemp("stepping"), preset="tiny", seed=17)


def test_a_stepper_built_from_an_engines_parts_decodes_as_the_engine_does(checkpoint):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = make_engine(checkpoint)
    try:
        expected = engine.generate(PROMPTS, params)
        stepper = Stepper(
            engine.model,
            engine.moe,
            engine.scheduler,
            engine.sampler,
            engine.kv,
            engine.telemetry,
            device=engine.device,
            eos_ids=frozenset(),
            max_context=engine.max_context,
            overlap_decode=False,
        )
        seqs = [engine.add(p, params) for p in PROMPTS]
        assert not stepper.idle and not engine.stepper.in_flight
        stepper.run_until_idle()
        assert stepper.idle and engine.idle
        assert [s.output_ids for s in seqs] == expected
        assert engine.kv.used_blocks == 0
    finally:
        engine.close()
