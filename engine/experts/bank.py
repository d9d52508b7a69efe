"""ExpertBank: every routed expert in host memory, one contiguous block per (layer, expert).

Per MoE layer the bank holds `w13 [E, 2I, H]` (gate rows then up rows) and `w2 [E, H, I]`, so one
expert is two contiguous copies. An FP8 bank (format "fp8") holds them as float8_e4m3fn with their
fp32 block factors beside them, `w13_scale [E, ⌈2I/128⌉, ⌈H/128⌉]` and `w2_scale [E, ⌈H/128⌉,
⌈I/128⌉]` (kernels/fp8.py): four copies an expert. An MXFP4 bank (format "mxfp4") holds them as
blocks, `w13 [E, 2I, H/32, 16]` and `w2 [E, H, I/32, 16]` uint8 (two e2m1 values a byte), with
their E8M0 scales `w13_scale [E, 2I, H/32]` and `w2_scale [E, H, I/32]` uint8 (kernels/mxfp4.py),
as kernels/mxfp4_moe.py and the native CPU kernel read them. An NVFP4 bank (format "nvfp4",
ModelOpt's layout: kernels/nvfp4.py) holds `w13 [E, 2I, H/2]` and `w2 [E, H, I/2]` uint8, their
e4m3 scales `w13_scale [E, 2I, H/16]` and `w2_scale [E, H, I/16]` (float8_e4m3fn) and their
per-tensor fp32 scales `w13_scale_2 [E, 2]` (gate's, then up's) and `w2_scale_2 [E, 1]`, as
kernels/nvfp4_moe.py reads them. The format is the checkpoint's, or the one `--moe-expert-dtype`
asks for, converted once as the prepacked file is written.

The bank is written once in this final layout (a prepacked safetensors file in the cache
directory) and later starts memory-map it; with CUDA present each layer is copied once into pinned
memory, falling back to the mapped pages where pinning fails.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import logging
import mmap
import os
import struct
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from ...kernels import fp8, mxfp4, nvfp4
from ...kernels.nvfp4_moe import dequantized as nvfp4_dequantized
from ..model.checkpoint import Expert, SafetensorsSource, TensorSource, iter_layer_experts
from ..model.spec import CheckpointError, ModelSpec, blocks

log = logging.getLogger("moelab.bank")

BANK_VERSION = 1
_ST_CODES = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.uint8: "U8",
}

Progress = Callable[[int, int], None]
# a bank's tensors per layer, in file order (those it holds: w13 and w2, FP8 factors or MXFP4 or
# NVFP4 scales, NVFP4's per-tensor scales, biases)
TENSOR_KINDS = (
    "w13", "w2", "w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2", "w13_bias", "w2_bias",
)  # fmt: skip


class HostMemoryError(RuntimeError):
    """The expert bank does not fit in this machine's RAM."""


