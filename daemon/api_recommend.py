"""/api/recommend: Recommended settings and the context planner for one model on this machine.

`GET /api/recommend?model=PATH|ID[&profile=ID][&context=TOKENS]` answers with what recommend.py
gathers and advises.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .http import access_of, blocking, daemon_of, query_number
from .recommend import gather, recommendation_json


async def get_recommend(request: Request) -> Response:
    daemon = daemon_of(request)
    profile = query_number(request, "profile", None, 1, 2**62)
    context = query_number(request, "context", None, 1, 2**31)
    inputs = await blocking(
        gather,
        daemon,
        request.query_params.get("model"),
        int(profile) if profile is not None else None,
    )
    body = await blocking(
        recommendation_json,
        inputs,
        int(context) if context else None,
        access_of(request).control,
    )
    return JSONResponse(body)


def routes() -> list[Route]:
    return [Route("/api/recommend", get_recommend)]
