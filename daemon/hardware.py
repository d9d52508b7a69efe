"""What this machine has: GPUs through NVML, CPU, RAM, and how fast the disks holding models read.

No NVIDIA driver, or no GPU, is a normal machine here: the inventory then has no GPUs and says why.
Nothing in this module imports torch; versions are read from package metadata.
"""

from __future__ import annotations

import hashlib
import os
import platform
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import psutil

from ..engine.text import Text


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One NVIDIA GPU as NVML reports it; fields NVML cannot tell are None."""

    index: int
    name: str
    uuid: str
    pci_bus_id: str | None
    vram_total_bytes: int | None
    vram_free_bytes: int | None
    pcie_gen_max: int | None
    pcie_width_max: int | None
    pcie_gen_current: int | None
    pcie_width_current: int | None
    # the memory's peak rate, from its bus width and top memory clock: what a split weighs a
    # card's dense work by where it was not measured
    memory_gbps: float | None = None


@dataclass(frozen=True, slots=True)
class Inventory:
    """A snapshot of the machine: identity, CPU, RAM, GPUs and the driver stack."""

    machine_id: str
    hostname: str
    cpu_model: str
    physical_cores: int
    logical_cores: int
    ram_total_bytes: int
    ram_available_bytes: int
    gpus: tuple[GpuInfo, ...] = ()
    nvml: Text | str = "ok"  # "ok", or why there is no GPU information
    driver_version: str | None = None
    cuda_version: str | None = None
    engine_version: str = "unknown"
    torch_version: str | None = None
    taken: float = field(default_factory=time.time)


def package_version(name: str) -> str | None:
    """An installed distribution's version from its metadata (no import of the package)."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def machine_id() -> str:
    """A stable, non-reversible id of this machine (a hash of /etc/machine-id or the MAC)."""
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw:
            return hashlib.sha256(f"moelab:{raw}".encode()).hexdigest()[:16]
    return hashlib.sha256(f"moelab:{uuid.getnode()}".encode()).hexdigest()[:16]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_nvml_lock = threading.Lock()
_nvml_state: Text | str | None = None  # None: not tried; "ok"; else why it is unavailable


def nvml_status() -> Text | str:
    """Initialise NVML once per process; "ok" or the reason it cannot be used."""
    global _nvml_state
    with _nvml_lock:
        if _nvml_state is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml_state = "ok"
            except ImportError:
                _nvml_state = Text("the nvidia-ml-py package is not installed")
            except Exception as err:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
                _nvml_state = Text("no NVIDIA driver ({error})", error=str(err))
        return _nvml_state


def _nvml(call: str, *args: object) -> object | None:
    """One NVML call; None when this GPU or driver does not support it."""
    import pynvml

    try:
        value = getattr(pynvml, call)(*args)
    except Exception:
        return None
    return value.decode() if isinstance(value, bytes) else value


def gpu_count() -> int:
    if nvml_status() != "ok":
        return 0
    count = _nvml("nvmlDeviceGetCount")
    return count if isinstance(count, int) else 0


def probe_gpu(index: int) -> GpuInfo | None:
    """One GPU's identity, memory and PCIe link (max and current); None without NVML."""
    if nvml_status() != "ok":
        return None
    handle = _nvml("nvmlDeviceGetHandleByIndex", index)
    if handle is None:
        return None
    memory = _nvml("nvmlDeviceGetMemoryInfo", handle)
    pci = _nvml("nvmlDeviceGetPciInfo", handle)
    bus_id = getattr(pci, "busId", None)
    return GpuInfo(
        index=index,
        name=str(_nvml("nvmlDeviceGetName", handle) or f"GPU {index}"),
        uuid=str(_nvml("nvmlDeviceGetUUID", handle) or f"gpu-{index}"),
        pci_bus_id=bus_id.decode() if isinstance(bus_id, bytes) else bus_id,
        vram_total_bytes=getattr(memory, "total", None),
        vram_free_bytes=getattr(memory, "free", None),
        pcie_gen_max=_nvml("nvmlDeviceGetMaxPcieLinkGeneration", handle),  # type: ignore[arg-type]
        pcie_width_max=_nvml("nvmlDeviceGetMaxPcieLinkWidth", handle),  # type: ignore[arg-type]
        pcie_gen_current=_nvml("nvmlDeviceGetCurrPcieLinkGeneration", handle),  # type: ignore[arg-type]
        pcie_width_current=_nvml("nvmlDeviceGetCurrPcieLinkWidth", handle),  # type: ignore[arg-type]
        memory_gbps=_memory_gbps(handle),
    )


