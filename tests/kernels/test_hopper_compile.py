"""Every Triton kernel compiles for sm_90 (H100/H200) at real shapes, fits, and does not spill.

The interpreter runs the kernels' logic; this catches what only the GPU compiler sees: layouts,
shared memory per pipeline stage, register pressure. No GPU needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Dynamic shared memory a block may use on sm_90, sm_86 and sm_75.
SM90_SHARED_BYTES = 232448
SHARED_BYTES = {86: 101376, 75: 65536}
# The kernels of the MoE launches (fused_moe, fused_moe_one_token, grouped_moe, and over MXFP4
# banks mxfp4_moe).
MXFP4_KERNELS = {
    "_decode_gate_up_kernel",
    "_decode_down_kernel",
    "_fp4_gate_up_kernel",
    "_fp4_down_kernel",
    "_grouped_gate_up_kernel",
    "_grouped_down_kernel",
}
MOE_KERNELS = MXFP4_KERNELS | {
    "_gate_up_kernel",
    "_down_kernel",
    "_count_kernel",
    "_blocks_kernel",
    "_scatter_kernel",
    "_one_token_gate_up_kernel",
    "_one_token_down_kernel",
}
# The kernels over FP8 KV pages (rope_kv's write, decode attention, the prefill gather)
FP8_KV_KERNELS = {"_qk_norm_rope_kv_kernel", "_split_kernel", "_merge_kernel", "_gather_kernel"}
# The decode projections over FP8 weights (gemv.linear_decode_fp8) and their split's sum
FP8_LINEAR_KERNELS = {"_one_token_fp8_kernel", "_tokens_fp8_kernel", "_sum_splits_kernel"}
KERNELS = MXFP4_KERNELS | {
    "_gate_up_kernel",
    "_down_kernel",
    "_count_kernel",
    "_blocks_kernel",
    "_scatter_kernel",
    "_one_token_gate_up_kernel",
    "_one_token_down_kernel",
    "_split_kernel",
    "_merge_kernel",
    "_rmsnorm_kernel",
    "_topk_softmax_kernel",
    "_route_kernel",
    "_guess_kernel",
    "_one_token_kernel",
    "_tokens_kernel",
    "_sum_splits_kernel",
    "_one_token_fp8_kernel",
    "_tokens_fp8_kernel",
    "_wait_epoch_kernel",
    "_sum_parts_kernel",
    "_sum_norm_kernel",
    "_route_slots_from_host_kernel",
    "_route_slots_from_map_kernel",
    "_routing_to_host_kernel",
    "_tokens_to_host_kernel",
    "_signal_kernel",
    "_qk_norm_rope_kv_kernel",
    "_draw_kernel",
    "_pick_kernel",
    "_gather_kernel",
    "_conv_prefill_kernel",
    "_conv_decode_kernel",
    "_delta_decode_kernel",
    "_gated_norm_kernel",
    "_combine_kernel",
}
# Prefill's grouped GEMM is launched plainly, and the MXFP4 bank's kernels (not yet in the engine's
# decode graphs); every decode kernel with programmatic dependent launch
NOT_PDL = {"moelab.kernels.grouped_moe", "moelab.kernels.fp8_kv", "moelab.kernels.mxfp4_moe"}
# Decode kernels that wait without releasing the next one early (common.pdl_wait)
RELEASED_AT_END = {"_split_kernel"}


def test_kernels_compile_for_hopper_within_its_limits():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("hopper_compile.py")
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    kernels = [json.loads(line) for line in done.stdout.splitlines()]
    assert {k["kernel"] for k in kernels} == KERNELS
    for k in kernels:
        assert k["shared_bytes"] <= SM90_SHARED_BYTES, k
        assert k["LOCAL"] == 0, f"registers spill to local memory: {k}"
        if k["module"] not in NOT_PDL:
            assert k["waits_for_previous"], k
            # each releases the next kernel at its start, but decode attention's wide slice grid
            assert k["releases_early"] == (k["kernel"] not in RELEASED_AT_END), k
    # the routing's signal: the one-launch router with it, and the kernel that follows the copy;
    # the guess's, the guess's kernel
    signalling = {k["kernel"] for k in kernels if k["signals_host"]}
    assert signalling == {"_route_kernel", "_signal_kernel", "_guess_kernel"}, signalling


def test_fp8_kernels_compile_for_ampere_and_turing_without_fp8_instructions():
    """FP8 and MXFP4 banks, FP8 KV pages and FP8 projections on GPUs without FP8 or FP4
    (consumer Ampere, Turing): the narrowing and the widening are integer ops."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("hopper_compile.py")
    runs = {  # one process per GPU: a kernel's compiled variants are cached per device, not arch
        arch: subprocess.Popen(
            [sys.executable, str(script), "--arch", str(arch)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for arch in SHARED_BYTES
    }
    for arch, run in runs.items():
        out, err = run.communicate()
        assert run.returncode == 0, err[-3000:]
        kernels = [json.loads(line) for line in out.splitlines()]
        assert {k["kernel"] for k in kernels} == MOE_KERNELS | FP8_KV_KERNELS | FP8_LINEAR_KERNELS
        for k in kernels:
            assert k["arch"] == arch and not k["narrow_float_instructions"], k
            assert k["shared_bytes"] <= SHARED_BYTES[arch], k
            assert k["LOCAL"] == 0, f"registers spill to local memory: {k}"
