"""The kernel benchmark's arithmetic, its table, and its behaviour without a GPU."""

from __future__ import annotations

import pytest
import torch

from moelab.kernels import bench, common, measure
from moelab.kernels.fp4_one_token import OneTokenFP4Config, choose_config
from moelab.kernels.mxfp4_moe import DotDecodeConfig


def result(kernel: str = "fused_moe_decode", ref_us: float | None = 90.0) -> measure.Result:
    return measure.Result(
        kernel=kernel,
        shape="T=1 K=8",
        time_us=30.0,
        bytes_moved=60_000_000,
        flops=300_000_000,
        ref_us=ref_us,
        copy_gbps=4000.0,
        matmul_tflops=600.0,
    )


def fake_gpu(monkeypatch) -> None:
    """bench.run on the CPU (its random generator too) as on a GPU named "Fake GPU", its
    ceilings given, not measured."""
    props = type("Props", (), {"name": "Fake GPU"})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _device: props)
    monkeypatch.setattr(bench, "measure_copy_gbps", lambda: 4000.0)
    monkeypatch.setattr(bench, "measure_matmul_tflops", lambda: 600.0)
    monkeypatch.setattr(bench, "DEVICE", torch.device("cpu"))


def test_rates_and_shares_follow_from_time_bytes_and_flops():
    r = result()
    assert r.gbps == pytest.approx(2000.0)  # 60 MB in 30 us
    assert r.bw_share == pytest.approx(0.5)
    assert r.tflops == pytest.approx(10.0)  # 300 MFLOP in 30 us
    assert r.mm_share == pytest.approx(10.0 / 600)
    assert r.to_json()["gbps"] == pytest.approx(2000.0)


def test_table_lists_every_kernel_with_its_reference_speedup():
    device = {"name": "Fake GPU", "copy_gbps": 4000.0, "matmul_tflops": 600.0, "torch": "x"}
    text = bench.table(device, [result(), result("sdpa_prefill", ref_us=None)], ["no cuDNN"])
    lines = text.splitlines()
    assert "Fake GPU" in lines[0] and "4000 GB/s" in lines[0]
    assert lines[2].startswith("fused_moe_decode") and lines[2].rstrip().endswith("3.0")
    assert lines[3].startswith("sdpa_prefill") and lines[3].rstrip().endswith("-")
    assert lines[4] == "note: no cuDNN"