@dataclass(slots=True)
class ExpertBank:
    """Host-resident expert weights of all MoE layers."""

    w13: list[torch.Tensor]
    w2: list[torch.Tensor]
    # an FP8 bank's block factors or an MXFP4 bank's scales per layer (empty for an unquantized
    # bank)
    w13_scale: list[torch.Tensor] = field(default_factory=list)
    w2_scale: list[torch.Tensor] = field(default_factory=list)
    # an NVFP4 bank's per-tensor scales per layer, [E, 2] and [E, 1] fp32 (empty otherwise)
    w13_scale_2: list[torch.Tensor] = field(default_factory=list)
    w2_scale_2: list[torch.Tensor] = field(default_factory=list)
    # gpt_oss's experts: their biases per layer, [E, 2I] and [E, H] fp32 (the CPU kernel's
    # dtype, and exact for the checkpoint's bf16), and
    # the clamped SwiGLU's limit (kernels/swiglu.py; 0: SwiGLU)
    w13_bias: list[torch.Tensor] = field(default_factory=list)
    w2_bias: list[torch.Tensor] = field(default_factory=list)
    swiglu_limit: float = 0.0
    pinned: list[bool] = field(default_factory=list)
    path: Path | None = None
    _maps: list[mmap.mmap] = field(default_factory=list, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.w13[0].dtype

    @property
    def num_layers(self) -> int:
        return len(self.w13)

    @property
    def num_experts(self) -> int:
        return self.w13[0].shape[0]

    @property
    def hidden_size(self) -> int:
        """H, in any format (w2's rows: MXFP4 blocks its columns, not its rows)."""
        return self.w2[0].shape[1]

    @property
    def intermediate_size(self) -> int:
        """I, in any format (half of w13's rows)."""
        return self.w13[0].shape[1] // 2

    @property
    def fmt(self) -> str:
        """ "fp8" (values and block factors), "mxfp4" (blocks and scales), "nvfp4" (values, block
        scales and per-tensor scales) or "bf16" (weights in the engine's dtype)."""
        return held_format(self.w13[0][0], self.w13_scale[0][0] if self.w13_scale else None)

    @property
    def block_rows(self) -> int:
        """The rows of gate and up (columns of the down projection) one scale factor covers:
        fp8.BLOCK for an FP8 bank, mxfp4.BLOCK (nvfp4.BLOCK) columns of the down projection for
        an MXFP4 (NVFP4) one, 1 without factors (a split miss cuts at a multiple of it)."""
        return {"fp8": fp8.BLOCK, "mxfp4": mxfp4.BLOCK, "nvfp4": nvfp4.BLOCK}.get(self.fmt, 1)

    def cpu_args(self, moe_layer: int) -> dict[str, torch.Tensor | float]:
        """What the CPU expert runner takes beside a layer's weights: an FP8 layer's factors or an
        MXFP4 or NVFP4 layer's scales, gpt_oss's biases and SwiGLU limit (none for a bf16 bank of
        another architecture)."""
        args: dict[str, torch.Tensor | float] = {}
        if self.w13_scale:
            args.update(w13_scale=self.w13_scale[moe_layer], w2_scale=self.w2_scale[moe_layer])
        if self.w13_scale_2:
            args.update(
                w13_scale_2=self.w13_scale_2[moe_layer], w2_scale_2=self.w2_scale_2[moe_layer]
            )
        if self.w13_bias:
            args.update(w13_bias=self.w13_bias[moe_layer], w2_bias=self.w2_bias[moe_layer])
        if self.swiglu_limit:
            args["swiglu_limit"] = self.swiglu_limit
        return args

    def layers(self, span: range) -> ExpertBank:
        """The bank of the MoE layers in `span` alone (one device's of a split), its layers
        numbered from 0: views of this bank's memory, no copy."""
        kinds = {kind: getattr(self, kind)[span.start : span.stop] for kind in TENSOR_KINDS}
        pinned = self.pinned[span.start : span.stop]
        return replace(self, **kinds, pinned=pinned)

    def layer_tensors(self, moe_layer: int) -> list[torch.Tensor]:
        """A layer's tensors: w13, w2 and, for an FP8, MXFP4 or NVFP4 bank, their factors or
        scales (NVFP4's per-tensor ones after), then any biases (an expert's row of each is one
        copy into a slot: `ExpertCache.tensors`)."""
        return [tensors[moe_layer] for tensors in self._all() if tensors]

    @property
    def expert_bytes(self) -> int:
        """One expert's bytes, as held (FP8 values and their factors, MXFP4 blocks and scales,
        NVFP4 values and both scales)."""
        return sum(t[0][0].nbytes for t in self._all() if t)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for tensors in self._all() for t in tensors)

    def _all(self) -> tuple[list[torch.Tensor], ...]:
        return tuple(getattr(self, kind) for kind in TENSOR_KINDS)

    @property
    def pinned_layers(self) -> int:
        return sum(self.pinned)

    def snapshot(self) -> dict:
        """The bank's bytes and its layers in pinned memory (telemetry's `Reports`)."""
        return {"bytes": self.nbytes, "pinned_layers": self.pinned_layers}


