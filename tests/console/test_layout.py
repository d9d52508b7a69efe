"""The console's layout as a person sees it, measured from element boxes in Debian's Chromium.

The console is served from an in-process daemon holding three recorded engines, one of them
reachable from the LAN, so that the dashboard has a legend per engine chart and memory rows for
each; `mgr.lan` resolves to loopback in the browser, to play a LAN viewer (read-only, and in no
secure context: no clipboard API).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from playwright.sync_api import Browser, Page, sync_playwright

from moelab.console.main import build_app
from moelab.daemon.service import Daemon
from tests.daemon.conftest import free_port, http, make_daemon, wait_for

from .conftest import record_engine
from .test_browser import CHROMIUM, FLAGS, Watched, open_page, visit

pytestmark = pytest.mark.browser

PHONE_PX, DESKTOP_PX = 390, 1280
LAN_NAME = "mgr.lan"


@pytest.fixture(scope="module")
def layout_daemon(
    tmp_path_factory: pytest.TempPathFactory, demo_model: Path
) -> Iterator[tuple[Daemon, dict[str, int]]]:
    daemon = make_daemon(
        tmp_path_factory.mktemp("layout-data"),
        demo_model.parent,
        host="0.0.0.0",
        allow_hosts=(LAN_NAME,),
    )
    daemon.start()
    ids = {
        "loopback": record_engine(daemon, demo_model, "engine-one", 8301).running_id,
        "second": record_engine(daemon, demo_model, "engine-two", 8302).running_id,
        "lan": record_engine(daemon, demo_model, "engine-lan", 8303, host="0.0.0.0").running_id,
    }
    yield daemon, ids
    daemon.close()


@pytest.fixture(scope="module")
def console(layout_daemon: tuple[Daemon, dict[str, int]]) -> Iterator[str]:
    """The console's URL, served over real HTTP (the daemon is already started)."""
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(layout_daemon[0]),
            host="127.0.0.1",
            port=port,
            lifespan="off",
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, name="console", daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "the console to listen")
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM),
            args=[*FLAGS, f"--host-resolver-rules=MAP {LAN_NAME} 127.0.0.1"],
        )
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def profile_id(console: str, demo_model: Path) -> int:
    status, body = http(
        "POST",
        console + "/api/profiles",
        {"name": "layout", "model": str(demo_model), "flags": ["--moe-cache-rate", "0.5"]},
    )
    assert status == 201, body
    return body["id"]


def pages(ids: dict[str, int], profile: int) -> list[str]:
    return [
        "/",
        "/servers",
        f"/servers/{ids['loopback']}",
        f"/experts/{ids['loopback']}",
        "/hardware",
        "/profiles",
        f"/profiles/{profile}",
    ]


def box(page: Page, selector: str) -> dict[str, float]:
    found = page.locator(selector).first.bounding_box()
    assert found is not None, f"{selector} is not shown"
    return found


# for each chart with a legend: the legend's box against the chart's, its entries against its
# box (a legend taller than its room is clipped and scrolls), and the x axis' tick labels
LEGENDS_JS = """() => [...document.querySelectorAll('.chart[data-chart]')].flatMap(chart => {
  const legend = chart.querySelector('.legend');
  if (!legend) return [];
  const inside = (a, b) => a.left >= b.left - 1 && a.right <= b.right + 1
    && a.top >= b.top - 1 && a.bottom <= b.bottom + 1;
  const meets = (a, b) => a.left < b.right && b.left < a.right && a.top < b.bottom
    && b.top < a.bottom;
  const area = chart.getBoundingClientRect();
  const own = legend.querySelector('.bg').getBoundingClientRect();
  const problems = [];
  if (!inside(own, area)) problems.push('legend outside its chart');
  for (const entry of legend.querySelectorAll('.traces')) {
    if (!inside(entry.getBoundingClientRect(), own)) problems.push('entry cut off');
  }
  for (const tick of chart.querySelectorAll('.xtick text')) {
    if (meets(tick.getBoundingClientRect(), own)) problems.push('tick label on the legend');
  }
  return problems.map(p => chart.dataset.chart + ': ' + p);
})"""


