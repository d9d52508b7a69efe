"""Hardware: the inventory with and without NVML, cold disk reads, `moelab bench bw` as a child."""

from __future__ import annotations

import ctypes
import dataclasses
import mmap
import os
import sys
import types
from pathlib import Path

import pytest

from moelab.daemon import child, hardware
from moelab.daemon.jobs import Jobs
from moelab.daemon.measure import HardwareService, Reading, inventory_json, inventory_readings
from moelab.daemon.store import Store

from .conftest import asgi_client, make_daemon


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A pynvml with one RTX 4090 on a PCIe 4.0 x16 link that idles at gen 1."""
    state = types.SimpleNamespace(gen_current=1)
    module = types.ModuleType("pynvml")
    module.nvmlInit = lambda: None
    module.nvmlDeviceGetCount = lambda: 1
    module.nvmlDeviceGetHandleByIndex = lambda i: f"handle{i}"
    module.nvmlDeviceGetName = lambda h: b"NVIDIA GeForce RTX 4090"
    module.nvmlDeviceGetUUID = lambda h: "GPU-1234"
    module.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=b"00000000:01:00.0")
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=24 * 1024**3, free=20 * 1024**3
    )
    module.nvmlDeviceGetMaxPcieLinkGeneration = lambda h: 4
    module.nvmlDeviceGetMaxPcieLinkWidth = lambda h: 16
    module.nvmlDeviceGetCurrPcieLinkGeneration = lambda h: state.gen_current
    module.nvmlDeviceGetCurrPcieLinkWidth = lambda h: 16
    module.NVML_CLOCK_MEM = 2
    module.nvmlDeviceGetMemoryBusWidth = lambda h: 384
    module.nvmlDeviceGetMaxClockInfo = lambda h, clock: 10501 if clock == 2 else 3105
    module.nvmlSystemGetDriverVersion = lambda: "550.54.14"

    def no_v2() -> int:
        raise RuntimeError("NVML_ERROR_FUNCTION_NOT_FOUND")

    module.nvmlSystemGetCudaDriverVersion_v2 = no_v2
    module.nvmlSystemGetCudaDriverVersion = lambda: 12040
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setattr(hardware, "_nvml_state", None)
    return state


def test_inventory_reads_gpus_through_nvml(fake_nvml: types.SimpleNamespace) -> None:
    inventory = hardware.probe_inventory()
    assert inventory.nvml == "ok"
    (gpu,) = inventory.gpus
    assert gpu.name == "NVIDIA GeForce RTX 4090" and gpu.uuid == "GPU-1234"
    assert gpu.pci_bus_id == "00000000:01:00.0"
    assert (gpu.vram_total_bytes, gpu.vram_free_bytes) == (24 * 1024**3, 20 * 1024**3)
    assert (gpu.pcie_gen_max, gpu.pcie_width_max) == (4, 16)
    assert (gpu.pcie_gen_current, gpu.pcie_width_current) == (1, 16)
    assert inventory.driver_version == "550.54.14" and inventory.cuda_version == "12.4"
    kinds = {r.kind: r.value for r in inventory_readings(inventory)}
    assert kinds["gpu.vram_total"] == 24 * 1024**3 and kinds["gpu.pcie_gen_max"] == 4


def test_each_gpu_is_listed_with_its_links_and_its_memorys_peak_rates(
    fake_nvml: types.SimpleNamespace,
) -> None:
    """The RTX 4090's 384-bit bus at 10501 MHz moves 1008 GB/s; its PCIe 4.0 x16 link 31.5."""
    inventory = hardware.probe_inventory()
    (gpu,) = inventory.gpus
    assert gpu.memory_gbps == pytest.approx(1008.1, abs=0.1)
    assert {r.kind: r.value for r in inventory_readings(inventory)}["gpu.memory_gbps"] == (
        gpu.memory_gbps
    )
    (listed,) = inventory_json(inventory)["gpus"]
    assert listed["pcie"]["peak_gbps"] == pytest.approx(31.5, abs=0.01)
    assert listed["memory_gbps"] == gpu.memory_gbps


