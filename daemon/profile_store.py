"""Launch profiles (a model and its engine flags, under a name) in the store: read, checked, kept.

Flags are checked by profiles/flags.py and stored in their canonical form (`--flag value`, each
flag once). A profile's name is unique: a second one of the same name is a Conflict.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from ..engine.text import Text, error_text
from ..profiles.flags import FlagError, canonical
from .errors import BadRequest, Conflict
from .flags import redact_flags
from .schema import Profile, Server
from .store import Store, iso_time, row_or_404

FIELDS = ("name", "model", "flags", "notes", "origin")


def profile_json(row: Profile, reveal: bool) -> dict[str, Any]:
    """A profile as the API shows it; secret flag values only to callers with control."""
    return {
        "id": row.id,
        "name": row.name,
        "model": row.model,
        "flags": row.flags if reveal else redact_flags(row.flags),
        "notes": row.notes,
        "origin": row.origin,
        "created": iso_time(row.created),
        "updated": iso_time(row.updated),
    }


def checked_fields(body: dict[str, Any], current: Profile | None) -> dict[str, Any]:
    """The profile fields of a request body, validated; missing ones keep `current`'s values."""
    unknown = set(body) - set(FIELDS)
    if unknown:
        raise BadRequest(
            Text(
                "unknown field(s) {unknown}; a profile has {fields}",
                unknown=str(sorted(unknown)),
                fields=str(list(FIELDS)),
            )
        )
    merged = {f: getattr(current, f) for f in FIELDS} if current else {}
    merged.update(body)
    name, model = merged.get("name"), merged.get("model")
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise BadRequest(Text("name must be a non-empty string of at most 200 characters"))
    if not isinstance(model, str) or not model.strip():
        raise BadRequest(
            Text("model must be the path of a checkpoint folder (see GET /api/models)")
        )
    model_dir = Path(model).expanduser()
    if "model" in body and not (model_dir / "config.json").is_file():
        raise BadRequest(
            Text(
                "no checkpoint at {model} (a folder with config.json); GET /api/models lists them",
                model=model,
            ),
            code="model_not_found",
        )
    try:
        flags = canonical(merged.get("flags", []))
    except FlagError as err:
        raise BadRequest(error_text(err), code="invalid_flags") from None
    for text_field in ("notes", "origin"):
        if text_field in merged and not isinstance(merged[text_field], str):
            raise BadRequest(Text("{field} must be a string", field=text_field))
    out = {
        "name": name.strip(),
        "model": str(model_dir.resolve()) if "model" in body else model,
        "flags": flags,
    }
    for text_field in ("notes", "origin"):
        if text_field in merged:
            out[text_field] = merged[text_field]
    return out


class ProfileStore:
    """The profiles table: list, read, create, change, copy and delete launch profiles."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def list(self) -> list[Profile]:
        """Every profile, by name."""
        with self.store.session() as session:
            return list(session.scalars(select(Profile).order_by(Profile.name)))

    def with_origin(self, origin: str) -> list[Profile]:
        """The profiles of one origin ("benchmark run 7"), oldest first."""
        with self.store.session() as session:
            query = select(Profile).where(Profile.origin == origin).order_by(Profile.id)
            return list(session.scalars(query))

    def get_or_404(self, profile_id: int) -> Profile:
        return self.store.get_or_404(Profile, profile_id)

    def save(self, profile_id: int | None, body: dict[str, Any]) -> Profile:
        """Create a profile (`profile_id` None) or change one from a request body, checked."""
        now = time.time()
        with _unique_name(body.get("name")), self.store.session() as session:
            row = row_or_404(session, Profile, profile_id) if profile_id is not None else None
            fields = checked_fields(body, row)
            if row is None:
                row = Profile(
                    created=now, updated=now, **{"notes": "", "origin": "by hand", **fields}
                )
                session.add(row)
            else:
                for key, value in fields.items():
                    setattr(row, key, value)
                row.updated = now
            session.flush()
            return row

    def add(self, *, name: str, model: str, flags: list[str], notes: str, origin: str) -> Profile:
        """Store a profile made by mgr itself (its fields are known to be right)."""
        now = time.time()
        with _unique_name(name), self.store.session() as session:
            row = Profile(
                name=name,
                model=model,
                flags=flags,
                notes=notes,
                origin=origin,
                created=now,
                updated=now,
            )
            session.add(row)
            session.flush()
            return row

    def delete(self, profile_id: int) -> list[int]:
        """Delete a profile; returns the servers that were started from it (they keep running)."""
        with self.store.session() as session:
            row = row_or_404(session, Profile, profile_id)
            servers = list(
                session.scalars(select(Server.id).where(Server.profile_id == profile_id))
            )
            session.delete(row)
            return servers

    def copy_name(self, name: str) -> str:
        """A name for a copy of the profile `name` that no profile has: "NAME (copy)", ..."""
        taken = {p.name for p in self.list()}
        candidate, n = f"{name} (copy)", 2
        while candidate in taken:
            candidate, n = f"{name} (copy {n})", n + 1
        return candidate


@contextmanager
def _unique_name(name: Any) -> Iterator[None]:
    """Turns the unique index's refusal of a second profile of one name into a Conflict."""
    try:
        yield
    except IntegrityError:
        raise Conflict(
            Text("a profile named {name!r} exists already", name=name), code="name_taken"
        ) from None
