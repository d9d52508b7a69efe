"""The models table: what discovery found, checkpoints that went away, and the demo model."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select

from ..engine.model.spec import FULL_ATTENTION, LINEAR_ATTENTION, ModelSpec
from ..engine.text import Text, text_columns, text_fields
from .child import run_moelab
from .errors import BadRequest, NotFound
from .jobs import Job, JobError, Jobs
from .models import DEMO_NAME, Checkpoint, ModelRoot, discover
from .private import DIR_MODE, make_private
from .schema import Model
from .store import MAX_ROW_ID, Store, iso_time

DEMO_SYNTH_ARGS = [
    "--arch",
    "qwen3_moe",
    "--preset",
    "tiny",
    "--routing-skew",
    "1.0",
    "--seed",
    "0",
]

# The demo engine's flags: half of its 48 experts in the cache. With every expert resident (what
# the engine's default cache size gives so small a model) the Experts page has no misses, no
# split between copies and the CPU and no gain on the what-if curve: nothing of what moelab is for.
DEMO_FLAGS = ["--moe-cache-rate", "0.5"]


class ModelCatalog:
    """Checkpoints the daemon knows, refreshed from the model roots on start and on request."""

    def __init__(self, store: Store, roots: list[ModelRoot], data_dir: Path, jobs: Jobs) -> None:
        self.store = store
        self.roots = roots
        self.data_dir = data_dir
        self.jobs = jobs

    @property
    def demo_path(self) -> Path:
        return self.data_dir / "models" / DEMO_NAME

    def rescan(self) -> list[Model]:
        """Discover checkpoints, upsert them by path, mark the ones no longer found."""
        found = {c.path: c for c in discover(self.roots)}
        now = time.time()
        with self.store.session() as session:
            rows = {m.path: m for m in session.scalars(select(Model))}
            for path, checkpoint in found.items():
                row = rows.get(path)
                if row is None:
                    row = Model(path=path, discovered=now)
                    session.add(row)
                _fill(row, checkpoint, now)
            for path, row in rows.items():
                if path not in found and row.present:
                    row.present = False
                    row.updated = now
        return self.list()

    def list(self, include_missing: bool = False) -> list[Model]:
        with self.store.session() as session:
            query = select(Model).order_by(Model.is_demo, Model.name)
            if not include_missing:
                query = query.where(Model.present)
            return list(session.scalars(query))

    def get(self, model_id: int) -> Model | None:
        if not 0 < model_id <= MAX_ROW_ID:
            return None
        with self.store.session() as session:
            return session.get(Model, model_id)

    def get_or_404(self, model_id: int) -> Model:
        """One model by id (present or not); NotFound when there is none."""
        return self.store.get_or_404(Model, model_id)

    def by_path(self, path: str) -> Model | None:
        try:
            resolved = str(Path(path).expanduser().resolve())
        except (ValueError, OSError):  # a NUL in it, a loop of links: no model is there
            return None
        with self.store.session() as session:
            return session.scalars(select(Model).where(Model.path == resolved)).first()

    def ensure_demo(self) -> Job | None:
        """Write the demo model when no checkpoint is known at all; returns its job, or None."""
        if self.list():
            return None
        job, _ = self.jobs.start_unless_running("demo-model", self._write_demo)
        return job

    def _write_demo(self, job: Job) -> dict[str, Any]:
        target = self.demo_path
        staging = target.with_name(f".{DEMO_NAME}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        job.progress(Text("writing the demo model into {target}", target=str(target)))
        result = run_moelab(["synth", *DEMO_SYNTH_ARGS, "--out", str(staging)], job.progress)
        if result.returncode != 0:
            shutil.rmtree(staging, ignore_errors=True)
            raise JobError(
                Text(
                    "`moelab synth` failed with exit code {code}: {stderr}",
                    code=result.returncode,
                    stderr=result.stderr_tail,
                )
            )
        make_private(staging)
        # rename last, so a half-written model is never discovered
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        self.rescan()
        job.progress(Text("demo model ready"))
        return {"path": str(target)}

    def resolve(self, model: str) -> tuple[Model, ModelSpec]:
        """A model by path or id and its spec; NotFound or BadRequest (unsupported) otherwise."""
        row = self.get(int(model)) if model.isascii() and model.isdigit() else self.by_path(model)
        if row is None:
            raise NotFound(
                Text("unknown model {model!r}; GET /api/models lists them", model=model),
                code="model_not_found",
            )
        if row.error is not None:
            raise BadRequest(
                Text("{name} cannot be served: {error}", name=row.name, error=serving_error(row)),
                code="unsupported_model",
            )
        return row, ModelSpec.from_config(row.config)


def _fill(row: Model, checkpoint: Checkpoint, now: float) -> None:
    for name in (
        "name",
        "source",
        "architecture",
        "model_type",
        "num_layers",
        "num_experts",
        "top_k",
        "dense_bytes",
        "expert_bytes",
        "max_context",
        "is_demo",
        "config",
    ):
        setattr(row, name, getattr(checkpoint, name))
    for name, value in text_columns("error", checkpoint.error).items():
        setattr(row, name, value)
    row.present = True
    row.updated = now


def serving_error(row: Model) -> Text | str | None:
    """Why a model cannot be served (None: it can), as discovery said it."""
    return Text.from_json(row.error_text) if row.error_text else row.error


def layer_kinds(row: Model) -> dict[str, int] | None:
    """How many layers of each kind the model has, as the engine reads its config.json:
    full_attention (a KV cache) and linear_attention (Gated DeltaNet, a fixed state); None for
    a model that cannot be served."""
    if row.error is not None:
        return None
    kinds = ModelSpec.from_config(row.config).layer_types
    return {kind: kinds.count(kind) for kind in (FULL_ATTENTION, LINEAR_ATTENTION)}


def model_json(row: Model) -> dict[str, Any]:
    """A model as the API shows it."""
    return {
        "id": row.id,
        "path": row.path,
        "name": row.name,
        "source": row.source,
        "architecture": row.architecture,
        "model_type": row.model_type,
        "num_layers": row.num_layers,
        "layer_kinds": layer_kinds(row),
        "num_experts": row.num_experts,
        "top_k": row.top_k,
        "dense_bytes": row.dense_bytes,
        "expert_bytes": row.expert_bytes,
        "max_context": row.max_context,
        "is_moe": bool(row.num_experts and row.num_experts > 1),
        "is_demo": row.is_demo,
        "present": row.present,
        **text_fields("error", serving_error(row)),
        "discovered": iso_time(row.discovered),
        "updated": iso_time(row.updated),
    }