def test_a_rate_measured_on_one_gpu_of_two_is_stored_as_that_gpus(tmp_path: Path) -> None:
    cards = (
        hardware.GpuInfo(0, "RTX 4090", "GPU-a", None, 24 << 30, 24 << 30, 4, 16, 4, 16),
        hardware.GpuInfo(1, "RTX 3060", "GPU-b", None, 12 << 30, 12 << 30, 3, 8, 3, 8),
    )
    store = Store(tmp_path / "mgr.sqlite3")
    service = HardwareService(store, Jobs())
    inventory = dataclasses.replace(service.inventory(), gpus=cards)
    service.record(
        [
            Reading("h2d_pinned", 25.0, "GB/s", {"gpu_index": 0}),
            Reading("h2d_pinned", 6.1, "GB/s", {"gpu_index": 1}),
            Reading("cpu_experts", 9.0, "GB/s", {"threads": 2}),
        ],
        "moelab bench bw",
        inventory,
    )
    stored = {(m.kind, m.value): (m.gpu_uuid, m.gpu_name) for m in service.latest()}
    assert stored[("h2d_pinned", 25.0)] == ("GPU-a", "RTX 4090")
    assert stored[("h2d_pinned", 6.1)] == ("GPU-b", "RTX 3060")
    assert stored[("cpu_experts", 9.0)] == (None, None)
    store.close()


def test_pcie_link_under_load_is_stored_when_it_changes(
    fake_nvml: types.SimpleNamespace, tmp_path: Path
) -> None:
    store = Store(tmp_path / "mgr.sqlite3")
    service = HardwareService(store, Jobs())
    fake_nvml.gen_current = 4
    assert service.sample_pcie_under_load(0, server_id=3)
    assert not service.sample_pcie_under_load(0, server_id=3)  # same link, minutes not passed
    fake_nvml.gen_current = 3
    assert service.sample_pcie_under_load(0, server_id=3)
    history = service.history("gpu.pcie_gen_loaded")
    assert [m.value for m in history] == [3.0, 4.0]
    assert history[0].gpu_uuid == "GPU-1234" and history[0].driver_version == "550.54.14"
    store.close()


def test_no_nvidia_driver_is_an_inventory_without_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("pynvml")

    def fail() -> None:
        raise OSError("NVML Shared Library Not Found")

    module.nvmlInit = fail
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setattr(hardware, "_nvml_state", None)
    inventory = hardware.probe_inventory()
    assert inventory.gpus == ()
    assert "no NVIDIA driver" in str(inventory.nvml)
    assert inventory.physical_cores >= 1 and inventory.ram_total_bytes > 0
    assert hardware.pcie_link(0) is None
    assert {r.kind for r in inventory_readings(inventory)} == {
        "cpu.physical_cores", "cpu.logical_cores", "ram.total", "ram.available",
    }  # fmt: skip


def test_this_machines_gpus_through_the_real_nvml() -> None:
    if hardware.nvml_status() != "ok" or hardware.gpu_count() == 0:
        pytest.skip(f"needs an NVIDIA GPU and driver ({hardware.nvml_status()})")
    inventory = hardware.probe_inventory()
    assert inventory.nvml == "ok" and inventory.driver_version and inventory.cuda_version
    for gpu in inventory.gpus:
        assert gpu.uuid.startswith("GPU-") and gpu.name
        assert gpu.vram_total_bytes and 0 < gpu.vram_free_bytes <= gpu.vram_total_bytes
        assert gpu.pcie_gen_max and gpu.pcie_width_max
        assert 1 <= gpu.pcie_gen_current <= gpu.pcie_gen_max
        assert 1 <= gpu.pcie_width_current <= gpu.pcie_width_max
        assert hardware.pcie_link(gpu.index) is not None


