"""The fused qk norm + RoPE + KV write against its torch reference, bit for bit.

CPU runs use the Triton interpreter. There the reference's RMSNorm sums squares in the CPU's order,
not CUDA's, so the plain comparisons use values on a grid of 1/16 (sums of their squares are exact
in any order); `test_squares_are_added_in_torch_cuda_order` checks the order itself on any values.
On a GPU, the tests at the end compare with torch's CUDA ops on any values, at real shapes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from moelab.kernels import rope_kv

from .kernel_inputs import DEVICE, randn

pytestmark = pytest.mark.usefixtures("triton_runs")

EPS = 1e-6
MAX_POSITIONS = 64
DTYPE_IDS = ["fp32", "bf16", "fp16"]


@dataclass(frozen=True, slots=True)
class Shape:
    """One call's geometry and options."""

    tokens: int = 5
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: torch.dtype = torch.float32
    qk_norm: bool = True
    grid_values: bool = True  # multiples of 1/16: sums of squares exact in any order
    extra_cols: int = 0  # qkv as a column slice of a wider tensor
    num_blocks: int = 6
    block_size: int = 4


def make_args(gen: torch.Generator, s: Shape) -> dict[str, object]:
    """Fresh inputs for one call; caches full of NaN, slots scattered over the blocks."""
    width = (s.num_heads + 2 * s.num_kv_heads) * s.head_dim
    if s.grid_values:
        wide = torch.randint(-64, 65, (s.tokens, width + 2 * s.extra_cols), generator=gen) / 16
        wide = wide.to(DEVICE, s.dtype)
    else:
        wide = randn(gen, s.tokens, width + 2 * s.extra_cols, scale=2.0, dtype=s.dtype)
    angles = randn(gen, MAX_POSITIONS, s.head_dim, scale=3.0)
    norms = [randn(gen, s.head_dim, dtype=s.dtype) + 1 for _ in range(2)]
    cache_shape = (s.num_blocks + 1, s.block_size, s.num_kv_heads, s.head_dim)
    slots = torch.randperm(s.num_blocks * s.block_size, generator=gen)[: s.tokens]
    return {
        "qkv": wide[:, s.extra_cols : s.extra_cols + width],
        "positions": torch.randint(0, MAX_POSITIONS, (s.tokens,), generator=gen).to(DEVICE),
        "cos_table": angles.cos().to(s.dtype),
        "sin_table": angles.sin().to(s.dtype),
        "q_norm": norms[0] if s.qk_norm else None,
        "k_norm": norms[1] if s.qk_norm else None,
        "eps": EPS,
        "k_cache": torch.full(cache_shape, float("nan"), device=DEVICE, dtype=s.dtype),
        "v_cache": torch.full(cache_shape, float("nan"), device=DEVICE, dtype=s.dtype),
        "slots": slots.to(DEVICE),
        "num_heads": s.num_heads,
        "num_kv_heads": s.num_kv_heads,
        "head_dim": s.head_dim,
    }


