"""The console's frame: templates, the page-or-JSON response every page handler returns, the
header's access mode and languages, charts, static assets and HTML error pages.

A page handler gathers one JSON-able dict and calls `render(request, "thing.html", data)`. The same
handler so answers three ways: the HTML page; `?format=json` (or `Accept: application/json`) gives
`data` itself; `?part=NAME` gives only the partial `_NAME.html` (for htmx polling), when the handler
lists NAME in `parts`. Charts are Plotly figures built in Python from `data` by the handler's
`charts` function, only when HTML is asked for.
"""

from __future__ import annotations

import html
import json
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import plotly
from markupsafe import Markup
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from ..daemon.auth import Access
from ..daemon.errors import ApiError
from ..daemon.http import error_response
from ..engine.text import Text, text_of
from .i18n import DEFAULT_LANGUAGE, LANG_COOKIE, LANGUAGES, Translator, choose_language

if TYPE_CHECKING:  # the pages that draw charts import plotly.graph_objects themselves
    import plotly.graph_objects as go

log = logging.getLogger("moelab.console")

CONSOLE_DIR = Path(__file__).parent
TEMPLATES_DIR = CONSOLE_DIR / "templates"
STATIC_DIR = CONSOLE_DIR / "static"
PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
LANG_COOKIE_MAX_AGE_S = 365 * 24 * 3600
_PART_NAME = re.compile(r"[a-z][a-z0-9_]*")
WINDOWS_MIN = (15, 60, 360, 1440)

ChartBuilder = Callable[[dict[str, Any], Translator], "Mapping[str, go.Figure]"]


@dataclass(frozen=True, slots=True)
class NavEntry:
    """A link in the header's navigation: the path, its English label, and where it sorts."""

    path: str
    label: str
    order: int


ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES_DIR),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    trim_blocks=True,
    lstrip_blocks=True,
)


def _fill(values: Mapping[str, Mapping[str, Any]], t: Translator) -> dict[str, str]:
    """Numbers as advice.Number.to_json() carries them, written for the page's language."""
    return {name: t.value(n["kind"], n["value"]) for name, n in values.items()}


ENV.filters["fill"] = _fill


def wants_json(request: Request) -> bool:
    """Whether the client asked for the JSON alternate of a page."""
    if request.query_params.get("format") == "json":
        return True
    accept = request.headers.get("accept", "")
    first = accept.split(",")[0].split(";")[0].strip()
    return first == "application/json"


def window_minutes(request: Request) -> int:
    """The time span of a page's charts, `?minutes=` (one of WINDOWS_MIN; default an hour)."""
    raw = request.query_params.get("minutes", "60")
    if not raw.isdigit() or int(raw) not in WINDOWS_MIN:
        raise ApiError(
            Text("minutes must be one of {choices}", choices=", ".join(map(str, WINDOWS_MIN))),
            code="bad_request",
        )
    return int(raw)


def translator_of(request: Request) -> Translator:
    return Translator(
        choose_language(request.cookies.get(LANG_COOKIE), request.headers.get("accept-language"))
    )


def safe_next(path: str | None) -> str:
    """A local path to go back to (never another site)."""
    if not path or not path.startswith("/") or path.startswith("//") or "\\" in path:
        return "/"
    return path


def mode_json(access: Access) -> dict[str, Any]:
    """The caller's access as pages show it (and their JSON alternates carry it)."""
    return {
        "mode": "control" if access.control else "read-only",
        "via": access.via,
        "this_machine": access.may_see_token,
    }


def _chart_markup(name: str, figure: go.Figure) -> Markup:
    figure_json = figure.to_json()
    return Markup(
        f'<div class="chart" id="chart-{html.escape(name)}" data-chart="{html.escape(name)}" '
        f'data-figure="{html.escape(figure_json)}"></div>'
    )


def render(
    request: Request,
    template: str,
    data: dict[str, Any],
    *,
    charts: ChartBuilder | None = None,
    parts: tuple[str, ...] = (),
    status: int = 200,
) -> Response:
    """A page, its JSON alternate, or one of its partials, from the same `data`.

    The JSON alternate is `data` with the caller's access mode added as "access"."""
    data = {"access": mode_json(request.state.access), **data}
    if wants_json(request):
        return JSONResponse(data, status_code=status)
    part = request.query_params.get("part")
    if part is not None:
        if part not in parts or not _PART_NAME.fullmatch(part):
            raise ApiError(
                Text(
                    "this page has no part {part} (it has: {parts})",
                    part=repr(part),
                    parts=", ".join(parts),
                )
                if parts
                else Text("this page has no part {part}", part=repr(part)),
                code="no_such_part",
                status=404,
            )
        template = f"_{part}.html"
    t = translator_of(request)
    figures = charts(data, t) if charts is not None else {}
    context = {**frame_context(request, t), **data}
    context["chart"] = lambda name: _chart_markup(name, figures[name])
    context["has_chart"] = lambda name: name in figures
    context["chart_names"] = list(figures)
    body = ENV.get_template(template).render(context)
    return Response(body, status_code=status, media_type="text/html; charset=utf-8")