def _resident_pages(path: Path) -> int:
    """How many of the file's pages are in the page cache now (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vector = ctypes.create_string_buffer(pages)
        assert libc.mincore(addr, size, vector) == 0, ctypes.get_errno()
        libc.munmap(addr, size)
    finally:
        os.close(fd)
    return sum(b & 1 for b in vector.raw)


def test_a_disk_read_starts_and_ends_with_the_file_out_of_the_page_cache(tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    with open(path, "wb") as f:
        f.write(os.urandom(32 * 1024**2))
        f.flush()
        os.fsync(f.fileno())
    path.read_bytes()  # warm: a read now would measure memory, not the disk
    pages = 32 * 1024**2 // mmap.PAGESIZE
    if _resident_pages(path) < pages // 2:
        pytest.skip("this file system does not keep file pages in the page cache")
    reading = hardware.measure_disk_read(path)
    assert reading.bytes_read == 32 * 1024**2
    assert reading.read_gbps > 0
    assert _resident_pages(path) < pages // 10
    assert reading.mountpoint and Path(path).resolve().is_relative_to(reading.mountpoint)


FAKE_BENCH = """
import json, sys
for line in ("measuring host-to-device", "measuring CPU experts with 1 thread"):
    print(line, file=sys.stderr, flush=True)
if "--hold" in sys.argv:  # until the test creates the file named next
    import pathlib, time
    release = pathlib.Path(sys.argv[sys.argv.index("--hold") + 1])
    while not release.exists():
        time.sleep(0.01)
if "--fail" in sys.argv:
    print("boom: no memory", file=sys.stderr)
    sys.exit(3)