def run_both(args: dict[str, object]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(kernel, reference) pairs for q, k_cache and v_cache, each side on its own caches."""
    ref_args = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    q_ref = rope_kv.qk_norm_rope_kv_ref(**ref_args)
    q = rope_kv.qk_norm_rope_kv_triton(**args)
    return [
        (q, q_ref),
        (args["k_cache"], ref_args["k_cache"]),
        (args["v_cache"], ref_args["v_cache"]),
    ]


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal shape, dtype and bits (NaN left in a cache equals NaN; -0.0 differs from 0.0)."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.dtype)
    ints = {2: torch.int16, 4: torch.int32}[out.element_size()]
    differ = out.view(ints) != ref.view(ints)
    assert not differ.any(), (
        f"{int(differ.sum())} of {out.numel()} elements differ, e.g. "
        f"{out[differ][:4].tolist()} vs {ref[differ][:4].tolist()}"
    )


def assert_matches_reference(args: dict[str, object]) -> None:
    for out, ref in run_both(args):
        assert_same_bits(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=DTYPE_IDS)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_norm"])
@pytest.mark.parametrize("tokens", [1, 6])
def test_matches_reference_bit_for_bit(gen, dtype, qk_norm, tokens):
    shape = Shape(tokens=tokens, dtype=dtype, qk_norm=qk_norm, grid_values=qk_norm)
    assert_matches_reference(make_args(gen, shape))


@pytest.mark.parametrize(
    "shape",
    [
        Shape(num_heads=4, num_kv_heads=4, head_dim=16, dtype=torch.float16),
        Shape(tokens=3, num_heads=4, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16),
        Shape(tokens=2, num_heads=4, num_kv_heads=1, head_dim=128, dtype=torch.bfloat16),
    ],
    ids=["no_gqa_d16", "gqa4_d64", "gqa4_d128"],
)
def test_head_geometries(gen, shape):
    assert_matches_reference(make_args(gen, shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS[:2])
def test_qkv_may_be_a_column_slice_of_a_wider_tensor(gen, dtype):
    args = make_args(gen, Shape(tokens=4, dtype=dtype, extra_cols=24))
    assert args["qkv"].stride(0) != args["qkv"].shape[1]
    assert_matches_reference(args)


def test_cache_slots_not_named_are_left_untouched(gen):
    shape = Shape(tokens=5, num_blocks=3, block_size=8)
    args = make_args(gen, shape)
    for name in ("k_cache", "v_cache"):
        args[name] = randn(gen, *args[name].shape)
    before = {name: args[name].clone() for name in ("k_cache", "v_cache")}
    rope_kv.qk_norm_rope_kv_triton(**args)
    named = torch.zeros((shape.num_blocks + 1) * shape.block_size, dtype=torch.bool, device=DEVICE)
    named[args["slots"]] = True
    for name in ("k_cache", "v_cache"):
        after_rows = args[name].flatten(0, 1)
        before_rows = before[name].flatten(0, 1)
        assert_same_bits(after_rows[~named], before_rows[~named])
        assert not torch.equal(after_rows[named], before_rows[named])


def test_padding_rows_may_share_one_scratch_slot(gen):
    """Rows a CUDA graph pads a batch with all write the cache's spare block; real rows stay
    exact, and the spare slot holds one of the padding rows."""
    shape = Shape(tokens=6, num_blocks=4, block_size=4)
    args = make_args(gen, shape)
    scratch = shape.num_blocks * shape.block_size
    args["slots"][3:] = scratch
    (q, q_ref), *caches = run_both(args)
    assert_same_bits(q, q_ref)
    for cache, ref in caches:
        rows, ref_rows = cache.flatten(0, 1), ref.flatten(0, 1)
        assert_same_bits(rows[:scratch], ref_rows[:scratch])
        assert torch.isfinite(rows[scratch]).all()


def test_one_layer_of_a_layered_cache(gen):
    """The engine passes kv.k[layer]: a view into the cache of every layer."""
    args = make_args(gen, Shape(tokens=3, dtype=torch.bfloat16))
    layered = {
        name: args[name].expand(3, *args[name].shape).clone() for name in ("k_cache", "v_cache")
    }
    assert_matches_reference(
        {**args, "k_cache": layered["k_cache"][1], "v_cache": layered["v_cache"][1]}
    )
    for cache in layered.values():
        assert torch.isnan(cache[0]).all() and torch.isnan(cache[2]).all()


# torch's CUDA mean over the last dimension, transcribed from ATen/native/cuda/Reduce.cuh (2.11):
# set_block_dimension, thread_reduce (vectorized by 4 from 128 inputs), block_x_reduce.
def torch_cuda_row_sum(row: np.ndarray, rows: int) -> np.float32:
    """The fp32 sum of one row, its elements added in the order torch's CUDA reduction adds them
    when it reduces `rows` such rows at once."""
    f32 = np.float32
    n = len(row)
    vec = 4 if n >= 128 else 1
    dim0 = n // vec
    dim0_pow2 = min(1 << (dim0.bit_length() - 1), 512)
    dim1_pow2 = min(1 << (rows.bit_length() - 1), 512)
    width = min(dim0_pow2, 32)
    height = min(dim1_pow2, 512 // width)
    width = min(dim0_pow2, 512 // height)
    lanes = []
    for lane in range(width):
        acc = [f32(0)] * 4
        idx = lane
        if vec == 4:
            while idx * 4 + 3 < n:
                acc = [f32(acc[i] + row[idx * 4 + i]) for i in range(4)]
                idx += width
        else:
            while idx + 3 * width < n:
                acc = [f32(acc[i] + row[idx + i * width]) for i in range(4)]
                idx += 4 * width
            for i in range(4):
                if idx >= n:
                    break
                acc[i] = f32(acc[i] + row[idx])
                idx += width
        total = acc[0]
        for i in range(1, 4):
            total = f32(total + acc[i])
        lanes.append(total)
    offset = width // 2
    while offset >= 1:
        for lane in range(offset):
            lanes[lane] = f32(lanes[lane] + lanes[lane + offset])
        offset //= 2
    return lanes[0]


def rmsnorm_in_torch_cuda_order(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rmsnorm_ref with its mean of squares summed as on CUDA (the rest on x's device)."""
    xf = x.float()
    squares = xf.pow(2).reshape(-1, x.shape[-1]).cpu().numpy()
    sums = [torch_cuda_row_sum(row, len(squares)) for row in squares]
    mean = torch.tensor(np.array(sums), device=x.device).view(*x.shape[:-1], 1) / x.shape[-1]
    return weight * (xf * torch.rsqrt(mean + eps)).to(x.dtype)


@pytest.mark.parametrize(
    ("shape", "lanes"),
    [
        (Shape(tokens=3, head_dim=64, dtype=torch.float32), (32, 64)),
        (Shape(tokens=2, head_dim=128), (32, 32)),
        (Shape(tokens=2, num_heads=8, num_kv_heads=1, head_dim=256), (32, 64)),
    ],
    ids=["d64", "d128", "d256"],
)
def test_squares_are_added_in_torch_cuda_order(gen, monkeypatch, shape, lanes):
    monkeypatch.setattr(rope_kv, "rmsnorm_ref", rmsnorm_in_torch_cuda_order)
    args = make_args(gen, replace(shape, grid_values=False))
    q_rows, k_rows = shape.tokens * shape.num_heads, shape.tokens * shape.num_kv_heads
    # the cases cover torch's layouts: 32 lanes, more lanes for few rows, several loads per lane
    assert (
        rope_kv._torch_lanes(shape.head_dim, q_rows)[0],
        rope_kv._torch_lanes(shape.head_dim, k_rows)[0],
    ) == lanes
    assert_matches_reference(args)


def test_cpu_tensors_go_to_the_reference(gen, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the Triton path ran on CPU tensors")

    monkeypatch.setattr(rope_kv, "qk_norm_rope_kv_triton", refuse)
    args = {
        k: v.cpu() if isinstance(v, torch.Tensor) else v
        for k, v in make_args(gen, Shape(tokens=2)).items()
    }
    ref_args = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
    q = rope_kv.qk_norm_rope_kv(**args)
    assert_same_bits(q, rope_kv.qk_norm_rope_kv_ref(**ref_args))
    assert_same_bits(args["k_cache"], ref_args["k_cache"])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"head_dim": 48}, "head_dim must be a power of two"),
        ({"num_heads": 7}, r"qkv must be \[T, \(Hq \+ 2 Hkv\) \* D\]"),
        ({"k_norm": None}, "q_norm and k_norm go together"),
        ({"q_norm": torch.ones(16)}, r"q_norm must be \[32\]"),
        (
            {"positions": torch.zeros(4, dtype=torch.long)},
            r"positions must be int32 or int64 \[T=5\]",
        ),
        ({"slots": torch.zeros(5)}, "slots must be int32 or int64"),
        ({"cos_table": torch.ones(8, 32, dtype=torch.float16)}, "cos_table must be"),
        ({"v_cache": torch.ones(2, 6, 2, 32).transpose(0, 1)}, "v_cache must be a contiguous"),
    ],
    ids=["head_dim", "width", "one_norm", "norm_size", "positions", "slot_dtype", "table", "cache"],
)
def test_bad_arguments_are_refused_with_the_reason(gen, change, message):
    args = make_args(gen, Shape(tokens=5))
    args.update({k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in change.items()})
    for fn in (rope_kv.qk_norm_rope_kv_ref, rope_kv.qk_norm_rope_kv_triton):
        with pytest.raises(ValueError, match=message):
            fn(**args)


