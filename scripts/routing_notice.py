"""How soon the host learns that a routing kernel is done: a pinned flag the kernel stores
(after `fence.sc.sys`, as `host_handoff.signal_host`) against `cuStreamQuery`; and, with
--launches, whether the host is slower to queue work just after such a flag (the graph before
still finishing on the device) than after `cuStreamQuery` said the stream was idle.

Usage (needs CUDA): python scripts/routing_notice.py [--launches]

Notice: a graph of four kernels (three reading 16 MB, then one that also stores the flag) is
replayed on its own stream, 2,000 times per mode: "both" polls the flag and the stream in one loop
and prints how much later the stream said done than the flag was seen; "flag" and "query" poll
one of them from the replay's return. Then the same with the flag kernel alone launched eagerly,
the cost of one cuStreamQuery call and of one read of the flag, and the clock source.

--launches: a graph P (six kernels reading 4 MB, then one whose thread 0 stores the flag) is
replayed; the host waits for it ("query": cuStreamQuery until idle; "signal": the flag;
"signal+query": the flag, then one cuStreamQuery call), then times a 1 MiB cuMemcpyHtoDAsync on
another stream, a small graph's replay, a torch setitem on pinned memory, and another small
graph's replay. Medians of 1,500 rounds, µs (docs/kernels.md).
"""

import ctypes
import statistics as st
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

pc = time.perf_counter_ns


@triton.jit
def work_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) * 2.0, mask=m)


@triton.jit
def flag_kernel(x_ptr, y_ptr, flag_ptr, n, val, BLOCK: tl.constexpr, SIGNAL: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1.0, mask=m)
    if SIGNAL and pid == 0:
        tl.debug_barrier()
        tl.inline_asm_elementwise(
            "fence.sc.sys;\n\tst.relaxed.sys.global.b32 [$1], $2;\n\tmov.u32 $0, 0;",
            "=r,l,r", [flag_ptr, val], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def one_thread_flag_kernel(x_ptr, y_ptr, flag_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=m) + 1.0, mask=m)
    if pid == 0:
        tl.debug_barrier()
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; mov.u32 t, 1; "
            "fence.sc.sys; @p st.relaxed.sys.global.b32 [$1], t; mov.u32 $0, 0; }",
            "=r,l", [flag_ptr], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


def quantiles(d: list[int]) -> str:
    d = sorted(d)
    return (f"median {d[len(d) // 2]:.0f} p10 {d[len(d) // 10]:.0f} "
            f"p90 {d[9 * len(d) // 10]:.0f} mean {st.mean(d):.0f}")  # fmt: skip


