"""Decode MoE over the expert cache's slots: gate/up, SiLU·up, down and the weighted sum.

Gate/up is a split-N GEMV grid over (route, row block). A slot that several tokens route to is read
once: the first route naming a slot (its leader) computes it for every token that names it.

The down projection and the weighted sum over the routes take one of two ways (`fuse_sum`):
- fused: gate/up also records each route's group (the slot it leads, and for each token the act
  row and summed weight), and one launch over row blocks of H walks the leading routes in route
  order, accumulating their weighted down projections into [T, H];
- unfused (the default until the fused launch is measured on the GPU): a (route, row block) grid
  writes each route's weighted projection to [T, K, H] (zeros for routes that lead nothing) and
  torch sums over K: one more launch.
Both sum in a fixed order without atomics, so a call gives the same bits each time; nothing depends
on the data on the host, so the call can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import common

# Tokens one program handles at once; larger batches are split into chunks of this many tokens.
MAX_TOKENS_PER_LAUNCH = 64


@dataclass(frozen=True, slots=True)
class DecodeMoEConfig:
    """How the decode launches run: whether the sum over routes is fused into the down launch, and
    each launch's tile sizes (rows per program, reduction step) and pipeline depth.

    down_block_* tile the unfused down launch; down_sum_* the fused one (fuse_sum=True), whose
    programs hold the groups of down_sum_route_batch routes in registers at a time."""

    gate_up_block_n: int = 16
    gate_up_block_k: int = 256
    down_block_n: int = 32
    down_block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4
    fuse_sum: bool = False
    down_sum_block_n: int = 16
    down_sum_block_k: int = 256
    down_sum_num_stages: int = 4
    down_sum_route_batch: int = 32

    def __post_init__(self) -> None:
        for name in (
            "gate_up_block_n",
            "gate_up_block_k",
            "down_block_n",
            "down_block_k",
            "down_sum_block_n",
            "down_sum_block_k",
        ):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot), got {value}")
        for name in ("num_stages", "down_sum_num_stages"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("num_warps", "down_sum_route_batch"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two, got {value}")


def fused_moe_decode_ref(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reference, a torch loop: sum over routes of weight * w2[s] @ (silu(gate·x) * (up·x))."""
    _check(x, slot_ids, route_weights, w13, w2)
    dtype = compute_dtype or x.dtype
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    slots = slot_ids.tolist()
    weights = route_weights.float()
    for t, row in enumerate(slots):
        xt = x[t].to(dtype)
        for k, slot in enumerate(row):
            if slot < 0:
                continue
            gate_up = w13[slot].to(dtype) @ xt
            act = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += weights[t, k] * (w2[slot].to(dtype) @ act).float()
    return out


@triton.jit
def _route_group(
    slots_ptr, route, num_tokens, TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr
):
    """For this program's route: its slot, whether it leads that slot, and each token's first k."""
    slot = tl.load(slots_ptr + route)
    t_idx = tl.arange(0, BLOCK_T)
    k_idx = tl.arange(0, BLOCK_R)
    flat = t_idx[:, None] * TOP_K + k_idx[None, :]
    valid = (t_idx[:, None] < num_tokens) & (k_idx[None, :] < TOP_K)
    all_slots = tl.load(slots_ptr + flat, mask=valid, other=-1)
    match = (all_slots == slot) & valid
    earlier = tl.sum(tl.sum((match & (flat < route)).to(tl.int32), axis=1), axis=0)
    leads = (slot >= 0) & (earlier == 0)
    # The first k of each token naming this slot holds the token's result; later duplicates are 0.
    first_k = tl.min(tl.where(match, k_idx[None, :], BLOCK_R), axis=1)
    return slot, leads, match, first_k, t_idx