def frame_context(request: Request, t: Translator) -> dict[str, Any]:
    """What base.html needs: language, access mode, the token for this machine's browser, nav
    (the pages' entries, which the app keeps: console/main.py)."""
    access: Access = request.state.access
    daemon = request.app.state.daemon
    here = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return {
        "t": t,
        "lang": t.lang,
        "languages": LANGUAGES,
        "mode": mode_json(access),
        "token": daemon.token if access.may_see_token else None,
        "nav": request.app.state.nav,
        "path": request.url.path,
        "here": here,
    }


# ---- routes of the frame itself ---------------------------------------------------------------


async def set_language(request: Request) -> Response:
    """Remember a language in a cookie and go back to the page the switch was pressed on."""
    lang = request.path_params["lang"]
    if lang not in LANGUAGES:
        raise ApiError(
            Text(
                "no language {lang!r}; the console speaks {languages}",
                lang=lang,
                languages=", ".join(LANGUAGES),
            ),
            code="unknown_language",
            status=404,
        )
    response = RedirectResponse(safe_next(request.query_params.get("next")), status_code=303)
    response.set_cookie(LANG_COOKIE, lang, max_age=LANG_COOKIE_MAX_AGE_S, samesite="lax", path="/")
    return response


async def plotly_js(_request: Request) -> Response:
    """plotly.js from the installed plotly package (the LAN may have no internet)."""
    return FileResponse(PLOTLY_JS, media_type="text/javascript", headers=_CACHE)


_CACHE = {"cache-control": "public, max-age=3600"}


def frame_routes() -> list[BaseRoute]:
    return [
        Route("/lang/{lang}", set_language),
        Route("/static/plotly.min.js", plotly_js),
        Mount("/static", StaticFiles(directory=STATIC_DIR), name="static"),
    ]


# ---- errors on pages --------------------------------------------------------------------------


def _is_page(request: Request) -> bool:
    return not request.url.path.startswith("/api/") and not wants_json(request)


def error_page(request: Request, status: int, message: Text | str) -> Response:
    t = translator_of(request)
    context = {**frame_context(request, t), "status": status, "message": t.text(message)}
    body = ENV.get_template("error.html").render(context)
    return Response(body, status_code=status, media_type="text/html; charset=utf-8")


def localized(request: Request, response: Response) -> Response:
    """An API error as the console's scripts show it: beside the English `message`, the same
    sentence in the language of the page that asked, as `localized` (from `message_text`)."""
    t = translator_of(request)
    if t.lang == DEFAULT_LANGUAGE:
        return response
    body = json.loads(bytes(response.body))
    error = body["error"]
    error["localized"] = t.plain(text_of(error, "message"))
    kept = {
        k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")
    }
    return JSONResponse(body, status_code=response.status_code, headers=kept)


def api_error(
    status: int, code: str, message: Text | str, headers: dict[str, str] | None = None
) -> ASGIApp:
    """A refusal of the access rules (daemon/auth.py), answered in the asker's language too."""

    async def respond(scope: Scope, receive: Receive, send: Send) -> None:
        response = localized(Request(scope), error_response(status, code, message, headers))
        await response(scope, receive, send)

    return respond


def page_aware(
    api_handlers: Mapping[Any, Callable[..., Any]],
) -> dict[Any, Callable[..., Any]]:
    """The API's exception handlers, answering with an HTML page on console paths and in the
    page's language beside the English on the API (`localized`)."""

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        if _is_page(request):
            return error_page(request, exc.status, exc.text)
        return localized(request, await api_handlers[ApiError](request, exc))

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if _is_page(request):
            t = translator_of(request)
            message = (
                t("There is no page at {path}.", path=request.url.path)
                if exc.status_code == 404
                else str(exc.detail)
            )
            return error_page(request, exc.status_code, message)
        if not request.url.path.startswith("/api/") and exc.status_code == 404:
            return error_response(
                404, "not_found", Text("nothing at {path}", path=request.url.path)
            )
        return localized(request, await api_handlers[HTTPException](request, exc))

    async def on_internal_error(request: Request, exc: Exception) -> Response:
        if _is_page(request):
            log.exception("internal error on %s", request.url.path, exc_info=exc)
            t = translator_of(request)
            return error_page(
                request,
                500,
                t("mgr failed on this page ({error}); see its log.", error=type(exc).__name__),
            )
        return localized(request, await api_handlers[Exception](request, exc))

    return {ApiError: on_api_error, HTTPException: on_http_error, Exception: on_internal_error}
