"""Access rules at the ASGI level: client × method × token × Origin × Host; cookies; limits."""

from __future__ import annotations

import itertools
import os
import stat
import time
from collections import Counter
from pathlib import Path

import pytest
from sqlalchemy import select

from moelab.daemon.auth import (
    COOKIE_NAME,
    Credentials,
    LoginLimiter,
    ServedHosts,
    load_or_create_token,
)
from moelab.daemon.schema import AuditEvent, Profile
from moelab.daemon.service import Daemon

from .conftest import asgi_client

LOOPBACK = "127.0.0.1"
HOSTS = {"loopback": "127.0.0.1:1901", "lan": "mgr.lan:1901", "odd": "evil.example:1901"}
_addresses = (f"192.168.7.{i}" for i in itertools.count(10))
_names = itertools.count()


def expected(client: str, method: str, token: str, origin: str, host: str) -> tuple[int, str]:
    """The status (and error code) the rules in daemon/auth.py promise for one request."""
    if host == "odd":
        return 400, "unknown_host"
    if method == "GET":
        return 200, ""
    if origin == "foreign":
        return 403, "foreign_origin"
    if client == "loopback" and host == "loopback":
        return 201, ""
    if token == "right":
        return 201, ""
    return 401, "token_invalid" if token == "wrong" else "token_required"


MATRIX = list(
    itertools.product(
        ("loopback", "lan"),
        ("GET", "POST"),
        ("none", "wrong", "right"),
        ("none", "same", "foreign"),
        ("loopback", "lan", "odd"),
    )
)


@pytest.mark.parametrize(("client", "method", "token", "origin", "host"), MATRIX)
def test_access_matrix(
    session_daemon: Daemon, demo_model: Path, client: str, method: str, token: str, origin: str,
    host: str,
) -> None:  # fmt: skip
    address = LOOPBACK if client == "loopback" else next(_addresses)
    http = asgi_client(session_daemon, address, HOSTS[host])
    headers = {}
    if token != "none":
        headers["Authorization"] = "Bearer " + (
            session_daemon.token if token == "right" else "x" * 43
        )
    if origin == "same":
        headers["Origin"] = f"http://{HOSTS[host]}"
    elif origin == "foreign":
        headers["Origin"] = "http://evil.example"
    name = f"matrix-{next(_names)}"
    audited_before = _audited(session_daemon, address, "/api/profiles")
    if method == "GET":
        response = http.get("/api/profiles", headers=headers)
    else:
        response = http.post(
            "/api/profiles", json={"name": name, "model": str(demo_model)}, headers=headers
        )
    status, code = expected(client, method, token, origin, host)
    assert response.status_code == status, response.text
    if code:
        assert response.json()["error"]["code"] == code
        assert response.json()["error"]["message"]
    with session_daemon.store.session() as session:
        created = session.scalars(select(Profile).where(Profile.name == name)).first()
        assert (created is not None) == (status == 201)
    # every change, made or refused, is counted in the audit table with the peer address
    audited = _audited(session_daemon, address, "/api/profiles")
    assert audited - audited_before == (Counter({status: 1}) if method == "POST" else Counter())


def _audited(daemon: Daemon, address: str, path: str) -> Counter[int]:
    """How many requests from `address` to `path` the audit table counts, by status."""
    counted: Counter[int] = Counter()
    with daemon.store.session() as session:
        query = select(AuditEvent.status, AuditEvent.count).where(
            AuditEvent.address == address, AuditEvent.path == path
        )
        for status, count in session.execute(query):
            counted[status] += count
    return counted


def test_forwarded_headers_do_not_make_a_lan_client_local(session_daemon: Daemon) -> None:
    http = asgi_client(session_daemon, next(_addresses), HOSTS["loopback"])
    response = http.post(
        "/api/models/rescan",
        headers={
            "X-Forwarded-For": "127.0.0.1",
            "X-Real-IP": "127.0.0.1",
            "Forwarded": "for=127.0.0.1",
        },
    )
    assert response.status_code == 401


def test_the_token_is_shown_only_to_a_loopback_client_on_a_loopback_host(
    session_daemon: Daemon,
) -> None:
    local = asgi_client(session_daemon, LOOPBACK, HOSTS["loopback"]).get("/api/auth").json()
    assert local["token"] == session_daemon.token and local["mode"] == "control"
    for address, host in ((next(_addresses), "loopback"), (LOOPBACK, "lan")):
        body = asgi_client(session_daemon, address, HOSTS[host]).get("/api/auth").json()
        assert "token" not in body and body["mode"] == "read-only"


def test_login_sets_a_strict_httponly_cookie_that_grants_control(session_daemon: Daemon) -> None:
    http = asgi_client(session_daemon, next(_addresses), HOSTS["lan"])
    assert http.post("/api/models/rescan").status_code == 401
    response = http.post("/api/auth/login", json={"token": session_daemon.token})
    assert response.status_code == 200
    cookie = response.headers["set-cookie"]
    assert cookie.startswith(COOKIE_NAME + "=")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    assert http.get("/api/auth").json()["mode"] == "control"
    assert http.post("/api/models/rescan").status_code == 200
    # the same cookie cannot be replayed cross-site
    foreign = http.post("/api/models/rescan", headers={"Origin": "http://evil.example"})
    assert foreign.status_code == 403
    http.post("/api/auth/logout")
    assert http.post("/api/models/rescan").status_code == 401


