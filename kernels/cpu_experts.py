"""MoE experts on the CPU, straight from the host expert bank: a compiled kernel, torch reference.

`CpuExpertRunner` runs the experts of one MoE layer step on persistent worker threads while the
caller's thread goes on launching GPU work. The native kernel (csrc/cpu_experts.cpp and its
headers, built once per source by torch's JIT extension loader) streams bf16/fp16/fp32 weights,
FP8 weights with their block factors (kernels/fp8.py) or MXFP4 blocks with their scales
(kernels/mxfp4.py), as stored, at close to the host's memory bandwidth; `cpu_experts_ref` is the
plain-torch reference and the fallback; NVFP4 values with their e4m3 scales and per-tensor
scales (kernels/nvfp4.py) too; FP8 and 4-bit rows of bf16 activations (a bf16 model's) through
AVX-512 BF16 dot products where the CPU has them. Its build: native_build.py; its benchmark:
`python -m moelab.kernels.cpu_experts_bench --threads 1,2,4` (see docs/cpu-experts.md).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from types import ModuleType

import numpy as np
import torch

from . import fp8, mxfp4, nvfp4, nvfp4_moe, swiglu
from .native_build import NativeKernelError, load_native

log = logging.getLogger(__name__)

KERNELS = ("auto", "native", "torch")
SIMD_LEVELS = ("best", "avx512", "avx2", "scalar")
_SIMD_CODES = {"scalar": 0, "avx2": 1, "avx512": 2}
# FP8 weights (e4m3fn, or its bits as uint8) come with one fp32 factor per 128 x 128 block
_FP8_DTYPES = (torch.float8_e4m3fn, torch.uint8)
_WEIGHT_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2} | dict.fromkeys(
    _FP8_DTYPES, 3
)
# MXFP4 weights: gpt-oss's blocks, uint8 [E, N, K/32, 16], with their E8M0 scales [E, N, K/32]
_MXFP4_CODE = 4
# NVFP4 weights: ModelOpt's values, uint8 [E, N, K/2], with their e4m3 scales [E, N, K/16] and
# per-tensor scales (w13's [E, 2], w2's [E, 1])
_NVFP4_CODE = 5
# the weight KiB a task of a native job aims at: 16 threads stay balanced over one expert, and
# claiming a task costs nothing next to streaming it (kernels/csrc/pool.h, kDefaultTaskBytes)
DEFAULT_TASK_KB = 96
# how long a task of a redoable job may be in flight before an idle worker runs it again, in us
# (kernels/csrc/pool.h, kDefaultRedoUs: a task takes tens of us; a stopped worker holds it for
# milliseconds)
DEFAULT_REDO_US = 150


def _check_redo_us(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"redo_us must be an int of 0 or more (0: never), got {value!r}")


def cpu_experts_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    pair_expert: torch.Tensor,
    pair_token: torch.Tensor,
    pair_weight: torch.Tensor,
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float = 0.0,
    w13_scale_2: torch.Tensor | None = None,
    w2_scale_2: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' output [T, H] fp32 in plain torch: the reference and the fallback kernel.

    out[t] = sum over the pairs j with pair_token[j] = t of
    pair_weight[j] * w2[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])), e = pair_expert[j],
    gate = w13[e, :I], up = w13[e, I:]. Computed in fp32. FP8 weights (float8_e4m3fn, or their
    bits as uint8) need their block factors, w13_scale [E, ceil(2I/128), ceil(H/128)] and w2_scale
    [E, ceil(H/128), ceil(I/128)] fp32 (kernels/fp8.py; a weight is its value times its factor).
    gpt-oss's experts add w13_bias [E, 2I] and w2_bias [E, H] (fp32) and take the clamped
    SwiGLU (swiglu_limit > 0: kernels/swiglu.py).
    MXFP4 weights are gpt-oss's blocks, w13 [E, 2I, H/32, 16] and w2 [E, H, I/32, 16] uint8, with
    their E8M0 scales w13_scale [E, 2I, H/32] and w2_scale [E, H, I/32] uint8 (kernels/mxfp4.py).
    NVFP4 weights are ModelOpt's values, w13 [E, 2I, H/2] and w2 [E, H, I/2] uint8, with their
    e4m3 scales w13_scale [E, 2I, H/16] and w2_scale [E, H, I/16] and their per-tensor scales
    w13_scale_2 [E, 2] (gate's, up's) and w2_scale_2 [E, 1] fp32 (kernels/nvfp4_moe.py).
    """
    tensor_scales = _tensor_scales(w13_scale_2, w2_scale_2)
    num_tokens, hidden, inter, num_experts = _check_inputs(
        x, w13, w2, pair_expert, pair_token, pair_weight, None, w13_scale, w2_scale, tensor_scales
    )
    _check_pair_indices(pair_expert, pair_token, num_experts, num_tokens)
    biased = swiglu.check_biases(w13, w2, w13_bias, w2_bias)

    def weights(w: torch.Tensor, scale: torch.Tensor | None, e: int) -> torch.Tensor:
        if scale is None:
            return w[e].float()
        if tensor_scales is not None:
            scale_2 = tensor_scales[0 if w is w13 else 1]
            return nvfp4_moe.dequantized(w[e : e + 1], scale[e : e + 1], scale_2[e : e + 1])[0]
        return _dequantized(w[e], scale[e])

    out = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    experts = pair_expert.long()
    tokens = pair_token.long()
    for e in torch.unique(experts).tolist():
        picked = (experts == e).nonzero().squeeze(1)
        rows = tokens[picked]
        gate_up = x[rows] @ weights(w13, w13_scale, e).T
        if biased:
            gate_up = gate_up + w13_bias[e].float()
        h = swiglu.activate(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit)
        y = h @ weights(w2, w2_scale, e).T
        if biased:
            y = y + w2_bias[e].float()
        out.index_add_(0, rows, y * pair_weight[picked, None])
    return out


