"""Who may change things: the control token, the session cookie and the access rules (ASGI).

The rules, in the order they are applied to every request:

1. A `Host` header the daemon does not serve is refused with 400 (DNS rebinding); what it
   serves is engine/serving/hosts.py's rule, which the engine applies too.
2. GET, HEAD and OPTIONS are open to everyone who can reach the port (read-only viewing).
3. An unsafe method with a foreign `Origin` (or a browser saying the request is cross-site) is
   refused with 403, token or not.
4. An unsafe method is allowed without a token only from a loopback client address to a loopback
   Host; otherwise it needs the control token, as `Authorization: Bearer` or the signed cookie that
   the login endpoint sets. Wrong tokens count as failed logins, which are rate-limited per address.

The client address is the socket's peer; `X-Forwarded-For` and similar headers are never read.
Every unsafe request that reaches a handler, or is refused (429 included), is written to the audit
table (audit.py: refusals counted per address, reason and minute).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..engine.serving.hosts import (
    ServedHosts,
    is_foreign,
    is_loopback_address,
    is_loopback_host,
    split_host,
)
from ..engine.text import Text
from .audit import AuditEntry, AuditLog, cut
from .errors import DiskFull

log = logging.getLogger("moelab.mgr")

TOKEN_NAME = "control-token"
COOKIE_NAME = "mgr_session"
COOKIE_MAX_AGE_S = 30 * 24 * 3600
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
# paths an unsafe request may reach without the token (they are how one presents it)
TOKEN_FREE_PATHS = frozenset({"/api/auth/login", "/api/auth/logout"})
WRONG_TOKEN = Text("the control token is wrong")


def too_many_attempts(address: str, wait_s: float) -> Text:
    """Why an address that gave too many wrong tokens lately is refused, and for how long."""
    return Text(
        "too many wrong tokens from {address}; try again in {wait_s:.0f} s",
        address=address,
        wait_s=wait_s,
    )


def load_or_create_token(data_dir: Path) -> str:
    """The control token (256 random bits), created mode 0600 in the data dir on first start."""
    path = data_dir / TOKEN_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        token = path.read_text().strip()
        if len(token) < 32:
            raise RuntimeError(
                f"{path} holds no usable control token; delete it and restart mgr to make a new one"
            ) from None
        os.chmod(path, 0o600)
        return token
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


class LoginLimiter:
    """Failed token presentations per client address; too many in a window and the address waits."""

    def __init__(self, max_failures: int = 5, window_s: float = 60.0) -> None:
        self.max_failures = max_failures
        self.window_s = window_s
        self._failures: dict[str, deque[float]] = {}
        self._lock = threading.Lock()

    def retry_after_s(self, address: str, now: float | None = None) -> float:
        """Seconds this address must wait before its next attempt (0 when it may try now)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            failures = self._failures.get(address)
            if not failures:
                return 0.0
            while failures and now - failures[0] > self.window_s:
                failures.popleft()
            if len(failures) < self.max_failures:
                return 0.0
            return self.window_s - (now - failures[0])

    def failed(self, address: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._failures.setdefault(address, deque()).append(now)

    def succeeded(self, address: str) -> None:
        with self._lock:
            self._failures.pop(address, None)


class Credentials:
    """Checks the control token and signs / verifies the session cookie made from it."""

    def __init__(self, token: str) -> None:
        self.token = token

    def token_ok(self, presented: str | None) -> bool:
        return presented is not None and secrets.compare_digest(
            presented.encode(), self.token.encode()
        )

    def make_cookie(self, now: float | None = None) -> str:
        issued = str(int(time.time() if now is None else now))
        return f"{issued}.{self._sign(issued)}"

    def cookie_ok(self, value: str | None, now: float | None = None) -> bool:
        if not value or "." not in value:
            return False
        issued, signature = value.split(".", 1)
        if not secrets.compare_digest(signature.encode(), self._sign(issued).encode()):
            return False
        now = time.time() if now is None else now
        return issued.isdigit() and 0 <= now - int(issued) <= COOKIE_MAX_AGE_S

    def _sign(self, issued: str) -> str:
        # keyed by the token, so a new token invalidates every cookie made from the old one
        message = f"mgr-session:{issued}".encode()
        return hmac.new(self.token.encode(), message, hashlib.sha256).hexdigest()


@dataclass(slots=True)
class Access:
    """What the middleware decided about a request; handlers read it from `request.state.access`."""

    address: str
    loopback_client: bool
    loopback_host: bool
    via: str | None  # "loopback", "token", "cookie", or None for a viewer without control

    @property
    def control(self) -> bool:
        return self.via is not None

    @property
    def may_see_token(self) -> bool:
        return self.loopback_client and self.loopback_host


@dataclass(slots=True)
class AccessPolicy:
    """The access rules, separate from ASGI plumbing so that they read as one function."""

    credentials: Credentials
    hosts: ServedHosts
    limiter: LoginLimiter = field(default_factory=LoginLimiter)

    def decide(
        self,
        method: str,
        path: str,
        address: str,
        headers: dict[str, str],
        local_address: str | None = None,
    ) -> tuple[Access, tuple[int, str, Text] | None]:
        """The request's access, and (status, code, message) when it must be refused;
        `local_address`: the address the connection arrived on (served whatever it is)."""
        host = headers.get("host")
        access = Access(
            address, is_loopback_address(address), is_loopback_host(split_host(host or "")[0]), None
        )
        if not self.hosts.serves(host, local_address):
            return access, (
                400,
                "unknown_host",
                Text(
                    "this daemon does not serve the host {host!r}; open it by this machine's "
                    "address or name, or start mgr with --allow-host NAME",
                    host=host,
                ),
            )
        # a blocked address gets no credential checked at all, or it could go on guessing
        wait_s = 0.0 if access.may_see_token else self.limiter.retry_after_s(address)
        wrong_token = False
        if access.may_see_token:
            access.via = "loopback"
        elif wait_s <= 0:
            access.via, wrong_token = self._credential(headers, address)
        if method in SAFE_METHODS:
            return access, None
        if is_foreign(headers, host or ""):
            return access, (
                403,
                "foreign_origin",
                Text(
                    "requests that change something must come from this daemon's own pages "
                    "(Origin {origin!r} is not {host!r})",
                    origin=headers.get("origin"),
                    host=host,
                ),
            )
        if path in TOKEN_FREE_PATHS or access.control:
            return access, None
        if wait_s > 0:
            return access, (429, "too_many_attempts", too_many_attempts(address, wait_s))
        if wrong_token:
            return access, (401, "token_invalid", WRONG_TOKEN)
        return access, (
            401,
            "token_required",
            Text(
                "changing anything needs the control token (printed by mgr at start, and stored "
                "in its data dir): send `Authorization: Bearer TOKEN` or log in"
            ),
        )

    def _credential(self, headers: dict[str, str], address: str) -> tuple[str | None, bool]:
        """("token" | "cookie" | None, whether a wrong bearer token was presented)."""
        bearer = _bearer(headers)
        if bearer is not None:
            if self.credentials.token_ok(bearer):
                self.limiter.succeeded(address)
                return "token", False
            self.limiter.failed(address)
            return None, True
        # a stale cookie (the token was replaced) is not a guess: it does not count as a failure
        if self.credentials.cookie_ok(_cookie(headers, COOKIE_NAME)):
            return "cookie", False
        return None, False


def _bearer(headers: dict[str, str]) -> str | None:
    value = headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _cookie(headers: dict[str, str], name: str) -> str | None:
    for part in headers.get("cookie", "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return value
    return None


class AccessMiddleware:
    """Applies AccessPolicy to every HTTP request and writes unsafe ones to the audit log."""

    def __init__(
        self,
        app: ASGIApp,
        policy: AccessPolicy,
        audit: AuditLog,
        render_error: Callable[[int, str, Text, dict[str, str]], Any],
    ) -> None:
        self.app = app
        self.policy = policy
        self.audit = audit
        self.render_error = render_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        address = (scope.get("client") or ("", 0))[0]
        method, path = scope["method"], scope["path"]
        local_address = (scope.get("server") or ("", 0))[0]
        access, refusal = self.policy.decide(method, path, address, headers, local_address)
        scope.setdefault("state", {})["access"] = access
        if refusal is not None:
            status, code, message = refusal
            extra = {}
            if status == 429:  # the time this address has left to wait, as the login's 429 says
                extra["retry-after"] = str(int(self.policy.limiter.retry_after_s(address)) + 1)
            response = self.render_error(status, code, message, extra)
            # written before the answer goes out, so a flood of refusals goes at the pace of
            # the audit's writes
            if method not in SAFE_METHODS:
                await self._audit(scope, access, status, f"refused: {code}")
            await response(scope, receive, send)
            return
        if method in SAFE_METHODS:
            await self.app(scope, receive, send)
            return
        status_seen = 500

        async def send_watching(message: Message) -> None:
            nonlocal status_seen
            if message["type"] == "http.response.start":
                status_seen = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_watching)
        finally:
            await self._audit(scope, access, status_seen, None)

    async def _audit(self, scope: Scope, access: Access, status: int, refused: str | None) -> None:
        note = scope.get("state", {}).get("audit", {})
        entry = AuditEntry(
            time=time.time(),
            address=access.address,
            via=access.via or "none",
            method=scope["method"],
            path=scope["path"],
            status=status,
            action=refused or note.get("action") or f"{scope['method']} {scope['path']}",
            target=note.get("target"),
            detail=note.get("detail") or {},
            # what a caller without control can cause comes in any number: counted, not listed
            counted=refused is not None or not access.control,
        )
        try:
            await anyio.to_thread.run_sync(self.audit.record, entry)
        except DiskFull as full:  # the request has its answer (a 507 if it wrote): serve on
            log.error("no audit row for %s %s: %s", entry.method, cut(entry.path), full.message)
