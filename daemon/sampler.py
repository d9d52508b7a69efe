"""Polls each running engine's /v1/stats every few seconds into telemetry rows; keeps the latest."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..engine.process import launch
from .errors import DiskFull
from .measure import HardwareService
from .retention import Retention, maintain
from .schema import Server
from .store import Store
from .supervisor import EngineHandle, Supervisor
from .telemetry import Compactor, write_rows

log = logging.getLogger("moelab.mgr")

StatsSource = Callable[[EngineHandle], "dict[str, Any] | None"]


def fetch_stats(handle: EngineHandle) -> dict[str, Any] | None:
    """An engine's /v1/stats body; None when it does not answer with one."""
    body = launch.get_json(handle.base_url + "/v1/stats", timeout_s=1.5, api_key=handle.api_key)
    if not isinstance(body, dict) or "error" in body or "uptime_s" not in body:
        return None
    return body


def generating(stats: dict[str, Any]) -> bool:
    throughput = stats.get("throughput") or {}
    running = (stats.get("requests") or {}).get("running") or 0
    return running > 0 or (throughput.get("decode_tok_s_10s") or 0) > 0


class Sampler:
    """The sampling thread: each ready engine polled once per interval, maintenance now and then."""

    def __init__(
        self,
        store: Store,
        supervisor: Supervisor,
        hardware: HardwareService | None,
        *,
        interval_s: float = 2.0,
        picks_every_s: float = 60.0,
        retention: Retention | None = None,
        maintain_every_s: float = 600.0,
        source: StatsSource = fetch_stats,
    ) -> None:
        self.store = store
        self.supervisor = supervisor
        self.hardware = hardware
        self.interval_s = interval_s
        self.picks_every_s = picks_every_s
        self.retention = retention or Retention()
        self.maintain_every_s = maintain_every_s
        self.source = source
        self._compactors: dict[tuple[int, int], Compactor] = {}
        self._latest: dict[int, tuple[float, dict[str, Any]]] = {}
        self._persisted: dict[int, float] = {}
        self._last_maintained = 0.0
        self._disk_full = False
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closing.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._closing.is_set():
            began = time.monotonic()
            try:
                self.poll_once()
                if time.time() - self._last_maintained >= self.maintain_every_s:
                    self._last_maintained = time.time()
                    maintain(self.store, self.retention)
                self._disk_full = False
            except DiskFull as full:  # those samples are lost; sampling goes on once space is freed
                if not self._disk_full:
                    log.error("telemetry not stored until space is freed: %s", full.message)
                self._disk_full = True
            self._closing.wait(max(0.0, self.interval_s - (time.monotonic() - began)))

    def poll_once(self, now: float | None = None) -> int:
        """Sample every ready engine once; returns how many answered."""
        answered = 0
        live = set()
        for handle in self.supervisor.handles():
            if not handle.ready or handle.stopping:
                continue
            key = (handle.server_id, handle.engine.pid)
            live.add(key)
            stats = self.source(handle)
            if stats is None:
                continue
            answered += 1
            t = time.time() if now is None else now
            self._latest[handle.server_id] = (t, stats)
            compactor = self._compactors.get(key)
            if compactor is None:
                compactor = Compactor(
                    fresh=handle.fresh,
                    resolution_s=self.interval_s,
                    picks_every_s=self.picks_every_s,
                )
                self._compactors[key] = compactor
            write_rows(self.store, handle.server_id, compactor.ingest(stats, t))
            if t - self._persisted.get(handle.server_id, 0.0) >= self.picks_every_s:
                self._persist(handle.server_id, t, stats)
            if self.hardware is not None and handle.device.startswith("cuda") and generating(stats):
                index = int(handle.device.partition(":")[2] or 0)
                self.hardware.sample_pcie_under_load(index, handle.server_id)
        for key in set(self._compactors) - live:
            # the engine stopped: keep its last body in the row for the console's crash page
            server_id = key[0]
            del self._compactors[key]
            if server_id in self._latest:
                self._persist(server_id, *self._latest[server_id])
        return answered

    def _persist(self, server_id: int, t: float, stats: dict[str, Any]) -> None:
        self._persisted[server_id] = t
        with self.store.session() as session:
            row = session.get(Server, server_id)
            if row is not None:
                row.last_stats, row.last_stats_time = stats, t

    def latest(self, server_id: int) -> tuple[float, dict[str, Any]] | None:
        """The newest stats body of a server: from memory, else the one kept in its row."""
        if server_id in self._latest:
            return self._latest[server_id]
        with self.store.session() as session:
            row = session.get(Server, server_id)
            if row is None or row.last_stats is None or row.last_stats_time is None:
                return None
            return row.last_stats_time, row.last_stats
