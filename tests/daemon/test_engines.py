"""The supervisor with a real `moelab serve` on the demo model, driven through a real `mgr`."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import stat
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moelab.daemon.errors import Conflict
from moelab.daemon.schema import Server
from moelab.daemon.supervisor import EngineHandle
from moelab.engine.process import launch

from .conftest import (
    MgrProcess,
    copy_model,
    free_port,
    http,
    make_daemon,
    start_mgr,
    wait_for,
)

READY_S = 240.0


@pytest.fixture(scope="module")
def mgr(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[MgrProcess]:
    process = start_mgr(
        tmp_path_factory.mktemp("engines") / "data", "--models-dir", str(demo_model.parent)
    )
    yield process
    for server in process.get("/api/servers")["servers"]:
        if server["status"] in ("starting", "running"):
            process.post(f"/api/servers/{server['id']}/stop")
    process.stop()


def wait_status(
    mgr: MgrProcess, server_id: int, statuses: tuple[str, ...], timeout_s: float
) -> dict:
    def check() -> dict | None:
        server = mgr.get(f"/api/servers/{server_id}")
        return server if server["status"] in statuses else None

    return wait_for(check, timeout_s, f"server {server_id} to be {statuses}", poll_s=0.25)


def start(mgr: MgrProcess, body: dict[str, Any]) -> dict:
    server = mgr.post("/api/servers", body, expect=(202,))
    assert server["status"] == "starting"
    return wait_status(mgr, server["id"], ("running", "crashed", "failed"), READY_S)


def chat(server: dict, text: str = "Tell me about the sea.", max_tokens: int = 24) -> dict:
    served = http("GET", server["url"] + "/v1/models")[1]["data"][0]["id"]
    status, body = http(
        "POST",
        server["url"] + "/v1/chat/completions",
        {
            "model": served,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
        },
        timeout=120,
    )
    assert status == 200, body
    return body


def port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_start_from_a_profile_stop_and_restart(mgr: MgrProcess, demo_model: Path) -> None:
    profile = mgr.post(
        "/api/profiles",
        {"name": "demo-2", "model": str(demo_model), "flags": ["--max-running-requests", "2"]},
    )
    server = start(mgr, {"profile_id": profile["id"]})
    assert server["status"] == "running", server
    assert server["profile_id"] == profile["id"] and server["name"] == "demo-2"
    assert server["flags"][:2] == ["--max-running-requests", "2"]
    assert 8100 <= server["port"] < 8200 and server["host"] == "127.0.0.1"
    health = http("GET", server["url"] + "/health")[1]
    assert health["status"] == "ok"
    chat(server)

    # the sampler reads /v1/stats every 2 s: the decode counters of that request arrive as deltas
    def sampled_after_the_request() -> dict | None:
        stats = mgr.get(f"/api/servers/{server['id']}/stats")["stats"]
        return stats if stats and stats["requests"]["completed"] >= 1 else None

    stats = wait_for(sampled_after_the_request, 30, "stats sampled after the request")
    assert stats["experts"]["num_layers"] >= 1

    def decoded() -> bool:
        samples = mgr.get(f"/api/servers/{server['id']}/samples")["samples"]
        return any(sum(s.get("d", {}).get("reads", [])) > 0 for s in samples)

    wait_for(decoded, 30, "telemetry with decode reads")
    logs = mgr.get(f"/api/servers/{server['id']}/logs?lines=50")
    assert logs["lines"] and logs["path"].endswith(f"logs/server-{server['id']}.log")

    stopped = mgr.post(f"/api/servers/{server['id']}/stop")
    assert stopped["status"] == "stopped"
    assert not launch.pid_alive(server["pid"])
    assert port_is_free(server["port"])

    restarted = mgr.post(f"/api/servers/{server['id']}/restart", expect=(202,))
    assert restarted["pid"] != server["pid"] and restarted["port"] == server["port"]
    running = wait_status(mgr, server["id"], ("running", "crashed", "failed"), READY_S)
    assert running["status"] == "running", running
    assert http("GET", running["url"] + "/health")[1]["status"] == "ok"
    mgr.post(f"/api/servers/{server['id']}/stop")
    assert not launch.pid_alive(restarted["pid"])


def test_an_engine_log_is_private_and_never_holds_the_api_key(
    mgr: MgrProcess, demo_model: Path
) -> None:
    key = "sk-" + secrets.token_hex(12)
    server = start(mgr, {"model": str(demo_model), "flags": ["--device", "cpu", "--api-key", key]})
    try:
        assert server["status"] == "running", server
        # mgr itself talks to the engine with the key: the sampler gets its stats
        wait_for(lambda: mgr.get(f"/api/servers/{server['id']}/stats")["stats"], 30, "stats")
        mgr.post(f"/api/servers/{server['id']}/restart", expect=(202,))
        running = wait_status(mgr, server["id"], ("running", "crashed", "failed"), READY_S)
        assert running["status"] == "running", running
    finally:
        mgr.post(f"/api/servers/{server['id']}/stop")
    log_path = mgr.data_dir / "logs" / f"server-{server['id']}.log"
    text = log_path.read_text()
    assert key not in text
    starts = [line for line in text.splitlines() if " starting: " in line]
    assert len(starts) == 2 and all("--api-key (hidden) " in line for line in starts), starts
    assert stat.S_IMODE(os.stat(log_path).st_mode) == 0o600
    for folder in (mgr.data_dir, log_path.parent):
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700, folder
    for name in ("mgr.sqlite3", "mgr.sqlite3-wal", "mgr.sqlite3-shm"):
        assert stat.S_IMODE(os.stat(mgr.data_dir / name).st_mode) == 0o600, name


def test_ports_in_use_are_refused_with_the_reason(mgr: MgrProcess, demo_model: Path) -> None:
    # on the CPU, so that a GPU machine does not refuse the second engine for its GPU first
    server = start(mgr, {"model": str(demo_model), "flags": ["--device", "cpu"]})
    try:
        assert server["status"] == "running", server
        status, body = mgr.request(
            "POST",
            "/api/servers",
            {"model": str(demo_model), "flags": ["--device", "cpu", "--port", str(server["port"])]},
        )
        assert status == 409 and body["error"]["code"] == "port_in_use"
        assert f"server {server['id']}" in body["error"]["message"]
        with socket.socket() as foreign:
            foreign.bind(("127.0.0.1", 0))
            foreign.listen()
            port = foreign.getsockname()[1]
            status, body = mgr.request(
                "POST", "/api/servers", {"model": str(demo_model), "flags": ["--port", str(port)]}
            )
        assert status == 409 and "another program" in body["error"]["message"]
    finally:
        mgr.post(f"/api/servers/{server['id']}/stop")


def test_no_program_takes_the_port_between_its_choice_and_the_engine(
    tmp_path: Path, demo_model: Path
) -> None:
    """The port is bound when it is chosen and the engine serves on that socket: a program that
    tries it while the engine still loads finds it taken, and a port another program holds is
    passed over. The row says the port the engine serves on."""
    first = free_port()
    daemon = make_daemon(tmp_path / "data", demo_model.parent, engine_ports=range(first, first + 8))
    supervisor = daemon.supervisor
    supervisor.open()
    foreign = socket.socket()
    foreign.bind(("127.0.0.1", first))
    foreign.listen()
    try:
        row = supervisor.start(model=str(demo_model), flags=["--device", "cpu"])
        assert row.port != first and launch.flag_value(row.flags, "--port") == str(row.port)
        # the engine is still importing torch: another program tries its port
        with socket.socket() as late:
            late.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            with pytest.raises(OSError):
                late.bind(("127.0.0.1", row.port))
                late.listen()
        running = wait_for(
            lambda: (r := supervisor.row(row.id)).status != "starting" and r, READY_S, "ready"
        )
        assert running.status == "running", running.error
        assert http("GET", f"http://127.0.0.1:{running.port}/health")[1]["status"] == "ok"
    finally:
        foreign.close()
        for handle in supervisor.handles():
            supervisor.stop(handle.server_id)
        daemon.close()


def test_bad_requests_never_start_an_engine(mgr: MgrProcess, demo_model: Path) -> None:
    before = len(mgr.get("/api/servers")["servers"])
    for body, code in (
        ({"model": str(demo_model), "flags": ["--moe-cahce-rate", "0.5"]}, "invalid_flags"),
        ({"model": str(demo_model), "flags": ["--model-path", "/x"]}, "invalid_flags"),
        ({"model": "/nowhere", "flags": []}, "model_not_found"),
        ({"profile_id": 999999}, "not_found"),
    ):
        status, reply = mgr.request("POST", "/api/servers", body)
        assert status in (400, 404) and reply["error"]["code"] == code, reply
    assert len(mgr.get("/api/servers")["servers"]) == before


def test_an_engine_that_dies_while_loading_reports_its_exit_code_and_log(
    mgr: MgrProcess, demo_model: Path
) -> None:
    """An early exit (here a SIGKILL during start-up) is seen at once, and not taken for an
    out-of-memory kill: nothing says the kernel sent it."""
    server = mgr.post("/api/servers", {"model": str(demo_model), "flags": []}, expect=(202,))
    os.kill(server["pid"], signal.SIGKILL)  # still importing torch: far from ready
    crashed = wait_status(mgr, server["id"], ("crashed", "running", "failed"), 30)
    assert crashed["status"] == "crashed", crashed
    assert crashed["exit_code"] == -signal.SIGKILL
    assert "was killed by signal 9 (SIGKILL) before it was ready" in crashed["error"]
    assert "memory" not in crashed["error"]
    assert "starting:" in crashed["log_tail"]  # the launcher's first line of the log


def test_an_engine_that_cannot_load_its_checkpoint_fails_with_its_error(
    mgr: MgrProcess, demo_model: Path, tmp_path: Path
) -> None:
    # a tensor of the wrong shape (its bytes the same): only loading the checkpoint tells
    broken = copy_model(demo_model, tmp_path / "broken")
    weights = broken / "model.safetensors"
    raw = weights.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    name = "model.layers.0.self_attn.k_proj.weight"
    header[name]["shape"] = header[name]["shape"][::-1]
    edited = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    assert len(edited) == length
    weights.write_bytes(raw[:8] + edited + raw[8 + length :])
    server = start(mgr, {"model": str(broken), "flags": []})
    # the engine stays up and says "error" on /health: the daemon reports that error (not a
    # ready timeout) and stops it
    assert server["status"] == "failed", server
    assert f"tensor {name} has shape" in server["error"]
    assert "Traceback" in server["log_tail"]
    assert not launch.pid_alive(server["pid"])


def test_an_engine_killed_while_serving_is_reported_crashed(
    mgr: MgrProcess, demo_model: Path
) -> None:
    server = start(mgr, {"model": str(demo_model), "flags": []})
    assert server["status"] == "running", server
    os.kill(server["pid"], signal.SIGKILL)
    crashed = wait_status(mgr, server["id"], ("crashed",), 10)
    assert crashed["exit_code"] == -signal.SIGKILL
    assert crashed["error"] == "the engine was killed by signal 9 (SIGKILL)"


def test_twenty_concurrent_readers_while_an_engine_runs(mgr: MgrProcess, demo_model: Path) -> None:
    server = start(mgr, {"model": str(demo_model), "flags": []})
    assert server["status"] == "running", server
    paths = [
        "/api/servers",
        f"/api/servers/{server['id']}",
        f"/api/servers/{server['id']}/stats",
        f"/api/servers/{server['id']}/samples",
        "/api/hardware",
        "/api/models",
        "/api/profiles",
        "/api/flags",
    ]
    failures: list[Any] = []
    answered: list[str] = []
    lock = threading.Lock()

    def reader(n: int) -> None:
        for i in range(20):
            path = paths[(n + i) % len(paths)]
            status, body = mgr.request("GET", path)
            with lock:
                answered.append(path)
                if status != 200:
                    failures.append((path, status, body))

    generator = threading.Thread(target=lambda: chat(server, max_tokens=64))
    generator.start()
    readers = [threading.Thread(target=reader, args=(n,)) for n in range(20)]
    for thread in readers:
        thread.start()
    for thread in readers:
        thread.join(timeout=120)
    generator.join(timeout=120)
    mgr.post(f"/api/servers/{server['id']}/stop")
    assert failures == []
    assert len(answered) == 400


def test_engines_are_adopted_after_mgr_is_killed(tmp_path: Path, demo_model: Path) -> None:
    data = tmp_path / "data"
    first = start_mgr(data, "--models-dir", str(demo_model.parent))
    try:
        # two at once: on the CPU, where engines do not exclude each other as on one GPU
        kept = start(first, {"model": str(demo_model), "flags": ["--device", "cpu"]})
        lost = start(first, {"model": str(demo_model), "flags": ["--device", "cpu"]})
        assert kept["status"] == lost["status"] == "running"
    finally:
        first.kill()
    # the engines run in their own process groups: the daemon's death does not take them along
    assert launch.pid_alive(kept["pid"]) and launch.pid_alive(lost["pid"])
    os.killpg(lost["pid"], signal.SIGKILL)
    wait_for(lambda: not launch.pid_alive(lost["pid"]), 10, "the second engine to die")

    second = start_mgr(data, "--models-dir", str(demo_model.parent))
    try:
        adopted = second.get(f"/api/servers/{kept['id']}")
        assert adopted["status"] == "running" and adopted["pid"] == kept["pid"]
        dead = second.get(f"/api/servers/{lost['id']}")
        assert dead["status"] == "dead" and str(lost["pid"]) in dead["error"]
        restarted_at = time.time()

        def sampled_again() -> bool:
            stats = second.get(f"/api/servers/{kept['id']}/stats")
            return stats["sampled_at"] is not None and stats["age_s"] < time.time() - restarted_at

        wait_for(sampled_again, 30, "the adopted engine to be sampled")
        chat(adopted)
        stopped = second.post(f"/api/servers/{kept['id']}/stop")
        assert stopped["status"] == "stopped"
        wait_for(lambda: not launch.pid_alive(kept["pid"]), 20, "the adopted engine to stop")
    finally:
        second.stop()


def test_adoption_does_not_wait_for_the_engines_to_answer(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asking an adopted engine how it is happens off the daemon's start: one slow to answer
    (busy, or stopped in a debugger) holds up neither the start nor the other engines."""
    engine = subprocess.Popen(["sleep", "120"], start_new_session=True)
    answer = threading.Event()
    asked: list[str] = []

    def health(url: str, timeout_s: float = 2.0, api_key: str | None = None) -> dict | None:
        asked.append(url)
        answer.wait(60)
        return {"status": "ok"}

    try:
        daemon = make_daemon(tmp_path / "data", demo_model.parent)
        now = time.time()
        with daemon.store.session() as session:
            session.add(
                Server(
                    id=1, name="kept", model=str(demo_model), flags=[], host="127.0.0.1",
                    port=8150, device="cpu", status="running", pid=engine.pid,
                    process_started=launch.process_start_time(engine.pid), log_path="",
                    created=now, started=now,
                )
            )  # fmt: skip
        monkeypatch.setattr(launch, "get_json", health)
        opened = threading.Thread(target=daemon.supervisor.open)
        opened.start()
        opened.join(timeout=30)
        assert not opened.is_alive(), "the start waited for the engine's answer"
        handle = daemon.supervisor.handle(1)
        assert handle is not None and not handle.ready
        answer.set()
        wait_for(lambda: daemon.supervisor.handle(1).ready, 30, "the engine to be adopted")
        assert asked == ["http://127.0.0.1:8150/health"]
        assert daemon.supervisor.row(1).status == "running"
        daemon.close()
    finally:
        answer.set()
        engine.kill()
        engine.wait()


