"""/api/status, /api/auth and /api/audit: which daemon this is, who the caller is to it (log in,
log out), and what was changed through it."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from .audit import audit_json
from .auth import COOKIE_MAX_AGE_S, COOKIE_NAME, WRONG_TOKEN, too_many_attempts
from .errors import ApiError
from .hardware import package_version
from .http import access_of, audit, blocking, daemon_of, json_body, query_number
from .store import iso_time


async def get_status(request: Request) -> Response:
    daemon = daemon_of(request)
    return JSONResponse(
        {
            "version": package_version("moelab") or "unknown",
            "pid": daemon.pid,
            "data_dir": str(daemon.data_dir),
            "host": daemon.config.host,
            "port": daemon.config.port,
            "started": iso_time(daemon.started),
        }
    )


async def get_auth(request: Request) -> Response:
    """Who the caller is to the daemon; a browser on this machine also gets the token."""
    access = access_of(request)
    body: dict[str, Any] = {
        "mode": "control" if access.control else "read-only",
        "via": access.via,
        "address": access.address,
        "loopback": access.may_see_token,
    }
    if access.may_see_token:
        body["token"] = daemon_of(request).token
    return JSONResponse(body)


async def login(request: Request) -> Response:
    """Check a token (JSON `{"token"}` or a form field) and set the session cookie."""
    daemon = daemon_of(request)
    access = access_of(request)
    form = request.headers.get("content-type", "").startswith("application/x-www-form-urlencoded")
    body = await json_body(request)
    limiter = daemon.policy.limiter
    wait_s = limiter.retry_after_s(access.address)
    if wait_s > 0:
        audit(request, "login refused: too many attempts")
        raise ApiError(
            too_many_attempts(access.address, wait_s),
            code="too_many_attempts",
            status=429,
            headers={"retry-after": str(int(wait_s) + 1)},
        )
    token = body.get("token")
    if not isinstance(token, str) or not daemon.policy.credentials.token_ok(token.strip()):
        limiter.failed(access.address)
        audit(request, "login failed")
        raise ApiError(WRONG_TOKEN, code="token_invalid", status=401)
    limiter.succeeded(access.address)
    audit(request, "login")
    next_path = body.get("next") if isinstance(body.get("next"), str) else "/"
    if not next_path.startswith("/") or next_path.startswith("//"):
        next_path = "/"
    response: Response = (
        RedirectResponse(next_path, status_code=303) if form else JSONResponse({"mode": "control"})
    )
    response.set_cookie(
        COOKIE_NAME,
        daemon.policy.credentials.make_cookie(),
        max_age=COOKIE_MAX_AGE_S,
        httponly=True,
        samesite="strict",
        path="/",
    )
    return response


async def logout(request: Request) -> Response:
    audit(request, "logout")
    response = JSONResponse({"mode": "read-only"})
    response.delete_cookie(COOKIE_NAME, path="/", httponly=True, samesite="strict")
    return response


async def get_audit(request: Request) -> Response:
    limit = int(query_number(request, "limit", 100, 1, 5000) or 100)
    rows = await blocking(daemon_of(request).audit.recent, limit)
    return JSONResponse({"events": [audit_json(r) for r in rows]})


def routes() -> list[Route]:
    return [
        Route("/api/status", get_status),
        Route("/api/auth", get_auth),
        Route("/api/auth/login", login, methods=["POST"]),
        Route("/api/auth/logout", logout, methods=["POST"]),
        Route("/api/audit", get_audit),
    ]
