"""How an OpenAI client reaches an engine from where the person looking at the console is.

An engine listens on its `--host`: on loopback (the default) only programs on the PC itself reach
it; on a wildcard address (0.0.0.0, ::) anything that reaches the PC does, by the same name the
viewer used to reach the console; on one address, by that address.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..daemon.flags import SECRET_FLAGS
from ..daemon.schema import Server
from ..daemon.servers import served_model_name

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True, slots=True)
class Viewer:
    """Where a page is looked at from: the host name it used for the console, and whether its
    browser runs on the PC itself."""

    host: str
    on_this_pc: bool


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def client_json(server: Server, viewer: Viewer) -> dict[str, Any]:
    """The OpenAI `base_url` and `model` that work from the viewer's machine to a server's
    engine, and whether the engine can be reached from there at all."""
    engine_host = server.host
    only_this_pc = engine_host in LOOPBACK_HOSTS
    if only_this_pc:
        host = engine_host
    elif engine_host in WILDCARD_HOSTS:
        host = viewer.host
    else:
        host = engine_host
    return {
        "base_url": f"http://{_url_host(host)}:{server.port}/v1",
        "model": served_model_name(server),
        "only_this_pc": only_this_pc,
        "reachable_from_viewer": viewer.on_this_pc or not only_this_pc,
        "needs_api_key": any(f.split("=", 1)[0] in SECRET_FLAGS for f in server.flags),
    }
