"""The decode benchmark's bound: the fastest a decode step could run on this machine.

t_min = resident_bytes / HBM + miss_bytes / (Bp + B_host), resident_bytes the dense weights, the
KV cache the step's attention reads (a hybrid model's attention layers' alone), the recurrent
states its linear layers read and write (each sequence's conv and DeltaNet states, once each way)
and the cached experts (an expert's bytes as the bank holds it: FP8 values and their block factors
with --moe-expert-dtype fp8, MXFP4 blocks and scales with mxfp4, NVFP4 values and both scales with
nvfp4), with the device copy rate
(HBM), the pinned host-to-device rate (Bp) and the host memory read rate (B_host) measured here,
Bp and B_host while running at the same time. A slow kernel shows as a gap to this bound.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import torch


def concurrent_rates(engine, seconds: float = 0.6) -> dict:
    """HBM copy rate alone; pinned H2D and host read rates measured running at the same time."""
    dev = engine.device
    if dev.type != "cuda":
        read = engine.cpu.read_gbps(256 * 1024**2)
        return {"hbm_gbps": read, "bp_gbps": read, "host_gbps": read}
    big = torch.empty(512 * 1024**2, dtype=torch.uint8, device=dev)
    out = torch.empty_like(big)
    out.copy_(big)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        out.copy_(big)
    torch.cuda.synchronize()
    hbm = 2 * 10 * big.nbytes / (time.perf_counter() - t0) / 1e9
    del big, out
    bank = engine.bank
    slots = [torch.empty_like(t[0], device=dev) for t in bank.layer_tensors(0)]
    stop = threading.Event()
    copied = [0]
    # written before the copies start: this thread fills it on one core, where (with
    # --moe-cpu-pin isolate) the copying thread runs too
    buf = torch.ones((1 << 30) // 4, dtype=torch.float32)

    def copies(in_flight: int = 4) -> None:
        """Experts copied `in_flight` at a time, so that the copy engine stays busy while this
        thread waits for a CPU (the feeding thread queues the engine's fills the same way)."""
        stream = torch.cuda.Stream(dev)
        i = 0
        with torch.cuda.stream(stream):
            while not stop.is_set():
                for _ in range(in_flight):
                    layer, expert = i % bank.num_layers, (i // bank.num_layers) % bank.num_experts
                    for slot, src in zip(slots, bank.layer_tensors(layer), strict=True):
                        slot.copy_(src[expert], non_blocking=True)
                    i += 1
                stream.synchronize()
                copied[0] += in_flight * bank.expert_bytes

    thread = threading.Thread(target=copies)
    t0 = time.perf_counter()
    thread.start()
    host = engine.cpu.read_gbps(repeats=3, buf=buf)
    while time.perf_counter() - t0 < seconds:
        time.sleep(0.01)
    stop.set()
    thread.join()
    bp = copied[0] / (time.perf_counter() - t0) / 1e9
    return {"hbm_gbps": hbm, "bp_gbps": bp, "host_gbps": host}


def rates_around(before: dict, after: dict) -> dict:
    """The rates a decode run is bounded by: the mean of each, measured before and after it (a
    shared host's read rate drifts between two measurements a minute apart), with both
    measurements kept."""
    mean = {k: (before[k] + after[k]) / 2 for k in ("hbm_gbps", "bp_gbps", "host_gbps")}
    return {**mean, "rates_before": before, "rates_after": after}


def mean_context(prompt_tokens: int, steps: int) -> float:
    """The mean number of tokens a sequence's attention reads over a timed run's `steps` decode
    steps: the first output token (untimed) makes the context prompt + 1, each timed step reads
    the context including the token it writes."""
    return prompt_tokens + (steps + 1) / 2


def state_bytes_per_step(spec) -> int:
    """What one sequence's decode step moves of the linear layers' recurrent states: each layer
    reads its conv state [W-1, C] and DeltaNet state [HV, DK, DV] and writes them back (0 for a
    model without linear layers)."""
    return 2 * spec.state_bytes_per_seq


def window_bytes_per_step(engine, context: float) -> float:
    """What one sequence's decode step reads of the sliding-window layers' keys and values, as
    their rings hold them (engine/model/window.py): each layer's last `sliding_window` tokens, at
    most the context (0 for a model without sliding-window layers)."""
    spec = engine.spec
    if not spec.sliding_layers:
        return 0.0
    rings = engine.states
    return rings.bytes_per_slot / rings.ring_tokens * min(context, spec.sliding_window)


def against_the_bound(engine, args, timed: dict, rates: dict) -> dict:
    """A timed run's tok/s beside its bound t_min, from its counts and the rates around it."""
    spec = engine.spec
    counts = timed["counts"]
    reads, hits, fills, cpu = (counts[k] for k in ("reads", "hits", "fills", "cpu"))
    steps = args.tokens
    elapsed = timed["elapsed"]
    tok_s = args.batch * steps / elapsed
    eb = engine.bank.expert_bytes  # as held: FP8, MXFP4 or NVFP4 with scales, or the dtype's
    elem = engine.dtype.itemsize
    dense = spec.dense_bytes_at(elem, engine.config.model.dense_dtype)  # as held (--dense-dtype)
    dense_step = dense - spec.vocab_size * spec.hidden_size * elem
    hits_step, misses_step = hits.sum() / steps, (fills.sum() + cpu.sum()) / steps
    kv_token = engine.kv.bytes_per_token  # the paged layers' K and V, as the pages hold them
    context = mean_context(args.prompt_tokens, steps)
    kv_step = args.batch * (context * kv_token + window_bytes_per_step(engine, context))
    state_step = args.batch * state_bytes_per_step(spec)
    resident_bytes = dense_step + kv_step + state_step + hits_step * eb
    miss_bytes = misses_step * eb
    t_min = resident_bytes / (rates["hbm_gbps"] * 1e9) + miss_bytes / (
        (rates["bp_gbps"] + rates["host_gbps"]) * 1e9
    )
    bound = args.batch / t_min
    active = (
        dense_step + (kv_step + state_step) / args.batch + spec.num_moe_layers * spec.top_k * eb
    )
    return {
        "batch": args.batch,
        "tokens": steps,
        "decode_tok_s": tok_s,
        "ms_per_step": 1e3 * elapsed / steps,
        "hit_rate": float(hits.sum() / reads.sum()) if reads.sum() else None,
        "fills_per_step": float(fills.sum() / steps),
        "cpu_per_step": float(cpu.sum() / steps),
        "pick_evenness": _evenness(counts["picks"]),
        "bound_tok_s": bound,
        "achieved_of_bound": tok_s / bound,
        "hbm_bound_tok_s": args.batch * rates["hbm_gbps"] * 1e9 / active,
        "active_bytes_per_token": active,
        "kv_bytes_per_step": kv_step,
        "state_bytes_per_step": state_step,
        **rates,
    }


def _evenness(picks: np.ndarray) -> float:
    """Mean normalized entropy of the per-layer pick distributions (1 = perfectly even)."""
    out = []
    for row in picks:
        total = row.sum()
        if total == 0:
            continue
        p = row[row > 0] / total
        out.append(float(-(p * np.log(p)).sum() / math.log(row.size)))
    return float(np.mean(out)) if out else float("nan")
