"""Profiles: the list (start, duplicate, delete, create, paste a command line, import TOML) and one
profile's page: its flag editor generated from the engine's parser, Recommended beside it with
each flag marked not set / different / same, and the context planner's chart.

The editor checks values as they are typed (htmx fetches the editor part with the draft in the
query, and each flag shows its problem inline) and saves with a PUT of the form to
`/profiles/{id}/flags`, which stores through the same code as `PUT /api/profiles/{id}`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ...daemon.catalog import model_json
from ...daemon.errors import ApiError
from ...daemon.flags import redact_flags
from ...daemon.http import audit, blocking, daemon_of, path_id
from ...daemon.profile_store import profile_json
from ...daemon.recommend import gather, recommendation_json
from ...daemon.service import Daemon
from ...engine.text import Text, text_fields
from ...profiles.cmdline import to_command_line
from ...profiles.flags import catalog, check_value, find_problems, split_flags
from ..i18n import Translator, _
from ..web import ENV, NavEntry, render

if TYPE_CHECKING:
    import plotly.graph_objects as go

GROUPS = {
    "model": _("Model"),
    "memory": _("Memory"),
    "experts": _("Experts"),
    "prefill": _("Prefill"),
    "batching": _("Batching"),
    "server": _("Server"),
}
STATES = {"not set": _("not set"), "different": _("different"), "same": _("same")}
# the origins mgr gives profiles, in words (an origin given through the API is shown as it is)
ORIGINS = (_("by hand"), _("Recommended"), _("imported"))
BENCHMARK_ORIGIN = re.compile(r"benchmark run (\d+)")


def origin_words(origin: str, t: Translator) -> str:
    """A profile's origin in the page's language."""
    match = BENCHMARK_ORIGIN.fullmatch(origin)
    if match:
        return t("benchmark run {n}", n=match.group(1))
    return t(origin) if origin in ORIGINS else origin


ENV.filters["origin"] = origin_words


def servers_of(daemon: Daemon) -> dict[int, list[dict[str, Any]]]:
    """The servers started from each profile, oldest first: id, name and status."""
    out: dict[int, list[dict[str, Any]]] = {}
    for r in reversed(daemon.supervisor.servers()):
        if r.profile_id is not None:
            out.setdefault(r.profile_id, []).append(
                {"id": r.id, "name": r.name, "status": r.status}
            )
    return out


def list_data(daemon: Daemon, reveal: bool) -> dict[str, Any]:
    using = servers_of(daemon)
    profiles = []
    for row in daemon.profiles.list():
        profiles.append({**profile_json(row, reveal), "servers": using.get(row.id, [])})
    return {"profiles": profiles, "models": [model_json(m) for m in daemon.catalog.list()]}


async def profiles_page(request: Request) -> Response:
    data = await blocking(list_data, daemon_of(request), request.state.access.control)
    return render(request, "profiles.html", data, parts=("profile_list",))


# ---- the editor ------------------------------------------------------------------------------


def editor_data(flags: list[str], draft: Mapping[str, str] | None) -> dict[str, Any]:
    """Every engine flag by group with its value (the stored one, or the draft being typed) and
    the problem with it, if any. A draft maps flag names to form values ("" or absent: unset;
    an on/off flag is on when present)."""
    if draft is None:
        settings, _problems = split_flags(flags)
        values: dict[str, str | None] = {s.flag: s.value for s in settings}
        problems: dict[str, Text | str] = {}
    else:
        values, problems = {}, {}
        for flag, info in catalog().items():
            raw = draft.get(flag)
            if info.switch:
                if raw:
                    values[flag] = None
            elif raw is not None and raw.strip():
                values[flag] = raw.strip()
                problem = check_value(flag, values[flag])
                if problem is not None:
                    problems[flag] = problem.message
        for problem in find_problems(draft_flags(values)):
            if problem.kind == "exclusive" and problem.flag is not None:
                for flag in (problem.flag, *catalog()[problem.flag].exclusive_with):
                    problems.setdefault(flag, problem.message)
    groups: dict[str, list[dict[str, Any]]] = {}
    for flag, info in catalog().items():
        groups.setdefault(info.group, []).append(
            {
                "flag": flag,
                "kind": info.kind,
                "help": info.help,
                "choices": list(info.choices) if info.choices else None,
                "default": None if info.default in (None, False) else str(info.default),
                **text_fields("expects", info.expects),
                "tunable": info.tunable,
                "exclusive_with": list(info.exclusive_with),
                "set": flag in values,
                "value": values.get(flag),
                **text_fields("problem", problems.get(flag)),
            }
        )
    return {
        "groups": [
            {"name": name, "label": GROUPS.get(name, name), "flags": items}
            for name, items in groups.items()
        ],
        "problems": len(problems),
        "set_count": len(values),
    }


def draft_flags(values: Mapping[str, str | None]) -> list[str]:
    """Flag values as a flag list, in the parser's order."""
    out: list[str] = []
    for flag in catalog():
        if flag in values:
            value = values[flag]
            out += [flag] if value is None else [flag, value]
    return out


