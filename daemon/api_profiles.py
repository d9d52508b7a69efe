"""/api/profiles: launch profiles (a model and its engine flags, under a name) kept in the store."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .api import access_of, audit, blocking, daemon_of, json_body, path_id
from .errors import BadRequest, Conflict, NotFound
from .flags import FlagError, redact_flags, validate_flags
from .schema import Profile, Server
from .store import Store, iso_time

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
        raise BadRequest(f"unknown field(s) {sorted(unknown)}; a profile has {list(FIELDS)}")
    merged = {f: getattr(current, f) for f in FIELDS} if current else {}
    merged.update(body)
    name, model = merged.get("name"), merged.get("model")
    if not isinstance(name, str) or not name.strip() or len(name) > 200:
        raise BadRequest("name must be a non-empty string of at most 200 characters")
    if not isinstance(model, str) or not model.strip():
        raise BadRequest("model must be the path of a checkpoint folder (see GET /api/models)")
    model_dir = Path(model).expanduser()
    if "model" in body and not (model_dir / "config.json").is_file():
        raise BadRequest(
            f"no checkpoint at {model} (a folder with config.json); GET /api/models lists them",
            code="model_not_found",
        )
    flags = merged.get("flags", [])
    try:
        validate_flags(str(model_dir), flags)
    except FlagError as err:
        raise BadRequest(str(err), code="invalid_flags") from None
    for text_field in ("notes", "origin"):
        if text_field in merged and not isinstance(merged[text_field], str):
            raise BadRequest(f"{text_field} must be a string")
    out = {
        "name": name.strip(),
        "model": str(model_dir.resolve()) if "model" in body else model,
        "flags": list(flags),
    }
    for text_field in ("notes", "origin"):
        if text_field in merged:
            out[text_field] = merged[text_field]
    return out


def _save(store: Store, profile_id: int | None, body: dict[str, Any]) -> Profile:
    now = time.time()
    try:
        with store.session() as session:
            row = session.get(Profile, profile_id) if profile_id is not None else None
            if profile_id is not None and row is None:
                raise NotFound(f"no profile {profile_id}")
            fields = checked_fields(body, row)
            if row is None:
                row = Profile(created=now, updated=now, notes="", origin="by hand", **fields)
                session.add(row)
            else:
                for key, value in fields.items():
                    setattr(row, key, value)
                row.updated = now
            session.flush()
            return row
    except IntegrityError:
        raise Conflict(
            f"a profile named {body.get('name')!r} exists already", code="name_taken"
        ) from None


def _list(store: Store) -> list[Profile]:
    with store.session() as session:
        return list(session.scalars(select(Profile).order_by(Profile.name)))


def _get(store: Store, profile_id: int) -> Profile:
    with store.session() as session:
        row = session.get(Profile, profile_id)
        if row is None:
            raise NotFound(f"no profile {profile_id}")
        return row


def _delete(store: Store, profile_id: int) -> list[int]:
    """Delete a profile; returns the servers that were started from it (they keep running)."""
    with store.session() as session:
        row = session.get(Profile, profile_id)
        if row is None:
            raise NotFound(f"no profile {profile_id}")
        servers = list(session.scalars(select(Server.id).where(Server.profile_id == profile_id)))
        session.delete(row)
        return servers


async def list_profiles(request: Request) -> Response:
    rows = await blocking(_list, daemon_of(request).store)
    reveal = access_of(request).control
    return JSONResponse({"profiles": [profile_json(r, reveal) for r in rows]})


async def create_profile(request: Request) -> Response:
    body = await json_body(request)
    row = await blocking(_save, daemon_of(request).store, None, body)
    audit(
        request,
        "create profile",
        f"profile {row.id}",
        name=row.name,
        model=row.model,
        flags=redact_flags(row.flags),
    )
    return JSONResponse(profile_json(row, True), status_code=201)


async def get_profile(request: Request) -> Response:
    row = await blocking(_get, daemon_of(request).store, path_id(request))
    return JSONResponse(profile_json(row, access_of(request).control))


async def update_profile(request: Request) -> Response:
    body = await json_body(request)
    row = await blocking(_save, daemon_of(request).store, path_id(request), body)
    audit(request, "update profile", f"profile {row.id}", changed=sorted(body))
    return JSONResponse(profile_json(row, True))


async def delete_profile(request: Request) -> Response:
    servers = await blocking(_delete, daemon_of(request).store, path_id(request))
    audit(request, "delete profile", f"profile {path_id(request)}", servers=servers)
    return JSONResponse({"deleted": path_id(request), "servers": servers})


def routes() -> list[Route]:
    return [
        Route("/api/profiles", list_profiles),
        Route("/api/profiles", create_profile, methods=["POST"]),
        Route("/api/profiles/{id:int}", get_profile),
        Route("/api/profiles/{id:int}", update_profile, methods=["PUT", "PATCH"]),
        Route("/api/profiles/{id:int}", delete_profile, methods=["DELETE"]),
    ]
