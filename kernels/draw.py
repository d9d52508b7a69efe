"""A decode step's token draws: each row's Gumbel-max over its logits, the noise hashed from the
row's seed, the drawn token's position and the token id; `draw_tokens` sets the thresholds of
top-k, top-p and min-p on the device and calls it (engine/runtime/sampling.py maps each request to
its row's arguments).

`gumbel_argmax` picks, per row, the token of the largest logit * inv_t + g among those whose
logit is at least the row's threshold, g = -log(-log(u)) with u uniform in (0, 1) from
`draw_noise`; where inv_t is 0 (a greedy row) the largest logit, no noise. Picking the largest
perturbed logit draws each token with its softmax probability (the Gumbel-max trick); the hash
makes the draw a function of (seed, position, logits) alone, on any device and in any batch.
Ties go to the lowest token id, as torch.argmax's.
"""

from __future__ import annotations

import enum
import math

import torch

from . import common
from .common import tl, triton

MASK32 = 0xFFFFFFFF
# the Triton kernel: token ids per program, and per loop step of a program
SPLIT = 4096
BLOCK = 1024
# the widest top_k whose draw takes the logits' torch.topk of this width, not a vocabulary sort
TOP_K_WIDTH = 128


class Cut(enum.IntEnum):
    """What a draw's filters read of the sorted logits (`draw_tokens`); a batch takes its rows'
    widest."""

    TOP = 0  # min-p at most: the top logit (one amax)
    NARROW = 1  # top_k within TOP_K_WIDTH (top-p inside it): torch.topk of that width
    SORT = 2  # top-p over a wider top_k or none: the vocabulary sorted


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


def draw_tokens(
    logits: torch.Tensor,
    inv_t: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_offset: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    cut: Cut | None = None,
) -> torch.Tensor:
    """One token per row of `logits` [n, V]: the top logit where the row's inverse temperature
    `inv_t` is 0, else a draw from the softmax of logits * inv_t, limited to the top_k (0: off)
    likeliest tokens, then to the fewest whose probability before the last one is within top_p,
    and to the tokens whose logit is at least the top one's plus `min_offset` (min-p; -inf: off).
    The draw is `gumbel_argmax`, its noise a hash of the row's seed and `position` (the drawn
    token's). Every argument is [n] on the logits' device (position int32 or int64); no value is
    read on the host, so a CUDA graph can hold the draw. cut: the widest of the rows' cuts (a
    narrower one draws wrongly; None: read the rows, a sync). A row's tokens do not depend on the
    cut its batch takes: a row with top_k within TOP_K_WIDTH takes its threshold from that many
    sorted logits under either cut. Returns int64 [n] (into `out` where given)."""
    logits = logits.float()
    if cut is None:
        cut = _widest_cut(top_k, top_p)
    if cut is Cut.TOP:  # min-p alone (a greedy row's offset is -inf: it keeps every token)
        return gumbel_argmax(logits, inv_t, logits.amax(dim=-1) + min_offset, seed, position, out)
    narrow = (top_k > 0) & (top_k <= TOP_K_WIDTH)
    width = min(TOP_K_WIDTH, logits.shape[1])
    if cut is Cut.NARROW:  # a row that does not filter keeps what min-p keeps
        ordered = torch.topk(logits, width, dim=-1).values
        threshold = torch.where(narrow, _threshold(ordered, inv_t, top_k, top_p), -math.inf)
    else:
        ordered = torch.sort(logits, dim=-1, descending=True).values
        threshold = torch.where(
            narrow,
            _threshold(ordered[:, :width].contiguous(), inv_t, top_k, top_p),
            _threshold(ordered, inv_t, top_k, top_p),
        )
    # a greedy row's threshold never passes its top logit, which its draw takes
    threshold = torch.maximum(threshold, ordered[:, 0] + min_offset)
    return gumbel_argmax(logits, inv_t, threshold, seed, position, out)


def _widest_cut(top_k: torch.Tensor, top_p: torch.Tensor) -> Cut:
    """The widest cut of rows given as tensors (read on the host: a sync)."""
    narrow = (top_k > 0) & (top_k <= TOP_K_WIDTH)
    if bool((~narrow & ((top_k > 0) | (top_p < 1))).any()):
        return Cut.SORT
    return Cut.NARROW if bool(narrow.any()) else Cut.TOP


def _threshold(
    ordered: torch.Tensor, inv_t: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Each row's least kept logit under its top-k and top-p (`draw_tokens`), from the row's
    likeliest logits sorted [n, W]: top-k caps at W (0: W), top-p counts within the top-k."""
    width = ordered.shape[1]
    k = torch.where(top_k > 0, top_k.clamp(max=width), width)
    in_k = torch.arange(width, device=ordered.device)[None, :] < k[:, None]
    probs = torch.softmax((ordered * inv_t[:, None]).masked_fill(~in_k, -math.inf), dim=-1)
    before = probs.cumsum(dim=-1) - probs
    kept = torch.where(top_p[:, None] < 1, in_k & (before <= top_p[:, None]), in_k)
    last = kept.sum(dim=-1, keepdim=True).clamp(min=1) - 1
    return ordered.gather(1, last)[:, 0]


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