def launches() -> None:
    lib = ctypes.CDLL("libcuda.so.1")
    q = lib.cuStreamQuery
    q.argtypes = [ctypes.c_void_p]
    q.restype = ctypes.c_int
    cp = lib.cuMemcpyHtoDAsync_v2
    cp.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    cp.restype = ctypes.c_int
    dev = torch.device("cuda")
    n = 1 << 20
    x = torch.randn(n, device=dev)
    y = torch.empty_like(x)
    z = torch.empty_like(x)
    flag = torch.zeros(16, dtype=torch.int32, pin_memory=True)
    fl = flag.numpy()
    src = torch.empty(9 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(9 << 20, dtype=torch.uint8, device=dev)
    s = torch.cuda.Stream(dev)
    cs = torch.cuda.Stream(dev)

    def body_p() -> None:
        for _ in range(6):
            work_kernel[(n // 4096,)](x, y, n, BLOCK=4096)
        one_thread_flag_kernel[(n // 4096,)](y, x, flag, n, BLOCK=4096)

    def body_h() -> None:
        for _ in range(3):
            work_kernel[(16,)](y, z, 16 * 1024, BLOCK=1024)

    with torch.cuda.stream(s):
        for _ in range(2):
            body_p()
            body_h()
    s.synchronize()
    graphs = {}
    for name, body in (("p", body_p), ("h", body_h), ("h2", body_h)):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            body()
        graphs[name] = g
    s.synchronize()
    h = s.cuda_stream

    def run(mode: str, count: int = 1500) -> None:
        rec: dict[str, list[int]] = {k: [] for k in ("notice", "copy", "head", "setitem", "piece")}
        for _ in range(count):
            fl[0] = 0
            with torch.cuda.stream(s):
                t0 = pc()
                graphs["p"].replay()
                if mode == "query":
                    while q(h) != 0:
                        pass
                else:
                    while fl[0] == 0:
                        pass
                    if mode == "signal+query":
                        q(h)
                t1 = pc()
                cp(dst.data_ptr(), src.data_ptr(), 1 << 20, ctypes.c_void_p(cs.cuda_stream))
                t2 = pc()
                graphs["h"].replay()
                t3 = pc()
                flag[0] = 0
                t4 = pc()
                graphs["h2"].replay()
                t5 = pc()
            s.synchronize()
            cs.synchronize()
            for k, v in zip(rec, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
                rec[k].append(v)
        print(mode, " ".join(f"{k} {st.median(v) / 1000:.2f}" for k, v in rec.items()), flush=True)

    for mode in ("query", "signal", "signal+query", "query", "signal", "signal+query"):
        run(mode)


def notice() -> None:
    q = ctypes.CDLL("libcuda.so.1").cuStreamQuery
    q.argtypes = [ctypes.c_void_p]
    q.restype = ctypes.c_int
    dev = torch.device("cuda")
    n = 1 << 22  # 4M floats: ~16 MB read per kernel
    x = torch.randn(n, device=dev)
    y = torch.empty_like(x)
    flag = torch.zeros(4, dtype=torch.int32, pin_memory=True)
    fl = flag.numpy()
    s = torch.cuda.Stream(dev)

    def body() -> None:
        for _ in range(3):
            work_kernel[(n // 4096,)](x, y, n, BLOCK=4096)
        flag_kernel[(n // 4096,)](y, x, flag, n, 1, BLOCK=4096, SIGNAL=True)

    with torch.cuda.stream(s):
        body()
        body()
    s.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        body()
    s.synchronize()
    h = s.cuda_stream

    def query_after_flag() -> int:
        """Polls the flag and the stream in one loop: ns from the flag to the stream's done."""
        tf = tq = None
        while tf is None or tq is None:
            if tf is None and fl[0] != 0:
                tf = pc()
            if tq is None and q(h) == 0:
                tq = pc()
        return tq - tf

    def run(mode: str, count: int = 2000) -> list[int]:
        out = []
        for _ in range(count):
            fl[0] = 0
            with torch.cuda.stream(s):
                g.replay()
            t0 = pc()
            if mode == "both":
                out.append(query_after_flag())
            elif mode == "flag":
                while fl[0] == 0:
                    pass
                out.append(pc() - t0)
                while q(h) != 0:
                    pass
            else:
                while q(h) != 0:
                    pass
                out.append(pc() - t0)
                assert fl[0] == 1
        return out

    for mode in ("both", "flag", "query", "both", "flag", "query"):
        print(f"{mode:6s} ns: {quantiles(run(mode))}", flush=True)
    out = []
    for _ in range(2000):  # the flag kernel alone, launched eagerly
        fl[0] = 0
        with torch.cuda.stream(s):
            flag_kernel[(n // 4096,)](y, x, flag, n, 1, BLOCK=4096, SIGNAL=True)
        out.append(query_after_flag())
    print(f"eager both ns: {quantiles(out)}")
    # the cost of one cuStreamQuery call on an idle stream, and of the flag's read
    t0 = pc()
    _ = [q(h) for _ in range(10000)]
    print("query call ns", (pc() - t0) / 10000)
    t0 = pc()
    _ = [fl[0] for _ in range(10000)]
    print("flag read ns", (pc() - t0) / 10000)
    print(Path("/sys/devices/system/clocksource/clocksource0/current_clocksource").read_text())


if __name__ == "__main__":
    launches() if "--launches" in sys.argv[1:] else notice()