print(json.dumps({
    "machine": {"cpu": "fake"},
    "versions": {"moelab": "0.1.0", "torch": "9.9.9-fake", "cuda": None, "driver": None},
    "results": [
        {"kind": "h2d_pinned", "params": {"bytes": 1048576}, "value": 12.5, "unit": "GB/s"},
        {"kind": "cpu_expert", "params": {"threads": 1}, "value": 3.25, "unit": "GB/s"},
        {"kind": "cpu_expert", "params": {"threads": 2}, "value": 6.0, "unit": "GB/s"},
    ],
}))
"""


@pytest.fixture
def fake_moelab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    script = tmp_path / "fake_moelab.py"
    script.write_text(FAKE_BENCH)
    monkeypatch.setattr(child, "moelab_argv", lambda args: [sys.executable, str(script), *args])
    return script


def test_measure_relays_progress_and_stores_the_childs_versions(
    fake_moelab: Path, tmp_path: Path, demo_model: Path
) -> None:
    store = Store(tmp_path / "mgr.sqlite3")
    jobs = Jobs()
    # the demo model's files are far below the size a disk read is timed over by default
    service = HardwareService(store, jobs, min_disk_read_bytes=1)
    job, new = service.start_measure([demo_model], [])
    assert new
    assert jobs.wait(job, 60) and job.status == "done", job.error
    assert "measuring CPU experts with 1 thread" in job.lines
    rates = service.history("cpu_expert")
    assert sorted(m.params["threads"] for m in rates) == [1, 2]
    # torch's version comes from the child's report, not from this process
    assert {m.torch_version for m in rates} == {"9.9.9-fake"}
    assert {m.source for m in rates} == {"moelab bench bw"}
    disk = service.history("disk.read")
    assert len(disk) == 1 and disk[0].params["file"].endswith("model.safetensors")
    latest_kinds = {m.kind for m in service.latest()}
    assert {"h2d_pinned", "cpu_expert", "disk.read", "ram.total"} <= latest_kinds
    # a second measurement is history, not a replacement
    job2, _ = service.start_measure([], [])
    assert jobs.wait(job2, 60) and job2.status == "done"
    assert len(service.history("h2d_pinned")) == 2
    assert len([m for m in service.latest() if m.kind == "cpu_expert"]) == 2
    store.close()


def test_a_disk_is_not_timed_over_a_file_too_small_to_tell_its_bandwidth(
    fake_moelab: Path, tmp_path: Path, demo_model: Path
) -> None:
    store = Store(tmp_path / "mgr.sqlite3")
    jobs = Jobs()
    service = HardwareService(store, jobs)
    job, _ = service.start_measure([demo_model], [])
    assert jobs.wait(job, 60) and job.status == "done", job.error
    assert service.history("disk.read") == []
    skipped = [str(line) for line in job.lines if str(line).startswith("not timing the disk")]
    assert len(skipped) == 1 and "too small" in skipped[0], job.lines
    store.close()


def test_a_failing_bench_fails_the_job_with_its_last_lines(
    fake_moelab: Path, tmp_path: Path
) -> None:
    store = Store(tmp_path / "mgr.sqlite3")
    jobs = Jobs()
    service = HardwareService(store, jobs)
    job, _ = service.start_measure([], ["--fail"])
    assert jobs.wait(job, 60)
    assert job.status == "failed"
    assert "exit code 3" in str(job.error) and "boom: no memory" in str(job.error)
    assert service.history("h2d_pinned") == []
    store.close()


def test_measure_again_through_the_api(fake_moelab: Path, tmp_path: Path, demo_model: Path) -> None:
    daemon = make_daemon(tmp_path / "data", demo_model.parent)
    daemon.catalog.rescan()
    local = asgi_client(daemon, "127.0.0.1", "127.0.0.1:1901")
    started = local.post("/api/hardware/measure", json={"threads": [1, 2]})
    assert started.status_code == 202
    job_id = started.json()["job"]["id"]
    assert daemon.jobs.wait(daemon.jobs.get(job_id), 60)
    job = local.get(f"/api/jobs/{job_id}").json()
    assert job["status"] == "done" and "measuring host-to-device" in job["lines"]
    hardware_view = local.get("/api/hardware").json()
    assert hardware_view["inventory"]["cpu"]["logical_cores"] >= 1
    kinds = {m["kind"] for m in hardware_view["latest"]}
    assert {"h2d_pinned", "cpu_expert"} <= kinds
    history = local.get("/api/hardware/history?kind=cpu_expert").json()["measurements"]
    assert {m["versions"]["torch"] for m in history} == {"9.9.9-fake"}
    refused = local.post("/api/hardware/measure", json={"threads": [0]})
    assert refused.status_code == 400 and "threads" in refused.json()["error"]["message"]
    daemon.close()


@pytest.mark.slow
def test_the_real_bench_bw_is_stored_with_the_engines_versions(
    tmp_path: Path, demo_model: Path
) -> None:
    # the bench writes a bandwidth profile, by default into the user cache: --out keeps this
    # machine's own intact. The cache stays the user's, where the native CPU kernel's build
    # (kernels/native_build.py, keyed by its source) is shared: an empty one would compile it.
    profile = tmp_path / "bw-profile.json"
    store = Store(tmp_path / "mgr.sqlite3")
    jobs = Jobs()
    service = HardwareService(store, jobs)
    job, _ = service.start_measure(
        [demo_model],
        ["--model-path", str(demo_model), "--threads", "1", "--out", str(profile)],
    )
    assert jobs.wait(job, 600) and job.status == "done", (job.error, list(job.lines))
    assert profile.is_file()
    assert len(job.lines) > 3  # the child's progress came through
    rows = [m for m in service.latest() if m.source == "moelab bench bw"]
    assert rows and all(m.value > 0 for m in rows)
    assert {m.torch_version for m in rows} == {hardware.package_version("torch")}
    store.close()


def test_one_measurement_at_a_time(fake_moelab: Path, tmp_path: Path) -> None:
    store = Store(tmp_path / "mgr.sqlite3")
    jobs = Jobs()
    service = HardwareService(store, jobs)
    release = tmp_path / "release"
    first, new = service.start_measure([], ["--hold", str(release)])
    second, second_new = service.start_measure([], [])
    assert new and not second_new and second is first
    release.touch()
    assert jobs.wait(first, 60) and first.status == "done"
    store.close()
