"""Benchmark runs in the database: trials and events as rows, the journal over them, JSON shapes.

A trial row holds the figures in columns and the rest in `stats` (JSON): the engine's /v1/stats,
the workload's per-request readings, the trial's role, the measured reason for its verdict, the
context it proved. Everything a resumed run needs to replay a trial is in its row.

Reasons, errors and events are sentences (engine/text.py): each is kept in English (the columns
and fields the API serves) with its stored form beside it (`reason_text`, `error_text`, the
events' `text` column), so the console shows them in the viewer's language. Rows from before
the stored forms keep their English.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import delete, select

from ..autotune.flagset import Change
from ..autotune.journal import Journal, StoredTrial
from ..autotune.trial_record import TrialRequest, TrialResult
from ..autotune.workload import ContextProof
from ..engine.text import Text, text_columns, text_fields, text_of
from .flags import HIDDEN, SECRET_FLAGS, hide_secrets, redact_flags
from .schema import BenchmarkEvent, BenchmarkRun, Trial
from .store import Store, iso_time


def trial_values(trial: StoredTrial) -> dict[str, Any]:
    """The columns of a trial row for a stored trial."""
    r, q = trial.result, trial.request
    return {
        "n": trial.n,
        "change": q.change.to_json() if q.change else None,
        "flags": list(q.flags),
        "engine_pid": r.engine_pid,
        "started": r.started,
        "duration_s": r.duration_s,
        "startup_s": r.startup_s,
        "prefill_tok_s": r.prefill_tok_s,
        "decode_tok_s": r.decode_tok_s,
        "aggregate_tok_s": r.aggregate_tok_s,
        "ttft_s": r.ttft_s,
        "hit_rate": r.hit_rate,
        "verdict": trial.verdict,
        "error": None if r.error is None else str(r.error),
        "log_tail": r.log_tail,
        "stats": {
            "ok": r.ok,
            "role": q.role,
            **text_fields("reason", trial.reason),
            "error_text": r.error.to_json() if isinstance(r.error, Text) else None,
            "context_tokens": q.context_tokens,
            "usable_context": r.usable_context,
            "context_proof": r.context_proof.to_json() if r.context_proof else None,
            "warmup_s": r.warmup_s,
            "stop_s": r.stop_s,
            "failure": r.failure,
            "agent_tok_s": r.agent_tok_s,  # beside the figures' columns: no column of its own
            "details": r.details,
            "engine": r.stats,
        },
    }


def stored_trial(row: Trial) -> StoredTrial:
    """A trial row as the journal replays it."""
    extra = row.stats or {}
    proof = extra.get("context_proof")
    stored_error = extra.get("error_text")
    error = Text.from_json(stored_error) if stored_error else row.error
    request = TrialRequest(
        tuple(row.flags),
        Change.from_json(row.change) if row.change else None,
        extra.get("role", "candidate"),
        extra.get("context_tokens"),
    )
    result = TrialResult(
        ok=bool(extra.get("ok", row.verdict != "failed")),
        started=row.started or 0.0,
        duration_s=row.duration_s or 0.0,
        prefill_tok_s=row.prefill_tok_s,
        decode_tok_s=row.decode_tok_s,
        aggregate_tok_s=row.aggregate_tok_s,
        agent_tok_s=extra.get("agent_tok_s"),
        ttft_s=row.ttft_s,
        hit_rate=row.hit_rate,
        usable_context=extra.get("usable_context"),
        context_proof=ContextProof.from_json(proof) if proof else None,
        engine_pid=row.engine_pid,
        startup_s=row.startup_s,
        warmup_s=extra.get("warmup_s"),
        stop_s=extra.get("stop_s"),
        failure=extra.get("failure"),
        error=error,
        log_tail=row.log_tail,
        stats=extra.get("engine"),
        details=extra.get("details") or {},
    )
    return StoredTrial(row.n, request, result, row.verdict, text_of(extra, "reason"))


def newest_result(store: Store, model_path: str) -> BenchmarkRun | None:
    """The newest finished run of a model that has a result, of any objective."""
    with store.session() as session:
        return session.scalars(
            select(BenchmarkRun)
            .where(
                BenchmarkRun.model == model_path,
                BenchmarkRun.status == "done",
                BenchmarkRun.result.is_not(None),
            )
            .order_by(BenchmarkRun.finished.desc(), BenchmarkRun.id.desc())
        ).first()


def trials_of(store: Store, run_id: int) -> list[Trial]:
    with store.session() as session:
        return list(session.scalars(select(Trial).where(Trial.run_id == run_id).order_by(Trial.n)))


def events_of(store: Store, run_id: int, limit: int | None = None) -> list[BenchmarkEvent]:
    """A run's events, oldest first (the newest `limit` of them when given)."""
    with store.session() as session:
        query = select(BenchmarkEvent).where(BenchmarkEvent.run_id == run_id)
        if limit is None:
            return list(session.scalars(query.order_by(BenchmarkEvent.id)))
        rows = list(session.scalars(query.order_by(BenchmarkEvent.id.desc()).limit(limit)))
        return rows[::-1]


def add_event(
    store: Store, run_id: int, kind: str, message: Text | str, data: dict | None = None
) -> None:
    """A line of a run's story: its English, and its stored form to show in other languages."""
    with store.session() as session:
        columns = text_columns("message", message)
        session.add(
            BenchmarkEvent(
                run_id=run_id,
                time=time.time(),
                kind=kind,
                message=columns["message"],
                text=columns["message_text"],
                data=data or {},
            )
        )


