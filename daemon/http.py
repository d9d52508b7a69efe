"""The daemon's HTTP plumbing, shared by every route module and the console's pages.

Every error is `{"error": {"message": str, "code": str}}` with a 4xx/5xx status; a message made
as a Text (engine/text.py) also carries its stored form as `message_text`. Handlers are async
only to read bodies; blocking work (SQLite, child processes, engine stops) runs on the thread
pool (`blocking`). State-changing handlers describe what they did (`audit`), which the access
middleware writes to the audit table. No handler lives here: the route modules import this one.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import parse_qs

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..engine.text import Text, text_fields
from .auth import Access
from .errors import ApiError, BadRequest, NotFound, disk_full
from .service import Daemon
from .store import MAX_ROW_ID

log = logging.getLogger("moelab.mgr")
T = TypeVar("T")


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
