"""Who may drive the engine from a browser: the Host and Origin rules (ASGI), and CORS.

The rules, in the order they are applied to every request (docs/server.md, "Access"):

1. A `Host` the engine does not serve is refused with 400 (DNS rebinding). It serves what `mgr`
   serves (engine/serving/hosts.py): loopback, the address it is bound to (every interface's and the
   host names when bound to a wildcard), the address the connection arrived on, `--allow-host`.
2. GET and HEAD are open: they change nothing, and a browser lets another site's page read the
   answer only where CORS allows it.
3. A request from another site's page (a foreign `Origin`, or `Sec-Fetch-Site` cross-site or
   same-site) is refused with 403, unless it is an inference request, or the CORS preflight of
   one or of a read, from an origin given with `--allowed-origins`. Everything else (cache
   resizing) is never open to another site, listed or not.

The listed origins get CORS headers from Starlette's CORSMiddleware, which sits inside this one.
"""

from __future__ import annotations

from collections.abc import Iterable

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .hosts import ServedHosts, is_foreign
from .openai_api import ApiError

READ_METHODS = frozenset({"GET", "HEAD"})
# the OpenAI and Anthropic APIs a browser client calls (a chat page lists the models first)
INFERENCE_PATHS = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/messages",
    "/v1/messages/count_tokens",
})  # fmt: skip


def access_middleware(hosts: ServedHosts, allowed_origins: Iterable[str] = ()) -> list[Middleware]:
    """The engine's access rules, then CORS for the listed origins (outermost first)."""
    origins = tuple(allowed_origins)
    return [
        Middleware(EngineAccess, hosts=hosts, allowed_origins=origins),
        Middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],  # Authorization, and what the OpenAI clients add
            allow_private_network=True,  # a listed public page may call an engine on the LAN
        ),
    ]


class EngineAccess:
    """Applies the Host and Origin rules to every HTTP request; refusals are OpenAI-style JSON."""

    def __init__(self, app: ASGIApp, hosts: ServedHosts, allowed_origins: tuple[str, ...]) -> None:
        self.app = app
        self.hosts = hosts
        self.allowed_origins = allowed_origins

    def origin_allowed(self, origin: str | None) -> bool:
        return origin is not None and (
            "*" in self.allowed_origins or origin in self.allowed_origins
        )

    def refusal(self, scope: Scope) -> ApiError | None:
        """Why the request must be refused, or None."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        local_address = (scope.get("server") or ("", 0))[0]
        if not self.hosts.serves(host, local_address):
            return ApiError(
                400,
                f"this engine does not serve the host {host!r}; open it by this machine's "
                "address or name, or start it with --allow-host NAME",
                code="unknown_host",
            )
        method = scope["method"]
        if method in READ_METHODS or not is_foreign(headers, host or ""):
            return None
        origin = headers.get("origin")
        if method == "OPTIONS":  # a CORS preflight: judged by the request it asks about
            method = headers.get("access-control-request-method", method).upper()
        if scope["path"] not in INFERENCE_PATHS and method not in READ_METHODS:
            return ApiError(
                403,
                f"{scope['path']} takes no request from another site's page (Origin {origin!r} "
                f"is not {host!r}); --allowed-origins opens the inference endpoints alone",
                type_="permission_error",
                code="foreign_origin",
            )
        if self.origin_allowed(origin):
            return None
        listed = origin if origin and "://" in origin else "ORIGIN"
        return ApiError(
            403,
            f"the engine takes no cross-origin request from {origin or 'another site'!r}; to let "
            f"a browser page of that origin call the API, start the engine with "
            f"--allowed-origins {listed}",
            type_="permission_error",
            code="origin_not_allowed",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self.refusal(scope)
        if refused is None:
            await self.app(scope, receive, send)
            return
        response = JSONResponse(refused.body(), status_code=refused.status)
        await response(scope, receive, send)