def _draft_of(form: Mapping[str, str]) -> dict[str, str | None]:
    values: dict[str, str | None] = {}
    for flag, info in catalog().items():
        raw = form.get(flag)
        if info.switch and raw:
            values[flag] = None
        elif not info.switch and raw and raw.strip():
            values[flag] = raw.strip()
    return values


# ---- one profile -----------------------------------------------------------------------------


def recommended_data(daemon: Daemon, profile_id: int, reveal: bool) -> dict[str, Any]:
    """Recommended beside this profile and the planner, or why there is none."""
    try:
        inputs = gather(daemon, None, profile_id)
    except ApiError as err:
        return text_fields("error", err.text)
    body = recommendation_json(inputs, None, reveal)
    states = body["profile"]["comparison"]
    body["rows"] = [
        {**advice, "state": row["state"], "state_label": STATES[row["state"]],
         "profile_value": row["profile"]}
        for advice, row in zip(body["flags"], states, strict=True)
    ]  # fmt: skip
    return body


def profile_data(
    daemon: Daemon, profile_id: int, reveal: bool, draft: Mapping[str, str] | None
) -> dict[str, Any]:
    row = daemon.profiles.get_or_404(profile_id)
    flags = row.flags if reveal else redact_flags(row.flags)
    return {
        "profile": profile_json(row, reveal),
        "servers": servers_of(daemon).get(row.id, []),
        "models": [model_json(m) for m in daemon.catalog.list()],
        "command": to_command_line(row.model, flags, multiline=True),
        "editor": editor_data(flags, draft),
        "recommended": recommended_data(daemon, row.id, reveal),
        "saved": False,
        "save_error": None,
        "save_error_text": None,
    }


def planner_chart(data: dict[str, Any], t: Translator) -> dict[str, go.Figure]:
    """Predicted decode tok/s (or hit rate, without any speed) and expert slots per context."""
    planner = (data.get("recommended") or {}).get("planner") or {}
    points = [p for p in planner.get("points") or [] if p["fits"]]
    if not points:
        return {}
    import plotly.graph_objects as go

    from ..charts import layout

    x = [p["context_tokens"] for p in points]
    speed = all(p["decode_tok_s"] is not None for p in points)
    y = [p["decode_tok_s"] if speed else 100 * p["hit_rate"] for p in points]
    current = [p for p in points if p["kv_reserve_tokens"] == planner["current_kv_tokens"]]
    figure = go.Figure()
    figure.add_trace(
        go.Scatter(x=x, y=y, mode="lines+markers",
                   name=t("predicted decode tok/s") if speed else t("predicted hit rate, %"))
    )  # fmt: skip
    figure.add_trace(
        go.Scatter(x=x, y=[p["slots"] for p in points], mode="lines", yaxis="y2",
                   name=t("expert slots"), line={"dash": "dot"})
    )  # fmt: skip
    if current:
        p = current[0]
        figure.add_trace(
            go.Scatter(x=[p["context_tokens"]],
                       y=[p["decode_tok_s"] if speed else 100 * p["hit_rate"]],
                       mode="markers", marker={"size": 14, "symbol": "star"},
                       name=t("this profile"))
        )  # fmt: skip
    figure.update_layout(
        layout(t, title=t("Context against decode speed"), height_px=300),
        xaxis={"title": t("usable context, tokens"), "type": "log"},
        yaxis={"rangemode": "tozero"},
        yaxis2={"overlaying": "y", "side": "right", "rangemode": "tozero", "showgrid": False},
    )
    return {"planner": figure}


async def profile_page(request: Request) -> Response:
    control = request.state.access.control
    query = request.query_params
    draft = query if control and query.get("editor") == "draft" else None
    data = await blocking(profile_data, daemon_of(request), path_id(request), control, draft)
    return render(
        request,
        "profile.html",
        data,
        charts=planner_chart,
        parts=("profile_editor", "recommended"),
    )


async def save_flags(request: Request) -> Response:
    """The editor's save: the form's fields become the profile's name, model, notes and flags;
    problems are shown inline and nothing is stored."""
    daemon = daemon_of(request)
    profile_id = path_id(request)
    form = {k: str(v) for k, v in (await request.form()).items()}
    values = _draft_of(form)
    data = await blocking(profile_data, daemon, profile_id, True, form)
    error: Text | str | None = None
    if not data["editor"]["problems"]:
        body = {"name": form.get("name", ""), "model": form.get("model", ""),
                "notes": form.get("notes", ""), "flags": draft_flags(values)}  # fmt: skip
        try:
            row = await blocking(daemon.profiles.save, profile_id, body)
        except ApiError as err:
            error = err.text
        else:
            audit(request, "update profile", f"profile {row.id}", flags=redact_flags(row.flags))
            data = await blocking(profile_data, daemon, profile_id, True, None)
            data["saved"] = True
    data.update(text_fields("save_error", error))
    response = render(request, "_profile_editor.html", data)
    if data.get("saved"):
        response.headers["HX-Trigger"] = "profile-saved"
    return response


ROUTES = [
    Route("/profiles", profiles_page),
    Route("/profiles/{id:int}", profile_page),
    Route("/profiles/{id:int}/flags", save_flags, methods=["PUT"]),
]
NAV = (NavEntry("/profiles", _("Profiles"), 40),)
