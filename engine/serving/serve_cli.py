"""`moelab serve`: start the engine thread and the HTTP server; SIGTERM drains, then exits."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
from typing import NoReturn

import uvicorn

from ..config.args import add_engine_flags
from ..config.config import EngineConfig
from ..process.launch import LISTEN_FD_ENV

log = logging.getLogger("moelab.serve")

DRAIN_GRACE_S = 30


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over the OpenAI API")
    add_engine_flags(p)
    p.set_defaults(run=run)


class _DrainingServer(uvicorn.Server):
    """Marks the app as draining the moment a shutdown signal arrives, so new requests get 503
    while uvicorn lets the running ones finish within the grace."""

    def __init__(self, config: uvicorn.Config, on_exit) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)
        # a drained shutdown is a clean exit (status 0), not death by the signal
        self._captured_signals.clear()


def run(args: argparse.Namespace) -> NoReturn:
    from ..runtime.worker import EngineWorker
    from .server import Server

    config = EngineConfig.from_args(args)
    listen = config.server
    worker = EngineWorker(config)
    server = Server(config, worker)
    worker.start()

    def drain() -> None:
        if not server.draining:
            log.info("shutdown signal: draining (no new requests, %d s grace)", DRAIN_GRACE_S)
        server.draining = True

    uvicorn_config = uvicorn.Config(
        server.app, host=listen.host, port=listen.port, log_level=listen.log_level,
        timeout_graceful_shutdown=DRAIN_GRACE_S, access_log=listen.log_level == "debug",
    )  # fmt: skip
    http = _DrainingServer(uvicorn_config, drain)
    log.info(
        "moelab serve: http://%s:%d/v1 (model %s)", listen.host, listen.port, server.model_name
    )
    try:
        http.run(sockets=_inherited_listener())
    except SystemExit:
        pass  # uvicorn's own exit when it cannot start (a port in use): said below, status 1
    finally:
        worker.stop()
        worker.join(timeout=10)
    if not http.started:
        print(f"moelab serve: could not listen on {listen.host}:{listen.port}", file=sys.stderr)
        _exit_now(1)
    log.info("stopped: the HTTP server is down and the engine closed")
    _exit_now(0)


def _inherited_listener() -> list[socket.socket] | None:
    """The listening socket the process that started this one bound for it
    (engine/process/launch.py: the port was taken when it was chosen), else None: uvicorn binds
    --host and --port."""
    fd = os.environ.pop(LISTEN_FD_ENV, None)
    if fd is None:
        return None
    os.set_inheritable(int(fd), False)  # not for the engine's own children (compile workers)
    return [socket.socket(fileno=int(fd))]


def _exit_now(code: int) -> NoReturn:
    """End the process here, without the interpreter's teardown.

    Unloading torch and its extensions is most of an interpreter's exit (a GPU adds the CUDA
    context's), and the benchmark pays a stop on every trial. By now the HTTP server is down and
    the engine thread has closed the engine; the log is all that is left to write, and it is
    flushed first.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
