"""A decode step's token draws: each row's Gumbel-max over its logits, the noise hashed from the
row's seed, the drawn token's position and the token id (engine/sampling.py's `draw_tokens` sets
the thresholds of top-k, top-p and min-p and calls this).

`gumbel_argmax` picks, per row, the token of the largest logit * inv_t + g among those whose
logit is at least the row's threshold, g = -log(-log(u)) with u uniform in (0, 1) from
`draw_noise`; where inv_t is 0 (a greedy row) the largest logit, no noise. Picking the largest
perturbed logit draws each token with its softmax probability (the Gumbel-max trick); the hash
makes the draw a function of (seed, position, logits) alone, on any device and in any batch.
Ties go to the lowest token id, as torch.argmax's.

`top_k_threshold` sets a row's top-k and top-p threshold from its TOP_WIDTH largest logits, for a
top_k within TOP_WIDTH (sampling.Cut.NARROW): on CUDA, a program per row and TOPK_SPLIT token ids
sorts them and keeps its TOP_WIDTH largest, then a program per row sorts those and computes the
threshold (two launches in place of torch.topk's, which took 90 us at one row, and the
threshold's ten small ops).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import common

MASK32 = 0xFFFFFFFF
# the Triton kernel: token ids per program, and per loop step of a program
SPLIT = 4096
BLOCK = 1024
# the widest top_k `top_k_threshold` takes, and the token ids each of its first programs sorts
TOP_WIDTH = 128
TOPK_SPLIT = 8192


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Wellons' lowbias32) of int64 values in [0, 2**32).
    Products past 2**63 wrap on every torch device; the mask keeps their exact low 32 bits."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def row_keys(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Each row's key [n] int64, from its seed (any int64) and position."""
    key = mix32(position.long() & MASK32)
    key = mix32(key ^ (seed & MASK32))
    return mix32(key ^ ((seed >> 32) & MASK32))