@triton.jit
def _gate_up_kernel(
    x_ptr,
    slots_ptr,
    weights_ptr,
    w13_ptr,
    act_ptr,
    leader_ptr,
    group_k_ptr,
    group_w_ptr,
    num_tokens,
    hidden,
    inter,
    stride_xt,
    stride_ws,
    stride_wn,
    stride_at,
    stride_ak,
    stride_g,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr,
    WRITE_GROUPS: tl.constexpr,
):
    route = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot, leads, match, first_k, t_idx = _route_group(
        slots_ptr, route, num_tokens, TOP_K, BLOCK_T, BLOCK_R
    )
    if WRITE_GROUPS and pid_n == 0:
        # The fused down launch reads each route's group from here rather than recomputing it:
        # the slot the route leads (-1: none), each token's act row and summed weight in it.
        in_group = (first_k < BLOCK_R) & leads
        flat = t_idx[:, None] * TOP_K + tl.arange(0, BLOCK_R)[None, :]
        route_w = tl.load(weights_ptr + flat, mask=match, other=0.0).to(tl.float32)
        token_w = tl.sum(route_w, axis=1)
        tl.store(leader_ptr + route, tl.where(leads, slot, -1).to(tl.int32))
        tl.store(group_k_ptr + route * stride_g + t_idx, tl.where(in_group, first_k, -1))
        tl.store(group_w_ptr + route * stride_g + t_idx, tl.where(in_group, token_w, 0.0))
    if leads:
        has = first_k < BLOCK_R
        n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n_idx < inter
        gate_base = (
            w13_ptr + slot.to(tl.int64) * stride_ws + n_idx[None, :].to(tl.int64) * stride_wn
        )
        up_base = gate_base + inter * stride_wn
        x_base = x_ptr + t_idx[:, None].to(tl.int64) * stride_xt
        acc_gate = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_idx = k0 + tl.arange(0, BLOCK_K)
            k_ok = k_idx < hidden
            xs = tl.load(x_base + k_idx[None, :], mask=has[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            gate = tl.load(gate_base + k_idx[:, None], mask=w_mask, other=0.0)
            up = tl.load(up_base + k_idx[:, None], mask=w_mask, other=0.0)
            xs = xs.to(COMPUTE)
            # "ieee": an fp32 compute dtype multiplies exactly, not in TF32; bf16/fp16 ignore it.
            acc_gate += tl.dot(xs, gate.to(COMPUTE), input_precision="ieee")
            acc_up += tl.dot(xs, up.to(COMPUTE), input_precision="ieee")
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        act_ptrs = (
            act_ptr + t_idx[:, None] * stride_at + first_k[:, None] * stride_ak + n_idx[None, :]
        )
        tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=has[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr,
    slots_ptr,
    weights_ptr,
    w2_ptr,
    y_ptr,
    num_tokens,
    hidden,
    inter,
    stride_at,
    stride_ak,
    stride_ws,
    stride_wn,
    stride_yt,
    stride_yk,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    route = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot, leads, match, first_k, t_idx = _route_group(
        slots_ptr, route, num_tokens, TOP_K, BLOCK_T, BLOCK_R
    )
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < hidden
    if leads:
        has = first_k < BLOCK_R
        k_all = tl.arange(0, BLOCK_R)
        flat = t_idx[:, None] * TOP_K + k_all[None, :]
        route_w = tl.load(weights_ptr + flat, mask=match, other=0.0).to(tl.float32)
        token_w = tl.sum(route_w, axis=1)
        w_base = w2_ptr + slot.to(tl.int64) * stride_ws + n_idx[None, :].to(tl.int64) * stride_wn
        a_base = act_ptr + t_idx[:, None] * stride_at + first_k[:, None] * stride_ak
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            k_idx = k0 + tl.arange(0, BLOCK_K)
            k_ok = k_idx < inter
            a = tl.load(a_base + k_idx[None, :], mask=has[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + k_idx[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc += tl.dot(a.to(COMPUTE), w.to(COMPUTE), input_precision="ieee")
        y_ptrs = y_ptr + t_idx[:, None] * stride_yt + first_k[:, None] * stride_yk + n_idx[None, :]
        tl.store(y_ptrs, acc * token_w[:, None], mask=has[:, None] & n_ok[None, :])
    # This route's own row of y is zero when its slot is masked or named earlier by its token.
    own_t = route // TOP_K
    own_k = route % TOP_K
    own_first = tl.min(tl.where(t_idx == own_t, first_k, BLOCK_R), axis=0)
    if (slot < 0) | (own_k != own_first):
        zeros = tl.zeros((BLOCK_N,), dtype=tl.float32)
        tl.store(y_ptr + own_t * stride_yt + own_k * stride_yk + n_idx, zeros, mask=n_ok)


@triton.jit
def _down_sum_kernel(
    act_ptr,
    leader_ptr,
    group_k_ptr,
    group_w_ptr,
    w2_ptr,
    out_ptr,
    num_tokens,
    num_routes,
    hidden,
    inter,
    stride_at,
    stride_ak,
    stride_g,
    stride_ws,
    stride_wn,
    stride_ot,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ROUTE_BATCH: tl.constexpr,
    COMPUTE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    n_idx = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n_idx < hidden
    t_idx = tl.arange(0, BLOCK_T)
    b_idx = tl.arange(0, ROUTE_BATCH)
    w_cols = w2_ptr + n_idx[None, :].to(tl.int64) * stride_wn
    k_steps = tl.cdiv(inter, BLOCK_K)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, num_routes, ROUTE_BATCH):
        # A batch of routes' groups, held in registers: the loop below picks its operands' rows
        # from them by arithmetic, not by loads, so the compiler can prefetch the weights of
        # later routes while it multiplies (a load feeding a load's address shortens that).
        routes = r0 + b_idx
        in_batch = routes < num_routes
        slots = tl.load(leader_ptr + routes, mask=in_batch, other=-1)
        leads = slots >= 0
        rank = tl.cumsum(leads.to(tl.int32), axis=0) - 1
        num_leads = tl.sum(leads.to(tl.int32), axis=0)
        g_offs = routes[:, None] * stride_g + t_idx[None, :]
        batch_k = tl.load(group_k_ptr + g_offs, mask=in_batch[:, None], other=-1)
        batch_w = tl.load(group_w_ptr + g_offs, mask=in_batch[:, None], other=0.0)
        # One flat loop over (leader, reduction step), leaders in route order: the same order
        # every call, and routes that lead nothing cost nothing.
        for step in range(0, num_leads * k_steps):
            nth = step // k_steps
            k_idx = (step - nth * k_steps) * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = k_idx < inter
            pick = leads & (rank == nth)
            slot = tl.sum(tl.where(pick, slots, 0), axis=0)
            tok_k = tl.sum(tl.where(pick[:, None], batch_k, 0), axis=0)
            tok_w = tl.sum(tl.where(pick[:, None], batch_w, 0.0), axis=0)
            a_ptrs = (
                act_ptr + t_idx[:, None] * stride_at + tok_k[:, None] * stride_ak + k_idx[None, :]
            )
            a = tl.load(a_ptrs, mask=(tok_k[:, None] >= 0) & k_ok[None, :], other=0.0)
            w_ptrs = w_cols + slot.to(tl.int64) * stride_ws + k_idx[:, None]
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            part = tl.dot(a.to(COMPUTE), w.to(COMPUTE), input_precision="ieee")
            acc += part * tok_w[:, None]
    out_ptrs = out_ptr + t_idx[:, None] * stride_ot + n_idx[None, :]
    tl.store(out_ptrs, acc, mask=(t_idx[:, None] < num_tokens) & n_ok[None, :])


@dataclass(frozen=True, slots=True)
class _RouteGroups:
    """What gate/up records for the fused down launch, one row per route: the slot the route
    leads (-1: none), and per token of its chunk the act row (k, or -1) and summed weight."""

    leader: torch.Tensor  # int32 [R]
    token_k: torch.Tensor  # int32 [R, W]
    token_w: torch.Tensor  # fp32 [R, W]

    @classmethod
    def alloc(cls, routes: int, width: int, device: torch.device) -> _RouteGroups:
        return cls(
            common.alloc((routes,), torch.int32, device),
            common.alloc((routes, width), torch.int32, device),
            common.alloc((routes, width), torch.float32, device),
        )

    def rows(self, r0: int, r1: int) -> _RouteGroups:
        return _RouteGroups(self.leader[r0:r1], self.token_k[r0:r1], self.token_w[r0:r1])


def fused_moe_decode_triton(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    compute_dtype: torch.dtype | None = None,
    config: DecodeMoEConfig | None = None,
) -> torch.Tensor:
    """Triton decode MoE: fp32 [T, H], graph-capturable (no host sync, shapes fixed by T and K)."""
    _check(x, slot_ids, route_weights, w13, w2)
    cfg = config or DecodeMoEConfig()
    num_tokens, hidden = x.shape
    top_k = slot_ids.shape[1]
    inter = w13.shape[1] // 2
    slot_ids = slot_ids.contiguous()
    route_weights = route_weights.contiguous()
    act = common.alloc((num_tokens, top_k, inter), compute_dtype or x.dtype, x.device)
    if cfg.fuse_sum:
        out = common.alloc((num_tokens, hidden), torch.float32, x.device)
        # The first chunk is the widest: its token tile is every chunk's group row width.
        width = common.next_pow2(min(num_tokens, MAX_TOKENS_PER_LAUNCH), 16)
        groups = _RouteGroups.alloc(num_tokens * top_k, width, x.device)
    else:
        # Each route's weighted projection, summed over the routes at the end.
        out = common.alloc((num_tokens, top_k, hidden), torch.float32, x.device)
    for t0 in range(0, num_tokens, MAX_TOKENS_PER_LAUNCH):
        t1 = min(t0 + MAX_TOKENS_PER_LAUNCH, num_tokens)
        launch = _Chunk(t1 - t0, top_k, hidden, inter, compute_dtype or x.dtype, cfg)
        chunk_groups = groups.rows(t0 * top_k, t1 * top_k) if cfg.fuse_sum else None
        launch.gate_up(
            x[t0:t1], slot_ids[t0:t1], route_weights[t0:t1], w13, act[t0:t1], chunk_groups
        )
        if chunk_groups is not None:
            launch.down_sum(act[t0:t1], chunk_groups, w2, out[t0:t1])
        else:
            launch.down(act[t0:t1], slot_ids[t0:t1], route_weights[t0:t1], w2, out[t0:t1])
    return out if cfg.fuse_sum else out.sum(dim=1)


@dataclass(frozen=True, slots=True)
class _Chunk:
    """The launches for one chunk of at most MAX_TOKENS_PER_LAUNCH tokens."""

    tokens: int
    top_k: int
    hidden: int
    inter: int
    compute_dtype: torch.dtype
    cfg: DecodeMoEConfig

    @property
    def block_t(self) -> int:
        return common.next_pow2(self.tokens, 16)

    @property
    def route_batch(self) -> int:
        """Routes whose groups the fused down launch holds in registers at once."""
        # A route's group is a row of block_t entries: wide token tiles take fewer routes, so
        # that the kernel stays clear of the register limit on sm_90 (triton 3.6 and 3.9).
        routes = common.next_pow2(self.tokens * self.top_k)
        return min(routes, self.cfg.down_sum_route_batch, 512 // self.block_t)

    @property
    def down_sum_block_k(self) -> int:
        """The fused down launch's reduction step: its act tile is block_t x block_k."""
        # A 64 x 256 act tile takes all 255 registers a thread has; 64 x 128 takes 140.
        step = min(self.cfg.down_sum_block_k, 8192 // self.block_t)
        return min(step, common.next_pow2(self.inter, 16))

    def stages(self, wanted: int) -> int:
        # Wide token tiles take more shared memory per pipeline stage.
        return wanted if self.block_t <= 32 else min(wanted, 3)

    def gate_up(
        self,
        x: torch.Tensor,
        slot_ids: torch.Tensor,
        route_weights: torch.Tensor,
        w13: torch.Tensor,
        act: torch.Tensor,
        groups: _RouteGroups | None,
    ) -> None:
        cfg = self.cfg
        # Without groups to record (WRITE_GROUPS off) the group pointers are never touched.
        leader, token_k, token_w = (
            (groups.leader, groups.token_k, groups.token_w)
            if groups is not None
            else (slot_ids, slot_ids, route_weights)
        )
        grid = (self.tokens * self.top_k, triton.cdiv(self.inter, cfg.gate_up_block_n))
        _gate_up_kernel[grid](
            x,
            slot_ids,
            route_weights,
            w13,
            act,
            leader,
            token_k,
            token_w,
            self.tokens,
            self.hidden,
            self.inter,
            x.stride(0),
            w13.stride(0),
            w13.stride(1),
            act.stride(0),
            act.stride(1),
            token_k.stride(0),
            TOP_K=self.top_k,
            BLOCK_T=self.block_t,
            BLOCK_R=common.next_pow2(self.top_k),
            BLOCK_N=cfg.gate_up_block_n,
            BLOCK_K=min(cfg.gate_up_block_k, common.next_pow2(self.hidden, 16)),
            COMPUTE=common.tl_dtype(self.compute_dtype),
            WRITE_GROUPS=groups is not None,
            num_warps=cfg.num_warps,
            num_stages=self.stages(cfg.num_stages),
        )

    def down_sum(
        self, act: torch.Tensor, groups: _RouteGroups, w2: torch.Tensor, out: torch.Tensor
    ) -> None:
        cfg = self.cfg
        _down_sum_kernel[(triton.cdiv(self.hidden, cfg.down_sum_block_n),)](
            act,
            groups.leader,
            groups.token_k,
            groups.token_w,
            w2,
            out,
            self.tokens,
            self.tokens * self.top_k,
            self.hidden,
            self.inter,
            act.stride(0),
            act.stride(1),
            groups.token_k.stride(0),
            w2.stride(0),
            w2.stride(1),
            out.stride(0),
            BLOCK_T=self.block_t,
            BLOCK_N=cfg.down_sum_block_n,
            BLOCK_K=self.down_sum_block_k,
            ROUTE_BATCH=self.route_batch,
            COMPUTE=common.tl_dtype(self.compute_dtype),
            num_warps=cfg.num_warps,
            num_stages=self.stages(cfg.down_sum_num_stages),
        )

    def down(
        self,
        act: torch.Tensor,
        slot_ids: torch.Tensor,
        route_weights: torch.Tensor,
        w2: torch.Tensor,
        y: torch.Tensor,
    ) -> None:
        cfg = self.cfg
        grid = (self.tokens * self.top_k, triton.cdiv(self.hidden, cfg.down_block_n))
        _down_kernel[grid](
            act,
            slot_ids,
            route_weights,
            w2,
            y,
            self.tokens,
            self.hidden,
            self.inter,
            act.stride(0),
            act.stride(1),
            w2.stride(0),
            w2.stride(1),
            y.stride(0),
            y.stride(1),
            TOP_K=self.top_k,
            BLOCK_T=self.block_t,
            BLOCK_R=common.next_pow2(self.top_k),
            BLOCK_N=cfg.down_block_n,
            BLOCK_K=min(cfg.down_block_k, common.next_pow2(self.inter, 16)),
            COMPUTE=common.tl_dtype(self.compute_dtype),
            num_warps=cfg.num_warps,
            num_stages=self.stages(cfg.num_stages),
        )


def fused_moe_decode(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Decode MoE over cache slots: the Triton kernel on CUDA, the torch reference elsewhere."""
    if x.is_cuda:
        return fused_moe_decode_triton(
            x, slot_ids, route_weights, w13, w2, compute_dtype=compute_dtype
        )
    return fused_moe_decode_ref(x, slot_ids, route_weights, w13, w2, compute_dtype=compute_dtype)


def _check(
    x: torch.Tensor,
    slot_ids: torch.Tensor,
    route_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> None:
    common.check_routes(x, slot_ids, route_weights, w13, w2, ids_name="slot_ids")