def update_run(store: Store, run_id: int, **fields: Any) -> BenchmarkRun:
    with store.session() as session:
        row = session.get(BenchmarkRun, run_id)
        assert row is not None, run_id
        for key, value in fields.items():
            setattr(row, key, value)
        row.updated = time.time()
        return row


class DbJournal(Journal):
    """The journal of one run over the daemon's database."""

    def __init__(
        self,
        store: Store,
        run_id: int,
        runner: Callable[[TrialRequest, int], TrialResult],
        cancelled: Callable[[], bool],
        on_trial: Callable[[int, TrialRequest], None],
        on_progress: Callable[[str, float | None], None],
    ) -> None:
        self.store = store
        self.run_id = run_id
        self._on_trial = on_trial
        self._on_progress = on_progress
        stored = [stored_trial(row) for row in trials_of(store, run_id)]
        events = [(e.kind, e.message) for e in events_of(store, run_id)]
        super().__init__(runner, stored, events, cancelled)

    def trial_starting(self, n: int, request: TrialRequest) -> None:
        self._on_trial(n, request)

    def save_trial(self, trial: StoredTrial) -> None:
        with self.store.session() as session:
            session.add(Trial(run_id=self.run_id, **trial_values(trial)))

    def set_verdict(self, n: int, verdict: str, reason: Text) -> None:
        with self.store.session() as session:
            row = session.scalars(
                select(Trial).where(Trial.run_id == self.run_id, Trial.n == n)
            ).one()
            row.verdict = verdict
            row.stats = {**(row.stats or {}), **text_fields("reason", reason)}

    def save_event(self, kind: str, message: Text, data: dict[str, Any]) -> None:
        add_event(self.store, self.run_id, kind, message, data)

    def forget_from(self, n: int) -> None:
        with self.store.session() as session:
            session.execute(delete(Trial).where(Trial.run_id == self.run_id, Trial.n >= n))

    def progress(self, phase: str, eta_s: float | None) -> None:
        self._on_progress(phase, eta_s)


# ---- JSON ------------------------------------------------------------------------------------


def trial_json(row: Trial, reveal: bool, full: bool = False) -> dict[str, Any]:
    """A trial as the API shows it; `full` adds the engine's stats, the readings and the log."""
    extra = row.stats or {}
    body: dict[str, Any] = {
        "id": row.id,
        "n": row.n,
        "change": row.change,
        "flags": row.flags if reveal else redact_flags(row.flags),
        "engine_pid": row.engine_pid,
        "started": iso_time(row.started),
        "duration_s": row.duration_s,
        "startup_s": row.startup_s,
        "warmup_s": extra.get("warmup_s"),
        "workload_s": (extra.get("details") or {}).get("workload_s"),
        "prefill_tok_s": row.prefill_tok_s,
        "decode_tok_s": row.decode_tok_s,
        "aggregate_tok_s": row.aggregate_tok_s,
        "agent_tok_s": extra.get("agent_tok_s"),
        "ttft_s": row.ttft_s,
        "hit_rate": row.hit_rate,
        "verdict": row.verdict,
        **text_fields("reason", text_of(extra, "reason")),
        "role": extra.get("role"),
        "failure": extra.get("failure"),
        "error": row.error if reveal else hide_secrets(row.error or "") or None,
        "usable_context": extra.get("usable_context"),
        "context_proof": extra.get("context_proof"),
    }
    if full:
        body["stats"] = extra.get("engine")
        body["details"] = extra.get("details")
        tail = row.log_tail or ""
        body["log_tail"] = tail if reveal else hide_secrets(tail)
    return body


def event_json(row: BenchmarkEvent) -> dict[str, Any]:
    return {
        "id": row.id,
        "time": iso_time(row.time),
        "kind": row.kind,
        **text_fields("message", Text.from_json(row.text) if row.text else row.message),
        "data": row.data,
    }


def redact_result(result: dict[str, Any]) -> dict[str, Any]:
    """A result with the values of secret flags hidden (for viewers without control)."""
    notes = [
        {**note, "value": HIDDEN}
        if note.get("flag") in SECRET_FLAGS and note.get("value")
        else note
        for note in result.get("notes", [])
    ]
    return {**result, "flags": redact_flags(result.get("flags", [])), "notes": notes}


def run_json(
    row: BenchmarkRun,
    trials: list[Trial],
    reveal: bool,
    live: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A run as the API shows it: the contract's fields, plus the plan, options and progress."""
    options = dict(row.options or {})
    result = row.result
    if result is not None and not reveal:
        result = redact_result(result)
    return {
        "id": row.id,
        "model": row.model,
        "mode": row.mode,
        "objective": row.objective,
        "clients": options.get("clients", 0),
        "status": row.status,
        "phase": row.phase,
        "eta_s": row.eta_s if row.status == "running" else None,
        "base_flags": row.base_flags if reveal else redact_flags(row.base_flags),
        **text_fields("base_origin", text_of(options, "base_origin")),
        "pick_up_from": options.get("pick_up_from"),
        "plan": options.get("plan"),
        "options": {k: v for k, v in options.items() if k not in ("plan", "hardware")},
        "hardware": options.get("hardware"),
        "trials": [trial_json(t, reveal) for t in trials],
        "current": (live or {}).get("current"),
        "result": result,
        **text_fields("error", Text.from_json(row.error_text) if row.error_text else row.error),
        "engine_version": row.engine_version,
        "created": iso_time(row.created),
        "updated": iso_time(row.updated),
        "finished": iso_time(row.finished),
    }