def _check_biases(
    w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None
) -> None:
    """gpt-oss's biases as both kernels read them: fp32, contiguous, in host memory."""
    if not swiglu.check_biases(w13, w2, w13_bias, w2_bias):
        return
    for name, t in (("w13_bias", w13_bias), ("w2_bias", w2_bias)):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(
                f"{name} must be a contiguous float32 tensor in host memory, got {t.dtype} on "
                f"{t.device}"
            )


def _dequantized(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One expert's FP8 weights [N, K] in fp32: torch's cast of the values (exact; kernels/fp8.py
    decodes the same bits, 3-4x slower) times each one's block factor; MXFP4 blocks
    [N, K/32, 16] by their format's definition."""
    if q.dim() == 3:
        return mxfp4.dequantize(q, scale)
    n, k = q.shape
    factors = scale.repeat_interleave(fp8.BLOCK, 0)[:n].repeat_interleave(fp8.BLOCK, 1)[:, :k]
    return q.view(torch.float8_e4m3fn).float() * factors


_INPUT_NAMES = ("x", "w13", "w2", "pair_expert", "pair_token", "pair_weight", "out")
_FACTOR_NAMES = ("w13_scale", "w2_scale")


def _tensor_scales(
    w13_scale_2: torch.Tensor | None, w2_scale_2: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """NVFP4's per-tensor scales, both or neither (None: the weights are of another format)."""
    if w13_scale_2 is None and w2_scale_2 is None:
        return None
    if w13_scale_2 is None or w2_scale_2 is None:
        raise ValueError("NVFP4 weights need both w13_scale_2 and w2_scale_2")
    return w13_scale_2, w2_scale_2


def _check_inputs(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    pair_expert: torch.Tensor,
    pair_token: torch.Tensor,
    pair_weight: torch.Tensor,
    out: torch.Tensor | None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    tensor_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[int, int, int, int]:
    """Checks devices, dtypes, layouts and shapes; returns (T, H, I, E). tensor_scales: NVFP4's
    per-tensor scales, whose weights and scales nvfp4_moe.check_bank checks."""
    tensors = (x, w13, w2, pair_expert, pair_token, pair_weight, out, w13_scale, w2_scale)
    for name, t in zip(_INPUT_NAMES + _FACTOR_NAMES, tensors, strict=True):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_cpu:
            raise ValueError(f"{name} must be a CPU tensor, it is on {t.device}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (the kernel never copies weights)")
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"x must be [T, H] float32, got {list(x.shape)} {x.dtype}")
    if w13.dtype not in _WEIGHT_CODES or w2.dtype != w13.dtype or w13.dim() != w2.dim():
        raise ValueError(
            "w13 and w2 must share one dtype of bfloat16, float16, float32 or FP8 "
            f"(float8_e4m3fn, or its bits as uint8); got {w13.dtype} and {w2.dtype}"
        )
    num_tokens, hidden = x.shape
    if tensor_scales is not None:
        if w13_scale is None or w2_scale is None:
            raise ValueError("NVFP4 weights need w13_scale and w2_scale, their e4m3 scales")
        slots, held_hidden, inter = nvfp4_moe.check_bank(w13, w2, w13_scale, w2_scale,
                                                         *tensor_scales)  # fmt: skip
        shape13, shape2 = (slots, 2 * inter, held_hidden), (slots, held_hidden, inter)
    elif w13.dim() == 4 and w13.dtype == torch.uint8:
        shape13, shape2 = _mxfp4_shape(w13), _mxfp4_shape(w2)
    elif w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(
            f"w13 must be [E, 2I, H] and w2 [E, H, I] (MXFP4: [E, 2I, H/32, 16] and "
            f"[E, H, I/32, 16] uint8); got {list(w13.shape)} and {list(w2.shape)}"
        )
    else:
        shape13, shape2 = w13.shape, w2.shape
    num_experts, _, inter = shape2
    if shape13 != (num_experts, 2 * inter, hidden) or shape2[1] != hidden or inter == 0:
        raise ValueError(
            f"with x [T={num_tokens}, H={hidden}], w13 must be [E, 2I, {hidden}] and w2 "
            f"[E, {hidden}, I] with I > 0; got w13 {list(w13.shape)} and w2 {list(w2.shape)}"
        )
    if tensor_scales is None:
        _check_factors(w13, w13_scale, w2_scale, num_experts, hidden, inter)
    num_pairs = pair_expert.numel()
    if (
        pair_expert.dtype != torch.int32
        or pair_token.dtype != torch.int32
        or pair_weight.dtype != torch.float32
        or pair_expert.shape != pair_token.shape
        or pair_expert.shape != pair_weight.shape
        or pair_expert.shape != (num_pairs,)
    ):
        pairs = (pair_expert, pair_token, pair_weight)
        raise ValueError(
            "pair_expert, pair_token and pair_weight must be 1-D of one length, int32, int32 and "
            f"float32; got {', '.join(f'{list(p.shape)} {p.dtype}' for p in pairs)}"
        )
    if out is not None:
        if out.dtype != torch.float32 or out.shape != (num_tokens, hidden):
            raise ValueError(
                f"out must be [{num_tokens}, {hidden}] float32, got {list(out.shape)} {out.dtype}"
            )
        x_start, out_start = x.data_ptr(), out.data_ptr()
        if x_start < out_start + out.nbytes and out_start < x_start + x.nbytes:
            raise ValueError("out must not overlap x: x is still read while out is written")
    return num_tokens, hidden, inter, num_experts


def _check_factors(
    w13: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    num_experts: int,
    hidden: int,
    inter: int,
) -> None:
    """FP8 weights need their block factors, fp32 of the blocks' shape, MXFP4 weights their
    scales; other weights have none."""
    factors = {"w13_scale": w13_scale, "w2_scale": w2_scale}
    if w13.dim() == 4:
        shapes = {
            "w13_scale": [num_experts, 2 * inter, hidden // mxfp4.BLOCK],
            "w2_scale": [num_experts, hidden, inter // mxfp4.BLOCK],
        }
        for name, t in factors.items():
            want = shapes[name]
            if t is None or t.dtype != torch.uint8 or list(t.shape) != want:
                got = "none" if t is None else f"{list(t.shape)} {t.dtype}"
                raise ValueError(
                    f"MXFP4 weights need {name}: their E8M0 scales, {want} uint8 (one per "
                    f"{mxfp4.BLOCK} values); got {got}"
                )
        return
    if w13.dtype not in _FP8_DTYPES:
        given = [name for name, t in factors.items() if t is not None]
        if given:
            raise ValueError(
                f"{' and '.join(given)} belong to FP8 weights only; w13 and w2 are {w13.dtype}"
            )
        return
    shapes = {
        "w13_scale": (num_experts, fp8.blocks(2 * inter), fp8.blocks(hidden)),
        "w2_scale": (num_experts, fp8.blocks(hidden), fp8.blocks(inter)),
    }
    for name, t in factors.items():
        want = list(shapes[name])
        if t is None:
            raise ValueError(
                f"FP8 weights ({w13.dtype}) need {name}: their fp32 factors, one per "
                f"{fp8.BLOCK}x{fp8.BLOCK} block, {want} here"
            )
        if t.dtype != torch.float32 or t.shape != shapes[name]:
            raise ValueError(
                f"{name} must be {want} float32 (one factor per {fp8.BLOCK}x{fp8.BLOCK} block "
                f"of w13 [E, 2I, H] and w2 [E, H, I]), got {list(t.shape)} {t.dtype}"
            )


def _mxfp4_shape(blocks: torch.Tensor) -> tuple[int, int, int]:
    """The [E, N, K] weight that MXFP4 blocks [E, N, K/32, 16] hold."""
    if blocks.dim() != 4 or blocks.shape[3] != mxfp4.BLOCK // 2:
        raise ValueError(
            f"MXFP4 weights must be blocks [E, N, K/32, 16] uint8, got {list(blocks.shape)}"
        )
    num_experts, rows, num_blocks, _ = blocks.shape
    return num_experts, rows, num_blocks * mxfp4.BLOCK


def _weight_code(w13: torch.Tensor, nvfp4: bool = False) -> int:
    """The native kernel's code for the weights' type (csrc/simd.h, WeightType): NVFP4's where
    the weights come with per-tensor scales."""
    if nvfp4:
        return _NVFP4_CODE
    return _MXFP4_CODE if w13.dim() == 4 else _WEIGHT_CODES[w13.dtype]


def _held_shape(w: torch.Tensor, nvfp4: bool) -> tuple[int, int, int]:
    """The [E, N, K] weight that `w` holds: MXFP4 blocks, NVFP4 values (two a byte) or plain."""
    if nvfp4:
        return w.shape[0], w.shape[1], 2 * w.shape[2]
    return _mxfp4_shape(w) if w.dim() == 4 else tuple(w.shape)


def _check_pair_indices(
    pair_expert: torch.Tensor, pair_token: torch.Tensor, num_experts: int, num_tokens: int
) -> None:
    """Raises ValueError when a pair names an expert or token row that does not exist."""
    for name, values, bound in (
        ("pair_expert", pair_expert, num_experts),
        ("pair_token", pair_token, num_tokens),
    ):
        bad = ((values < 0) | (values >= bound)).nonzero()
        if bad.numel():
            j = int(bad[0, 0])
            raise ValueError(f"{name}[{j}] = {int(values[j])} is outside 0..{bound - 1}")


def _ref_into(
    out: torch.Tensor,
    done_flag: torch.Tensor,
    done_value: int,
    *args: torch.Tensor,
    **factors: torch.Tensor | float | None,
) -> torch.Tensor:
    """The reference kernel writing into out, then done_value into done_flag (as the native job
    does)."""
    out.copy_(cpu_experts_ref(*args, **factors))
    done_flag.view(-1)[0] = done_value
    return out


class CpuExpertJob:
    """One submitted call; `wait()` returns its output once the workers are done."""

    __slots__ = ("_future", "_job", "_keep", "_out")

    def __init__(
        self,
        out: torch.Tensor | None,
        job: object | None = None,
        future: Future[torch.Tensor] | None = None,
        keep: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self._out = out
        self._job = job
        self._future = future
        self._keep = keep  # the workers read these through raw pointers until the job is done

    def done(self) -> bool:
        """Whether the output is ready (wait() would not block)."""
        return self._job.done() if self._job is not None else self._future.done()

    def unclaimed(self) -> int:
        """Tasks of a native job not handed out yet to a worker (or to a thread that helps:
        the decode planner's wait); 0 for the torch kernel."""
        return self._job.unclaimed() if self._job is not None else 0

    def wait(self) -> torch.Tensor:
        """Blocks (without the GIL) until the output [T, H] fp32 is computed, and returns it."""
        if self._job is not None:
            self._job.wait()
            self._keep = ()
            return self._out
        result = self._future.result()
        return result if self._out is None else self._out.copy_(result)

    def seconds(self) -> tuple[float, float] | None:
        """(start_s, run_s) of a finished native job: from queueing to the first task taken (the
        workers' reaction time), and from then to the last task done; None for the torch kernel."""
        if self._job is None or not self._job.done():
            return None
        return tuple(self._job.seconds())

    def worker_seconds(self) -> tuple[float, float] | None:
        """(last_start_s, busy_s) of a finished native job: from queueing to the last pool
        worker's first task (how together the workers began), and the seconds the pool's workers
        spent in its tasks, all together (a thread that helps, the decode planner's, is not
        counted); None for the torch kernel."""
        if self._job is None or not self._job.done():
            return None
        return tuple(self._job.worker_seconds())

    def redoable(self) -> bool:
        """Whether a stalled task of this native job may be run again by another worker
        (`CpuExpertRunner.redo_us`); False for the torch kernel."""
        return self._job.redoable() if self._job is not None else False

    def redone(self) -> int:
        """Tasks of a native job that a worker ran again and finished first, the one that began
        them having stalled (`CpuExpertRunner.redo_us`); 0 for the torch kernel."""
        return self._job.redone() if self._job is not None else 0

    def phase_seconds(self) -> tuple[float, float] | None:
        """(phase1_s, wait_s) of a finished native job: from its first task to the end of its
        gate/up rows (the down projection needs them all), and the seconds its tasks waited for
        them, all threads together; None for the torch kernel."""
        if self._job is None or not self._job.done():
            return None
        return tuple(self._job.phase_seconds())

    def bf16_dot(self) -> bool:
        """Whether the native job's dot products were the bf16 ones (x all bf16 values, FP8,
        MXFP4 or NVFP4 weights, one token an expert, a build with AVX-512 BF16:
        docs/cpu-experts.md); False for the torch kernel."""
        return self._job.bf16_dot() if self._job is not None else False

    def __del__(self) -> None:
        if self._job is not None and self._keep:
            self._job.wait()


def process_thread_ids() -> set[int]:
    """The OS ids of this process's threads (Linux; an empty set elsewhere)."""
    try:
        return {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return set()


class CpuExpertRunner:
    """Runs MoE experts on persistent CPU worker threads; `submit` returns while they compute.

    kernel: "native" (compiled; NativeKernelError if it cannot be built), "torch" (the reference) or
    "auto" (native if it builds, else torch, saying why in the log). simd picks the native kernel's
    code path ("best": the widest this CPU has); the others are there to test and compare them.
    spin_us: how long idle native workers spin for the next job before sleeping. task_kb: the
    weight KiB each task of a native job aims at (tasks are what the workers claim one at a time).
    cpus: None (the OS places the native workers) or one logical CPU per thread, which that
    worker stays on (engine/experts/cpu.worker_cpus chooses them); `runner.cpus` keeps them (None
    where the OS places the workers, and for the torch kernel). `runner.thread_ids`: the native
    workers' OS thread ids (the threads this process gained while the pool started; [] off Linux
    and for the torch kernel).
    """

    def __init__(
        self,
        num_threads: int,
        kernel: str = "auto",
        simd: str = "best",
        spin_us: int = 1000,
        task_kb: int = DEFAULT_TASK_KB,
        cpus: Sequence[int] | None = None,
        redo_us: int = DEFAULT_REDO_US,
    ) -> None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {', '.join(KERNELS)}; got {kernel!r}")
        if simd not in SIMD_LEVELS:
            raise ValueError(f"simd must be one of {', '.join(SIMD_LEVELS)}; got {simd!r}")
        _check_redo_us(redo_us)
        self.num_threads = num_threads
        self._module: ModuleType | None = None
        if kernel != "torch":
            try:
                self._module = load_native()
            except NativeKernelError as e:
                if kernel == "native":
                    raise
                log.warning("CPU experts: using the torch kernel; %s", e)
        if self._module is not None:
            levels = list(self._module.simd_levels())
            if simd != "best" and simd not in levels:
                raise ValueError(
                    f"simd={simd!r} is not available on this CPU; this build has "
                    f"{', '.join(levels)}"
                )
            self.kernel = "native"
            self.simd = levels[0] if simd == "best" else simd
            # the bf16 dot products (AVX-512 BF16) for the jobs whose x are all bf16 values
            self.bf16_dot = self.simd == "avx512" and bool(self._module.bf16_dot_built())
            if isinstance(spin_us, bool) or not isinstance(spin_us, int) or spin_us < 0:
                raise ValueError(f"spin_us must be an int of 0 or more, got {spin_us!r}")
            if isinstance(task_kb, bool) or not isinstance(task_kb, int) or task_kb < 1:
                raise ValueError(f"task_kb must be a positive int, got {task_kb!r}")
            if cpus is not None and len(cpus) != num_threads:
                raise ValueError(f"cpus must name one CPU per thread ({num_threads}), got {cpus}")
            started = process_thread_ids()
            self._pool = self._module.Pool(
                num_threads, spin_us, task_kb * 1024, list(cpus or []), redo_us
            )
            self.thread_ids = sorted(process_thread_ids() - started)
            self.cpus = list(cpus) if cpus is not None else None
        else:
            if simd != "best":
                raise ValueError(f"simd={simd!r} applies to the native kernel only")
            self.bf16_dot = False
            if cpus is not None:
                log.info("CPU experts: the torch kernel places its own threads; cpus is ignored")
            self.cpus = None
            self.thread_ids = []
            self.kernel = "torch"
            self.simd = "torch"
            self._executor = ThreadPoolExecutor(
                1, "moelab-cpu-experts", initializer=torch.set_num_threads, initargs=(num_threads,)
            )
        self._closed = False
        # the weights of redoable jobs, which a late run of a task may read after its job is
        # done: held until the workers have ended (close)
        self._held: dict[int, torch.Tensor] = {}

    @property
    def redo_us(self) -> int:
        """How long a task of a redoable job (`submit`'s `redoable`, the decode planner's jobs)
        may be in flight before a worker with nothing else to do runs it again: the OS may take a
        worker's core in the middle of a task, and the job would wait for it (0: never; the torch
        kernel has no tasks)."""
        return self._pool.redo_us if self._module is not None else 0

    @redo_us.setter
    def redo_us(self, value: int) -> None:
        _check_redo_us(value)
        if self._module is None:
            if value:
                raise ValueError("redo_us applies to the native kernel's tasks only")
            return
        self._pool.redo_us = value

    def _hold(self, *weights: torch.Tensor) -> None:
        for t in weights:
            self._held[id(t)] = t

    def submit(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        pair_expert: torch.Tensor,
        pair_token: torch.Tensor,
        pair_weight: torch.Tensor,
        out: torch.Tensor | None = None,
        *,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
        w13_bias: torch.Tensor | None = None,
        w2_bias: torch.Tensor | None = None,
        swiglu_limit: float = 0.0,
        w13_scale_2: torch.Tensor | None = None,
        w2_scale_2: torch.Tensor | None = None,
        done_flag: torch.Tensor | None = None,
        done_value: int = 0,
        check: bool = True,
        own_rounds: int = 0,
        redoable: bool = False,
    ) -> CpuExpertJob:
        """Queues one call (see cpu_experts_ref) and returns at once.

        The weights' dtype picks the kernel's loads: FP8 weights (float8_e4m3fn or uint8 bits)
        need w13_scale and w2_scale, their block factors, and MXFP4 blocks (uint8, 4-D) their
        E8M0 scales under the same names, and NVFP4 values their e4m3 scales and per-tensor
        scales w13_scale_2 and w2_scale_2 (cpu_experts_ref). x, the weights, their
        factors and out must stay unchanged until the job's wait() returns. out: an optional
        [T, H] fp32 buffer to write into (e.g. pinned memory, for the copy to the GPU); it is
        overwritten, never accumulated into. done_flag: an int64 tensor whose first element
        receives done_value once out is written (with out, the handoff a GPU kernel polls for:
        kernels/host_handoff.py). check=False skips checking devices, dtypes, layouts and shapes,
        for a caller whose tensors are right by construction (the engine's decode steps, where
        the checks cost a tenth of the host's time per layer); the native kernel still checks
        every pair's expert and token. own_rounds: the job's first rounds of gate/up blocks
        belong to the pool's workers, one each a round (block w + r * threads to worker w, which
        runs its own first; those an owner has not taken by the time the rest are handed out go
        to whoever comes): a worker that fetched its blocks' weights while it waited reads them
        from its own cache (`jobs_profile`'s `fetch_own`). The output is the same bit for bit.
        redoable: a task in flight for longer than `redo_us` may be run again by an idle worker,
        the first run to finish writing its results (native kernel); the job keeps its own copy
        of x (where T * H <= 65536, else it is not redoable), and the runner holds the weights
        and their factors until it closes, since the late run goes on reading them. The output is
        the same bit for bit.
        """
        if self._closed:
            raise RuntimeError("this CpuExpertRunner is closed")
        factors = {"w13_scale": w13_scale, "w2_scale": w2_scale}
        tensor_scales = _tensor_scales(w13_scale_2, w2_scale_2)
        if tensor_scales is not None:
            factors.update(w13_scale_2=w13_scale_2, w2_scale_2=w2_scale_2)
        if w13_bias is not None or w2_bias is not None or swiglu_limit:
            factors.update(w13_bias=w13_bias, w2_bias=w2_bias, swiglu_limit=swiglu_limit)
            if check or self._module is None:
                _check_biases(w13, w2, w13_bias, w2_bias)
        if check or self._module is None:
            num_tokens, hidden, inter, num_experts = _check_inputs(
                x, w13, w2, pair_expert, pair_token, pair_weight, out, w13_scale, w2_scale,
                tensor_scales,
            )  # fmt: skip
        else:
            num_tokens, hidden = x.shape
            num_experts, _, inter = _held_shape(w2, tensor_scales is not None)
        if done_flag is not None:
            if out is None:
                raise ValueError("done_flag needs out: the flag says that out is written")
            if done_flag.dtype != torch.int64 or done_flag.device.type != "cpu":
                raise ValueError(
                    f"done_flag must be an int64 tensor in host memory, got {done_flag.dtype} "
                    f"on {done_flag.device}"
                )
        if self._module is None:
            _check_pair_indices(pair_expert, pair_token, num_experts, num_tokens)
            args = (x, w13, w2, pair_expert, pair_token, pair_weight)
            if done_flag is not None:
                assert out is not None
                work = functools.partial(_ref_into, out, done_flag, done_value, *args, **factors)
                return CpuExpertJob(None, future=self._executor.submit(work))
            work = functools.partial(cpu_experts_ref, *args, **factors)
            return CpuExpertJob(out, future=self._executor.submit(work))
        if out is None:
            out = torch.empty(num_tokens, hidden, dtype=torch.float32)
        job = self._module.submit_experts(
            self._pool,
            _SIMD_CODES[self.simd],
            _weight_code(w13, nvfp4=tensor_scales is not None),
            x.data_ptr(),
            out.data_ptr(),
            w13.data_ptr(),
            w2.data_ptr(),
            num_tokens,
            hidden,
            inter,
            num_experts,
            pair_expert.data_ptr(),
            pair_token.data_ptr(),
            pair_weight.data_ptr(),
            pair_expert.numel(),
            0 if done_flag is None else done_flag.data_ptr(),
            done_value,
            int(own_rounds),
            bool(redoable),
            _address(w13_scale),
            _address(w2_scale),
            _address(w13_bias),
            _address(w2_bias),
            float(swiglu_limit),
            _address(w13_scale_2),
            _address(w2_scale_2),
        )
        weights = tuple(
            t
            for t in (w13, w2, w13_scale, w2_scale, w13_bias, w2_bias, w13_scale_2, w2_scale_2)
            if t is not None
        )
        if redoable:
            self._hold(*weights)
        keep = (x, *weights, out) if done_flag is None else (x, *weights, out, done_flag)
        return CpuExpertJob(out, job=job, keep=keep)

    def decode_planner(
        self,
        *,
        slot_of: np.ndarray,
        key_of_slot: np.ndarray,
        last_use: np.ndarray,
        state: np.ndarray,
        picks: np.ndarray,
        w13: list[torch.Tensor],
        w2: list[torch.Tensor],
        top_k: int,
        w13_scale: list[torch.Tensor] | None = None,
        w2_scale: list[torch.Tensor] | None = None,
        w13_bias: list[torch.Tensor] | None = None,
        w2_bias: list[torch.Tensor] | None = None,
        swiglu_limit: float = 0.0,
        w13_scale_2: list[torch.Tensor] | None = None,
        w2_scale_2: list[torch.Tensor] | None = None,
    ) -> object | None:
        """The native DecodePlanner (kernels/csrc/decode_planner.h) over an expert cache's arrays
        (engine/experts/cache.py) and decode pick counts, queueing its CPU jobs on this runner's
        workers; None with the torch kernel. FP8 weights (`submit`) need their factors per
        layer, w13_scale and w2_scale, MXFP4 blocks and NVFP4 values their scales under the same
        names, and NVFP4 values their per-tensor scales too, w13_scale_2 and w2_scale_2: the
        planner copies them into the slots with the values, splits a miss at whole blocks (FP8:
        128 rows; MXFP4: 32, NVFP4: 16, its down projection's groups; the per-tensor scales
        copied whole) and passes them to its CPU jobs.
        gpt-oss's experts add their biases per layer (`submit`) and the clamped SwiGLU's limit:
        copied with the weights, a split miss's gate and up biases cut with its rows, its down
        bias added by its CPU part (its slot's zeroed).

        It keeps the arrays' addresses: they must stay alive and in place while it is used, and a
        cache that replaces them needs a new planner. Its CPU jobs are redoable (`redo_us`): the
        runner holds the weights until it closes.
        """
        if self._module is None:
            return None
        layers, experts = slot_of.shape
        arrays = {
            "slot_of": (slot_of, np.int32, (layers, experts)),
            "key_of_slot": (key_of_slot, np.int64, (key_of_slot.size,)),
            "last_use": (last_use, np.int64, (key_of_slot.size,)),
            "state": (state, np.int64, (4,)),
            "picks": (picks, np.int64, (layers, experts)),
        }
        for name, (array, dtype, shape) in arrays.items():
            if array.dtype != dtype or array.shape != shape or not array.flags.c_contiguous:
                raise ValueError(
                    f"{name} must be a contiguous {np.dtype(dtype).name} array of shape {shape}, "
                    f"got {array.dtype} {array.shape}"
                )
        factors = {"w13_scale": w13_scale, "w2_scale": w2_scale}
        per_tensor = {"w13_scale_2": w13_scale_2, "w2_scale_2": w2_scale_2}
        biases = {"w13_bias": w13_bias, "w2_bias": w2_bias}
        for name, tensors in {"w13": w13, "w2": w2, **factors, **per_tensor, **biases}.items():
            if tensors is not None and len(tensors) != layers:
                raise ValueError(f"{name} needs one tensor per layer ({layers})")
        nv = _tensor_scales(w13_scale_2, w2_scale_2) is not None
        if nv and (w13_scale is None or w2_scale is None):
            raise ValueError("NVFP4 weights need w13_scale and w2_scale, their e4m3 scales")
        mx = w13[0].dim() == 4
        _, two_inter, hidden = _held_shape(w13[0], nv)
        want13, want2 = (experts, two_inter, hidden), (experts, hidden, two_inter // 2)
        for m, (a, b) in enumerate(zip(w13, w2, strict=True)):
            shapes = (_held_shape(a, nv), _held_shape(b, nv))
            if (
                shapes != (want13, want2)
                or a.dtype not in _WEIGHT_CODES
                or b.dtype != a.dtype
                or not (a.is_contiguous() and b.is_contiguous())
                or a.device.type != "cpu"
            ):
                raise ValueError(
                    "every layer's w13 and w2 must be contiguous host tensors of "
                    f"[{experts}, 2I, H] and [{experts}, H, I] (MXFP4: their blocks; NVFP4: their "
                    "values), one dtype"
                )
            layer_factors = {name: t[m] if t is not None else None for name, t in factors.items()}
            if nv:
                layer_scales = {name: t[m] for name, t in per_tensor.items()}
                nvfp4_moe.check_bank(a, b, *layer_factors.values(), *layer_scales.values())
                layer_factors |= layer_scales
            else:
                _check_factors(a, **layer_factors, num_experts=experts, hidden=hidden,
                               inter=two_inter // 2)  # fmt: skip
            layer_biases = {name: t[m] if t is not None else None for name, t in biases.items()}
            _check_biases(a, b, **layer_biases)
            for name, t in (layer_factors | layer_biases).items():
                if t is not None and not (t.is_contiguous() and t.device.type == "cpu"):
                    raise ValueError(f"{name} must be contiguous host tensors")
        # each tensor an expert is copied as, its rows along I: w13's gate and up rows, or w2's
        # columns, `block` of them an entry (an FP8 factor's 128, an MXFP4 group's 32 columns
        # of w2, an NVFP4 group's 16); the down bias has none, and NVFP4's per-tensor scales are
        # copied whole. Its role for the CPU job (decode_planner.h, TensorRole)
        group = mxfp4.BLOCK if mx else nvfp4.BLOCK if nv else 1
        tensors = [(w13, True, 1, 0), (w2, False, group, 0)]
        if w13_scale is not None and w2_scale is not None:
            block13, block2 = (1, group) if mx or nv else (fp8.BLOCK, fp8.BLOCK)
            tensors += [(w13_scale, True, block13, 1), (w2_scale, False, block2, 1)]
        if nv:
            tensors += [(w13_scale_2, True, 1, 2), (w2_scale_2, False, 1, 2)]
        if w13_bias is not None and w2_bias is not None:
            tensors += [(w13_bias, True, 1, 3), (w2_bias, False, 1, 3)]
        specs = [
            ([t.data_ptr() for t in per_layer], gate_up, block, per_layer[0].shape[1],
             per_layer[0][0, 0].nbytes, role)
            for per_layer, gate_up, block, role in tensors
        ]  # fmt: skip
        self._hold(*(t for per_layer, *_ in tensors for t in per_layer))
        return self._module.DecodePlanner(
            self._pool,
            _SIMD_CODES[self.simd],
            _weight_code(w13[0], nvfp4=nv),
            slot_of.ctypes.data,
            key_of_slot.ctypes.data,
            last_use.ctypes.data,
            key_of_slot.size,
            state.ctypes.data,
            picks.ctypes.data,
            layers,
            experts,
            top_k,
            hidden,
            two_inter // 2,
            specs,
            float(swiglu_limit),
        )

    def run(
        self,
        x: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        pair_expert: torch.Tensor,
        pair_token: torch.Tensor,
        pair_weight: torch.Tensor,
        out: torch.Tensor | None = None,
        **extras: torch.Tensor | float | None,
    ) -> torch.Tensor:
        """submit() and wait(): the experts' output [T, H] fp32 (extras: FP8 factors, biases and
        SwiGLU limit, as submit takes them)."""
        args = (x, w13, w2, pair_expert, pair_token, pair_weight, out)
        return self.submit(*args, **extras).wait()

    def jobs_gbps(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        k: int,
        iterations: int,
        **factors: torch.Tensor | bool | None,
    ) -> float:
        """Weight GB/s of `iterations` one-token jobs of k experts each (native kernel), queued
        back to back in native code as decode queues them, through the bank w13 [E, 2I, H], w2
        [E, H, I] (FP8, MXFP4 or NVFP4 with its factors or scales, as `submit` takes them,
        counted in the bytes) in a scattered turn (so from memory, with a bank larger than the
        caches)."""
        return self.jobs_profile(w13, w2, k, iterations, **factors)["gbps"]

    def jobs_profile(
        self,
        w13: torch.Tensor,
        w2: torch.Tensor,
        k: int,
        iterations: int,
        *,
        gap_us: float = 0.0,
        own_rounds: int = 0,
        fetch_own: bool = False,
        bf16_x: bool = True,
        w13_scale: torch.Tensor | None = None,
        w2_scale: torch.Tensor | None = None,
        w13_scale_2: torch.Tensor | None = None,
        w2_scale_2: torch.Tensor | None = None,
    ) -> dict[str, float]:
        """`jobs_gbps`'s jobs, with where a job's run went, means in µs: `run_us` from its first
        task to its last, `phase1_us` from its first task to the end of its gate/up rows (the
        down projection needs them all), `wait_us` what its tasks waited for those rows, per
        worker (`CpuExpertJob.phase_seconds`); and `gbps` (of the whole time, gaps included).
        gap_us: the caller spins that long before queueing each job, as offloaded decode leaves
        the workers idle between two layers' jobs. own_rounds: each job's first rounds of gate/up
        blocks belong to the workers (`submit`); fetch_own: each worker is told of its own
        blocks' weights when the gap begins, and fetches them into its cache while it waits.
        bf16_x: the jobs' x are bf16 values, as a bf16 model's activations are (they take the bf16
        dot products where the build has them; `bf16_dot` in the result says whether they did),
        else fp32 values that bf16 does not hold.
        An FP8 bank takes its factors (w13_scale, w2_scale: `submit`), an MXFP4 or NVFP4 one its
        scales (NVFP4's per-tensor ones too), which `gbps` counts."""
        if self._module is None:
            raise RuntimeError("jobs_profile times the native kernel; this runner uses torch")
        tensor_scales = _tensor_scales(w13_scale_2, w2_scale_2)
        nvfp4 = tensor_scales is not None
        num_experts, two_inter, hidden = _held_shape(w13, nvfp4)
        if _held_shape(w2, nvfp4) != (num_experts, hidden, two_inter // 2) or w13.dtype != w2.dtype:
            raise ValueError(f"w2 {tuple(w2.shape)} does not match w13 {tuple(w13.shape)}")
        bank = [t for t in (w13, w2, w13_scale, w2_scale, *(tensor_scales or ())) if t is not None]
        if not all(t.is_contiguous() for t in bank) or w13.dtype not in _WEIGHT_CODES:
            raise ValueError(
                "the bank must be contiguous bf16, fp16, fp32, FP8, MXFP4 or NVFP4 (and factors)"
            )
        if nvfp4:
            nvfp4_moe.check_bank(w13, w2, w13_scale, w2_scale, *tensor_scales)
        else:
            _check_factors(w13, w13_scale, w2_scale, num_experts, hidden, two_inter // 2)
        seconds, run_s, phase1_s, wait_s, bf16_dot = self._module.time_expert_jobs(
            self._pool, _SIMD_CODES[self.simd], _weight_code(w13, nvfp4), w13.data_ptr(),
            w2.data_ptr(), _address(w13_scale), _address(w2_scale), num_experts, hidden,
            two_inter // 2, k, iterations, float(gap_us), int(own_rounds), bool(fetch_own),
            _address(w13_scale_2), _address(w2_scale_2), bool(bf16_x),
        )  # fmt: skip
        per_job = 1e6 / iterations
        return {
            "gbps": iterations * k * sum(t[0].nbytes for t in bank) / seconds / 1e9,
            "run_us": run_s * per_job,
            "phase1_us": phase1_s * per_job,
            "wait_us": wait_s * per_job / self.num_threads,
            "bf16_dot": bf16_dot,
        }

    def worker_cpus(self) -> list[list[int]] | None:
        """The logical CPUs each native worker may run on (None for the torch kernel)."""
        return None if self._module is None else [list(c) for c in self._pool.worker_cpus()]

    def read_gbps(
        self, size_bytes: int = 1 << 30, repeats: int = 5, buf: torch.Tensor | None = None
    ) -> float:
        """The host memory read rate in GB/s on these threads: the best of `repeats` sums of `buf`
        (a written float32 tensor; default a new one of size_bytes, written so every page is
        real)."""
        if buf is None:
            buf = torch.ones(size_bytes // 4, dtype=torch.float32)
        best_s = float("inf")
        for _ in range(repeats):
            started_s = time.perf_counter()
            if self._module is not None:
                self._module.read_sum(self._pool, buf.data_ptr(), buf.numel())
            else:
                self._executor.submit(torch.sum, buf).result()
            best_s = min(best_s, time.perf_counter() - started_s)
        return buf.numel() * 4 / best_s / 1e9

    def close(self) -> None:
        """Finishes the queued jobs and ends the worker threads."""
        if self._closed:
            return
        self._closed = True
        if self._module is not None:
            self._pool.close()
        else:
            self._executor.shutdown(wait=True)
        self._held = {}  # no worker runs any more

    def __enter__(self) -> CpuExpertRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_closed"):
            self.close()


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def host_read_gbps(threads: int, size_bytes: int = 1 << 30) -> float:
    """The host memory read rate in GB/s with `threads` CPU expert workers: the kernel's ceiling."""
    with CpuExpertRunner(threads) as runner:
        return runner.read_gbps(size_bytes)


# ----------------------------------------------------------------------------------------------
# Benchmark: python -m moelab.kernels.cpu_experts --threads 1,2,4 [--json]
