"""The console in Debian's headless Chromium against a real `mgr` and engine on the demo model.

Set MOELAB_SCREENSHOTS=docs/images to refresh the screenshots docs/console.md shows; otherwise
they go to the test's temporary folder.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psutil
import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from moelab.daemon.models import DEMO_NAME
from tests.daemon.conftest import MgrProcess, http, start_mgr, wait_for

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]
# the torch CPU kernel needs no compile step, so the engine is ready in seconds in a fresh HOME;
# half the experts in the cache, so that there are misses to see
ENGINE_FLAGS = "--device cpu --moe-cpu-kernel torch --moe-cache-rate 0.5"
# when refreshing the docs' screenshots, this long under load first, so the charts have a history
SCREENSHOT_LOAD_S = 60.0
READY_S = 240.0

if not CHROMIUM.exists():
    pytest.skip(
        "Debian's chromium is not installed (apt-get install chromium; .ci/run does it)",
        allow_module_level=True,
    )


def lan_address() -> str | None:
    """An IPv4 address of this machine that is not loopback (a LAN viewer's way in)."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if (
                address.family == socket.AF_INET
                and not ipaddress.ip_address(address.address).is_loopback
            ):
                return address.address
    return None


@pytest.fixture(scope="module")
def mgr(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[MgrProcess]:
    process = start_mgr(
        tmp_path_factory.mktemp("browser") / "data",
        "--models-dir",
        str(demo_model.parent),
        host="0.0.0.0",
    )
    yield process
    for server in process.get("/api/servers")["servers"]:
        if server["status"] in ("starting", "running"):
            process.post(f"/api/servers/{server['id']}/stop")
    process.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def shots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = os.environ.get("MOELAB_SCREENSHOTS")
    path = Path(folder) if folder else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass
class Watched:
    """A page and everything that went wrong on it: script errors, console errors, failed loads.

    A request the browser aborts because the test navigated away from its page (a favicon or an
    htmx poll still in flight when `visit` opens the next page) is not a failure; `visits` counts
    the navigations the test started, and each request remembers the count it began under. Nor is
    an aborted htmx poll for a part of a page (`?part=`): the browser drops it when the page
    leaves, and Playwright may report one that began just before a visit once the visit has
    started; such a part failing any other way, or with a status of 400 or more, still counts."""

    page: Page
    problems: list[str] = field(default_factory=list)
    visits: int = 0
    began: dict[Any, int] = field(default_factory=dict)

    def check(self) -> None:
        assert not self.problems, self.problems

    def failed(self, req: Any) -> None:
        left_behind = self.began.get(req, self.visits) < self.visits
        a_poll = "part" in parse_qs(urlsplit(req.url).query)
        if not ((left_behind or a_poll) and req.failure == "net::ERR_ABORTED"):
            self.problems.append(f"failed: {req.url} {req.failure}")


def open_page(browser: Browser, locale: str = "en-US", width: int = 1280) -> Watched:
    page = browser.new_page(locale=locale, viewport={"width": width, "height": 900})
    watched = Watched(page)
    page.on("pageerror", lambda err: watched.problems.append(f"script error: {err}"))
    page.on(
        "console",
        lambda msg: (
            watched.problems.append(f"console: {msg.text}") if msg.type == "error" else None
        ),
    )
    page.on("request", lambda req: watched.began.setdefault(req, watched.visits))
    page.on("requestfailed", watched.failed)
    page.on(
        "response",
        lambda r: watched.problems.append(f"{r.status}: {r.url}") if r.status >= 400 else None,
    )
    return watched


def charts_drawn(page: Page) -> list[str]:
    """Names of the charts Plotly has drawn on the page."""
    return page.eval_on_selector_all(
        ".chart[data-chart]", "els => els.filter(e => e.querySelector('.main-svg'))"
        ".map(e => e.dataset.chart)",
    )  # fmt: skip


def visit(watched: Watched, url: str) -> None:
    watched.visits += 1
    watched.page.goto(url, wait_until="networkidle")
    expected = watched.page.eval_on_selector_all(".chart[data-chart]", "els => els.length")
    wait_for(lambda: len(charts_drawn(watched.page)) == expected, 20, f"charts on {url}")


def assert_fits_a_phone(page: Page) -> None:
    """Nothing spills sideways and each nav label stays on one line."""
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    line_px = page.evaluate("parseFloat(getComputedStyle(document.body).fontSize) * 3")
    heights = page.eval_on_selector_all(".nav a", "els => els.map(e => e.offsetHeight)")
    assert max(heights) < line_px, heights


PAGES = ["/", "/servers", "/hardware", "/experts", "/login"]
BADGES = ("Control (this machine)", "操作可能（このマシン）")


@pytest.mark.parametrize(("locale", "width"), [("en-US", 1280), ("ja-JP", 420)])
def test_each_page_loads_with_no_errors(
    mgr: MgrProcess, browser: Browser, locale: str, width: int
) -> None:
    watched = open_page(browser, locale, width)
    for path in PAGES:
        visit(watched, mgr.url + path)
        lang = watched.page.get_attribute("html", "lang")
        assert lang == locale[:2], (path, lang)
        assert watched.page.text_content(".badge") in BADGES
        if width < 600:
            assert_fits_a_phone(watched.page)
    watched.check()
    watched.page.close()


def engine_traffic(server: dict[str, Any], requests: int = 6, clients: int = 1) -> None:
    """Chat requests to an engine from `clients` concurrent clients."""
    served = http("GET", server["url"] + "/v1/models")[1]["data"][0]["id"]

    def one(i: int) -> None:
        body = {
            "model": served,
            "messages": [{"role": "user", "content": f"Story {i} of the sea"}],
            "max_tokens": 32 + 16 * (i % 4),
        }
        status, reply = http("POST", server["url"] + "/v1/chat/completions", body, timeout=120)
        assert status == 200, reply

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(requests)))