# On a GPU: against torch's CUDA ops on any values (the summation order matters), at Qwen3-30B-A3B's
# geometry (32 q heads, 4 KV heads of 128, qk norm) and the token counts of decode and prefill.
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
QWEN3 = Shape(num_heads=32, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16, grid_values=False,
              num_blocks=512, block_size=16)  # fmt: skip


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("tokens", [1, 2, 3, 8, 64, 300])
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"]
)
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qk_norm", "no_norm"])
def test_cuda_qwen3_geometry_matches_torch(gen, tokens, dtype, qk_norm):
    assert_matches_reference(
        make_args(gen, replace(QWEN3, tokens=tokens, dtype=dtype, qk_norm=qk_norm))
    )


@pytest.mark.cuda
@cuda_only
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("tokens", [1, 4, 16, 100])
def test_cuda_other_head_dims_match_torch(gen, head_dim, tokens):
    shape = replace(QWEN3, tokens=tokens, num_heads=16, num_kv_heads=2, head_dim=head_dim)
    assert_matches_reference(make_args(gen, shape))


@pytest.mark.cuda
@cuda_only
def test_cuda_graph_replays_with_new_tokens(gen):
    shape = replace(QWEN3, tokens=8)
    args = make_args(gen, shape)
    rope_kv.qk_norm_rope_kv_triton(**args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = rope_kv.qk_norm_rope_kv_triton(**args)
    for _ in range(3):
        fresh = make_args(gen, shape)
        for name in ("qkv", "positions", "slots"):
            args[name].copy_(fresh[name])
        ref_args = {**args, "k_cache": args["k_cache"].clone(), "v_cache": args["v_cache"].clone()}
        graph.replay()
        assert_same_bits(q, rope_kv.qk_norm_rope_kv_ref(**ref_args))
        assert_same_bits(args["k_cache"], ref_args["k_cache"])
        assert_same_bits(args["v_cache"], ref_args["v_cache"])