@pytest.mark.parametrize("width", [PHONE_PX, DESKTOP_PX])
@pytest.mark.parametrize("locale", ["en-US", "ja-JP"])
def test_each_legend_lies_inside_its_chart_clear_of_the_tick_labels(
    console: str,
    browser: Browser,
    layout_daemon: tuple[Daemon, dict[str, int]],
    profile_id: int,
    locale: str,
    width: int,
) -> None:
    ids = layout_daemon[1]
    watched = open_page(browser, locale, width)
    charted = ["/", f"/experts/{ids['loopback']}", "/hardware", f"/profiles/{profile_id}"]
    legends = 0
    for path in charted:
        visit(watched, console + path)
        assert watched.page.evaluate(LEGENDS_JS) == [], path
        legends += watched.page.locator(".chart .legend").count()
    # three engines' charts and the memory charts have legends to measure
    assert legends >= 4
    watched.check()
    watched.page.close()


@pytest.mark.parametrize("width", [PHONE_PX, DESKTOP_PX])
def test_the_token_panel_opens_over_the_page_without_moving_it(
    console: str, browser: Browser, width: int
) -> None:
    watched = open_page(browser, "en-US", width)
    page = watched.page
    visit(watched, console + "/servers")
    nav, heading = box(page, ".nav"), box(page, "main h1")
    page.click(".token summary")
    page.wait_for_selector("#control-token", state="visible")
    assert box(page, ".nav") == nav and box(page, "main h1") == heading
    panel = box(page, "#token-panel")
    assert panel["x"] >= 0 and panel["x"] + panel["width"] <= width
    assert page.is_visible("#token-panel button")
    watched.check()
    page.close()


# words of each visible table header that its lines split (a word is a run of non-spaces; a
# Japanese header without spaces is one word)
BROKEN_WORDS_JS = """() => [...document.querySelectorAll('th')].flatMap(th => {
  const broken = [];
  const walker = document.createTreeWalker(th, NodeFilter.SHOW_TEXT);
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (const match of node.data.matchAll(/\\S+/g)) {
      const range = document.createRange();
      range.setStart(node, match.index);
      range.setEnd(node, match.index + match[0].length);
      const rects = [...range.getClientRects()].filter(r => r.width > 0);
      if (rects.length === 0) continue;
      const tops = rects.map(r => r.top);
      if (Math.max(...tops) - Math.min(...tops) > rects[0].height / 2) broken.push(match[0]);
    }
  }
  return broken;
})"""


@pytest.mark.parametrize("locale", ["en-US", "ja-JP"])
def test_on_a_phone_the_nav_is_one_row_and_no_table_header_breaks_a_word(
    console: str,
    browser: Browser,
    layout_daemon: tuple[Daemon, dict[str, int]],
    profile_id: int,
    locale: str,
) -> None:
    watched = open_page(browser, locale, PHONE_PX)
    page = watched.page
    headers = 0
    for path in pages(layout_daemon[1], profile_id):
        visit(watched, console + path)
        tops = page.eval_on_selector_all(
            ".nav a", "els => els.map(e => Math.round(e.getBoundingClientRect().top))"
        )
        assert len(set(tops)) == 1, (path, tops)
        link = max(page.eval_on_selector_all(".nav a", "els => els.map(e => e.offsetHeight)"))
        nav, current = box(page, ".nav"), box(page, ".nav [aria-current=page]")
        assert nav["height"] < 1.5 * link, path
        # the page itself does not scroll sideways, and the current page's link is in sight
        assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), path
        assert nav["x"] <= current["x"] + 1, (path, nav, current)
        assert current["x"] + current["width"] <= nav["x"] + nav["width"] + 1, (path, current)
        assert page.evaluate(BROKEN_WORDS_JS) == [], path
        headers += page.locator("th").count()
    assert headers > 20
    watched.check()
    page.close()