def bank_bytes(spec: ModelSpec, dtype: torch.dtype, fmt: str = "bf16") -> int:
    return spec.experts_total * spec.expert_bytes_as(fmt, dtype.itemsize)


def held_format(w13: torch.Tensor, w13_scale: torch.Tensor | None) -> str:
    """The format of an expert's weights: "mxfp4" (uint8 blocks with E8M0 scales), "nvfp4"
    (uint8 values with e4m3 scales), "fp8" (values with block factors) or "bf16" (unquantized,
    whatever their dtype)."""
    if w13_scale is None:
        return "bf16"
    if w13.dtype != torch.uint8:
        return "fp8"
    return "nvfp4" if w13_scale.dtype == torch.float8_e4m3fn else "mxfp4"


def as_format(expert: Expert, fmt: str, dtype: torch.dtype) -> Expert:
    """An expert as the bank holds it: FP8 values and factors ("fp8", in 128x128 blocks), MXFP4
    blocks and scales ("mxfp4", 32 values a block), NVFP4 values and scales ("nvfp4", 16 values
    a block, gate, up and down each with its per-tensor scale), or weights in `dtype` ("bf16");
    a weight stored in another format is widened (and quantized again where `fmt` is a
    quantized one)."""
    stored = held_format(expert.w13, expert.w13_scale)
    if stored == fmt:
        return expert
    w13 = _widened(stored, expert.w13, expert.w13_scale, expert.w13_scale_2)
    w2 = _widened(stored, expert.w2, expert.w2_scale, expert.w2_scale_2)
    plain = expert._replace(w13_scale=None, w2_scale=None, w13_scale_2=None, w2_scale_2=None)
    if fmt == "bf16":
        return plain._replace(w13=w13.to(dtype), w2=w2.to(dtype))
    if fmt == "nvfp4":
        q13, s13, t13 = _nvfp4_quantized(w13, 2)
        q2, s2, t2 = _nvfp4_quantized(w2, 1)
        return plain._replace(
            w13=q13, w2=q2, w13_scale=s13, w2_scale=s2, w13_scale_2=t13, w2_scale_2=t2
        )
    quantize = fp8.quantize if fmt == "fp8" else mxfp4.quantize
    q13, s13 = quantize(w13)
    q2, s2 = quantize(w2)
    return plain._replace(w13=q13, w2=q2, w13_scale=s13, w2_scale=s2)


def _widened(
    fmt: str, w: torch.Tensor, scale: torch.Tensor | None, scale_2: torch.Tensor | None
) -> torch.Tensor:
    """A projection's weights [N, K] from the values and scales of `fmt` (fp32), or as held
    ("bf16")."""
    if fmt == "bf16":
        return w
    if fmt == "nvfp4":
        return nvfp4_dequantized(w[None], scale[None], scale_2[None])[0]
    return (fp8.dequantize if fmt == "fp8" else mxfp4.dequantize)(w, scale)


def _nvfp4_quantized(
    w: torch.Tensor, parts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights [N, K] as NVFP4 values, block scales and `parts` per-tensor scales [parts], one
    for each run of N/parts rows (w13: gate, then up, quantized apart as ModelOpt does)."""
    quantized = [nvfp4.quantize(rows) for rows in w.chunk(parts)]
    values, scales, tensor_scales = zip(*quantized, strict=True)
    return torch.cat(values), torch.cat(scales), torch.stack(tensor_scales)


def check_host_memory(needed_bytes: int, *, pinned: bool) -> None:
    """Refuse, with the numbers, a bank that the machine's RAM cannot hold."""
    import psutil

    vm = psutil.virtual_memory()
    gib = 1024**3
    limit = vm.available if pinned else vm.total
    kind = "available" if pinned else "in total"
    log.info(
        "expert bank needs %.2f GiB of host RAM (%s); %.2f GiB available of %.2f GiB",
        needed_bytes / gib,
        "pinned" if pinned else "memory-mapped",
        vm.available / gib,
        vm.total / gib,
    )
    if needed_bytes > limit:
        raise HostMemoryError(
            f"the expert bank needs {needed_bytes / gib:.2f} GiB of host RAM but this machine has "
            f"{limit / gib:.2f} GiB {kind} ({vm.total / gib:.2f} GiB total); free memory, use a "
            "smaller dtype, or use a machine with more RAM"
        )


def default_bank_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("moelab")) / "banks"


