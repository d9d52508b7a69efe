"""Hardware readings kept as history: the inventory, disk reads, `moelab bench bw`, PCIe under load.

Every reading is one row with the machine and GPU it was taken on and the versions of the engine,
torch, the driver and CUDA, so a later reader can tell whether it still describes this machine.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from ..engine.config.bandwidth import pcie_gbps
from ..engine.text import Text, text_fields
from .child import run_moelab
from .hardware import GpuInfo, Inventory, measure_disk_read, pcie_link, probe_inventory
from .jobs import Job, JobError, Jobs
from .schema import Measurement
from .store import Store, iso_time

PCIE_LOADED_EVERY_S = 600.0
# A disk read is timed only over a model file at least this big: a few MiB (the demo model's
# files) are read in one request and time the disk's latency and the system's call overhead, not
# the bandwidth that loading a real checkpoint sees.
MIN_DISK_READ_BYTES = 256 * 1024**2


@dataclass(frozen=True, slots=True)
class Reading:
    """A value about to become a Measurement row."""

    kind: str
    value: float
    unit: str
    params: dict[str, Any]
    gpu: GpuInfo | None = None


def inventory_readings(inventory: Inventory) -> list[Reading]:
    """The inventory as rows: core counts, RAM, and per GPU its VRAM and PCIe link."""
    readings = [
        Reading(
            "cpu.physical_cores", inventory.physical_cores, "cores", {"model": inventory.cpu_model}
        ),
        Reading(
            "cpu.logical_cores", inventory.logical_cores, "cores", {"model": inventory.cpu_model}
        ),
        Reading("ram.total", inventory.ram_total_bytes, "bytes", {}),
        Reading("ram.available", inventory.ram_available_bytes, "bytes", {}),
    ]
    for gpu in inventory.gpus:
        params = {"gpu_index": gpu.index, "pci_bus_id": gpu.pci_bus_id}
        for kind, value, unit in (
            ("gpu.vram_total", gpu.vram_total_bytes, "bytes"),
            ("gpu.vram_free", gpu.vram_free_bytes, "bytes"),
            ("gpu.pcie_gen_max", gpu.pcie_gen_max, "generation"),
            ("gpu.pcie_width_max", gpu.pcie_width_max, "lanes"),
            ("gpu.pcie_gen_current", gpu.pcie_gen_current, "generation"),
            ("gpu.pcie_width_current", gpu.pcie_width_current, "lanes"),
            ("gpu.memory_gbps", gpu.memory_gbps, "GB/s"),
        ):
            if value is not None:
                readings.append(Reading(kind, value, unit, params, gpu))
    return readings


def parse_bench_output(stdout: str) -> dict[str, Any]:
    """The JSON object `moelab bench bw --json` printed (the last line that is one)."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                report = json.loads(line)
            except ValueError:
                continue
            if isinstance(report, dict) and isinstance(report.get("results"), list):
                return report
    try:
        report = json.loads(stdout)
    except ValueError:
        raise JobError(Text("`moelab bench bw --json` printed no JSON report")) from None
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        raise JobError(Text("`moelab bench bw --json` printed JSON without a results list"))
    return report