def shown_flags(page: Page) -> set[str]:
    return set(
        page.eval_on_selector_all(
            "#editor-form .flag", "els => els.filter(e => e.offsetParent).map(e => e.id.slice(3))"
        )
    )


def test_the_profile_editor_shows_the_set_flags_and_finds_the_others(
    console: str, browser: Browser, profile_id: int
) -> None:
    watched = open_page(browser, "en-US", DESKTOP_PX)
    page = watched.page
    visit(watched, f"{console}/profiles/{profile_id}")
    # the profile's own flag, and where the engine is reachable from; a page, not a catalog
    assert shown_flags(page) == {"--moe-cache-rate", "--host"}
    assert box(page, "#profile-editor")["height"] < 1200
    page.fill("#flag-search", "kv-reserve")
    assert shown_flags(page) == {"--moe-cache-rate", "--host", "--kv-reserve-tokens"}
    page.fill("#input--kv-reserve-tokens", "2048")
    page.press("#input--kv-reserve-tokens", "Tab")
    page.wait_for_selector("#row--kv-reserve-tokens.is-set")
    page.select_option("#input--host", "0.0.0.0")
    page.wait_for_selector("#input--host option[value='0.0.0.0'][selected]", state="attached")
    assert page.is_visible("text=set --api-key too")
    page.click("#editor-form button:has-text('Save')")
    page.wait_for_selector("#profile-editor .saved")
    status, profile = http("GET", f"{console}/api/profiles/{profile_id}")
    assert status == 200
    assert profile["flags"] == [
        "--kv-reserve-tokens", "2048", "--moe-cache-rate", "0.5", "--host", "0.0.0.0",
    ]  # fmt: skip
    watched.check()
    page.close()


def copy_button(page: Page, selector: str) -> Any:
    return page.locator(f"button[data-copy='{selector}']")


def test_the_base_url_names_the_host_the_viewer_used_and_copies(
    console: str, browser: Browser, layout_daemon: tuple[Daemon, dict[str, int]]
) -> None:
    ids = layout_daemon[1]
    port = console.rsplit(":", 1)[1]
    # a LAN viewer (no secure context, so no clipboard API): the text is selected to copy
    lan = Watched(browser.new_page(locale="en-US", viewport={"width": PHONE_PX, "height": 900}))
    visit(lan, f"http://{LAN_NAME}:{port}/servers/{ids['lan']}")
    assert lan.page.text_content("#client-base-url") == f"http://{LAN_NAME}:8303/v1"
    assert lan.page.text_content("#client-model") == "demo-tiny"
    copy_button(lan.page, "#client-base-url").click()
    assert lan.page.evaluate("String(window.getSelection())") == f"http://{LAN_NAME}:8303/v1"
    assert copy_button(lan.page, "#client-base-url").text_content() == "Selected: press Ctrl+C"
    # an engine on loopback: said to be reachable only from the PC itself
    visit(lan, f"http://{LAN_NAME}:{port}/servers/{ids['loopback']}")
    assert "reachable only from the PC itself" in lan.page.text_content("#only-this-pc")
    lan.page.close()
    # the browser on the PC itself: the clipboard
    context = browser.new_context(locale="en-US")
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=console)
    local = Watched(context.new_page())
    visit(local, f"{console}/servers/{ids['lan']}")
    assert local.page.text_content("#client-base-url") == "http://127.0.0.1:8303/v1"
    copy_button(local.page, "#client-base-url").click()
    wait_for(
        lambda: copy_button(local.page, "#client-base-url").text_content() == "Copied", 10, "Copied"
    )
    assert local.page.evaluate("navigator.clipboard.readText()") == "http://127.0.0.1:8303/v1"
    context.close()