def test_a_login_form_redirects_back_to_a_local_page_only(session_daemon: Daemon) -> None:
    http = asgi_client(session_daemon, next(_addresses), HOSTS["lan"])
    http.follow_redirects = False
    form = {"token": session_daemon.token, "next": "/servers"}
    response = http.post("/api/auth/login", data=form)
    assert response.status_code == 303 and response.headers["location"] == "/servers"
    response = http.post("/api/auth/login", data={**form, "next": "//evil.example/x"})
    assert response.headers["location"] == "/"


def test_forged_or_stale_cookies_are_refused(session_daemon: Daemon) -> None:
    mine = Credentials(session_daemon.token)
    other = Credentials("a-different-token-from-an-earlier-install-xx")
    issued, signature = mine.make_cookie().split(".")
    for value in (
        other.make_cookie(),
        f"{int(issued) + 1}.{signature}",
        mine.make_cookie(now=0),  # older than the cookie's life
        "garbage",
    ):
        http = asgi_client(session_daemon, next(_addresses), HOSTS["lan"])
        http.cookies.set(COOKIE_NAME, value)
        assert http.post("/api/models/rescan").status_code == 401, value


def test_failed_logins_are_rate_limited_even_for_the_right_token(session_daemon: Daemon) -> None:
    address = next(_addresses)
    http = asgi_client(session_daemon, address, HOSTS["lan"])
    for _ in range(session_daemon.policy.limiter.max_failures):
        assert http.post("/api/auth/login", json={"token": "guess"}).status_code == 401
    blocked = http.post("/api/auth/login", json={"token": session_daemon.token})
    assert blocked.status_code == 429 and int(blocked.headers["retry-after"]) > 0
    bearer = {"Authorization": "Bearer " + session_daemon.token}
    assert http.post("/api/models/rescan", headers=bearer).status_code == 429
    # another address is not affected, and loopback never is
    other = asgi_client(session_daemon, next(_addresses), HOSTS["lan"])
    assert other.post("/api/models/rescan", headers=bearer).status_code == 200


def test_a_blocked_address_is_told_the_wait_it_has_left(session_daemon: Daemon) -> None:
    address = next(_addresses)
    limiter = session_daemon.policy.limiter
    for _ in range(limiter.max_failures):  # five wrong tokens, 20 s ago
        limiter.failed(address, now=time.monotonic() - 20)
    http = asgi_client(session_daemon, address, HOSTS["lan"])
    bearer = {"Authorization": "Bearer " + session_daemon.token}
    refused = http.post("/api/models/rescan", headers=bearer)
    assert refused.status_code == 429
    # what is left of the window (40 s at most), not the whole window of 60 s again
    assert 0 < int(refused.headers["retry-after"]) <= limiter.window_s - 20 + 1


def test_the_limiter_forgets_failures_after_its_window() -> None:
    limiter = LoginLimiter(max_failures=2, window_s=60.0)
    limiter.failed("10.0.0.1", now=0.0)
    limiter.failed("10.0.0.1", now=1.0)
    assert limiter.retry_after_s("10.0.0.1", now=2.0) == pytest.approx(58.0)
    assert limiter.retry_after_s("10.0.0.1", now=61.5) == 0.0


def test_unknown_api_paths_and_methods_answer_with_the_error_shape(session_daemon: Daemon) -> None:
    http = asgi_client(session_daemon, LOOPBACK, HOSTS["loopback"])
    missing = http.get("/api/nothing-here")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong = http.delete("/api/hardware")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
    json_type = {"Content-Type": "application/json"}
    bad = http.post("/api/profiles", content=b"{not json", headers=json_type)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"


def test_the_token_file_is_private_and_long_and_survives_restarts(tmp_path: Path) -> None:
    token = load_or_create_token(tmp_path)
    mode = stat.S_IMODE(os.stat(tmp_path / "control-token").st_mode)
    assert mode == 0o600
    assert len(token) * 6 >= 128  # url-safe base64: 6 bits a character
    assert load_or_create_token(tmp_path) == token


def test_served_hosts_on_a_wildcard_bind_include_the_machines_addresses() -> None:
    hosts = ServedHosts("0.0.0.0", ["mgr.lan"])
    assert hosts.serves("127.0.0.1:1901") and hosts.serves("[::1]:1901")
    assert hosts.serves("localhost:1901") and hosts.serves("MGR.LAN:1901")
    assert not hosts.serves("evil.example:1901") and not hosts.serves(None)
    assert not hosts.serves("127.0.0.1.evil.example")
    single = ServedHosts("127.0.0.1")
    assert single.serves("localhost:1901") and not single.serves("mgr.lan")


def test_secret_flag_values_are_hidden_from_viewers_without_control(
    session_daemon: Daemon, demo_model: Path
) -> None:
    local = asgi_client(session_daemon, LOOPBACK, HOSTS["loopback"])
    flags = ["--api-key", "engine-secret-1", "--max-running-requests", "2"]
    created = local.post(
        "/api/profiles", json={"name": "keyed", "model": str(demo_model), "flags": flags}
    ).json()
    assert created["flags"] == flags
    viewer = asgi_client(session_daemon, next(_addresses), HOSTS["lan"])
    seen = viewer.get(f"/api/profiles/{created['id']}").json()
    assert seen["flags"] == ["--api-key", "(hidden)", "--max-running-requests", "2"]
    assert "engine-secret-1" not in viewer.get("/api/profiles").text
    assert "engine-secret-1" not in local.get("/api/audit").text
    holder = asgi_client(session_daemon, next(_addresses), HOSTS["lan"])
    bearer = {"Authorization": "Bearer " + session_daemon.token}
    assert holder.get(f"/api/profiles/{created['id']}", headers=bearer).json()["flags"] == flags