def test_a_gpu_in_use_by_another_server_is_refused(tmp_path: Path, demo_model: Path) -> None:
    """The GPU check in-process: a live handle on cuda:0 blocks a second engine on cuda:0."""
    daemon = make_daemon(tmp_path / "data", demo_model.parent)
    supervisor = daemon.supervisor
    first = supervisor.start(model=str(demo_model), flags=["--device", "cpu"])
    try:
        holder = supervisor.handle(first.id)
        assert holder is not None
        # what a first engine on the GPU looks like to the supervisor
        supervisor._handles[first.id] = EngineHandle(
            first.id, holder.engine, "cuda:0", None, fresh=True, ready=True
        )
        with pytest.raises(Conflict, match=r"cuda:0 is taken by server") as refused:
            supervisor.start(model=str(demo_model), flags=["--device", "cuda:0"])
        assert refused.value.status == 409 and refused.value.code == "gpu_taken"
        # a split that would use cuda:0 too is refused, naming it
        with pytest.raises(Conflict, match=r"^cuda:0 is taken by server"):
            supervisor.start(model=str(demo_model), flags=["--devices", "cuda:1,cuda:0"])
        # and an engine split across both GPUs takes each of them
        supervisor._handles[first.id] = EngineHandle(
            first.id, holder.engine, "cuda:0,cuda:1", None, fresh=True, ready=True
        )
        with pytest.raises(Conflict, match=r"^cuda:1 is taken by server"):
            supervisor.start(model=str(demo_model), flags=["--device", "cuda:1"])
        # the CPU is shared, not taken
        other = supervisor.start(model=str(demo_model), flags=["--device", "cpu"])
        supervisor.stop(other.id)
    finally:
        supervisor.stop(first.id)
        daemon.close()