def test_without_cuda_it_says_so_and_exits_0(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 0
    assert "no CUDA device" in capsys.readouterr().out


def test_working_set_outgrows_the_l2_cache():
    assert bench.layers_for(75_000_000) * 75_000_000 >= bench.MIN_WORKING_SET_BYTES
    assert bench.layers_for(10**10) == 2
    assert bench.layers_for(16) == bench.MAX_CALLS_PER_GRAPH  # a tiny call is launch-bound anyway


def test_only_refuses_an_unknown_kernel_and_names_the_choices(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--only", "paged_attention,flash"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown kernel flash" in err and "paged_attention" in err and "fused_moe" in err


def test_only_runs_the_named_kernels_alone(monkeypatch):
    timed = []
    for name in bench.KERNELS:
        monkeypatch.setattr(bench.Bench, name, lambda self, *a, _n=name, **k: timed.append(_n))
    monkeypatch.setattr(bench.Bench, "handoff_norm", lambda self, *a, **k: timed.append("handoff"))
    fake_gpu(monkeypatch)
    bench.run(False, ["paged_attention", "rope_kv"])
    assert sorted(set(timed)) == ["paged_attention", "rope_kv"]
    assert timed.count("paged_attention") == 4
    timed.clear()
    bench.run(False)
    assert set(timed) == set(bench.KERNELS)


def test_the_gated_deltanet_rows_time_decode_batches_and_prompts(monkeypatch):
    """The convolution's and the delta rule's rows: decode steps of 1 and 8 sequences, prompts
    of 512 and 8,192 tokens, at Qwen3.6-35B-A3B's 8,192 convolution channels."""
    timed = []
    for name in ("short_conv", "delta_rule"):
        monkeypatch.setattr(bench.Bench, name, lambda self, *a, _n=name: timed.append((_n, *a)))
    fake_gpu(monkeypatch)
    bench.run(False, ["short_conv", "delta_rule"])
    for name in ("short_conv", "delta_rule"):
        rows = [row[1:] for row in timed if row[0] == name]
        assert rows == [(1, False), (8, False), (512, True), (8192, True)]
    assert bench._linear_channels() == 8192


def test_the_sweep_times_the_delta_rules_decode_launches(monkeypatch):
    """--sweep: the delta rule's decode kernel at each launch of DELTA_DECODE_SWEEP, for decode
    steps of 1 and 8 sequences, after the default's rows."""
    timed = []
    for name in bench.KERNELS:
        monkeypatch.setattr(
            bench.Bench, name, lambda self, *a, _n=name, **k: timed.append((_n, *a))
        )
    fake_gpu(monkeypatch)
    bench.run(True, ["delta_rule"])
    swept = [row[1:] for row in timed if row[0] == "delta_rule" and len(row) == 4]
    configs = [bench.gated_deltanet.DeltaDecodeConfig(*f) for f in bench.DELTA_DECODE_SWEEP]
    assert swept == [(tokens, False, config) for tokens in (1, 8) for config in configs]
    assert bench.gated_deltanet.DeltaDecodeConfig() not in configs, "the default's row twice"


def test_the_4bit_decode_rows_time_batches_and_the_sweep_each_launch_at_one_token(monkeypatch):
    """The MXFP4 and NVFP4 decode's rows: 1, 4 and 8 tokens with the default launches; --sweep
    adds one token through the one-token launches at each of FP4_ONE_TOKEN_SWEEP's tiles and
    the tl.dot ones at each of FP4_DOT_SWEEP's, for the GPU to compare, and no other kernel's
    rows."""
    timed = []
    for name in bench.KERNELS:
        monkeypatch.setattr(
            bench.Bench, name, lambda self, *a, _n=name, **k: timed.append((_n, *a, *k.items()))
        )
    fake_gpu(monkeypatch)
    bench.run(False, ["fused_moe_mxfp4"])
    unsummed = ("fused_moe_mxfp4", 1, ("reduce", False))  # as the engine launches it
    assert timed == [("fused_moe_mxfp4", t) for t in (1, 4, 8)] + [unsummed]
    timed.clear()
    bench.run(True, ["fused_moe_mxfp4", "fused_moe_nvfp4"])
    assert {row[0] for row in timed} == {"fused_moe_mxfp4", "fused_moe_nvfp4"}
    configs = [OneTokenFP4Config(*f) for f in bench.FP4_ONE_TOKEN_SWEEP]
    configs += [DotDecodeConfig(*tiles) for tiles in bench.FP4_DOT_SWEEP]
    for name in ("fused_moe_mxfp4", "fused_moe_nvfp4"):
        rows = [row[1:] for row in timed if row[0] == name]
        assert rows == [(1,), (4,), (8,), (1, ("reduce", False))] + [(1, c) for c in configs]
    assert DotDecodeConfig() in configs, "the tl.dot launches at their default tiles"
    timed.clear()
    bench.run(True, ["fused_moe_mxfp4_gpt_oss"])
    rows = [row[1:] for row in timed]
    assert rows == [(1,), (8,)] + [(1, config) for config in configs], "gpt-oss's shape alike"
    chosen = choose_config(bench.TOP_K, bench.HIDDEN, bench.INTER, 132)
    assert chosen not in configs, "the default's row twice"
    for c in configs[: len(bench.FP4_ONE_TOKEN_SWEEP)]:  # no two threads read the same bytes
        threads = 32 * c.num_warps
        assert c.gate_up_block_n * c.gate_up_block_k // 32 >= threads, c
        assert c.down_block_n * c.down_block_k // 32 >= threads, c


@pytest.mark.usefixtures("triton_runs")
def test_the_4bit_decode_rows_run_their_launches_end_to_end(monkeypatch):
    """bench.run --sweep over the MXFP4 and NVFP4 decode at a small shape (the interpreter on
    the CPU): every row's launches run, one row each, labelled with its launches' tiles."""
    fake_gpu(monkeypatch)
    # three experts a layer, two of them each token's: few slots for the tl.dot rows to read
    for name, value in (("HIDDEN", 32), ("INTER", 32), ("EXPERTS", 3), ("TOP_K", 2)):
        monkeypatch.setattr(bench, name, value)
    monkeypatch.setattr(bench, "MIN_WORKING_SET_BYTES", 0)  # two layers a graph
    # a device of one SM: the one-token tiles' widest row blocks, the fewest programs to interpret
    monkeypatch.setattr(common, "sm_count", lambda device: 1)
    # the sweep's tiles take all 32 rows: one program a route
    monkeypatch.setattr(bench, "FP4_ONE_TOKEN_SWEEP", ((32, 512, 32, 256, 4, 3),))
    monkeypatch.setattr(bench, "FP4_DOT_SWEEP", ((32, 256),))
    calls = []

    def run_once(fns) -> float:
        calls.extend(fn() for fn in fns)
        return 10.0

    monkeypatch.setattr(bench, "graph_us_per_call", run_once)
    _, results, _ = bench.run(True, ["fused_moe_mxfp4", "fused_moe_nvfp4"])
    shapes = [(r.kernel, r.shape) for r in results]
    assert shapes == [
        (f"fused_moe_decode_{fmt}", f"T={t} K=2 H=32 I=32{variant}")
        for fmt, t, variant in [
            *(
                (fmt, t, variant)
                for fmt in ("mxfp4", "nvfp4")
                for t, variant in ((1, ""), (4, ""), (8, ""), (1, " parts"))
            ),
            *(
                (fmt, 1, variant)
                for variant in (" one-token 32/512/32/256/4/3/1", " tl.dot 32/256/3")
                for fmt in ("mxfp4", "nvfp4")
            ),
        ]
    ]
    assert all(torch.isfinite(out).all() for out in calls)
    # the unsummed rows' launches give each route's output: two layers of a format and of bf16
    # beside it, in each format's row
    assert sum(out.shape == (1, 2, 32) for out in calls) == 2 * (2 + 2)


def test_the_gpt_oss_decode_row_reads_what_it_counts(monkeypatch):
    """fused_moe_mxfp4_gpt_oss at a small geometry on the CPU (the interpreter): each call it
    times is the biased, clamped MXFP4 decode over its layer's own slots, equal to the
    dequantizing reference, and the row counts each routed expert's values, scales and biases."""
    fake_gpu(monkeypatch)
    # a device of one SM: the one-token tiles' widest row blocks, the fewest programs to interpret
    monkeypatch.setattr(common, "sm_count", lambda device: 1)
    calls = []
    monkeypatch.setattr(bench, "graph_us_per_call", lambda cs: calls.extend(cs) or 50.0)
    b = bench.Bench(4000.0, 600.0)
    geometry = {"hidden": 64, "inter": 32, "experts": 4, "top_k": 2, "limit": 7.0}
    b.fused_moe_mxfp4_gpt_oss(1, geometry=geometry)
    (row,) = b.results
    assert row.kernel == "fused_moe_decode_mxfp4" and "K=2 H=64 I=32 biased" in row.shape
    expert = 3 * 64 * 32 // 2 + 3 * 64 * 32 // 32 + (2 * 32 + 64) * 2
    assert row.bytes_moved == 2 * expert + 64 * (2 + 4)
    assert len(calls) == bench.layers_for(2 * expert)
    for call in calls[:2]:
        x, slots, weights, *bank = call.args
        assert slots.min() >= 0 and slots.max() < len(calls) * 4
        assert slots[0, 0] // 4 == slots[0, 1] // 4, "a token's routes are in one layer"
        kwargs = {k: v for k, v in call.keywords.items() if k != "config"}
        expected = bench.mxfp4_moe.fused_moe_decode_mxfp4_ref(x, slots, weights, *bank, **kwargs)
        torch.testing.assert_close(call(), expected, rtol=1e-4, atol=1e-4)


def test_the_fp8_projection_rows_read_what_they_count(monkeypatch):
    """linear_fp8 at a small projection on the CPU (the interpreter): each call it times is the
    FP8 skinny GEMM, equal to its dequantizing reference, and the row counts the FP8 weight, its
    block factors and the activations; --sweep times each FP8 tile once: more than one token
    in steps of at most 128 columns, one token in the bf16 tiles' steps and steps twice as wide."""
    fake_gpu(monkeypatch)
    monkeypatch.setattr(bench, "PROJECTIONS", {"qkv": (256, 384), "o": (128, 256)})
    monkeypatch.setattr(bench, "MIN_WORKING_SET_BYTES", 0)
    monkeypatch.setattr(bench, "graph_us_per_call", lambda fns: [fn() for fn in fns] and 10.0)
    real, seen = bench.gemv.linear_decode_fp8, []

    def recorded(x, weight, scale, **kwargs):
        out = real(x, weight, scale, **kwargs)
        seen.append((x, weight, scale, out))
        return out

    monkeypatch.setattr(bench.gemv, "linear_decode_fp8", recorded)
    b = bench.Bench(4000.0, 600.0)
    b.linear_fp8(1, "qkv")
    (row,) = b.results
    assert row.kernel == "linear_decode_fp8" and row.shape == "T=1 qkv N=256 K=384"
    assert row.bytes_moved == 256 * 384 + 2 * 3 * 4 + (256 + 384) * 2
    assert len(seen) == bench.layers_for(256 * 384 + 2 * 3 * 4)
    weights = {w.data_ptr() for _, w, _, _ in seen}
    assert len(weights) == len(seen), "each call reads another layer's weight"
    for x, weight, scale, out in seen[:2]:
        assert weight.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
        expected = bench.gemv.linear_decode_fp8_ref(x, weight, scale)
        assert x.dtype == torch.bfloat16  # the bf16 output rounds: a tolerance of its own
        torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)
    # the row of one token as the engine launches it: its first weights before the PDL wait
    seen.clear()
    b.linear_fp8(1, "qkv", early=True)
    assert b.results[-1].shape == "T=1 qkv N=256 K=384 early"
    for x, weight, scale, out in seen[:2]:
        expected = bench.gemv.linear_decode_fp8_ref(x, weight, scale)
        torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)
    swept = []
    monkeypatch.setattr(bench.Bench, "linear_fp8", lambda self, *a, **k: swept.append(a))
    bench.run(True, ["linear_fp8"])
    tiles = [a for a in swept if len(a) == 3]
    assert tiles and all(c.block_k <= 128 for tokens, _, c in tiles if tokens > 1)
    one_token = {c.block_k for tokens, _, c in tiles if tokens == 1}
    bf16_steps = {c.block_k for c in bench.GEMV_SWEEP[1]}
    assert one_token == bf16_steps | {2 * k for k in bf16_steps}, "the bf16 steps and twice them"
    assert len(tiles) == len(set(tiles))


