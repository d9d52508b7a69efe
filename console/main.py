"""`mgr`: the manager daemon's entry point, where its services and the web app are put together.

Start-up order: take the data-dir lock (a second mgr on the same dir stops here and names the
holder), bind the port (a clash is reported before anything else happens), open the store, build
the app, then serve; the lifespan starts the daemon's threads and prints the URL and the token.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import logging
import socket
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import platformdirs
import psutil
from starlette.applications import Starlette
from starlette.middleware import Middleware

from ..daemon.api import api_routes
from ..daemon.auth import AccessMiddleware
from ..daemon.benchmarks import BenchmarkService
from ..daemon.http import EXCEPTION_HANDLERS
from ..daemon.lock import DataDirLock, DataDirLocked
from ..daemon.service import Daemon, DaemonConfig
from ..daemon.store import StoreError
from . import pages
from .web import api_error, frame_routes, page_aware

DEFAULT_PORT = 1901


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mgr",
        description="The moelab manager: measures this machine, keeps launch profiles, starts and "
        "stops engines, and serves the console. Anyone who can reach it may look; changes need the "
        "control token it prints (or a browser on this machine).",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="Address to listen on; 0.0.0.0 lets the LAN watch (and control, with the token).",
    )
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="Port to listen on.")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=None,
        help="Where the database, the control token, engine logs and the demo model live; "
        f"default: {platformdirs.user_data_dir('moelab')}.",
    )
    parser.add_argument(
        "--models-dir",
        type=Path,
        action="append",
        default=[],
        help="A folder to search for checkpoints besides ~/models and the Hugging Face cache "
        "(may be given more than once).",
    )
    parser.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="Another host name this daemon is reached by (e.g. a DNS alias); requests naming "
        "an unknown host are refused to stop DNS rebinding.",
    )
    return parser


def build_app(daemon: Daemon) -> Starlette:
    """The web app of a daemon: its JSON API and the console's pages, behind the access rules.

    Benchmark runs live with the app: a stopping mgr interrupts the one running."""
    benchmarks = BenchmarkService(daemon)

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        daemon.start()
        benchmarks.open()
        _announce(daemon)
        try:
            yield
        finally:
            benchmarks.close()
            daemon.close()

    app = Starlette(
        routes=[*api_routes(), *frame_routes(), *pages.routes()],
        exception_handlers=page_aware(EXCEPTION_HANDLERS),
        middleware=[
            Middleware(
                AccessMiddleware,
                policy=daemon.policy,
                audit=daemon.audit,
                render_error=api_error,
            )
        ],
        lifespan=lifespan,
    )
    app.state.daemon = daemon
    app.state.benchmarks = benchmarks
    app.state.nav = pages.nav()
    return app


def _lan_addresses() -> list[str]:
    out = []
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if (
                address.family == socket.AF_INET
                and not ipaddress.ip_address(address.address).is_loopback
            ):
                out.append(address.address)
    return out


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def _announce(daemon: Daemon) -> None:
    config = daemon.config
    wildcard = config.host in ("0.0.0.0", "::")
    local = "127.0.0.1" if wildcard else config.host
    lines = [f"mgr: open {_url(local, config.port)}   (data in {daemon.data_dir})"]
    if wildcard:
        others = (
            ", ".join(_url(a, config.port) for a in _lan_addresses()) or "this machine's address"
        )
        lines.append(f"mgr: from other machines: {others}   (read-only without the token)")
    lines.append(f"mgr: control token: {daemon.token}")
    job = daemon.jobs.latest("demo-model")
    if job is not None and job.running:
        lines.append(f"mgr: no models found; writing a demo model into {daemon.catalog.demo_path}")
    print("\n".join(lines), flush=True)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # named as TCP, or asyncio leaves Nagle on for the connections it accepts, and every answer
    # after the first on a kept-alive connection (a browser's) waits for the client's delayed ACK
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    return sock


def configure_logging() -> None:
    """mgr's own lines at INFO; the HTTP client's one line per request (the benchmark's trials
    send hundreds) only when something goes wrong, so the URL and the token stay in sight."""
    logging.basicConfig(level=logging.INFO, format="mgr: %(message)s")
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    data_dir = (args.data_dir or Path(platformdirs.user_data_dir("moelab"))).expanduser().resolve()
    configure_logging()
    lock = DataDirLock(data_dir)
    try:
        lock.acquire()
    except DataDirLocked as err:
        print(f"mgr: {err}", file=sys.stderr)
        return 1
    except OSError as err:
        print(f"mgr: cannot use the data dir {data_dir}: {err}", file=sys.stderr)
        return 1
    try:
        try:
            sock = _listen(args.host, args.port)
        except OSError as err:
            print(
                f"mgr: cannot listen on {args.host}:{args.port} ({err.strerror}); is another mgr "
                "or program using it? Pass --port to pick another.",
                file=sys.stderr,
            )
            return 1
        config = DaemonConfig(
            data_dir=data_dir,
            models_dirs=tuple(args.models_dir),
            host=args.host,
            port=sock.getsockname()[1],
            allow_hosts=tuple(args.allow_host),
        )
        try:
            daemon = Daemon(config)
        except (StoreError, RuntimeError) as err:
            print(f"mgr: {err}", file=sys.stderr)
            return 1
        except OSError as err:
            print(f"mgr: cannot use the data dir {data_dir}: {err}", file=sys.stderr)
            return 1
        import uvicorn

        server = uvicorn.Server(
            uvicorn.Config(build_app(daemon), log_level="warning", access_log=False, lifespan="on")
        )
        server.run(sockets=[sock])
        return 0
    finally:
        lock.release()


if __name__ == "__main__":
    sys.exit(main())
