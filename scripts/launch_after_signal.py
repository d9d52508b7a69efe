"""Is the host slower to queue a copy and launch graphs right after a routing signal (the graph
before still finishing on the device) than after cuStreamQuery said the stream was idle?

Usage (needs CUDA): python scripts/launch_after_signal.py

A graph P (six kernels reading 4 MB, then one that stores a pinned flag, one thread after
`fence.sc.sys`) is replayed; the host waits for it ("query": cuStreamQuery until idle; "signal":
the flag; "signal+query": the flag, then one cuStreamQuery call), then times a 1 MiB
cuMemcpyHtoDAsync on another stream, a small graph's replay, a torch setitem on pinned memory,
and another small graph's replay. Medians of 1,500 rounds, µs (docs/performance.md, eighteenth
session).
"""

import ctypes
import statistics as st
import time

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
def flag_kernel(x_ptr, y_ptr, flag_ptr, n, BLOCK: tl.constexpr):
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


def main() -> None:
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
        flag_kernel[(n // 4096,)](y, x, flag, n, BLOCK=4096)

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


if __name__ == "__main__":
    main()