def bank_key(source: SafetensorsSource, dtype: torch.dtype, fmt: str = "bf16") -> str:
    """Identifies a checkpoint's files (path, sizes, mtimes) and the bank's format and dtype."""
    parts = [str(source.path.resolve()), str(dtype), BANK_VERSION]
    if fmt != "bf16":
        parts.append(fmt)
    for f in source.files:
        st = f.stat()
        parts.append([f.name, st.st_size, st.st_mtime_ns])
    return hashlib.sha1(json.dumps(parts).encode()).hexdigest()[:16]


def _layout(
    spec: ModelSpec, dtype: torch.dtype, fmt: str
) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The bank's tensors in file order: per MoE layer w13, w2 (and for FP8 their factors, for
    MXFP4 their scales, for NVFP4 both its scales, for gpt_oss their biases), named
    layer{m}.{kind} (TENSOR_KINDS)."""
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    out = []
    values = torch.float8_e4m3fn if fmt == "fp8" else dtype
    for m in range(spec.num_moe_layers):
        if fmt == "mxfp4":
            b = mxfp4.BLOCK
            u8 = torch.uint8
            out += [
                (f"layer{m}.w13", (e, 2 * i, h // b, b // 2), u8),
                (f"layer{m}.w2", (e, h, i // b, b // 2), u8),
                (f"layer{m}.w13_scale", (e, 2 * i, h // b), u8),
                (f"layer{m}.w2_scale", (e, h, i // b), u8),
            ]
        elif fmt == "nvfp4":
            b, u8, e4m3, f32 = nvfp4.BLOCK, torch.uint8, torch.float8_e4m3fn, torch.float32
            out += [
                (f"layer{m}.w13", (e, 2 * i, h // 2), u8),
                (f"layer{m}.w2", (e, h, i // 2), u8),
                (f"layer{m}.w13_scale", (e, 2 * i, h // b), e4m3),
                (f"layer{m}.w2_scale", (e, h, i // b), e4m3),
                (f"layer{m}.w13_scale_2", (e, 2), f32),
                (f"layer{m}.w2_scale_2", (e, 1), f32),
            ]
        else:
            out += [(f"layer{m}.w13", (e, 2 * i, h), values), (f"layer{m}.w2", (e, h, i), values)]
        if fmt == "fp8":
            out += [
                (f"layer{m}.w13_scale", (e, blocks(2 * i), blocks(h)), torch.float32),
                (f"layer{m}.w2_scale", (e, blocks(h), blocks(i)), torch.float32),
            ]
        if spec.expert_bias:
            bias = torch.float32
            out += [(f"layer{m}.w13_bias", (e, 2 * i), bias), (f"layer{m}.w2_bias", (e, h), bias)]
    return out


def _per_layer(spec: ModelSpec, fmt: str) -> int:
    return {"bf16": 2, "nvfp4": 6}.get(fmt, 4) + (2 if spec.expert_bias else 0)


def _kind(name: str) -> str:
    """The TENSOR_KINDS entry of a `_layout` name."""
    return name.split(".", 1)[1]


def _fill_layer(
    spec: ModelSpec,
    source: TensorSource,
    layer: int,
    tensors: dict[str, torch.Tensor],
    fmt: str,
    dtype: torch.dtype,
) -> None:
    """Copy a layer's experts, converted to the bank's format, into its tensors (by kind:
    w13, w2 and for FP8 their factors, for MXFP4 and NVFP4 their scales, for gpt_oss their
    biases).

    The experts are read in order (a checkpoint's reads, or the synthetic source's draws, stay
    on this thread) and converted and copied on torch's intra-op threads' worth of threads, an
    expert a thread, each running its ops on one thread: an expert's ops are too small for
    torch's own threads to pay (a quantized bank of Qwen3.6-35B-A3B's 10,240 experts took 59 s
    to build on 16 cores with them). At most two experts a thread are read ahead. The bank's
    bytes are the same either way: each expert's ops are the same, and its amax is exact in any
    order."""

    def fill(expert: Expert) -> None:
        held = as_format(expert, fmt, dtype)._asdict()
        for kind, dst in tensors.items():
            dst[expert.index].copy_(held[kind])

    experts = iter_layer_experts(spec, source, layer)
    threads = torch.get_num_threads()
    if threads == 1:
        for expert in experts:
            fill(expert)
        return
    with _one_torch_thread(threads), ThreadPoolExecutor(threads) as pool:
        pending: collections.deque[Future[None]] = collections.deque()
        for expert in experts:
            if len(pending) >= 2 * threads:
                pending.popleft().result()
            pending.append(pool.submit(fill, expert))
        while pending:
            pending.popleft().result()


@contextlib.contextmanager
def _one_torch_thread(threads: int) -> Iterator[None]:
    """Torch's ops on one thread each while `threads` threads of ours run them, then
    `threads` again."""
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def write_prepacked(
    spec: ModelSpec,
    source: TensorSource,
    dtype: torch.dtype,
    path: Path,
    progress: Progress | None = None,
    fmt: str = "bf16",
) -> None:
    """Write the bank in its final layout as a safetensors file (atomically, via a temp file)."""
    layout = _layout(spec, dtype, fmt)
    header: dict = {"__metadata__": {"moelab_bank_version": str(BANK_VERSION)}}
    offset = 0
    for name, shape, tensor_dtype in layout:
        size = tensor_dtype.itemsize
        for d in shape:
            size *= d
        header[name] = {
            "dtype": _ST_CODES[tensor_dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 4096)  # data starts page-aligned, so every layer maps cleanly
    total = offset
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    done = 0
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            n = _per_layer(spec, fmt)
            for m, layer in enumerate(spec.moe_layers):
                tensors = {
                    _kind(name): torch.empty(shape, dtype=d)
                    for name, shape, d in layout[n * m : n * m + n]
                }
                _fill_layer(spec, source, layer, tensors, fmt, dtype)
                for t in tensors.values():
                    f.write(t.view(torch.uint8).numpy().tobytes())
                    done += t.nbytes
                if progress:
                    progress(done, total)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def map_prepacked(
    spec: ModelSpec,
    dtype: torch.dtype,
    path: Path,
    *,
    pin: bool,
    progress: Progress | None = None,
    fmt: str = "bf16",
) -> ExpertBank:
    """Memory-map a prepacked bank; with `pin`, copy each layer into pinned memory."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    data_start = 8 + size
    layout = _layout(spec, dtype, fmt)
    views = []
    for name, shape, tensor_dtype in layout:
        meta = header.get(name)
        if (
            meta is None
            or tuple(meta["shape"]) != shape
            or meta["dtype"] != _ST_CODES[tensor_dtype]
        ):
            raise CheckpointError(f"prepacked bank {path} does not match the checkpoint ({name})")
        begin, end = meta["data_offsets"]
        count = (end - begin) // tensor_dtype.itemsize
        view = torch.frombuffer(mm, dtype=tensor_dtype, count=count, offset=data_start + begin)
        views.append(view.view(shape))
    bank = ExpertBank(w13=[], w2=[], swiglu_limit=spec.swiglu_limit, path=path, _maps=[mm])
    for (name, _, _), view in zip(layout, views, strict=True):
        getattr(bank, _kind(name)).append(view)
    total = bank.nbytes
    done = 0
    pin_ok = pin
    for m in range(bank.num_layers):
        layer_tensors = [tensors for tensors in bank._all() if tensors]
        if pin_ok:
            try:
                for tensors in layer_tensors:
                    tensors[m] = _pinned_copy(tensors[m])
            except RuntimeError as err:
                pin_ok = False
                log.warning(
                    "pinning host memory failed at MoE layer %d (%s); layers %d..%d stay in "
                    "pageable memory, so their copies to the GPU run slower",
                    m,
                    str(err).splitlines()[0],
                    m,
                    bank.num_layers - 1,
                )
        else:
            # touch every page now so the first decode steps do not fault them in one by one
            for tensors in layer_tensors:
                tensors[m].view(torch.uint8).flatten()[:: mmap.PAGESIZE].sum()
        bank.pinned.append(pin_ok)
        done += sum(tensors[m].nbytes for tensors in layer_tensors)
        if progress:
            progress(done, total)
    return bank


