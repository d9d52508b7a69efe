"""ORM classes over the tables that migrations.py creates (the migrations define the file).

Times are seconds since the epoch (REAL): retention and rate arithmetic stay simple, and the API
turns them into ISO 8601 strings. JSON-valued columns hold lists and dicts as text.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, ForeignKey, LargeBinary
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Measurement(Base):
    """One hardware reading (a probe or a measured rate) with the identity it was taken on."""

    __tablename__ = "hardware_measurements"

    id: Mapped[int] = mapped_column(primary_key=True)
    kind: Mapped[str]
    params: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    value: Mapped[float]
    unit: Mapped[str]
    source: Mapped[str]
    machine_id: Mapped[str]
    hostname: Mapped[str]
    gpu_uuid: Mapped[str | None]
    gpu_name: Mapped[str | None]
    engine_version: Mapped[str]
    torch_version: Mapped[str | None]
    driver_version: Mapped[str | None]
    cuda_version: Mapped[str | None]
    created: Mapped[float]


class Model(Base):
    """A checkpoint found on disk and what its config and safetensors headers say."""

    __tablename__ = "models"

    id: Mapped[int] = mapped_column(primary_key=True)
    path: Mapped[str] = mapped_column(unique=True)
    name: Mapped[str]
    source: Mapped[str]
    architecture: Mapped[str | None]
    model_type: Mapped[str | None]
    num_layers: Mapped[int | None]
    num_experts: Mapped[int | None]
    top_k: Mapped[int | None]
    dense_bytes: Mapped[int | None]
    expert_bytes: Mapped[int | None]
    max_context: Mapped[int | None]
    is_demo: Mapped[bool] = mapped_column(default=False)
    present: Mapped[bool] = mapped_column(default=True)
    error: Mapped[str | None]  # English: why it cannot be served
    error_text: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    config: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    discovered: Mapped[float]
    updated: Mapped[float]


class Profile(Base):
    """A launch profile: a model and the engine flags to serve it with."""

    __tablename__ = "profiles"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(unique=True)
    model: Mapped[str]
    flags: Mapped[list[str]] = mapped_column(JSON, default=list)
    notes: Mapped[str] = mapped_column(default="")
    origin: Mapped[str] = mapped_column(default="by hand")
    created: Mapped[float]
    updated: Mapped[float]


class Server(Base):
    """An engine process the daemon started (or once started), and how it is doing."""

    __tablename__ = "servers"

    id: Mapped[int] = mapped_column(primary_key=True)
    profile_id: Mapped[int | None] = mapped_column(ForeignKey("profiles.id", ondelete="SET NULL"))
    name: Mapped[str]
    model: Mapped[str]
    flags: Mapped[list[str]] = mapped_column(JSON, default=list)
    host: Mapped[str]
    port: Mapped[int]
    device: Mapped[str]
    status: Mapped[str]
    pid: Mapped[int | None]
    process_started: Mapped[float | None]
    log_path: Mapped[str]
    exit_code: Mapped[int | None]
    error: Mapped[str | None]  # English
    error_text: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    log_tail: Mapped[str | None]
    created: Mapped[float]
    started: Mapped[float | None]
    ready: Mapped[float | None]
    stopped: Mapped[float | None]
    last_stats: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    last_stats_time: Mapped[float | None]


class AuditEvent(Base):
    """A state-changing request: what it asked, who asked (address, credential), the outcome.

    Refusals, and requests from callers without control, are one row per address, action,
    status and minute (`minute`, since the epoch), `count` saying how many came; the row keeps
    the first one's time, method and path. Other requests are a row each (`minute` is null).
    """

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    time: Mapped[float]
    address: Mapped[str]
    via: Mapped[str]
    method: Mapped[str]
    path: Mapped[str]
    status: Mapped[int]
    action: Mapped[str]
    target: Mapped[str | None]
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    count: Mapped[int] = mapped_column(default=1)
    minute: Mapped[int | None]


class TelemetrySample(Base):
    """A compacted slice of an engine's /v1/stats: gauges plus counter deltas over `interval_s`."""

    __tablename__ = "telemetry_samples"

    id: Mapped[int] = mapped_column(primary_key=True)
    server_id: Mapped[int] = mapped_column(ForeignKey("servers.id", ondelete="CASCADE"))
    kind: Mapped[str]
    resolution_s: Mapped[float]
    time: Mapped[float]
    interval_s: Mapped[float]
    payload: Mapped[bytes] = mapped_column(LargeBinary)
    size_bytes: Mapped[int]


class BenchmarkRun(Base):
    """A benchmark (autotune) run of one model, driven by daemon/benchmarks.py."""

    __tablename__ = "benchmark_runs"

    id: Mapped[int] = mapped_column(primary_key=True)
    model: Mapped[str]
    mode: Mapped[str]
    objective: Mapped[str]
    status: Mapped[str]
    phase: Mapped[str] = mapped_column(default="")
    eta_s: Mapped[float | None]
    base_flags: Mapped[list[str]] = mapped_column(JSON, default=list)
    options: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    error: Mapped[str | None]  # English
    error_text: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    engine_version: Mapped[str | None]
    machine_id: Mapped[str | None]
    created: Mapped[float]
    updated: Mapped[float]
    finished: Mapped[float | None]


class Trial(Base):
    """One engine start of a benchmark run with one flag changed, and what it measured."""

    __tablename__ = "trials"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("benchmark_runs.id", ondelete="CASCADE"))
    n: Mapped[int]
    change: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))
    flags: Mapped[list[str]] = mapped_column(JSON, default=list)
    engine_pid: Mapped[int | None]
    started: Mapped[float | None]
    duration_s: Mapped[float | None]
    startup_s: Mapped[float | None]
    prefill_tok_s: Mapped[float | None]
    decode_tok_s: Mapped[float | None]
    aggregate_tok_s: Mapped[float | None]
    ttft_s: Mapped[float | None]
    hit_rate: Mapped[float | None]
    verdict: Mapped[str]
    error: Mapped[str | None]
    log_tail: Mapped[str | None]
    stats: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))


class BenchmarkEvent(Base):
    """A line of a benchmark run's story (phase changes, skipped candidates, errors)."""

    __tablename__ = "benchmark_events"

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("benchmark_runs.id", ondelete="CASCADE"))
    time: Mapped[float]
    kind: Mapped[str]
    message: Mapped[str]  # English
    text: Mapped[dict[str, Any] | None] = mapped_column(JSON(none_as_null=True))  # Text.to_json()
    data: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)
