"""The console's languages: message catalogs (JSON), the language a request gets, and number, size,
duration and time formats for it.

Messages are written in English in the templates and the code (`t("Servers")`, with `{name}`
placeholders filled by keyword). English is the source language, so it needs no catalog;
`messages/ja.json` maps each English message to its Japanese text. A message missing from a
catalog is shown in English (the tests check that none is missing). Sentences the daemon, the
benchmark and the profiles make are `Text`s (engine/text.py), whose templates share the catalog:
`t.text(...)` renders one in the page's language.

The language is, in order: the `lang` cookie (set by the switcher, `/lang/ja`), the best match in
`Accept-Language`, English.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from functools import cache
from pathlib import Path
from typing import Any

from markupsafe import Markup, escape

from ..engine.text import Text, text_of, texts_of

MESSAGES_DIR = Path(__file__).parent / "messages"
LANGUAGES: dict[str, str] = {"en": "English", "ja": "日本語"}
DEFAULT_LANGUAGE = "en"
LANG_COOKIE = "lang"
GIB = 1024**3


@cache
def catalog(lang: str) -> dict[str, str]:
    """The message catalog of a language (empty for English, the source language)."""
    if lang == DEFAULT_LANGUAGE:
        return {}
    return json.loads((MESSAGES_DIR / f"{lang}.json").read_text(encoding="utf-8"))


def parse_accept_language(header: str | None) -> str | None:
    """The best language we have for an `Accept-Language` header, or None."""
    if not header:
        return None
    ranked: list[tuple[float, int, str]] = []
    for position, part in enumerate(header.split(",")):
        tag, _, params = part.strip().partition(";")
        quality = 1.0
        if params.strip().startswith("q="):
            try:
                quality = float(params.strip()[2:])
            except ValueError:
                quality = 0.0
        primary = tag.strip().lower().split("-")[0]
        if primary in LANGUAGES and quality > 0:
            ranked.append((-quality, position, primary))
    return min(ranked)[2] if ranked else None


def choose_language(cookie: str | None, accept_language: str | None) -> str:
    if cookie in LANGUAGES:
        return cookie
    return parse_accept_language(accept_language) or DEFAULT_LANGUAGE


@dataclass(frozen=True, slots=True)
class Units:
    """How one language writes durations and dates."""

    hours: str
    minutes: str
    seconds: str
    ago: str
    date_time: str  # strftime pattern
    time_only: str
    list_separator: str  # between the sentences of a list inside a sentence


UNITS: dict[str, Units] = {
    "en": Units(" h", " min", " s", "{} ago", "%Y-%m-%d %H:%M:%S", "%H:%M:%S", "; "),
    "ja": Units("時間", "分", "秒", "{}前", "%Y年%m月%d日 %H:%M:%S", "%H:%M:%S", "；"),
}


@dataclass(frozen=True, slots=True)
class Translator:
    """Messages and formats of one language; templates get it as `t` (and its methods)."""

    lang: str

    def __call__(self, message: str, **values: Any) -> str:
        text = self._template(message)
        if any(isinstance(v, Markup) for v in values.values()):  # a sentence from t.text
            return Markup(escape(text)).format(**values)
        return text.format(**values) if values else text

    def plain(self, value: Text | Mapping[str, Any] | str | None) -> str:
        """A sentence made by the daemon, the benchmark or the profiles (engine/text.py), or its
        stored form, in this language, as plain text; English kept from before sentences had a
        stored form is shown as it is."""
        if value is None:
            return ""
        if isinstance(value, Mapping):
            value = Text.from_json(value)
        if isinstance(value, Text):
            return value.render(self._template, UNITS[self.lang].list_separator)
        return value

    def text(self, value: Text | Mapping[str, Any] | str | None) -> Markup:
        """`plain` for a page: the values that are data (flags, paths, another program's words)
        marked translate="no", as a browser's translation should leave them."""
        if isinstance(value, Mapping):
            value = Text.from_json(value)
        if not isinstance(value, Text):
            return escape(value or "")
        html = value.render(
            self._template,
            UNITS[self.lang].list_separator,
            words=lambda text: str(escape(text)),
            data=lambda text: f'<span translate="no">{escape(text)}</span>',
        )
        return Markup(html)  # every piece of it was escaped above

    def text_of(self, data: Mapping[str, Any], name: str) -> Markup:
        """The sentence a JSON object carries under `name` (with its stored form beside it)."""
        return self.text(text_of(data, name))

    def texts_of(self, data: Mapping[str, Any], name: str) -> list[Markup]:
        """The sentences a JSON object carries as a list under `name`."""
        return [self.text(value) for value in texts_of(data, name)]

    def _template(self, message: str) -> str:
        return catalog(self.lang).get(message, message)

    def plural(self, one: str, many: str, n: int, **values: Any) -> str:
        """`one` for n == 1 else `many`, each translated and filled with `n` and `values`."""
        return self(one if n == 1 else many, n=self.number(n), **values)

    # ---- numbers ------------------------------------------------------------------------------

    def number(self, value: float | None, digits: int = 0) -> str:
        """A number with grouped thousands; "–" for a missing one."""
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return "–"
        return f"{value:,.{digits}f}"

    def percent(self, share: float | None, digits: int = 1) -> str:
        if share is None:
            return "–"
        return f"{share * 100:.{digits}f}%"

    def size(self, size_bytes: float | None) -> str:
        """Bytes in the binary unit that suits them: GiB, MiB or KiB."""
        if size_bytes is None:
            return "–"
        for unit, scale in (("GiB", GIB), ("MiB", 1024**2)):
            if abs(size_bytes) >= scale:
                return f"{size_bytes / scale:,.2f} {unit}"
        return f"{size_bytes / 1024:,.1f} KiB"

    def rate(self, tok_s: float | None) -> str:
        if tok_s is None:
            return "–"
        return f"{self.number(tok_s, 1 if tok_s < 100 else 0)} tok/s"

    def seconds(self, value_s: float | None) -> str:
        """A short time (TTFT, a step): milliseconds below a second."""
        if value_s is None:
            return "–"
        if value_s < 1:
            return f"{value_s * 1000:,.0f} ms"
        return f"{value_s:,.2f}{UNITS[self.lang].seconds}"

    def setting(self, value: Any) -> str:
        """An engine setting as its stats report it, a fraction or a rate to 3 significant
        digits (a measured 0.43126043242602813 is 0.431)."""
        if isinstance(value, float):
            return self.number(value) if abs(value) >= 100 else f"{value:.3g}"
        return str(value)

    def value(self, kind: str, value: float | str | None) -> str:
        """A number of a given kind (as advice.Number carries them) written for this language."""
        if value is None or isinstance(value, str):
            return "–" if value is None else value
        formats = {
            "percent": self.percent,
            "bytes": self.size,
            "seconds": self.seconds,
            "count": self.number,
            "ratio": lambda v: self.number(v, 2),
            "rate": self.rate,
        }
        return formats[kind](value)

    # ---- durations and times ------------------------------------------------------------------

    def duration(self, value_s: float | None) -> str:
        """An uptime or a wait: "2 h 5 min", "2時間5分"; seconds only under a minute."""
        if value_s is None:
            return "–"
        units = UNITS[self.lang]
        total = int(value_s)
        hours, rest = divmod(total, 3600)
        minutes, secs = divmod(rest, 60)
        sep = " " if self.lang == "en" else ""
        if hours:
            tail = f"{sep}{minutes}{units.minutes}" if minutes else ""
            return f"{hours:,}{units.hours}{tail}"
        if minutes:
            tail = f"{sep}{secs}{units.seconds}" if secs else ""
            return f"{minutes}{units.minutes}{tail}"
        return f"{secs}{units.seconds}"

    def ago(self, when: str | float | None, now: float | None = None) -> str:
        epoch = to_epoch(when)
        if epoch is None:
            return "–"
        elapsed = max(0.0, (time.time() if now is None else now) - epoch)
        return UNITS[self.lang].ago.format(self.duration(elapsed))

    def datetime(self, when: str | float | None) -> str:
        """A moment in this machine's local time, written the language's way."""
        epoch = to_epoch(when)
        if epoch is None:
            return "–"
        moment = datetime.fromtimestamp(epoch)
        text = moment.strftime(UNITS[self.lang].date_time)
        if self.lang == "ja":  # 2024年05月01日 -> 2024年5月1日
            text = text.replace("年0", "年").replace("月0", "月")
        return text

    def clock(self, when: str | float | None) -> str:
        epoch = to_epoch(when)
        if epoch is None:
            return "–"
        return datetime.fromtimestamp(epoch).strftime(UNITS[self.lang].time_only)


def to_epoch(when: str | float | None) -> float | None:
    """Seconds since the epoch from the API's ISO 8601 strings or from a number."""
    if when is None:
        return None
    if isinstance(when, (int, float)):
        return float(when)
    return datetime.fromisoformat(when).timestamp()


def _(message: str) -> str:
    """Marks an English message that is translated later by `t(...)` (nav labels, chart texts),
    so the catalog test finds it."""
    return message