class HardwareService:
    """Takes readings, stores them, and answers "what is the latest" and "what was it before"."""

    def __init__(
        self, store: Store, jobs: Jobs, min_disk_read_bytes: int = MIN_DISK_READ_BYTES
    ) -> None:
        self.store = store
        self.jobs = jobs
        self.min_disk_read_bytes = min_disk_read_bytes
        self._inventory: Inventory | None = None
        self._lock = threading.Lock()
        self._loaded_pcie: dict[int, tuple[tuple[int, int], float]] = {}

    def inventory(self, max_age_s: float = 5.0, refresh: bool = False) -> Inventory:
        """The machine as probed at most `max_age_s` ago (free VRAM and RAM move)."""
        with self._lock:
            stale = self._inventory is None or time.time() - self._inventory.taken > max_age_s
            if stale or refresh:
                self._inventory = probe_inventory()
            return self._inventory

    def record(
        self,
        readings: list[Reading],
        source: str,
        inventory: Inventory,
        versions: dict[str, str | None] | None = None,
    ) -> int:
        """Store readings as rows; `versions` (from a child's report) override the local ones."""
        versions = versions or {}
        now = time.time()
        only_gpu = inventory.gpus[0] if len(inventory.gpus) == 1 else None
        by_index = {gpu.index: gpu for gpu in inventory.gpus}
        with self.store.session() as session:
            for reading in readings:
                # a rate `moelab bench bw` measured on one GPU of several names it by index
                gpu = reading.gpu or by_index.get(reading.params.get("gpu_index")) or only_gpu
                session.add(
                    Measurement(
                        kind=reading.kind,
                        params=reading.params,
                        value=float(reading.value),
                        unit=reading.unit,
                        source=source,
                        machine_id=inventory.machine_id,
                        hostname=inventory.hostname,
                        gpu_uuid=gpu.uuid if gpu else None,
                        gpu_name=gpu.name if gpu else None,
                        engine_version=versions.get("moelab") or inventory.engine_version,
                        torch_version=versions.get("torch") or inventory.torch_version,
                        driver_version=versions.get("driver") or inventory.driver_version,
                        cuda_version=versions.get("cuda") or inventory.cuda_version,
                        created=now,
                    )
                )
        return len(readings)

    def record_inventory(self) -> Inventory:
        """Probe the machine and store what it has (done at every daemon start)."""
        inventory = self.inventory(refresh=True)
        self.record(inventory_readings(inventory), "probe", inventory)
        return inventory

    def measure(self, job: Job, model_paths: list[Path], bench_args: list[str]) -> dict[str, Any]:
        """The "measure again" job: inventory, a cold read per disk, then `moelab bench bw`."""
        job.progress(Text("probing CPU, RAM and GPUs"))
        inventory = self.record_inventory()
        job.progress(Text("{n} GPU(s); NVML: {nvml}", n=len(inventory.gpus), nvml=inventory.nvml))
        disk_readings = []
        for path, size in _one_file_per_disk(model_paths):
            if size < self.min_disk_read_bytes:
                job.progress(
                    Text(
                        "not timing the disk under {path}: its largest model file is "
                        "{size_mib:.0f} MiB, too small to tell its bandwidth (at least "
                        "{min_mib:.0f} MiB is)",
                        path=str(path),
                        size_mib=size / 2**20,
                        min_mib=self.min_disk_read_bytes / 2**20,
                    )
                )
                continue
            job.progress(Text("reading {path} with its page cache dropped", path=str(path)))
            reading = measure_disk_read(path)
            params = {
                "file": reading.path,
                "mountpoint": reading.mountpoint,
                "device": reading.device,
                "fstype": reading.fstype,
                "bytes": reading.bytes_read,
            }
            disk_readings.append(Reading("disk.read", reading.read_gbps, "GB/s", params))
            job.progress(
                Text(
                    "{mountpoint}: {read_gbps:.2f} GB/s over {mib:,.0f} MiB",
                    mountpoint=reading.mountpoint,
                    read_gbps=reading.read_gbps,
                    mib=reading.bytes_read / 2**20,
                )
            )
        self.record(disk_readings, "disk read", inventory)
        job.progress(Text("running moelab bench bw"))
        result = run_moelab(["bench", "bw", "--json", *bench_args], job.progress)
        if result.returncode != 0:
            raise JobError(
                Text(
                    "`moelab bench bw` failed with exit code {code}:\n{stderr}",
                    code=result.returncode,
                    stderr=result.stderr_tail,
                )
            )
        report = parse_bench_output(result.stdout)
        readings = [
            Reading(str(r["kind"]), float(r["value"]), str(r["unit"]), dict(r.get("params") or {}))
            for r in report["results"]
            if isinstance(r, dict) and {"kind", "value", "unit"} <= r.keys()
        ]
        versions = {
            k: (str(v) if v is not None else None)
            for k, v in (report.get("versions") or {}).items()
        }
        self.record(readings, "moelab bench bw", inventory, versions)
        job.progress(Text("stored {n} measured rates", n=len(readings)))
        return {"disks": len(disk_readings), "rates": len(readings), "versions": versions}

    def start_measure(self, model_paths: list[Path], bench_args: list[str]) -> tuple[Job, bool]:
        return self.jobs.start_unless_running(
            "hardware", lambda job: self.measure(job, model_paths, bench_args)
        )

    def sample_pcie_under_load(self, gpu_index: int, server_id: int) -> bool:
        """Store the link state of a GPU while an engine generates on it (idle links step down).

        Stored when it differs from the last loaded reading or that one is 10 minutes old.
        Returns whether a row was written.
        """
        link = pcie_link(gpu_index)
        if link is None:
            return False
        now = time.time()
        last = self._loaded_pcie.get(gpu_index)
        if last is not None and last[0] == link and now - last[1] < PCIE_LOADED_EVERY_S:
            return False
        self._loaded_pcie[gpu_index] = (link, now)
        inventory = self.inventory(max_age_s=3600.0)
        gpu = next((g for g in inventory.gpus if g.index == gpu_index), None)
        params = {"gpu_index": gpu_index, "server_id": server_id}
        self.record(
            [
                Reading("gpu.pcie_gen_loaded", link[0], "generation", params, gpu),
                Reading("gpu.pcie_width_loaded", link[1], "lanes", params, gpu),
            ],
            "under load",
            inventory,
        )
        return True

    def latest(self) -> list[Measurement]:
        """The newest reading of each kind on this machine (all rows that reading wrote)."""
        machine = self.inventory(max_age_s=3600.0).machine_id
        with self.store.session() as session:
            newest = (
                select(Measurement.kind, func.max(Measurement.created).label("created"))
                .where(Measurement.machine_id == machine)
                .group_by(Measurement.kind)
                .subquery()
            )
            query = (
                select(Measurement)
                .join(
                    newest,
                    (Measurement.kind == newest.c.kind) & (Measurement.created == newest.c.created),
                )
                .where(Measurement.machine_id == machine)
                .order_by(Measurement.kind, Measurement.id)
            )
            return list(session.scalars(query))

    def history(self, kind: str, limit: int = 500) -> list[Measurement]:
        with self.store.session() as session:
            query = (
                select(Measurement)
                .where(Measurement.kind == kind)
                .order_by(Measurement.created.desc(), Measurement.id.desc())
                .limit(limit)
            )
            return list(session.scalars(query))


