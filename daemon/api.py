"""The JSON API: every /api route, gathered from the route modules (the console adds its pages).

The route modules (api_*.py) hold the handlers, one group of routes each; they share the HTTP
plumbing of http.py (the error shape, reading bodies and ids, the thread pool, the audit note)
and ask the services for data. This module only lists their routes, in the order they match.
"""

from __future__ import annotations

from starlette.routing import Route

from . import (
    api_auth,
    api_benchmarks,
    api_hardware,
    api_models,
    api_profiles,
    api_recommend,
    api_servers,
)


def api_routes() -> list[Route]:
    """Every /api route."""
    return [
        *api_auth.routes(),
        *api_hardware.routes(),
        *api_models.routes(),
        *api_profiles.routes(),
        *api_recommend.routes(),
        *api_servers.routes(),
        *api_benchmarks.routes(),
    ]
