"""Sentences as templates with values: English by default, any language through a catalog,
stored and read back, and marked up for a page."""

from __future__ import annotations

from pathlib import Path

import pytest

from moelab.engine.text import Text, error_text, text_fields, text_of, texts_fields, texts_of

JA = {
    "{head}: slower by {loss:.1%}": "{head}: {loss:.1%} 遅い",
    "{figure} {new:,.1f} against {old:,.1f}": "{figure} {old:,.1f} に対して {new:,.1f}",
    "decode tok/s": "デコード tok/s",
    "tried: {tries}": "試したもの: {tries}",
    "on": "オン",
}


def verdict() -> Text:
    head = Text("{figure} {new:,.1f} against {old:,.1f}", figure=Text("decode tok/s"),
                new=1074.8, old=1100.0)  # fmt: skip
    return Text("{head}: slower by {loss:.1%}", head=head, loss=0.0229)


def test_a_text_reads_as_english_and_in_another_language() -> None:
    assert str(verdict()) == "decode tok/s 1,074.8 against 1,100.0: slower by 2.3%"
    assert verdict().render(lambda t: JA.get(t, t)) == (
        "デコード tok/s 1,100.0 に対して 1,074.8: 2.3% 遅い"
    )
    tries = Text("tried: {tries}", tries=["auto", Text("on")])
    assert str(tries) == "tried: auto; on"
    assert tries.render(lambda t: JA.get(t, t), "；") == "試したもの: auto；オン"
    assert str(Text('give {{"toml": "..."}}')) == 'give {"toml": "..."}'


def test_a_text_survives_storage_and_old_rows_keep_their_english() -> None:
    stored = text_fields("reason", verdict())
    assert stored["reason"] == str(verdict())
    assert text_of(stored, "reason") == verdict()
    # a row written before sentences had a stored form
    assert text_of({"reason": "slower by 2.3%"}, "reason") == "slower by 2.3%"
    both = texts_fields("warnings", [verdict(), "an old line"])
    assert texts_of(both, "warnings") == [verdict(), "an old line"]
    assert texts_of({"warnings": ["an old line"]}, "warnings") == ["an old line"]


def test_data_in_a_text_is_marked_apart_from_its_words() -> None:
    text = Text("unknown model {model!r}; <see> {n} of them", model="/m<1>", n=3)
    html = text.render(words=lambda s: s.replace("<", "&lt;").replace(">", "&gt;"),
                       data=lambda s: f"[{s}]")  # fmt: skip
    assert html == "unknown model ['/m<1>']; &lt;see&gt; 3 of them"


def test_an_error_keeps_its_text() -> None:
    assert error_text(ValueError(verdict())) == verdict()
    assert error_text(ValueError("plain words")) == "plain words"


def test_a_value_that_could_not_be_stored_is_refused_at_once() -> None:
    with pytest.raises(AssertionError):
        Text("reading {path}", path=Path("/models"))
