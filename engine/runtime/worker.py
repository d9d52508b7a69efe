"""The engine thread: loads the model, then runs steps; the server talks to it through commands.

Everything that touches the engine (adding, cancelling, resizing, reading stats) runs on this one
thread, between steps, so the scheduler and caches need no locks.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from ..config.config import EngineConfig
from .loading import LoadProgress
from .sampling import SamplingParams
from .scheduler import ContextTooLong, Sequence

log = logging.getLogger("moelab.worker")


class QueueFull(RuntimeError):
    """More requests are waiting than --max-queued-requests allows."""


@dataclass(slots=True, eq=False)
class Request:
    """One API request's link to the engine thread: tokens flow back through `events`, each as
    (token, finish reason, log probabilities); a failure as (-1, its reason, None), the reason a
    ContextTooLong where the request can never fit the context."""

    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    # prompt token counts where a chat's messages end (Engine.add's boundaries)
    boundaries: tuple[int, ...] = ()
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    seq: Sequence | None = None
    arrival: float = field(default_factory=time.monotonic)

    def deliver(self, item: tuple) -> None:
        """Called on the engine thread: hand an event to the request's asyncio queue."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class EngineWorker(threading.Thread):
    """Owns the Engine; the HTTP side submits requests and calls functions on it."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(name="moelab-engine", daemon=True)
        self.config = config
        self.status = "loading"
        self.error: str | None = None
        self.loading = LoadProgress()
        self.engine = None
        self._commands: queue.Queue[tuple[Callable, Future | None]] = queue.Queue()
        self._stopping = threading.Event()
        self._in_flight = 0
        self._lock = threading.Lock()

    # lifecycle ---------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            from .engine import Engine, settle_heap  # here, so that a broken install is reported

            self.engine = Engine(self.config, progress=self.loading)
            log.info("heap settled: a full collection took %.0f ms", settle_heap())
        except Exception as err:  # reported through /health; the process stays up to say why
            self.status = "error"
            self.error = f"{type(err).__name__}: {err}"
            log.error("loading failed: %s\n%s", self.error, traceback.format_exc())
            return
        self.status = "ok"
        try:
            self._loop()
        finally:
            self.engine.close()
            gc.unfreeze()

    def stop(self) -> None:
        self._stopping.set()
        self._commands.put((lambda engine: None, None))

    def _loop(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            scheduler = engine.scheduler
            idle = engine.idle or (scheduler.paused and not scheduler.running)
            try:
                fn, future = self._commands.get(timeout=0.5 if idle else 0)
            except queue.Empty:
                fn = None
            if fn is not None:
                # commands see a settled engine: no decode step left in flight
                try:
                    engine.drain()
                except Exception as err:
                    self._fail_running(err)
                self._run_command(fn, future)
                continue
            if idle:
                continue
            try:
                engine.step()
            except Exception as err:
                self._fail_running(err)

    def _run_command(self, fn: Callable, future: Future | None) -> None:
        try:
            result = fn(self.engine)
        except Exception as err:
            if future is not None:
                future.set_exception(err)
            else:
                log.exception("engine command failed")
            return
        if future is not None:
            future.set_result(result)

    def _fail_running(self, err: Exception) -> None:
        """A step failed (e.g. out of memory): end its sequences with an error (and those
        preempted while their token was in flight), keep serving."""
        log.error("step failed: %s\n%s", err, traceback.format_exc())
        engine = self.engine
        scheduler = engine.scheduler
        for seq in [*scheduler.running, *(s for s in scheduler.waiting if s.pending)]:
            engine.scheduler.finish(seq, "error")
            engine.sampler.forget(seq.id)
            if seq.on_token is not None:
                seq.on_token(seq, -1)

    # requests ---------------------------------------------------------------------------------

    def call(self, fn: Callable[[Any], Any]) -> Future:
        """Run fn(engine) on the engine thread between steps."""
        future: Future = Future()
        self._commands.put((fn, future))
        return future

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, request: Request, limit: int) -> None:
        """Queue a request for the engine; QueueFull past `limit` requests in flight."""
        with self._lock:
            if self._in_flight >= limit:
                raise QueueFull(f"{self._in_flight} requests are in flight (limit {limit})")
            self._in_flight += 1

        def on_token(seq: Sequence, token: int) -> None:
            # the token's log probabilities, where the request asked for them
            logprobs = seq.output_logprobs[-1] if token >= 0 and seq.output_logprobs else None
            request.deliver((token, seq.error or seq.finish_reason, logprobs))
            if seq.finish_reason is not None:
                self._done()

        def add(engine) -> None:
            try:
                request.seq = engine.add(
                    request.prompt_ids, request.params, on_token, request.boundaries
                )
                request.seq.arrival_time = request.arrival
            except ContextTooLong as err:  # the context shrank since the server checked it
                self._done()
                request.deliver((-1, err, None))
            except ValueError as err:
                self._done()
                request.deliver((-1, f"error: {err}", None))

        self._commands.put((add, None))

    def _done(self) -> None:
        with self._lock:
            self._in_flight -= 1

    def cancel(self, request: Request) -> None:
        """Stop a request (its client went away) and free its KV, on the engine thread."""

        def cancel(engine) -> None:
            seq = request.seq
            if seq is not None and not seq.finished:
                engine.cancel(seq)
                self._done()

        self._commands.put((cancel, None))
