"""/api/profiles: launch profiles (a model and its engine flags, under a name) kept in the store.

Besides create, read, change and delete: duplicate; apply flag changes (Recommended, a point of
the context planner); the profile as a `moelab serve` command line and as a TOML file; import
from TOML; read a pasted command line. The profiles themselves are kept by profile_store.py.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..engine.text import Text, error_text
from ..profiles.cmdline import from_command_line, to_command_line
from ..profiles.flags import FlagError, apply_changes, changes_from_json
from ..profiles.toml_file import ProfileFile, dumps, loads
from .errors import BadRequest
from .flags import redact_flags
from .http import access_of, audit, blocking, daemon_of, json_body, path_id
from .profile_store import profile_json
from .recommend import recommended_changes


async def list_profiles(request: Request) -> Response:
    rows = await blocking(daemon_of(request).profiles.list)
    reveal = access_of(request).control
    return JSONResponse({"profiles": [profile_json(r, reveal) for r in rows]})


def _truthy(value: Any) -> bool:
    return value is True or value in ("1", "true", "on")


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
        changes, origin = await blocking(recommended_changes, daemon, body["model"], None)
        body["flags"] = apply_changes(body.get("flags") or [], changes)
        body.setdefault("origin", origin)
    row = await blocking(daemon.profiles.save, None, body)
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
    row = await blocking(daemon_of(request).profiles.get_or_404, path_id(request))
    return JSONResponse(profile_json(row, access_of(request).control))


async def update_profile(request: Request) -> Response:
    body = await json_body(request)
    row = await blocking(daemon_of(request).profiles.save, path_id(request), body)
    audit(request, "update profile", f"profile {row.id}", changed=sorted(body))
    return JSONResponse(profile_json(row, True))


async def delete_profile(request: Request) -> Response:
    servers = await blocking(daemon_of(request).profiles.delete, path_id(request))
    audit(request, "delete profile", f"profile {path_id(request)}", servers=servers)
    return JSONResponse({"deleted": path_id(request), "servers": servers})


async def duplicate_profile(request: Request) -> Response:
    """A copy of a profile under a new name (`{"name"}`, default "NAME (copy)")."""
    profiles = daemon_of(request).profiles
    body = await json_body(request)
    source = await blocking(profiles.get_or_404, path_id(request))
    name = body.get("name") or await blocking(profiles.copy_name, source.name)
    fields = {"name": name, "model": source.model, "flags": source.flags, "notes": source.notes,
              "origin": source.origin}  # fmt: skip
    row = await blocking(profiles.save, None, fields)
    audit(request, "duplicate profile", f"profile {row.id}", source=source.id, name=row.name)
    return JSONResponse(profile_json(row, True), status_code=201)


async def apply_to_profile(request: Request) -> Response:
    """Change some flags of a profile. The body is one of: `{"changes": [{"flag", "value"}]}`
    (a value is text to set, true/false to switch, null to drop: Recommended's flags and a
    planner point's are in this shape); one change `{"flag", "value"}`; `{"recommended": true}`
    for all of Recommended. `"origin"` sets the profile's origin (Recommended sets its own)."""
    daemon = daemon_of(request)
    body = await json_body(request)
    row = await blocking(daemon.profiles.get_or_404, path_id(request))
    origin = body.get("origin") if isinstance(body.get("origin"), str) else None
    try:
        if _truthy(body.get("recommended")):
            changes, advised = await blocking(recommended_changes, daemon, None, row.id)
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
    row = await blocking(daemon.profiles.save, row.id, update)
    audit(request, "apply flags to profile", f"profile {row.id}", flags=redact_flags(flags))
    return JSONResponse(profile_json(row, True))


async def profile_command(request: Request) -> Response:
    """The profile as a `moelab serve` command line (one line, and one flag per line)."""
    row = await blocking(daemon_of(request).profiles.get_or_404, path_id(request))
    flags = row.flags if access_of(request).control else redact_flags(row.flags)
    return JSONResponse(
        {
            "command": to_command_line(row.model, flags),
            "command_multiline": to_command_line(row.model, flags, multiline=True),
        }
    )


async def export_toml(request: Request) -> Response:
    """The profile as a TOML file to download."""
    row = await blocking(daemon_of(request).profiles.get_or_404, path_id(request))
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
    row = await blocking(daemon_of(request).profiles.save, None, fields)
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
    ]
