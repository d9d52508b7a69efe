"""The JSON API: routes, the error shape, and the handlers for auth, hardware, models and flags.

Every error is `{"error": {"message": str, "code": str}}` with a 4xx/5xx status; a message made
as a Text (engine/text.py) also carries its stored form as `message_text`. Handlers are
async only to read bodies; blocking work (SQLite, child processes, engine stops) runs on the
thread pool. State-changing handlers describe what they did in `request.state.audit`, which the
access middleware writes to the audit table.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs

import anyio
from sqlalchemy import select
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from ..engine.args import describe_flags
from ..engine.text import Text, text_fields
from .auth import COOKIE_MAX_AGE_S, COOKIE_NAME, WRONG_TOKEN, Access, too_many_attempts
from .catalog import model_json
from .errors import ApiError, BadRequest, Conflict, NotFound, disk_full
from .hardware import package_version
from .measure import inventory_json, measurement_json
from .schema import AuditEvent
from .service import Daemon
from .store import MAX_ROW_ID, iso_time

log = logging.getLogger("moelab.mgr")
T = TypeVar("T")


# ---- plumbing shared by every handler ---------------------------------------------------------


def error_response(
    status: int, code: str, message: Text | str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(
        {"error": {**text_fields("message", message), "code": code}},
        status_code=status,
        headers=headers,
    )


async def _api_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.code, exc.text, exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        return error_response(404, "not_found", Text("nothing at {path}", path=request.url.path))
    if exc.status_code == 405:
        return error_response(
            405,
            "method_not_allowed",
            Text("{method} is not allowed on {path}", method=request.method, path=request.url.path),
        )
    return error_response(exc.status_code, "http_error", str(exc.detail))


async def _internal_error(request: Request, exc: Exception) -> Response:
    # a file written on a full disk (an engine's log): the database's own writes come as DiskFull
    full = disk_full(exc, daemon_of(request).data_dir)
    if full is not None:
        log.error("%s %s: %s", request.method, request.url.path, full.message)
        return error_response(full.status, full.code, full.text)
    log.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(
        500,
        "internal",
        Text("mgr failed on this request ({error}); see its log", error=type(exc).__name__),
    )


EXCEPTION_HANDLERS: dict[Any, Callable[..., Any]] = {
    ApiError: _api_error,
    HTTPException: _http_error,
    Exception: _internal_error,
}


def daemon_of(request: Request) -> Daemon:
    return request.app.state.daemon


def access_of(request: Request) -> Access:
    return request.state.access


async def blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run blocking service code on the thread pool."""
    return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))