def _pinned_copy(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out


def load_bank(
    spec: ModelSpec,
    source: SafetensorsSource,
    dtype: torch.dtype,
    *,
    bank_dir: Path | None,
    pin: bool,
    progress: Progress | None = None,
    fmt: str = "bf16",
) -> ExpertBank:
    """The checkpoint's bank in `fmt`: prepacked on first use (converted from the checkpoint's
    format where it differs), memory-mapped (and pinned) afterwards."""
    check_host_memory(bank_bytes(spec, dtype, fmt), pinned=pin)
    bank_dir = bank_dir or default_bank_dir()
    key = bank_key(source, dtype, fmt)
    path = bank_dir / f"{source.path.resolve().name}-{key}.bank.safetensors"
    t0 = time.perf_counter()
    if not path.is_file():
        log.info("writing the prepacked expert bank to %s (once per checkpoint)", path)

        def half(done: int, total: int) -> None:
            if progress:
                progress(done // 2, total)

        write_prepacked(spec, source, dtype, path, half, fmt)
        t1 = time.perf_counter()
        log.info("prepacked bank written in %.2f s", t1 - t0)

        def second(done: int, total: int) -> None:
            if progress:
                progress(total // 2 + done // 2, total)

        bank = map_prepacked(spec, dtype, path, pin=pin, progress=second, fmt=fmt)
    else:
        bank = map_prepacked(spec, dtype, path, pin=pin, progress=progress, fmt=fmt)
    log.info(
        "expert bank: %d MoE layers x %d experts, %.2f GiB %s, %d/%d layers pinned, "
        "ready in %.2f s",
        bank.num_layers,
        bank.num_experts,
        bank.nbytes / 1024**3,
        str(dtype).replace("torch.", "") if fmt == "bf16" else fmt,
        bank.pinned_layers,
        bank.num_layers,
        time.perf_counter() - t0,
    )
    return bank


def build_in_memory(
    spec: ModelSpec,
    source: TensorSource,
    dtype: torch.dtype,
    *,
    pin: bool,
    progress: Progress | None = None,
    fmt: str = "bf16",
) -> ExpertBank:
    """A bank filled straight from a tensor source (synthetic weights), nothing written to disk."""
    total = bank_bytes(spec, dtype, fmt)
    check_host_memory(total, pinned=pin)
    bank = ExpertBank(w13=[], w2=[], swiglu_limit=spec.swiglu_limit)
    n = _per_layer(spec, fmt)
    done = 0
    for m, layer in enumerate(spec.moe_layers):
        layout = _layout(spec, dtype, fmt)[n * m : n * m + n]
        tensors = {
            _kind(name): torch.empty(shape, dtype=d, pin_memory=pin) for name, shape, d in layout
        }
        _fill_layer(spec, source, layer, tensors, fmt, dtype)
        for kind, t in tensors.items():
            getattr(bank, kind).append(t)
        bank.pinned.append(pin)
        done += sum(t.nbytes for t in tensors.values())
        if progress:
            progress(done, total)
    return bank