def _one_file_per_disk(model_paths: list[Path]) -> list[tuple[Path, int]]:
    """The largest safetensors file of the models on each distinct device, with its size."""
    best: dict[int, tuple[int, Path]] = {}
    for model in model_paths:
        for path in model.glob("*.safetensors"):
            try:
                stat = path.stat()
            except OSError:
                continue
            if stat.st_size > best.get(stat.st_dev, (-1, path))[0]:
                best[stat.st_dev] = (stat.st_size, path.resolve())
    return [(path, size) for size, path in best.values()]


def measurement_json(row: Measurement) -> dict[str, Any]:
    return {
        "id": row.id,
        "kind": row.kind,
        "params": row.params,
        "value": row.value,
        "unit": row.unit,
        "source": row.source,
        "machine_id": row.machine_id,
        "hostname": row.hostname,
        "gpu_uuid": row.gpu_uuid,
        "gpu_name": row.gpu_name,
        "versions": {
            "moelab": row.engine_version,
            "torch": row.torch_version,
            "driver": row.driver_version,
            "cuda": row.cuda_version,
        },
        "created": iso_time(row.created),
    }


def inventory_json(inventory: Inventory) -> dict[str, Any]:
    return {
        "machine_id": inventory.machine_id,
        "hostname": inventory.hostname,
        "cpu": {
            "model": inventory.cpu_model,
            "physical_cores": inventory.physical_cores,
            "logical_cores": inventory.logical_cores,
        },
        "ram": {
            "total_bytes": inventory.ram_total_bytes,
            "available_bytes": inventory.ram_available_bytes,
        },
        "gpus": [
            {
                "index": g.index,
                "name": g.name,
                "uuid": g.uuid,
                "pci_bus_id": g.pci_bus_id,
                "vram_total_bytes": g.vram_total_bytes,
                "vram_free_bytes": g.vram_free_bytes,
                "pcie": {
                    "gen_max": g.pcie_gen_max,
                    "width_max": g.pcie_width_max,
                    "gen_current": g.pcie_gen_current,
                    "width_current": g.pcie_width_current,
                    # the link's one-way peak at its top generation and width with this system
                    "peak_gbps": pcie_gbps(g.pcie_gen_max, g.pcie_width_max),
                },
                "memory_gbps": g.memory_gbps,
            }
            for g in inventory.gpus
        ],
        **text_fields("nvml", inventory.nvml),
        "versions": {
            "moelab": inventory.engine_version,
            "torch": inventory.torch_version,
            "driver": inventory.driver_version,
            "cuda": inventory.cuda_version,
        },
        "taken": iso_time(inventory.taken),
    }
