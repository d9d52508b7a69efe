"""The access rules from a real second address: a network namespace joined by a veth pair.

The client runs inside the namespace (`ip netns exec`), so its packets arrive at a real `mgr`
bound to 0.0.0.0 from 10.x.y.2: a LAN machine in every respect the daemon can see.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from moelab.engine.process.launch import start_engine, stop_engine, wait_ready

from .conftest import MgrProcess, free_port, start_mgr

CLIENT = """
import json, sys, urllib.request, urllib.error
results = []
for method, url, headers, body in json.load(sys.stdin):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            results.append([response.status, json.loads(response.read() or b"null")])
    except urllib.error.HTTPError as err:
        results.append([err.code, json.loads(err.read() or b"null")])
print(json.dumps(results))
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def lan() -> Iterator[tuple[str, str, str]]:
    """(namespace, address of this side, address of the client side)."""
    tag = os.getpid() % 100000
    namespace, here, there = f"mgrlan{tag}", f"vmg{tag}a", f"vmg{tag}b"
    subnet = f"10.{200 + tag % 50}.{tag % 250}"
    try:
        _ip("netns", "add", namespace)
    except (subprocess.CalledProcessError, FileNotFoundError, PermissionError) as err:
        reason = getattr(err, "stderr", "") or str(err)
        pytest.skip(f"network namespaces are not permitted here: {reason.strip()}")
    try:
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", namespace)
        _ip("addr", "add", f"{subnet}.1/24", "dev", here)
        _ip("link", "set", here, "up")
        _ip("netns", "exec", namespace, "ip", "addr", "add", f"{subnet}.2/24", "dev", there)
        _ip("netns", "exec", namespace, "ip", "link", "set", there, "up")
        _ip("netns", "exec", namespace, "ip", "link", "set", "lo", "up")
        yield namespace, f"{subnet}.1", f"{subnet}.2"
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def lan_mgr(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[MgrProcess]:
    mgr = start_mgr(
        tmp_path_factory.mktemp("lan") / "data",
        "--models-dir", str(demo_model.parent),
        host="0.0.0.0",
        port=free_port("0.0.0.0"),
    )  # fmt: skip
    yield mgr
    mgr.stop()


def from_lan(namespace: str, requests: list[list]) -> list[tuple[int, dict]]:
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", CLIENT],
        input=json.dumps(requests), capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return [tuple(r) for r in json.loads(out.stdout)]


def test_the_access_matrix_from_a_lan_address(
    lan: tuple[str, str, str], lan_mgr: MgrProcess, demo_model: Path
) -> None:
    namespace, server_ip, client_ip = lan
    base = f"http://{server_ip}:{lan_mgr.port}"
    right = {"Authorization": f"Bearer {lan_mgr.token}"}
    wrong = {"Authorization": "Bearer " + "w" * 43}

    def profile(name: str) -> dict:
        return {"name": name, "model": str(demo_model)}

    cases = [
        # (request, expected status, expected error code)
        (["GET", base + "/api/profiles", {}, None], 200, None),
        (["GET", base + "/api/auth", {}, None], 200, None),
        (["POST", base + "/api/profiles", {}, profile("lan-none")], 401, "token_required"),
        (["POST", base + "/api/profiles", wrong, profile("lan-wrong")], 401, "token_invalid"),
        (["POST", base + "/api/profiles", right, profile("lan-right")], 201, None),
        (
            ["POST", base + "/api/profiles", {**right, "Origin": "http://evil.example"},
             profile("lan-foreign")],
            403, "foreign_origin",
        ),
        (["GET", base + "/api/profiles", {"Host": "evil.example"}, None], 400, "unknown_host"),
        # a LAN client naming a loopback Host, or claiming to be forwarded, is still a LAN client
        (
            ["POST", base + "/api/profiles", {"Host": "127.0.0.1", "X-Forwarded-For": "127.0.0.1"},
             profile("lan-spoof")],
            401, "token_required",
        ),
    ]  # fmt: skip
    results = from_lan(namespace, [case[0] for case in cases])
    for (request, status, code), (got_status, body) in zip(cases, results, strict=True):
        assert got_status == status, (request, body)
        if code:
            assert body["error"]["code"] == code
    auth = results[1][1]
    assert auth["mode"] == "read-only" and "token" not in auth
    assert auth["address"] == client_ip
    names = {p["name"] for p in lan_mgr.get("/api/profiles")["profiles"]}
    assert names == {"lan-right"}
    events = lan_mgr.get("/api/audit")["events"]
    lan_events = [e for e in events if e["address"] == client_ip and e["method"] == "POST"]
    # refusals are counted per address, reason and minute, not written a row each
    statuses = [e["status"] for e in lan_events for _ in range(e["count"])]
    assert sorted(statuses) == [201, 401, 401, 401, 403]
    # the same daemon, asked from this machine over loopback, needs no token
    status, _ = lan_mgr.request("POST", "/api/profiles", profile("local"))
    assert status == 201


@contextlib.contextmanager
def address_added(server_ip: str) -> Iterator[str]:
    """One more address on the interface that holds `server_ip`, as a new Wi-Fi, a VPN or a
    DHCP lease adds one after start; removed after."""
    shown = subprocess.run(
        ["ip", "-o", "-4", "addr", "show", "to", server_ip],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.split()  # fmt: skip
    device = shown[1].split("@")[0]
    new_ip = server_ip.rsplit(".", 1)[0] + ".3"
    _ip("addr", "add", f"{new_ip}/24", "dev", device)
    try:
        yield new_ip
    finally:
        subprocess.run(["ip", "addr", "del", f"{new_ip}/24", "dev", device],
                       capture_output=True, timeout=30)  # fmt: skip


def test_an_address_that_comes_up_after_mgr_started_is_served_at_once(
    lan: tuple[str, str, str], lan_mgr: MgrProcess
) -> None:
    namespace, server_ip, _ = lan
    url = f"http://{server_ip}:{lan_mgr.port}/api/status"
    # a LAN client on the address mgr saw at start: mgr has read its interfaces' addresses
    assert from_lan(namespace, [["GET", url, {}, None]])[0][0] == 200
    with address_added(server_ip) as new_ip:
        url = f"http://{new_ip}:{lan_mgr.port}/api/status"
        assert from_lan(namespace, [["GET", url, {}, None]])[0][0] == 200


def test_an_engine_on_the_lan_serves_an_address_that_came_up_after_start(
    lan: tuple[str, str, str], demo_model: Path, tmp_path: Path
) -> None:
    namespace, server_ip, _ = lan
    port = free_port("0.0.0.0")
    engine = start_engine(
        ["--model-path", str(demo_model), "--host", "0.0.0.0", "--port", str(port),
         "--device-memory", "1GiB", "--bank-dir", str(tmp_path / "bank")],
        tmp_path / "engine.log",
    )  # fmt: skip
    try:
        wait_ready(engine, timeout_s=300)
        completion = {"prompt": "The harbour", "max_tokens": 2}
        base = f"http://{server_ip}:{port}"
        assert from_lan(namespace, [["GET", base + "/v1/models", {}, None]])[0][0] == 200
        with address_added(server_ip) as new_ip:
            base = f"http://{new_ip}:{port}"
            results = from_lan(namespace, [
                ["GET", base + "/v1/models", {}, None],
                ["POST", base + "/v1/completions", {}, completion],
                ["GET", base + "/v1/models", {"Host": f"rebound.example:{port}"}, None],
            ])  # fmt: skip
        assert [status for status, _ in results] == [200, 200, 400]
        assert results[1][1]["usage"]["completion_tokens"] == 2
        assert results[2][1]["error"]["code"] == "unknown_host"
    finally:
        stop_engine(engine)
