"""/api/profiles: launch profiles (a model and its engine flags, under a name) kept in the store.

Besides create, read, change and delete: duplicate; apply flag changes (Recommended, a point of
the context planner); the profile as a `moelab serve` command line and as a TOML file; import
from TOML; read a pasted command line. Flags are checked by profiles/flags.py and stored in their
canonical form (`--flag value`, each flag once).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.text import Text, error_text
from ..profiles.cmdline import from_command_line, to_command_line
from ..profiles.flags import FlagChange, FlagError, apply_changes, canonical, changes_from_json
from ..profiles.toml_file import ProfileFile, dumps, loads
from . import api_recommend
from .api import access_of, audit, blocking, daemon_of, json_body, path_id
from .errors import BadRequest, Conflict, NotFound
from .flags import redact_flags
from .schema import Profile, Server
from .service import Daemon
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


def save_profile(store: Store, profile_id: int | None, body: dict[str, Any]) -> Profile:
    now = time.time()
    try:
        with store.session() as session:
            row = session.get(Profile, profile_id) if profile_id is not None else None
            if profile_id is not None and row is None:
                raise NotFound(Text("no profile {profile_id}", profile_id=profile_id))
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
    except IntegrityError:
        raise Conflict(
            Text("a profile named {name!r} exists already", name=body.get("name")),
            code="name_taken",
        ) from None


def profile_rows(store: Store) -> list[Profile]:
    with store.session() as session:
        return list(session.scalars(select(Profile).order_by(Profile.name)))


def profile_row(store: Store, profile_id: int) -> Profile:
    with store.session() as session:
        row = session.get(Profile, profile_id)
        if row is None:
            raise NotFound(Text("no profile {profile_id}", profile_id=profile_id))
        return row


def delete_row(store: Store, profile_id: int) -> list[int]:
    """Delete a profile; returns the servers that were started from it (they keep running)."""
    with store.session() as session:
        row = session.get(Profile, profile_id)
        if row is None:
            raise NotFound(Text("no profile {profile_id}", profile_id=profile_id))
        servers = list(session.scalars(select(Server.id).where(Server.profile_id == profile_id)))
        session.delete(row)
        return servers


async def list_profiles(request: Request) -> Response:
    rows = await blocking(profile_rows, daemon_of(request).store)
    reveal = access_of(request).control
    return JSONResponse({"profiles": [profile_json(r, reveal) for r in rows]})


def _truthy(value: Any) -> bool:
    return value is True or value in ("1", "true", "on")


def recommended_flags(
    daemon: Daemon, model: str | None, profile_id: int | None
) -> tuple[list[FlagChange], str]:
    """Recommended for a model (or a profile's model) as changes, and the origin to record."""
    inputs = api_recommend.gather(daemon, model, profile_id)
    rec = api_recommend.recommendation_of(inputs, None)
    origin = f"benchmark run {rec.benchmark_run}" if rec.benchmark_run else "Recommended"
    return rec.changes(), origin


async def create_profile(request: Request) -> Response:
    """Create a profile from `{"name", "model", "flags"?, "notes"?, "origin"?}`; or with
    `"command"` (a pasted `moelab serve` line) instead of flags (and model); or with
    `"recommended": true` for the model's Recommended flags."""
    daemon = daemon_of(request)
    body = await json_body(request)
    paste_notes: list[str] = []
    if "command" in body:
        if "flags" in body:
            raise BadRequest(Text("give flags or a command line, not both"))
        try:
            pasted = from_command_line(str(body.pop("command")))
        except FlagError as err:
            raise BadRequest(error_text(err), code="invalid_flags") from None
        if not body.get("model"):
            if pasted.model is None:
                raise BadRequest(Text("the command line names no --model-path; choose the model"))
            body["model"] = pasted.model
        body["flags"], paste_notes = pasted.flags, pasted.notes
    if _truthy(body.pop("recommended", False)):
        if not isinstance(body.get("model"), str) or not body["model"]:
            raise BadRequest(Text("choose the model to recommend flags for"))
        changes, origin = await blocking(recommended_flags, daemon, body["model"], None)
        body["flags"] = apply_changes(body.get("flags") or [], changes)
        body.setdefault("origin", origin)
    row = await blocking(save_profile, daemon.store, None, body)
    audit(
        request,
        "create profile",
        f"profile {row.id}",
        name=row.name,
        model=row.model,
        flags=redact_flags(row.flags),
    )
    return JSONResponse({**profile_json(row, True), "paste_notes": paste_notes}, status_code=201)


async def get_profile(request: Request) -> Response:
    row = await blocking(profile_row, daemon_of(request).store, path_id(request))
    return JSONResponse(profile_json(row, access_of(request).control))


async def update_profile(request: Request) -> Response:
    body = await json_body(request)
    row = await blocking(save_profile, daemon_of(request).store, path_id(request), body)
    audit(request, "update profile", f"profile {row.id}", changed=sorted(body))
    return JSONResponse(profile_json(row, True))


async def delete_profile(request: Request) -> Response:
    servers = await blocking(delete_row, daemon_of(request).store, path_id(request))
    audit(request, "delete profile", f"profile {path_id(request)}", servers=servers)
    return JSONResponse({"deleted": path_id(request), "servers": servers})


def _copy_name(store: Store, name: str) -> str:
    taken = {p.name for p in profile_rows(store)}
    candidate, n = f"{name} (copy)", 2
    while candidate in taken:
        candidate, n = f"{name} (copy {n})", n + 1
    return candidate


async def duplicate_profile(request: Request) -> Response:
    """A copy of a profile under a new name (`{"name"}`, default "NAME (copy)")."""
    store = daemon_of(request).store
    body = await json_body(request)
    source = await blocking(profile_row, store, path_id(request))
    name = body.get("name") or await blocking(_copy_name, store, source.name)
    fields = {"name": name, "model": source.model, "flags": source.flags, "notes": source.notes,
              "origin": source.origin}  # fmt: skip
    row = await blocking(save_profile, store, None, fields)
    audit(request, "duplicate profile", f"profile {row.id}", source=source.id, name=row.name)
    return JSONResponse(profile_json(row, True), status_code=201)


async def apply_to_profile(request: Request) -> Response:
    """Change some flags of a profile. The body is one of: `{"changes": [{"flag", "value"}]}`
    (a value is text to set, true/false to switch, null to drop: Recommended's flags and a
    planner point's are in this shape); one change `{"flag", "value"}`; `{"recommended": true}`
    for all of Recommended. `"origin"` sets the profile's origin (Recommended sets its own)."""
    daemon = daemon_of(request)
    body = await json_body(request)
    row = await blocking(profile_row, daemon.store, path_id(request))
    origin = body.get("origin") if isinstance(body.get("origin"), str) else None
    try:
        if _truthy(body.get("recommended")):
            changes, advised = await blocking(recommended_flags, daemon, None, row.id)
            origin = origin or advised
        elif "changes" in body:
            changes = changes_from_json(body["changes"])
        elif "flag" in body:
            changes = changes_from_json([{"flag": body["flag"], "value": body.get("value")}])
        else:
            raise BadRequest(
                Text(
                    'give {{"changes": [{{"flag", "value"}}]}}, {{"flag", "value"}} or '
                    '{{"recommended": true}}'
                )
            )
        flags = apply_changes(row.flags, changes)
    except FlagError as err:
        raise BadRequest(error_text(err), code="invalid_flags") from None
    update: dict[str, Any] = {"flags": flags}
    if origin is not None:
        update["origin"] = origin
    row = await blocking(save_profile, daemon.store, row.id, update)
    audit(request, "apply flags to profile", f"profile {row.id}", flags=redact_flags(flags))
    return JSONResponse(profile_json(row, True))


async def profile_command(request: Request) -> Response:
    """The profile as a `moelab serve` command line (one line, and one flag per line)."""
    row = await blocking(profile_row, daemon_of(request).store, path_id(request))
    flags = row.flags if access_of(request).control else redact_flags(row.flags)
    return JSONResponse(
        {
            "command": to_command_line(row.model, flags),
            "command_multiline": to_command_line(row.model, flags, multiline=True),
        }
    )


async def export_toml(request: Request) -> Response:
    """The profile as a TOML file to download."""
    row = await blocking(profile_row, daemon_of(request).store, path_id(request))
    flags = row.flags if access_of(request).control else redact_flags(row.flags)
    text = dumps(ProfileFile(row.name, row.model, flags, row.origin, row.notes))
    filename = re.sub(r"[^A-Za-z0-9._-]+", "-", row.name).strip("-") or f"profile-{row.id}"
    return Response(
        text,
        media_type="application/toml",
        headers={"content-disposition": f'attachment; filename="{filename}.toml"'},
    )


async def import_toml(request: Request) -> Response:
    """Create a profile from a TOML file: the raw file, or `{"toml", "name"?}` (a name given
    here wins over the file's)."""
    content_type = request.headers.get("content-type", "")
    if content_type.startswith(("application/json", "application/x-www-form-urlencoded")):
        body = await json_body(request)
        text, name = body.get("toml"), body.get("name")
    else:
        text, name = (await request.body()).decode("utf-8", "replace"), None
    if not isinstance(text, str) or not text.strip():
        raise BadRequest(Text('send the TOML file as the body, or as {{"toml": "..."}}'))
    try:
        parsed = loads(text)
    except FlagError as err:
        raise BadRequest(error_text(err), code="invalid_profile_file") from None
    fields: dict[str, Any] = {"name": name or parsed.name, "model": parsed.model,
                              "flags": parsed.flags}  # fmt: skip
    if not fields["name"]:
        raise BadRequest(Text('the file has no name; give one (name = "..." or {{"name"}})'))
    if not parsed.model:
        raise BadRequest(Text('the file has no model (model = "/path/to/checkpoint")'))
    fields["origin"] = parsed.origin or "imported"
    if parsed.notes is not None:
        fields["notes"] = parsed.notes
    row = await blocking(save_profile, daemon_of(request).store, None, fields)
    audit(request, "import profile", f"profile {row.id}", name=row.name)
    return JSONResponse(profile_json(row, True), status_code=201)


async def parse_command(request: Request) -> Response:
    """Read a pasted `moelab serve ...` line: `{"command"}` -> `{"model", "flags", "notes"}`."""
    body = await json_body(request)
    command = body.get("command")
    if not isinstance(command, str):
        raise BadRequest(Text('give {{"command": "moelab serve --model-path ... --flag value"}}'))
    try:
        pasted = from_command_line(command)
    except FlagError as err:
        raise BadRequest(error_text(err), code="invalid_flags") from None
    audit(request, "read a command line")
    return JSONResponse({"model": pasted.model, "flags": pasted.flags, "notes": pasted.notes})


def routes() -> list[Route]:
    return [
        Route("/api/profiles", list_profiles),
        Route("/api/profiles", create_profile, methods=["POST"]),
        Route("/api/profiles/{id:int}", get_profile),
        Route("/api/profiles/{id:int}", update_profile, methods=["PUT", "PATCH"]),
        Route("/api/profiles/{id:int}", delete_profile, methods=["DELETE"]),
        Route("/api/profiles/{id:int}/duplicate", duplicate_profile, methods=["POST"]),
        Route("/api/profiles/{id:int}/apply", apply_to_profile, methods=["POST"]),
        Route("/api/profiles/{id:int}/command", profile_command),
        Route("/api/profiles/{id:int}/toml", export_toml),
        Route("/api/profiles/import", import_toml, methods=["POST"]),
        Route("/api/profiles/parse-command", parse_command, methods=["POST"]),
        # Recommended is shown beside a profile; its route is listed with the profiles' routes
        *api_recommend.routes(),
    ]
