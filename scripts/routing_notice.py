"""How soon the host learns that a routing kernel is done: a pinned flag the kernel stores
(one thread, after `fence.sc.sys`, as `host_handoff.signal_host`) against `cuStreamQuery`.

Usage (needs CUDA): python scripts/routing_notice.py

A graph of four kernels (three reading 16 MB, then one that also stores the flag) is replayed on
its own stream, 2,000 times per mode: "both" polls the flag and the stream in one loop and prints
how much later the stream said done than the flag was seen; "flag" and "query" poll one of them
from the replay's return. Then the same with the flag kernel alone launched eagerly, the cost of
one cuStreamQuery call and of one read of the flag, and the clock source (docs/performance.md,
eighteenth session).
"""

import ctypes
import statistics as st
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


def quantiles(d: list[int]) -> str:
    d = sorted(d)
    return (f"median {d[len(d) // 2]:.0f} p10 {d[len(d) // 10]:.0f} "
            f"p90 {d[9 * len(d) // 10]:.0f} mean {st.mean(d):.0f}")  # fmt: skip


def main() -> None:
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

    def run(mode: str, count: int = 2000) -> list[int]:
        out = []
        for _ in range(count):
            fl[0] = 0
            with torch.cuda.stream(s):
                g.replay()
            t0 = pc()
            tf = tq = None
            if mode == "both":
                while tf is None or tq is None:
                    if tf is None and fl[0] != 0:
                        tf = pc()
                    if tq is None and q(h) == 0:
                        tq = pc()
                out.append(tq - tf)
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
        tf = tq = None
        while tf is None or tq is None:
            if tf is None and fl[0] != 0:
                tf = pc()
            if tq is None and q(h) == 0:
                tq = pc()
        out.append(tq - tf)
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
    main()