def draw_noise(seed: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform noise in (0, 1), [n, vocab] fp32: 24 bits of a hash of each row's key and each
    token id."""
    tokens = mix32(torch.arange(vocab, device=seed.device))
    bits = mix32(tokens[None, :] ^ row_keys(seed, position)[:, None]) >> 8
    return (bits.float() + 0.5) * 2.0**-24


def gumbel_argmax_ref(
    logits: torch.Tensor,
    inv_t: torch.Tensor,
    threshold: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference: logits [n, V] (any float dtype, read as fp32), inv_t and threshold fp32 [n],
    seed int64 [n], position int32 or int64 [n]; int64 [n] (into `out` where given)."""
    _check(logits, inv_t, threshold, seed, position, out)
    x = logits.float()
    gumbel = -torch.log(-torch.log(draw_noise(seed, position, x.shape[1])))
    drawn = (inv_t > 0)[:, None]
    scores = torch.where(drawn, x * inv_t[:, None] + gumbel, x)
    scores = scores.masked_fill(x < threshold[:, None], -torch.inf)
    if out is None:
        return scores.argmax(dim=-1)
    return torch.argmax(scores, dim=-1, out=out)


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


@triton.jit
def _draw_kernel(
    logits_ptr,
    inv_t_ptr,
    threshold_ptr,
    seed_ptr,
    position_ptr,
    best_ptr,
    index_ptr,
    vocab,
    stride_l,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (row, part): the best score of token ids [part * SPLIT, (part + 1) * SPLIT) and its
    lowest id, into best/index [rows, parts] (an id of `vocab` where none is kept)."""
    common.pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    inv_t = tl.load(inv_t_ptr + row)
    threshold = tl.load(threshold_ptr + row)
    seed = tl.load(seed_ptr + row)
    position = tl.load(position_ptr + row).to(tl.int64)
    key = _mix32(position & 0xFFFFFFFF)
    key = _mix32(key ^ (seed & 0xFFFFFFFF))
    key = _mix32(key ^ ((seed >> 32) & 0xFFFFFFFF))
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_id = tl.zeros((BLOCK,), tl.int32) + vocab
    lanes = tl.arange(0, BLOCK)
    for start in range(part * SPLIT, part * SPLIT + SPLIT, BLOCK):
        ids = start + lanes
        ok = ids < vocab
        x = tl.load(logits_ptr + row * stride_l + ids, mask=ok, other=0.0)
        x = x.to(tl.float32)
        bits = _mix32(_mix32(ids.to(tl.int64)) ^ key) >> 8
        u = (bits.to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2**-24
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(inv_t > 0, x * inv_t + gumbel, x)
        score = tl.where(ok & (x >= threshold), score, float("-inf"))
        take = score > best  # strictly: a lane keeps its lowest id of a tie
        best = tl.where(take, score, best)
        best_id = tl.where(take, ids, best_id)
    top = tl.max(best, axis=0)
    top_id = tl.min(tl.where((best == top) & (best_id < vocab), best_id, vocab), axis=0)
    tl.store(best_ptr + row * parts + part, top)
    tl.store(index_ptr + row * parts + part, top_id)


@triton.jit
def _pick_kernel(
    best_ptr, index_ptr, out_ptr, parts, vocab, BLOCK_P: tl.constexpr, PDL: tl.constexpr
):
    """Program row: the best of its parts (the lowest id of a tie) into out[row] (int64)."""
    common.pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    ok = p < parts
    best = tl.load(best_ptr + row * parts + p, mask=ok, other=float("-inf"))
    ids = tl.load(index_ptr + row * parts + p, mask=ok, other=vocab)
    top = tl.max(best, axis=0)
    top_id = tl.min(tl.where(best == top, ids, vocab), axis=0)
    # every token excluded (no finite logit kept): the reference's argmax of -inf is token 0
    top_id = tl.where(top_id < vocab, top_id, 0)
    tl.store(out_ptr + row, top_id.to(tl.int64))


def gumbel_argmax_triton(
    logits: torch.Tensor,
    inv_t: torch.Tensor,
    threshold: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton: a program per row and SPLIT token ids, then one per row picking among them; two
    launches whatever the batch, graph-capturable."""
    _check(logits, inv_t, threshold, seed, position, out)
    n, vocab = logits.shape
    dev = logits.device
    parts = triton.cdiv(vocab, SPLIT)
    best = common.alloc((n, parts), torch.float32, dev)
    index = common.alloc((n, parts), torch.int32, dev)
    if out is None:
        out = common.alloc((n,), torch.int64, dev)
    pdl = common.pdl_launch(dev)
    _draw_kernel[(n, parts)](
        logits, inv_t, threshold, seed, position, best, index, vocab, logits.stride(0),
        SPLIT=SPLIT, BLOCK=BLOCK, num_warps=4, **pdl,
    )  # fmt: skip
    _pick_kernel[(n,)](
        best, index, out, parts, vocab, BLOCK_P=common.next_pow2(parts, 16), num_warps=1, **pdl
    )
    return out


def gumbel_argmax(
    logits: torch.Tensor,
    inv_t: torch.Tensor,
    threshold: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's drawn token: the Triton kernels on CUDA, the reference elsewhere (so the host
    and the decode graphs of one device draw alike)."""
    if logits.is_cuda:
        return gumbel_argmax_triton(logits, inv_t, threshold, seed, position, out)
    return gumbel_argmax_ref(logits, inv_t, threshold, seed, position, out)


def top_p_threshold(
    ordered: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Each row's least kept logit under its top-k and top-p, from the row's likeliest logits
    sorted [n, W] (fp32): top_k caps at W (0: W), and top-p keeps the fewest tokens whose
    probability, renormalized within the top-k, before the last one is within top_p."""
    width = ordered.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=width), width)
    in_k = torch.arange(width, device=ordered.device)[None, :] < k[:, None]
    probs = torch.softmax((ordered * inv_t[:, None]).masked_fill(~in_k, -torch.inf), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    kept = torch.where(top_p[:, None] < 1, in_k & (before <= top_p[:, None]), in_k)
    last = kept.sum(dim=-1, keepdim=True).clamp(min=1) - 1
    return ordered.gather(1, last)[:, 0]


def top_k_threshold_ref(
    logits: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Reference: each row's threshold (`top_p_threshold`) from its TOP_WIDTH largest logits
    where its top_k is in [1, TOP_WIDTH], else -inf (the caller's to set). logits [n, V] (any
    float dtype, read as fp32), inv_t and top_p fp32 [n], top_k int64 [n]; fp32 [n]."""
    _check_top_k(logits, inv_t, top_k, top_p)
    x = logits.float()
    ordered = torch.topk(x, min(TOP_WIDTH, x.shape[1]), dim=-1).values
    narrow = (top_k > 0) & (top_k <= TOP_WIDTH)
    return torch.where(narrow, top_p_threshold(ordered, inv_t, top_k, top_p), -torch.inf)


@triton.jit
def _top_block_kernel(
    logits_ptr, cand_ptr, vocab, stride_l, SPLIT: tl.constexpr, WIDTH: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """Program (row, part): the WIDTH largest logits of token ids [part * SPLIT, (part + 1) *
    SPLIT), sorted, into cand[row, part * WIDTH:] (fp32; -inf past the vocabulary)."""
    common.pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    ids = part * SPLIT + tl.arange(0, SPLIT)
    x = tl.load(logits_ptr + row * stride_l + ids, mask=ids < vocab, other=float("-inf"))
    x = tl.sort(x.to(tl.float32), descending=True)
    # row 0 of [SPLIT / WIDTH, WIDTH] is the WIDTH largest: each column's largest
    top = tl.max(tl.reshape(x, (SPLIT // WIDTH, WIDTH)), axis=0)
    tl.store(cand_ptr + (row * parts + part) * WIDTH + tl.arange(0, WIDTH), top)


@triton.jit
def _top_threshold_kernel(
    cand_ptr, inv_t_ptr, top_k_ptr, top_p_ptr, threshold_ptr, count, CAND: tl.constexpr,
    WIDTH: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Program row: the WIDTH largest of its `count` candidates sorted, then its threshold
    (`top_p_threshold`; -inf where top_k is not in [1, WIDTH])."""
    common.pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CAND)
    x = tl.load(cand_ptr + row * count + c, mask=c < count, other=float("-inf"))
    x = tl.sort(x, descending=True)
    v = tl.max(tl.reshape(x, (CAND // WIDTH, WIDTH)), axis=0)
    inv_t = tl.load(inv_t_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    i = tl.arange(0, WIDTH)
    in_k = i < top_k
    # the softmax's numerators within the top-k; top-p compares the sum before each with
    # top_p times their total
    p = tl.where(in_k, tl.exp((v - tl.max(v, axis=0)) * inv_t), 0.0)
    before = tl.cumsum(p, axis=0) - p
    limit = tl.where(top_p < 1.0, top_p * tl.sum(p, axis=0), float("inf"))
    kept = in_k & (before <= limit)
    last = tl.maximum(tl.sum(kept.to(tl.int32), axis=0), 1) - 1
    threshold = tl.max(tl.where(i == last, v, float("-inf")), axis=0)
    threshold = tl.where((top_k > 0) & (top_k <= WIDTH), threshold, float("-inf"))
    tl.store(threshold_ptr + row, threshold)


def top_k_threshold_triton(
    logits: torch.Tensor,
    inv_t: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    split: int = TOPK_SPLIT,
) -> torch.Tensor:
    """Triton: `top_k_threshold_ref` in two launches whatever the batch, graph-capturable. split:
    the token ids each first program sorts (a power of two, at least TOP_WIDTH)."""
    _check_top_k(logits, inv_t, top_k, top_p)
    n, vocab = logits.shape
    dev = logits.device
    parts = triton.cdiv(vocab, split)
    cand = common.alloc((n, parts * TOP_WIDTH), torch.float32, dev)
    threshold = common.alloc((n,), torch.float32, dev)
    pdl = common.pdl_launch(dev)
    _top_block_kernel[(n, parts)](
        logits, cand, vocab, logits.stride(0), SPLIT=split, WIDTH=TOP_WIDTH,
        num_warps=8 if split > 4096 else 4, **pdl,
    )  # fmt: skip
    _top_threshold_kernel[(n,)](
        cand, inv_t, top_k, top_p, threshold, parts * TOP_WIDTH,
        CAND=common.next_pow2(parts * TOP_WIDTH), WIDTH=TOP_WIDTH, num_warps=4, **pdl,
    )  # fmt: skip
    return threshold


def top_k_threshold(
    logits: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Each row's top-k and top-p threshold for a top_k within TOP_WIDTH (-inf elsewhere): the
    Triton kernels on CUDA, the reference elsewhere."""
    if logits.is_cuda:
        return top_k_threshold_triton(logits, inv_t, top_k, top_p)
    return top_k_threshold_ref(logits, inv_t, top_k, top_p)


def _check_top_k(logits, inv_t, top_k, top_p) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, vocab], got {tuple(logits.shape)}")
    common.check_last_dim_contiguous("logits", logits)
    n = logits.shape[0]
    for name, t, dtype in (
        ("inv_t", inv_t, torch.float32), ("top_k", top_k, torch.int64),
        ("top_p", top_p, torch.float32),
    ):  # fmt: skip
        if t.shape != (n,) or t.dtype != dtype:
            raise ValueError(f"{name} must be [{n}] {dtype}, got {tuple(t.shape)} {t.dtype}")
    common.check_same_device(logits=logits, inv_t=inv_t, top_k=top_k, top_p=top_p)


def _check(logits, inv_t, threshold, seed, position, out) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [n, vocab], got {tuple(logits.shape)}")
    common.check_last_dim_contiguous("logits", logits)
    n = logits.shape[0]
    for name, t, dtypes in (
        ("inv_t", inv_t, (torch.float32,)),
        ("threshold", threshold, (torch.float32,)),
        ("seed", seed, (torch.int64,)),
        ("position", position, (torch.int32, torch.int64)),
    ):
        if t.shape != (n,) or t.dtype not in dtypes:
            raise ValueError(
                f"{name} must be [{n}] {' or '.join(str(d) for d in dtypes)}, got "
                f"{tuple(t.shape)} {t.dtype}"
            )
    if out is not None and (out.shape != (n,) or out.dtype != torch.int64):
        raise ValueError(f"out must be int64 [{n}], got {tuple(out.shape)} {out.dtype}")
    common.check_same_device(logits=logits, inv_t=inv_t, threshold=threshold, seed=seed,
                             position=position)  # fmt: skip