async def json_body(request: Request) -> dict[str, Any]:
    """The request body as a JSON object (an empty body is an empty object)."""
    raw = await request.body()
    if not raw.strip():
        return {}
    content_type = request.headers.get("content-type", "")
    if content_type.startswith("application/x-www-form-urlencoded"):
        try:
            fields = parse_qs(raw.decode(), errors="strict")
        except UnicodeDecodeError:
            raise BadRequest(Text("the form is not valid UTF-8"), code="invalid_form") from None
        return {k: v[-1] for k, v in fields.items()}
    try:
        body = json.loads(raw)
    except ValueError:
        raise BadRequest(Text("the request body is not valid JSON"), code="invalid_json") from None
    except RecursionError:
        raise BadRequest(
            Text("the request body nests arrays or objects too deeply"), code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise BadRequest(Text("the request body must be a JSON object"), code="invalid_json")
    _check_text(body)
    return body


THE_BODY = Text("the body")


def _check_text(body: dict[str, Any]) -> None:
    """BadRequest naming the field when a string holds an unpaired surrogate (`"\\ud800"`):
    valid JSON, but not text, which nothing can store or print."""
    pending: list[tuple[Any, Text | str]] = [(body, "")]
    while pending:
        value, where = pending.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                # the key is looked at first: the item's message names the field by it
                pending.append((item, f"{where}.{key}" if where else str(key)))
                pending.append((key, Text("a field name in {where}", where=where or THE_BODY)))
        elif isinstance(value, list):
            pending.extend((item, f"{where}[{i}]") for i, item in enumerate(value))
        elif isinstance(value, str) and not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                raise BadRequest(
                    Text(
                        "{where} holds an unpaired surrogate escape (such as \\ud800); send text "
                        "as UTF-8, or a character beyond U+FFFF as an escaped pair",
                        where=where,
                    ),
                    code="invalid_json",
                ) from None


def path_id(request: Request, name: str = "id") -> int:
    """A whole number from the path; NotFound past the largest id a row can have."""
    value = int(request.path_params[name])
    if value > MAX_ROW_ID:
        raise NotFound(
            Text(
                "nothing at {path}: no {name} is larger than {largest}",
                path=request.url.path,
                name=name,
                largest=MAX_ROW_ID,
            )
        )
    return value


def body_id(body: dict[str, Any], name: str) -> int | None:
    """An id field of a request body (absent: None); BadRequest unless a whole number in range."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_ROW_ID:
        raise BadRequest(
            Text("{name} must be a whole number from 1 to {largest}", name=name, largest=MAX_ROW_ID)
        )
    return value


def query_number(
    request: Request, name: str, default: float | None, lo: float, hi: float
) -> float | None:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(Text("{name} must be a number, not {raw!r}", name=name, raw=raw)) from None
    if not lo <= value <= hi:
        raise BadRequest(Text("{name} must be between {lo:g} and {hi:g}", name=name, lo=lo, hi=hi))
    return value


def audit(request: Request, action: str, target: str | None = None, **detail: Any) -> None:
    """Describe the change this request made, for the audit row the middleware writes."""
    request.state.audit = {"action": action, "target": target, "detail": detail}


# ---- daemon and auth --------------------------------------------------------------------------


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

    def read() -> list[dict[str, Any]]:
        with daemon_of(request).store.session() as session:
            rows = session.scalars(select(AuditEvent).order_by(AuditEvent.id.desc()).limit(limit))
            return [
                {
                    "id": r.id,
                    "time": iso_time(r.time),
                    "address": r.address,
                    "via": r.via,
                    "method": r.method,
                    "path": r.path,
                    "status": r.status,
                    "action": r.action,
                    "target": r.target,
                    "detail": r.detail,
                    "count": r.count,
                }
                for r in rows
            ]

    return JSONResponse({"events": await blocking(read)})


# ---- hardware and jobs ------------------------------------------------------------------------


async def get_hardware(request: Request) -> Response:
    daemon = daemon_of(request)
    inventory = await blocking(daemon.hardware.inventory)
    latest = await blocking(daemon.hardware.latest)
    job = daemon.jobs.latest("hardware")
    return JSONResponse(
        {
            "inventory": inventory_json(inventory),
            "latest": [measurement_json(m) for m in latest],
            "job": job.to_json() if job else None,
        }
    )


async def get_hardware_history(request: Request) -> Response:
    kind = request.query_params.get("kind")
    if not kind:
        raise BadRequest(
            Text("give ?kind=, e.g. ?kind=disk.read (GET /api/hardware lists the kinds)")
        )
    limit = int(query_number(request, "limit", 500, 1, 10000) or 500)
    rows = await blocking(daemon_of(request).hardware.history, kind, limit)
    return JSONResponse({"kind": kind, "measurements": [measurement_json(m) for m in rows]})


async def measure_hardware(request: Request) -> Response:
    """Start "measure again": inventory, disk reads, `moelab bench bw` (body: model, threads)."""
    daemon = daemon_of(request)
    body = await json_body(request)
    bench_args: list[str] = []
    model = body.get("model")
    if model is not None:
        if not isinstance(model, str):
            raise BadRequest(
                Text("model must be the path of a checkpoint folder (see GET /api/models)")
            )
        if await blocking(daemon.catalog.by_path, model) is None:
            raise BadRequest(
                Text("unknown model {model!r}; GET /api/models lists them", model=model)
            )
        bench_args += ["--model-path", model]
    threads = body.get("threads")
    if threads is not None:
        if not isinstance(threads, list) or not all(isinstance(t, int) and t > 0 for t in threads):
            raise BadRequest(
                Text("threads must be a list of positive whole numbers, e.g. [1, 2, 4]")
            )
        bench_args += ["--threads", ",".join(str(t) for t in threads)]
    paths = [m.path for m in await blocking(daemon.catalog.list)]
    job, new = daemon.hardware.start_measure([Path(p) for p in paths], bench_args)
    if not new:
        raise Conflict(Text("a measurement is already running (job {id})", id=job.id), code="busy")
    audit(request, "measure hardware", f"job {job.id}", bench_args=bench_args)
    return JSONResponse({"job": job.to_json()}, status_code=202)


async def get_job(request: Request) -> Response:
    job = daemon_of(request).jobs.get(path_id(request))
    if job is None:
        raise NotFound(
            Text("no job {id} (jobs last as long as the daemon process)", id=path_id(request))
        )
    return JSONResponse(job.to_json())


# ---- models and flags -------------------------------------------------------------------------


async def get_models(request: Request) -> Response:
    daemon = daemon_of(request)
    rows = await blocking(daemon.catalog.list, request.query_params.get("all") == "1")
    job = daemon.jobs.latest("demo-model")
    return JSONResponse(
        {
            "models": [model_json(m) for m in rows],
            "roots": [{"path": str(r.path), "source": r.source} for r in daemon.catalog.roots],
            "demo_job": job.to_json() if job else None,
        }
    )


async def get_model(request: Request) -> Response:
    row = await blocking(daemon_of(request).catalog.get, path_id(request))
    if row is None:
        raise NotFound(Text("no model {id}", id=path_id(request)))
    return JSONResponse(model_json(row))


async def rescan_models(request: Request) -> Response:
    rows = await blocking(daemon_of(request).catalog.rescan)
    audit(request, "rescan models", detail_count=len(rows))
    return JSONResponse({"models": [model_json(m) for m in rows]})


async def get_flags(_request: Request) -> Response:
    return JSONResponse({"flags": describe_flags()})


def api_routes() -> list[Route]:
    """Every /api route; the console adds its pages beside them."""
    from . import api_profiles, api_servers

    return [
        Route("/api/status", get_status),
        Route("/api/auth", get_auth),
        Route("/api/auth/login", login, methods=["POST"]),
        Route("/api/auth/logout", logout, methods=["POST"]),
        Route("/api/audit", get_audit),
        Route("/api/hardware", get_hardware),
        Route("/api/hardware/history", get_hardware_history),
        Route("/api/hardware/measure", measure_hardware, methods=["POST"]),
        Route("/api/jobs/{id:int}", get_job),
        Route("/api/models", get_models),
        Route("/api/models/rescan", rescan_models, methods=["POST"]),
        Route("/api/models/{id:int}", get_model),
        Route("/api/flags", get_flags),
        *api_profiles.routes(),
        *api_servers.routes(),
    ]