def _memory_gbps(handle: object) -> float | None:
    """Peak memory rate in GB/s: bus width in bytes times the top memory clock, twice a cycle
    (NVML's memory clock is half the data rate, for GDDR and HBM alike); None where NVML does
    not tell either."""
    import pynvml

    bus_bits = _nvml("nvmlDeviceGetMemoryBusWidth", handle)
    clock_mhz = _nvml("nvmlDeviceGetMaxClockInfo", handle, getattr(pynvml, "NVML_CLOCK_MEM", 2))
    if not isinstance(bus_bits, int) or not isinstance(clock_mhz, int) or not bus_bits * clock_mhz:
        return None
    return bus_bits / 8 * clock_mhz * 2 / 1000


def pcie_link(index: int) -> tuple[int, int] | None:
    """The current PCIe (generation, width) of a GPU; None without NVML or support."""
    if nvml_status() != "ok":
        return None
    handle = _nvml("nvmlDeviceGetHandleByIndex", index)
    if handle is None:
        return None
    gen = _nvml("nvmlDeviceGetCurrPcieLinkGeneration", handle)
    width = _nvml("nvmlDeviceGetCurrPcieLinkWidth", handle)
    if not isinstance(gen, int) or not isinstance(width, int):
        return None
    return gen, width


def _cuda_version() -> str | None:
    version = _nvml("nvmlSystemGetCudaDriverVersion_v2") or _nvml("nvmlSystemGetCudaDriverVersion")
    if not isinstance(version, int):
        return None
    return f"{version // 1000}.{(version % 1000) // 10}"


def probe_inventory() -> Inventory:
    """The machine now. Takes milliseconds (plus NVML's first initialisation)."""
    status = nvml_status()
    gpus = tuple(g for i in range(gpu_count()) if (g := probe_gpu(i)) is not None)
    memory = psutil.virtual_memory()
    return Inventory(
        machine_id=machine_id(),
        hostname=socket.gethostname(),
        cpu_model=cpu_model(),
        physical_cores=psutil.cpu_count(logical=False) or os.cpu_count() or 1,
        logical_cores=psutil.cpu_count(logical=True) or os.cpu_count() or 1,
        ram_total_bytes=memory.total,
        ram_available_bytes=memory.available,
        gpus=gpus,
        nvml=status if status != "ok" or gpus else Text("NVML works but reports no GPU"),
        driver_version=_nvml("nvmlSystemGetDriverVersion") if status == "ok" else None,  # type: ignore[arg-type]
        cuda_version=_cuda_version() if status == "ok" else None,
        engine_version=package_version("moelab") or "unknown",
        torch_version=package_version("torch"),
    )


@dataclass(frozen=True, slots=True)
class DiskReading:
    """A cold read of one model file: how fast the disk under it delivers."""

    path: str
    mountpoint: str
    device: str
    fstype: str
    bytes_read: int
    seconds: float

    @property
    def read_gbps(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0


def disk_of(path: Path) -> tuple[str, str, str]:
    """(mount point, device, file system type) of the disk holding `path`."""
    real = str(path.resolve())
    best = ("/", "unknown", "unknown")
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[0]):
            best = (mount, part.device, part.fstype)
    return best


def measure_disk_read(
    path: Path, max_bytes: int = 2 * 1024**3, max_s: float = 10.0, chunk_bytes: int = 16 * 1024**2
) -> DiskReading:
    """Read up to `max_bytes` of `path` with its page cache dropped first (posix_fadvise).

    The cache is dropped again afterwards, so the measurement leaves no warm pages behind to
    flatter the next one.
    """
    mountpoint, device, fstype = disk_of(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        buffer = bytearray(chunk_bytes)
        view = memoryview(buffer)
        total = 0
        start = time.perf_counter()
        while total < max_bytes and time.perf_counter() - start < max_s:
            n = os.readv(fd, [view])
            if n == 0:
                break
            total += n
        seconds = time.perf_counter() - start
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return DiskReading(str(path), mountpoint, device, fstype, total, seconds)
