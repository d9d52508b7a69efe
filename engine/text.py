"""Sentences for people, in any language: an English template with named values (torch-free).

Code that makes a sentence someone reads (a reason, an event, an error) writes it as
`Text("slower by {share:.1%}", share=0.252)`. `str()` gives the English (logs, the command line,
the JSON API); the console renders the same template from its catalog (console/messages/ja.json,
keyed by the English template) with the same values, so a sentence reads in the viewer's language
wherever it was made and however long ago it was stored.

A value is a number, a string shown as it is (a flag, a path, another program's message), another
Text (a reason inside an event; a Text without values is a translatable word), or a list of those
(joined with "; "). A number takes the format its placeholder gives (`{share:.1%}`,
`{tok_s:,.1f}`), which is the same in every language the console speaks. A template is a format
string even without values: a literal brace is written twice.

JSON that carries a sentence keeps the English in its field and the Text's stored form beside it,
under the field's name plus `_text` (`text_fields`, `text_of`): scripts read the English, and
rows written before a sentence had a stored form keep showing their English.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

LIST_SEPARATOR = "; "


def _as_is(text: str) -> str:
    return text


class Text:
    """A sentence: an English template (also its key in the console's catalogs) and its values."""

    __slots__ = ("template", "values")

    def __init__(self, template: str, /, **values: Any) -> None:
        assert all(_storable(v) for v in values.values()), (template, values)
        self.template = template
        self.values = values

    def render(
        self,
        translate: Callable[[str], str] = _as_is,
        separator: str = LIST_SEPARATOR,
        *,
        words: Callable[[str], str] = _as_is,
        data: Callable[[str], str] = _as_is,
    ) -> str:
        """The sentence with this template, and every Text among its values, through
        `translate` (English by default). For markup, `words` transforms the template's own
        text (escaping) and `data` each string value once formatted (a flag, a path, another
        program's message: text no translation touches)."""
        renderer = _Renderer(translate, separator, words, data)
        return renderer.vformat(translate(self.template), (), self.values)

    def __str__(self) -> str:
        return self.render()

    def __repr__(self) -> str:
        return f"Text({self.template!r}, **{self.values!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Text) and (self.template, self.values) == (
            other.template,
            other.values,
        )

    def __hash__(self) -> int:  # equal Texts read the same (values may be lists)
        return hash((self.template, str(self)))

    def to_json(self) -> dict[str, Any]:
        return {"template": self.template, "values": {k: _json(v) for k, v in self.values.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Text:
        values = data.get("values") or {}
        return cls(str(data["template"]), **{k: _from_json(v) for k, v in values.items()})


class _Renderer(string.Formatter):
    """str.format for a Text's template, with nested Texts, lists and the markup hooks."""

    def __init__(
        self,
        translate: Callable[[str], str],
        separator: str,
        words: Callable[[str], str],
        data: Callable[[str], str],
    ) -> None:
        self.translate, self.separator, self.words, self.data = translate, separator, words, data

    def parse(self, format_string: str) -> Iterator[tuple[str, str | None, str | None, str | None]]:
        for literal, field, spec, conversion in super().parse(format_string):
            yield self.words(literal), field, spec, conversion

    def format_field(self, value: Any, format_spec: str) -> str:
        if isinstance(value, Text):
            return value.render(self.translate, self.separator, words=self.words, data=self.data)
        if isinstance(value, list | tuple):
            parts = [self.format_field(v, "") for v in value]
            return self.words(self.separator).join(parts)
        formatted = format(value, format_spec)
        return self.data(formatted) if isinstance(value, str) else self.words(formatted)


def _storable(value: Any) -> bool:
    """Whether a value survives to_json and from_json as it is."""
    if isinstance(value, list | tuple):
        return all(_storable(v) for v in value)
    return value is None or isinstance(value, str | int | float | Text)


def _json(value: Any) -> Any:
    if isinstance(value, Text):
        return value.to_json()
    if isinstance(value, list | tuple):
        return [_json(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    if isinstance(value, Mapping):
        return Text.from_json(value)
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def text_fields(name: str, value: Text | str | None) -> dict[str, Any]:
    """A sentence as a JSON object carries it: the English under `name` and, for a Text, its
    stored form under `name_text`."""
    if isinstance(value, Text):
        return {name: str(value), f"{name}_text": value.to_json()}
    return {name: value}


def text_columns(name: str, value: Text | str | None) -> dict[str, Any]:
    """A sentence as a table keeps it: the English in column `name`, the stored form (None for
    none or a plain string) in `name_text`."""
    return {
        name: None if value is None else str(value),
        f"{name}_text": value.to_json() if isinstance(value, Text) else None,
    }


def texts_fields(name: str, values: Sequence[Text | str]) -> dict[str, Any]:
    """A list of sentences as a JSON object carries it: the English list under `name`, the
    stored forms (a string for a sentence stored as English only) under `name_text`."""
    return {
        name: [str(v) for v in values],
        f"{name}_text": [v.to_json() if isinstance(v, Text) else v for v in values],
    }


def text_of(data: Mapping[str, Any], name: str, default: str = "") -> Text | str:
    """The sentence a JSON object keeps under `name`: a Text where its stored form is beside it,
    else the English as it was stored."""
    stored = data.get(f"{name}_text")
    if isinstance(stored, Mapping):
        return Text.from_json(stored)
    value = data.get(name)
    return default if value is None else value


def texts_of(data: Mapping[str, Any], name: str) -> list[Text | str]:
    """The sentences a JSON object keeps as a list under `name` (see `text_of`)."""
    stored = data.get(f"{name}_text")
    if isinstance(stored, list):
        return [Text.from_json(v) if isinstance(v, Mapping) else str(v) for v in stored]
    return [str(v) for v in data.get(name) or []]


def error_text(err: BaseException) -> Text | str:
    """The sentence an exception was raised with: its Text, or its English message."""
    first = err.args[0] if len(err.args) == 1 else None
    return first if isinstance(first, Text) else str(err)
