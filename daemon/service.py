"""The daemon's services wired together over one data dir: what `mgr` builds its web app from."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import child
from .audit import AuditLog
from .auth import AccessPolicy, Credentials, LoginLimiter, ServedHosts, load_or_create_token
from .catalog import ModelCatalog
from .jobs import Jobs
from .measure import HardwareService
from .models import ModelRoot, default_roots
from .private import make_private
from .profile_store import ProfileStore
from .retention import Retention
from .sampler import Sampler
from .store import Store
from .supervisor import DEFAULT_PORTS, Supervisor


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Where the daemon keeps its state, where it looks for models, and what it serves."""

    data_dir: Path
    models_dirs: tuple[Path, ...] = ()
    host: str = "127.0.0.1"
    port: int = 1901
    allow_hosts: tuple[str, ...] = ()
    engine_ports: range = DEFAULT_PORTS
    sample_interval_s: float = 2.0
    retention: Retention = field(default_factory=Retention)
    write_demo: bool = True
    # None: the usual places (~/models, the HF cache, --models-dir, the data dir)
    model_roots: tuple[ModelRoot, ...] | None = None

    def roots(self) -> list[ModelRoot]:
        if self.model_roots is not None:
            return list(self.model_roots)
        return default_roots(self.models_dirs, self.data_dir)


class Daemon:
    """Store, token, hardware, models, profiles, supervisor and sampler of one running `mgr`."""

    def __init__(self, config: DaemonConfig) -> None:
        self.config = config
        self.data_dir = config.data_dir
        self.started = time.time()
        self.pid = os.getpid()
        make_private(config.data_dir)
        self.store = Store.open(config.data_dir)
        self.audit = AuditLog(self.store, config.retention)
        self.token = load_or_create_token(config.data_dir)
        self.policy = AccessPolicy(
            Credentials(self.token), ServedHosts(config.host, config.allow_hosts), LoginLimiter()
        )
        self.profiles = ProfileStore(self.store)
        self.jobs = Jobs()
        self.hardware = HardwareService(self.store, self.jobs)
        self.catalog = ModelCatalog(self.store, config.roots(), config.data_dir, self.jobs)
        self.supervisor = Supervisor(
            self.store,
            config.data_dir,
            gpu_count=lambda: len(self.hardware.inventory(max_age_s=3600.0).gpus),
            ports=config.engine_ports,
        )
        self.sampler = Sampler(
            self.store,
            self.supervisor,
            self.hardware,
            interval_s=config.sample_interval_s,
            retention=config.retention,
        )

    def start(self) -> None:
        """Find models, adopt engines, start sampling; slow probes run on their own threads."""
        self.catalog.rescan()
        self.supervisor.open()
        self.sampler.start()
        threading.Thread(
            target=self.hardware.record_inventory, name="inventory", daemon=True
        ).start()
        if self.config.write_demo:
            self.catalog.ensure_demo()

    def close(self) -> None:
        """Stop the daemon's threads; engines keep running and are adopted by the next start."""
        self.sampler.close()
        self.supervisor.close()
        child.stop_all()
        self.store.close()