def load_for(server: dict[str, Any], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        engine_traffic(server, requests=8, clients=4)
        time.sleep(2.0)


def test_start_watch_and_stop_the_demo_engine_from_the_servers_page(
    mgr: MgrProcess, browser: Browser, shots: Path
) -> None:
    watched = open_page(browser)
    page = watched.page
    page.on("dialog", lambda dialog: dialog.accept())
    visit(watched, mgr.url + "/servers")
    assert page.is_visible("#server-list >> text=No engine has been started yet")
    page.fill("#start-model input[name=flags]", ENGINE_FLAGS)
    page.check("#start-model input[name=lan]")
    page.click("#start-model button[type=submit]")
    page.wait_for_url("**/servers/*")
    server_id = int(page.url.rsplit("/", 1)[1])
    page.wait_for_selector("#server-head .status-running", timeout=READY_S * 1000)
    server = mgr.get(f"/api/servers/{server_id}")
    assert server["status"] == "running" and "--moe-cpu-kernel" in server["flags"]
    assert server["host"] == "0.0.0.0"  # "reachable from the LAN"
    page.wait_for_selector("#log >> text=engine ready")
    # what the page gives an OpenAI client works: base_url and model name
    base_url = page.text_content("#client-base-url")
    assert base_url == f"http://127.0.0.1:{server['port']}/v1"
    models = http("GET", base_url + "/models")[1]["data"]
    assert [m["id"] for m in models] == [page.text_content("#client-model")]

    engine_traffic(server)
    if os.environ.get("MOELAB_SCREENSHOTS"):
        load_for(server, SCREENSHOT_LOAD_S)
    # the sampler stores a row with the layers' increases within a couple of seconds
    wait_for(
        lambda: any("d" in s for s in mgr.get(f"/api/servers/{server_id}/samples")["samples"]),
        30, "a stored sample with expert reads",
    )  # fmt: skip
    experts = mgr.get(f"/api/servers/{server_id}/stats")["stats"]["experts"]
    visit(watched, f"{mgr.url}/experts/{server_id}")
    for name in ("miss_heatmap", "pick_heatmap", "whatif"):
        assert name in charts_drawn(page), charts_drawn(page)
    rows = page.evaluate(
        "name => document.getElementById('chart-' + name).data[0].z.map(r => r.length)",
        "pick_heatmap",
    )
    assert len(rows) == experts["num_layers"] == len(experts["layer_ids"])
    assert rows == [experts["num_experts"]] * experts["num_layers"]
    picked = page.evaluate("document.getElementById('chart-pick_heatmap').data[0].customdata")
    assert sum(map(sum, picked)) > 0
    misses = page.evaluate("document.getElementById('chart-miss_heatmap').data[0].z")
    assert len(misses) == experts["num_layers"] and all(len(r) >= 1 for r in misses)
    page.screenshot(path=str(shots / "experts.png"), full_page=True)

    visit(watched, mgr.url + "/")
    assert f"throughput-{server_id}" in charts_drawn(page)
    page.screenshot(path=str(shots / "dashboard.png"), full_page=True)
    japanese = open_page(browser, "ja-JP")
    visit(japanese, f"{mgr.url}/experts/{server_id}")
    assert "エキスパート" in japanese.page.text_content("h1")
    japanese.page.screenshot(path=str(shots / "experts-ja.png"), full_page=True)
    japanese.check()
    japanese.page.close()
    visit(watched, f"{mgr.url}/servers/{server_id}")
    page.screenshot(path=str(shots / "server.png"), full_page=True)

    visit(watched, mgr.url + "/servers")
    page.screenshot(path=str(shots / "servers.png"), full_page=True)
    page.click(f"#server-{server_id} button.danger")
    page.wait_for_selector(f"#server-{server_id}[data-status=stopped]", timeout=60_000)
    assert mgr.get(f"/api/servers/{server_id}")["status"] == "stopped"
    watched.check()
    page.close()


@pytest.fixture(scope="module")
def demo_mgr(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[MgrProcess]:
    """A `mgr` whose one checkpoint is the demo model it writes on a first start."""
    data_dir = tmp_path_factory.mktemp("first-start") / "data"
    shutil.copytree(demo_model, data_dir / "models" / DEMO_NAME)
    process = start_mgr(data_dir)
    yield process
    for server in process.get("/api/servers")["servers"]:
        if server["status"] in ("starting", "running"):
            process.post(f"/api/servers/{server['id']}/stop")
    process.stop()


def test_the_demo_engine_misses_in_its_expert_cache_on_first_look(
    demo_mgr: MgrProcess, browser: Browser
) -> None:
    watched = open_page(browser)
    page = watched.page
    visit(watched, demo_mgr.url + "/")
    page.click("#nothing-running button[type=submit]")  # "Start the demo model"
    page.wait_for_url("**/servers/*")
    server_id = int(page.url.rsplit("/", 1)[1])
    page.wait_for_selector("#server-head .status-running", timeout=READY_S * 1000)
    server = demo_mgr.get(f"/api/servers/{server_id}")
    engine_traffic(server)

    def layers_with_misses() -> list[dict[str, Any]]:
        stats = demo_mgr.get(f"/api/servers/{server_id}/stats")["stats"] or {}
        layers = (stats.get("experts") or {}).get("layers") or []
        return [layer for layer in layers if layer["reads"] > layer["hits"]]

    assert wait_for(layers_with_misses, 90, "the demo engine's cache misses in its stats")
    experts = demo_mgr.get(f"/api/servers/{server_id}/stats")["stats"]["experts"]
    assert experts["slots"] < experts["num_layers"] * experts["num_experts"]
    # the Experts page has a larger cache to offer, not "a larger cache cannot help"
    wait_for(
        lambda: any("d" in s for s in demo_mgr.get(f"/api/servers/{server_id}/samples")["samples"]),
        30, "a stored sample with expert reads",
    )  # fmt: skip
    visit(watched, f"{demo_mgr.url}/experts/{server_id}")
    assert "cannot help" not in page.text_content("main")
    curve = page.evaluate("document.getElementById('chart-whatif').data[0].y")
    assert max(curve) > min(curve)
    demo_mgr.post(f"/api/servers/{server_id}/stop")
    watched.check()
    page.close()


def test_measure_again_shows_its_progress(mgr: MgrProcess, browser: Browser, shots: Path) -> None:
    watched = open_page(browser)
    page = watched.page
    visit(watched, mgr.url + "/hardware")
    page.fill("#measure input[name=threads]", "1")
    page.click("#measure button[type=submit]")
    page.wait_for_selector("#measure-job .status-running")
    page.wait_for_selector("#measure-job >> text=Show the new readings", timeout=180_000)
    assert page.text_content("#measure-job .status") in ("done", "failed")
    job = mgr.get("/api/hardware")["job"]
    assert job["status"] == "done", job
    visit(watched, mgr.url + "/hardware")
    assert "unit-GB_per_s" in charts_drawn(page)
    page.screenshot(path=str(shots / "hardware.png"), full_page=True)
    watched.check()
    page.close()


def test_a_lan_browser_is_read_only_until_it_logs_in(
    mgr: MgrProcess, browser: Browser, shots: Path
) -> None:
    address = lan_address()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to play the LAN viewer")
    base = f"http://{address}:{mgr.port}"
    watched = open_page(browser, "ja-JP", width=420)
    page = watched.page
    visit(watched, base + "/servers")
    assert page.text_content(".badge") == "閲覧のみ"
    assert page.locator("[data-api-post], form[data-api='/api/servers']").count() == 0
    assert mgr.token not in page.content()
    assert_fits_a_phone(page)
    page.screenshot(path=str(shots / "servers-read-only-ja-phone.png"), full_page=True)
    page.click("#mode a")
    page.fill("input[name=token]", "not the token")
    page.click("form[data-api='/api/auth/login'] button")
    page.wait_for_selector(".form-error:not([hidden])")
    assert page.text_content(".form-error") == "制御トークンが違います"
    # the wrong token's 401 is the one failed request this test causes on purpose
    assert [p for p in watched.problems if "401" not in p] == []
    watched.problems.clear()
    page.fill("input[name=token]", mgr.token)
    page.click("form[data-api='/api/auth/login'] button")
    page.wait_for_url(base + "/servers")
    assert page.text_content(".badge") == "操作可能"
    assert page.locator("form[data-api='/api/servers']").count() == 2
    watched.check()
    page.close()


def test_start_from_a_profile_and_stop_from_the_server_page(
    mgr: MgrProcess, browser: Browser, demo_model: Path
) -> None:
    profile = mgr.post(
        "/api/profiles",
        {"name": "browser-demo", "model": str(demo_model), "flags": ENGINE_FLAGS.split()},
    )
    watched = open_page(browser)
    page = watched.page
    page.on("dialog", lambda dialog: dialog.accept())
    visit(watched, mgr.url + "/servers")
    page.select_option("#start-profile select[name=profile_id]", str(profile["id"]))
    page.click("#start-profile button[type=submit]")
    page.wait_for_url("**/servers/*")
    server_id = int(page.url.rsplit("/", 1)[1])
    assert mgr.get(f"/api/servers/{server_id}")["profile_id"] == profile["id"]
    page.wait_for_selector("#server-head .status-running", timeout=READY_S * 1000)
    page.click("#server-head button.danger")
    page.wait_for_selector("#server-head .status-stopped", timeout=60_000)
    assert mgr.get(f"/api/servers/{server_id}")["status"] == "stopped"
    watched.check()
    page.close()
