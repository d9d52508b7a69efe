"""The login page: the form that takes the control token (POST /api/auth/login sets the cookie)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..web import NavEntry, render, safe_next


async def login_page(request: Request) -> Response:
    return render(
        request,
        "login.html",
        {
            "next": safe_next(request.query_params.get("next")),
        },
    )


ROUTES = [Route("/login", login_page)]
NAV: tuple[NavEntry, ...] = ()
