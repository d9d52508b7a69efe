"""ExpertBank: every routed expert in host memory, one contiguous block per (layer, expert).

Per MoE layer the bank holds `w13 [E, 2I, H]` (gate rows then up rows) and `w2 [E, H, I]`, so one
expert is two contiguous copies. The bank is written once in this final layout (a prepacked
safetensors file in the cache directory) and later starts memory-map it; with CUDA present each
layer is copied once into pinned memory, falling back to the mapped pages where pinning fails.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model.checkpoint import SafetensorsSource, TensorSource, iter_layer_experts
from ..model.spec import CheckpointError, ModelSpec

log = logging.getLogger("moelab.bank")

BANK_VERSION = 1
_ST_CODES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}

Progress = Callable[[int, int], None]


class HostMemoryError(RuntimeError):
    """The expert bank does not fit in this machine's RAM."""


@dataclass(slots=True)
class ExpertBank:
    """Host-resident expert weights of all MoE layers."""

    w13: list[torch.Tensor]
    w2: list[torch.Tensor]
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
    def expert_bytes(self) -> int:
        return self.w13[0][0].nbytes + self.w2[0][0].nbytes

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.w13) + sum(t.nbytes for t in self.w2)

    @property
    def pinned_layers(self) -> int:
        return sum(self.pinned)

    def snapshot(self) -> dict:
        """The bank's bytes and its layers in pinned memory (telemetry's `Reports`)."""
        return {"bytes": self.nbytes, "pinned_layers": self.pinned_layers}


def bank_bytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    return spec.experts_total * spec.expert_params * torch.empty((), dtype=dtype).element_size()


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


def bank_key(source: SafetensorsSource, dtype: torch.dtype) -> str:
    """Identifies a checkpoint's files (path, sizes, mtimes) and the bank dtype."""
    parts = [str(source.path.resolve()), str(dtype), BANK_VERSION]
    for f in source.files:
        st = f.stat()
        parts.append([f.name, st.st_size, st.st_mtime_ns])
    return hashlib.sha1(json.dumps(parts).encode()).hexdigest()[:16]


def _layout(spec: ModelSpec, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...]]]:
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    out = []
    for m in range(spec.num_moe_layers):
        out += [(f"layer{m}.w13", (e, 2 * i, h)), (f"layer{m}.w2", (e, h, i))]
    return out


def write_prepacked(
    spec: ModelSpec,
    source: TensorSource,
    dtype: torch.dtype,
    path: Path,
    progress: Progress | None = None,
) -> None:
    """Write the bank in its final layout as a safetensors file (atomically, via a temp file)."""
    layout = _layout(spec, dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    header: dict = {"__metadata__": {"moelab_bank_version": str(BANK_VERSION)}}
    offset = 0
    for name, shape in layout:
        size = elem
        for d in shape:
            size *= d
        header[name] = {
            "dtype": _ST_CODES[dtype],
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
            for m, layer in enumerate(spec.moe_layers):
                w13 = torch.empty(layout[2 * m][1], dtype=dtype)
                w2 = torch.empty(layout[2 * m + 1][1], dtype=dtype)
                for e, gate_up, down in iter_layer_experts(spec, source, layer):
                    w13[e].copy_(gate_up)
                    w2[e].copy_(down)
                for t in (w13, w2):
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
) -> ExpertBank:
    """Memory-map a prepacked bank; with `pin`, copy each layer into pinned memory."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    data_start = 8 + size
    layout = _layout(spec, dtype)
    views = []
    for name, shape in layout:
        meta = header.get(name)
        if meta is None or tuple(meta["shape"]) != shape or meta["dtype"] != _ST_CODES[dtype]:
            raise CheckpointError(f"prepacked bank {path} does not match the checkpoint ({name})")
        begin, end = meta["data_offsets"]
        count = (end - begin) // torch.empty((), dtype=dtype).element_size()
        views.append(
            torch.frombuffer(mm, dtype=dtype, count=count, offset=data_start + begin).view(shape)
        )
    bank = ExpertBank(w13=views[0::2], w2=views[1::2], path=path, _maps=[mm])
    total = bank.nbytes
    done = 0
    pin_ok = pin
    for m in range(bank.num_layers):
        if pin_ok:
            try:
                bank.w13[m] = _pinned_copy(bank.w13[m])
                bank.w2[m] = _pinned_copy(bank.w2[m])
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
            bank.w13[m].view(torch.uint8)[:: mmap.PAGESIZE].sum()
            bank.w2[m].view(torch.uint8)[:: mmap.PAGESIZE].sum()
        bank.pinned.append(pin_ok)
        done += bank.w13[m].nbytes + bank.w2[m].nbytes
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
) -> ExpertBank:
    """The checkpoint's bank: prepacked on first use, memory-mapped (and pinned) afterwards."""
    check_host_memory(bank_bytes(spec, dtype), pinned=pin)
    bank_dir = bank_dir or default_bank_dir()
    path = bank_dir / f"{source.path.resolve().name}-{bank_key(source, dtype)}.bank.safetensors"
    t0 = time.perf_counter()
    if not path.is_file():
        log.info("writing the prepacked expert bank to %s (once per checkpoint)", path)

        def half(done: int, total: int) -> None:
            if progress:
                progress(done // 2, total)

        write_prepacked(spec, source, dtype, path, half)
        t1 = time.perf_counter()
        log.info("prepacked bank written in %.2f s", t1 - t0)

        def second(done: int, total: int) -> None:
            if progress:
                progress(total // 2 + done // 2, total)

        bank = map_prepacked(spec, dtype, path, pin=pin, progress=second)
    else:
        bank = map_prepacked(spec, dtype, path, pin=pin, progress=progress)
    log.info(
        "expert bank: %d MoE layers x %d experts, %.2f GiB %s, %d/%d layers pinned, "
        "ready in %.2f s",
        bank.num_layers,
        bank.num_experts,
        bank.nbytes / 1024**3,
        str(dtype).replace("torch.", ""),
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
) -> ExpertBank:
    """A bank filled straight from a tensor source (synthetic weights), nothing written to disk."""
    check_host_memory(bank_bytes(spec, dtype), pinned=pin)
    e, h, i = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    bank = ExpertBank(w13=[], w2=[])
    total = bank_bytes(spec, dtype)
    done = 0
    for layer in spec.moe_layers:
        w13 = torch.empty((e, 2 * i, h), dtype=dtype, pin_memory=pin)
        w2 = torch.empty((e, h, i), dtype=dtype, pin_memory=pin)
        for x, gate_up, down in iter_layer_experts(spec, source, layer):
            w13[x].copy_(gate_up)
            w2[x].copy_(down)
        bank.w13.append(w13)
        bank.w2.append(w2)
        bank.pinned.append(pin)
        done += w13.nbytes + w2.nbytes
        if progress:
            progress(done, total)
    return bank
