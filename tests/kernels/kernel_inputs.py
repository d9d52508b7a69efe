"""Random inputs and comparisons shared by the kernel tests."""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def randn(
    gen: torch.Generator, *shape: int, scale: float = 1.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Normal random values (never all zeros) on the test device."""
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def route_table(
    gen: torch.Generator, tokens: int, top_k: int, choices: int, masked: float = 0.0
) -> torch.Tensor:
    """int32 [T, K]: distinct picks per token from range(choices), a share of them set to -1."""
    picks = torch.stack([torch.randperm(choices, generator=gen)[:top_k] for _ in range(tokens)])
    drop = torch.rand(tokens, top_k, generator=gen) < masked
    return torch.where(drop, -1, picks).to(device=DEVICE, dtype=torch.int32)


def route_weights(gen: torch.Generator, tokens: int, top_k: int) -> torch.Tensor:
    """fp32 [T, K] positive weights, as a router gives."""
    return (torch.rand(tokens, top_k, generator=gen) + 0.1).to(DEVICE)


def assert_matches(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Assert same shape and dtype, every element written, and max error <= tol * max |ref|."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.dtype)
    assert torch.isfinite(out).all(), "the kernel left unwritten (poisoned) or non-finite elements"
    err = (out.float() - ref.float()).abs().max().item()
    scale = max(ref.float().abs().max().item(), 1e-6)
    assert err <= tol * scale, f"max error {err:.3e} exceeds {tol} x max |ref| = {tol * scale:.3e}"


def assert_top_k(
    weights: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor, k: int, renormalize: bool
) -> None:
    """Assert ids pick k distinct experts of highest probability, in descending order, and the
    weights are their probabilities (rescaled to sum 1 when renormalize). Experts of equal
    probability may come in either order, as torch.topk leaves ties unspecified."""
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == weights.shape == (logits.shape[0], k)
    probs = torch.softmax(logits.float(), dim=-1)
    picked = probs.gather(1, ids.long())
    assert torch.equal(picked, probs.topk(k, dim=-1).values), "not the k most probable experts"
    assert all(len(set(row)) == k for row in ids.tolist()), "an expert picked twice"
    expected = picked / picked.sum(-1, keepdim=True) if renormalize else picked
    torch.testing.assert_close(weights, expected, rtol=1e-5, atol=1e-6)


def nvfp4_bank(
    gate: tuple[torch.Tensor, ...], up: tuple[torch.Tensor, ...], down: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, ...]:
    """An NVFP4 bank (w13, w2, w13_scale, w2_scale, w13_scale_2, w2_scale_2) from gate's, up's
    and down's `nvfp4.quantize` outputs (values, block scales, tensor scales; gate, up and down
    quantized apart, as ModelOpt does): w13 gate's rows then up's, each with its tensor scale."""
    w2, w2_scale, w2_scale_2 = down
    return (
        torch.cat([gate[0], up[0]], dim=1),
        w2,
        torch.cat([gate[1], up[1]], dim=1),
        w2_scale,
        torch.stack([gate[2], up[2]], dim=1),
        w2_scale_2[:, None].contiguous(),
    )