def test_the_projection_rows_time_one_token_as_the_engine_launches_it(monkeypatch):
    """linear at a small projection on the CPU (the interpreter): the plain row has cuBLAS's
    beside it; the "early" row calls the skinny GEMM with its first weights loaded before the
    PDL wait, as the engine's `linear` does for one token, and gives its product."""
    fake_gpu(monkeypatch)
    monkeypatch.setattr(bench, "PROJECTIONS", {"o": (128, 256)})
    monkeypatch.setattr(bench, "MIN_WORKING_SET_BYTES", 0)
    monkeypatch.setattr(bench, "graph_us_per_call", lambda fns: [fn() for fn in fns] and 10.0)
    real, seen = bench.gemv.linear_decode, []

    def recorded(x, weight, **kwargs):
        out = real(x, weight, **kwargs)
        seen.append((x, weight, kwargs, out))
        return out

    monkeypatch.setattr(bench.gemv, "linear_decode", recorded)
    b = bench.Bench(4000.0, 600.0)
    b.linear(1, "o")
    assert [(r.kernel, r.shape) for r in b.results] == [
        ("linear_decode", "T=1 o N=128 K=256"), ("cublas_linear", "T=1 o N=128 K=256"),
    ]  # fmt: skip
    assert not any(kwargs["early_weights"] for _, _, kwargs, _ in seen)
    seen.clear()
    b.linear(1, "o", early=True)
    assert [(r.kernel, r.shape) for r in b.results[2:]] == [
        ("linear_decode", "T=1 o N=128 K=256 early")
    ]
    assert seen and all(kwargs["early_weights"] for _, _, kwargs, _ in seen)
    x, weight, _, out = seen[0]
    torch.testing.assert_close(out.float(), x.float() @ weight.float().T, rtol=1e-2, atol=1e-2)
