"""The language of a request, the Japanese catalog's completeness, and locale formats."""

from __future__ import annotations

import ast
import string
from pathlib import Path

import pytest
from jinja2 import nodes

from moelab.console.i18n import Translator, catalog, choose_language, parse_accept_language
from moelab.console.web import ENV
from moelab.engine.config.args import describe_flags

ROOT = Path(__file__).resolve().parents[2]
CONSOLE = ROOT / "console"
# the packages whose sentences the console shows, as Text("...") (engine/text.py)
PRODUCERS = ("engine", "profiles", "autotune", "daemon", "console")


def _literals(call: ast.Call) -> list[str]:
    return [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]


def _calls(source: str) -> list[ast.Call]:
    return [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)]


def _is_text(call: ast.Call) -> bool:
    return isinstance(call.func, ast.Name) and call.func.id == "Text"


def _python_messages(source: str) -> list[str]:
    """English literals given to t(...), t.plural(...) and _(...) in the console's code."""
    found = []
    for call in _calls(source):
        func = call.func
        named = isinstance(func, ast.Name) and func.id in ("t", "_")
        plural = isinstance(func, ast.Attribute) and func.attr == "plural"
        if named or plural:
            found += _literals(call)
    return found


def _text_templates(source: str) -> list[str]:
    """The templates of Text("...", ...) in Python code."""
    return [call.args[0].value for call in _calls(source) if _is_text(call) and _literals(call)]


def producer_files() -> list[Path]:
    return [path for package in PRODUCERS for path in sorted((ROOT / package).rglob("*.py"))]


def _template_messages(source: str) -> list[str]:
    """English literals given to t(...) and t.plural(...) in a Jinja template."""
    found = []
    for call in ENV.parse(source).find_all(nodes.Call):
        func = call.node
        named = isinstance(func, nodes.Name) and func.name == "t"
        plural = isinstance(func, nodes.Getattr) and func.attr == "plural"
        if named or plural:
            found += [a.value for a in call.args if isinstance(a, nodes.Const)
                      and isinstance(a.value, str)]  # fmt: skip
    return found


def used_messages() -> dict[str, str]:
    """Every English message the console shows, with where it comes from: the console's t()
    and _() messages, every Text template of the packages that make sentences, and the help of
    every engine flag (the profile editor shows it)."""
    found: dict[str, str] = {}
    for path in CONSOLE.rglob("*.py"):
        for message in _python_messages(path.read_text(encoding="utf-8")):
            found.setdefault(message, path.name)
    for path in CONSOLE.rglob("*.html"):
        for message in _template_messages(path.read_text(encoding="utf-8")):
            found.setdefault(message, path.name)
    for path in producer_files():
        for message in _text_templates(path.read_text(encoding="utf-8")):
            found.setdefault(message, str(path.relative_to(ROOT)))
    for flag in describe_flags():
        found.setdefault(flag["help"], f"engine/config/args.py {flag['flag']}")
    found.pop("", None)
    return found


def test_every_text_template_is_a_literal() -> None:
    """A template built at run time could not be found here, so it would have no Japanese."""
    built = []
    for path in producer_files():
        for call in _calls(path.read_text(encoding="utf-8")):
            first = call.args[0] if call.args else None
            literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
            if _is_text(call) and not literal:
                built.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert not built, f"Text(...) without a literal template: {built}"


def fields(text: str) -> set[tuple[str, str]]:
    """The placeholders of a message with their number formats (a translation keeps both)."""
    return {(name, spec or "") for _, name, spec, _ in string.Formatter().parse(text) if name}


def test_every_message_has_japanese_with_the_same_placeholders() -> None:
    messages = used_messages()
    assert len(messages) > 50, "the message scan found too little; is the pattern broken?"
    sources = set(messages.values())
    assert any(s.startswith("autotune/") for s in sources), "no Text found in autotune/"
    ja = catalog("ja")
    missing = sorted(m for m in messages if m not in ja)
    assert not missing, f"messages without Japanese in console/messages/ja.json: {missing}"
    for english, japanese in ja.items():
        assert fields(english) == fields(japanese), (english, japanese)


def test_catalog_has_no_stale_entries() -> None:
    stale = sorted(set(catalog("ja")) - set(used_messages()))
    assert not stale, f"ja.json entries no page uses any more: {stale}"


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        ("ja,en-US;q=0.8", "ja"),
        ("en-GB,en;q=0.9,ja;q=0.8", "en"),
        ("fr-FR,ja;q=0.5,en;q=0.4", "ja"),
        ("de", None),
        ("ja;q=0, en", "en"),
        ("", None),
        (None, None),
    ],
)
def test_accept_language(header: str | None, expected: str | None) -> None:
    assert parse_accept_language(header) == expected


def test_cookie_wins_over_accept_language() -> None:
    assert choose_language("en", "ja") == "en"
    assert choose_language("ja", "en") == "ja"
    assert choose_language("xx", "ja") == "ja"
    assert choose_language(None, None) == "en"


def test_formats_differ_by_language() -> None:
    en, ja = Translator("en"), Translator("ja")
    assert en.duration(2 * 3600 + 5 * 60 + 7) == "2 h 5 min"
    assert ja.duration(2 * 3600 + 5 * 60 + 7) == "2時間5分"
    assert en.duration(42) == "42 s"
    assert ja.ago(1000.0, now=1042.0) == "42秒前"
    assert en.ago(1000.0, now=1042.0) == "42 s ago"
    assert en.number(1234567.891, 1) == "1,234,567.9"
    assert en.size(3 * 1024**3) == "3.00 GiB"
    assert en.size(24576) == "24.0 KiB"
    assert en.size(5 * 1024**2) == "5.00 MiB"
    assert en.seconds(0.0425) == "42 ms"
    assert en.percent(0.8567) == "85.7%"
    moment = "2024-05-01T03:04:05+00:00"
    assert "2024年" in ja.datetime(moment) and "月" in ja.datetime(moment)
    assert ja.datetime(moment).count("0") < en.datetime(moment).count("0")  # 5月1日, not 05月01日
    assert en.number(None) == "–"


def test_placeholders_are_filled_in_both_languages() -> None:
    one, many = "mgr knows one checkpoint.", "mgr knows {n} checkpoints."
    assert Translator("en").plural(one, many, 1) == one
    assert Translator("en").plural(one, many, 1200) == "mgr knows 1,200 checkpoints."
    assert "1,200" in Translator("ja").plural(one, many, 1200)
    assert Translator("ja")("Servers") != "Servers"
