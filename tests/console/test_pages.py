"""Every page through the ASGI app: both languages, each access mode, the JSON alternate, partials,
controls only with control (and refused by the API without it), errors as pages."""

from __future__ import annotations

import copy
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from moelab.console.pages.dashboard import prefix_cached_share
from moelab.daemon.schema import Server
from moelab.daemon.service import Daemon
from tests.daemon.conftest import make_daemon

from .conftest import (
    LAN_HOST,
    MODES,
    Recorded,
    client_for,
    lan_client,
    local_client,
    record_engine,
)

# every page; {running} and {crashed} are the recorded servers' ids (other issues add their pages)
PAGES = [
    "/",
    "/servers",
    "/servers/{running}",
    "/servers/{crashed}",
    "/hardware",
    "/experts",
    "/experts/{running}",
    "/experts/{crashed}",
    "/login",
]
NAV_LABELS = {"en": ("Dashboard", "Servers", "Hardware"), "ja": ("ダッシュボード", "サーバー")}
MODE_BADGE = {
    ("en", "control"): "Control",
    ("en", "read-only"): "Read-only",
    ("ja", "control"): "操作可能",
    ("ja", "read-only"): "閲覧のみ",
}
# attributes that make an element change something through the API (console.js acts on them)
CONTROL_ATTRS = ("data-api", "data-api-post")


def fill(path: str, recorded: Recorded) -> str:
    return path.format(running=recorded.running_id, crashed=recorded.crashed_id)


class Controls(HTMLParser):
    """Collects the API calls an HTML page offers (forms and buttons console.js sends)."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if name in CONTROL_ATTRS:
                self.targets.append(value or "")
            if tag == "form" and name == "method" and (value or "").lower() == "post":
                self.targets.append(dict(attrs).get("action") or "")


def controls(html: str) -> list[str]:
    parser = Controls()
    parser.feed(html)
    return parser.targets


def get_page(client: TestClient, path: str, lang: str) -> str:
    reply = client.get(path, headers={"Accept-Language": lang})
    assert reply.status_code == 200, (path, reply.status_code, reply.text[:2000])
    assert reply.headers["content-type"].startswith("text/html")
    return reply.text


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("lang", ["en", "ja"])
@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_in_each_language_and_mode(
    daemon: Daemon, recorded: Recorded, page: str, lang: str, mode: str
) -> None:
    client = client_for(daemon, mode)
    html = get_page(client, fill(page, recorded), lang)
    assert f'<html lang="{lang}">' in html
    for label in NAV_LABELS[lang]:
        assert label in html
    control = mode != "lan-read-only"
    assert MODE_BADGE[(lang, "control" if control else "read-only")] in html
    # the token is shown to a browser on this machine only
    assert (daemon.token in html) == (mode == "this-machine")
    assert "/static/htmx.min.js" in html and "/static/plotly.min.js" in html
    assert "https://" not in html and "http://cdn" not in html


@pytest.mark.parametrize("page", PAGES)
def test_read_only_pages_offer_no_controls(daemon: Daemon, recorded: Recorded, page: str) -> None:
    for lang in ("en", "ja"):
        html = get_page(lan_client(daemon), fill(page, recorded), lang)
        assert set(controls(html)) <= {"/api/auth/login"}, controls(html)


def test_controls_appear_with_control(daemon: Daemon, recorded: Recorded) -> None:
    for mode in ("this-machine", "lan-logged-in"):
        client = client_for(daemon, mode)
        servers = controls(get_page(client, "/servers", "en"))
        assert "/api/servers" in servers  # the start forms
        assert f"/api/servers/{recorded.running_id}/stop" in servers
        assert f"/api/servers/{recorded.crashed_id}/restart" in servers
        assert "/api/hardware/measure" in controls(get_page(client, "/hardware", "en"))
        head = controls(get_page(client, f"/servers/{recorded.crashed_id}", "en"))
        assert f"/api/servers/{recorded.crashed_id}" in head  # forget
    logged_in = get_page(client_for(daemon, "lan-logged-in"), "/", "en")
    assert "/api/auth/logout" in controls(logged_in)


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/api/servers", {"model": "/nowhere", "flags": []}),
        ("POST", "/api/servers/{running}/stop", None),
        ("POST", "/api/servers/{crashed}/restart", None),
        ("DELETE", "/api/servers/{crashed}", None),
        ("POST", "/api/hardware/measure", {}),
        ("POST", "/api/models/rescan", None),
    ],
)
def test_the_api_refuses_every_control_of_the_pages_without_the_token(
    daemon: Daemon, recorded: Recorded, method: str, path: str, body: dict | None
) -> None:
    reply = lan_client(daemon).request(
        method, fill(path, recorded), json=body, headers={"Origin": f"http://{LAN_HOST}"}
    )
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "token_required"


@pytest.mark.parametrize("page", PAGES)
def test_every_page_has_a_json_alternate(daemon: Daemon, recorded: Recorded, page: str) -> None:
    path = fill(page, recorded)
    for client, mode in ((lan_client(daemon), "read-only"), (local_client(daemon), "control")):
        by_query = client.get(path + ("&" if "?" in path else "?") + "format=json")
        by_accept = client.get(path, headers={"Accept": "application/json"})
        for reply in (by_query, by_accept):
            assert reply.status_code == 200
            assert reply.headers["content-type"] == "application/json"
            assert reply.json()["access"]["mode"] == mode
        assert set(by_query.json()) == set(by_accept.json())


def test_json_alternates_carry_what_the_pages_show(daemon: Daemon, recorded: Recorded) -> None:
    client = local_client(daemon)
    dashboard = client.get("/?format=json").json()
    card = next(c for c in dashboard["engines"] if c["server"]["id"] == recorded.running_id)
    assert card["now"]["completed"] == 75  # the second recorded body
    assert len(card["series"]["t"]) == 2 and card["series"]["hit_rate_60s"][-1] > 0.5
    assert card["devices"][0]["parts"]["weights"] > 0
    experts = client.get(f"/experts/{recorded.running_id}?format=json").json()
    layers = experts["experts"]["num_layers"]
    assert layers == 3 and len(experts["miss_rates"]["z"]) == layers
    assert len(experts["picks"]["matrix"]) == layers and experts["picks"]["source"] == "samples"
    assert [p["name"] for p in experts["cache_points"]] == ["now", "1.5x", "2x"]
    assert experts["advice"], "the recorded engine gives the advice rules something to say"
    assert experts["experts"]["miss_cost"]["us_per_miss"] == 35.4
    servers = client.get("/servers?format=json").json()
    crashed = next(s for s in servers["servers"] if s["id"] == recorded.crashed_id)
    assert crashed["exit_code"] == 3 and "out of memory" in crashed["log_tail"]


def test_the_prefix_caches_share_of_the_prompt_tokens_is_shown_where_known(
    daemon: Daemon, recorded: Recorded
) -> None:
    on = {"enabled": True, "prompt_tokens": 400, "cached_tokens": 300, "tokens_held": 512}
    assert prefix_cached_share(on) == 0.75
    # before any prompt, with the cache off, from an engine that does not report it: unknown
    assert prefix_cached_share({**on, "prompt_tokens": 0}) is None
    assert prefix_cached_share({**on, "enabled": False}) is None
    assert prefix_cached_share(None) is None
    # the recorded engine predates the figure: its card says so with a dash
    html = get_page(local_client(daemon), "/", "en")
    card = html[html.index("prompt tokens from the prefix cache") - 200 :]
    assert '<span class="value">–</span><span class="label">prompt tokens from the prefix' in card


def test_a_crashed_engine_shows_its_exit_code_and_last_lines(
    daemon: Daemon, recorded: Recorded
) -> None:
    html = get_page(lan_client(daemon), f"/servers/{recorded.crashed_id}", "en")
    assert "Exit code 3." in html and "RuntimeError: out of memory" in html
    html_ja = get_page(lan_client(daemon), f"/servers/{recorded.crashed_id}", "ja")
    assert "終了コード 3。" in html_ja and "異常終了" in html_ja


def test_settings_in_force_are_rounded(daemon: Daemon, recorded: Recorded) -> None:
    html = get_page(local_client(daemon), f"/servers/{recorded.running_id}", "en")
    settings = html[html.index("Settings in force") :].split("</code>")[0]
    # the recorded engine measured fetch_fraction 0.429792621857573 and Bp 2.317179019726841
    assert "fetch_fraction=0.43," in settings and "bp_gbps=2.32," in settings
    assert "slots=24," in settings and "kv_reserve_tokens=8192," in settings
    assert "0.4297" not in settings and "2.3171" not in settings


def test_an_engine_s_expert_dense_and_kv_formats_are_shown_in_both_languages(
    tmp_path: Path, demo_model: Path
) -> None:
    """/v1/stats says FP8 (or MXFP4) experts, FP8 projections and FP8 KV pages: the server's page
    names each; an engine that holds them in its compute dtype shows that dtype."""
    daemon = make_daemon(tmp_path / "data", None)
    daemon.start()
    try:
        ids = record_engine(daemon, demo_model)

        def say(experts: str, kv: str, dense: str = "float32") -> None:
            with daemon.store.session() as session:
                row = session.get(Server, ids.running_id)
                stats = copy.deepcopy(row.last_stats)
                stats["experts"]["dtype"], stats["kv"]["dtype"] = experts, kv
                stats["config"]["dense_dtype"] = dense
                row.last_stats = stats

        say("bf16", "float32")  # on a CPU device: the compute dtype, float32
        plain = get_page(local_client(daemon), f"/servers/{ids.running_id}", "en")
        say("fp8", "fp8", "fp8")
        en = get_page(local_client(daemon), f"/servers/{ids.running_id}", "en")
        ja = get_page(local_client(daemon), f"/servers/{ids.running_id}", "ja")
        say("mxfp4", "fp8")
        fp4_en = get_page(local_client(daemon), f"/servers/{ids.running_id}", "en")
        fp4_ja = get_page(local_client(daemon), f"/servers/{ids.running_id}", "ja")
        say("nvfp4", "bf16")
        nv_en = get_page(local_client(daemon), f"/servers/{ids.running_id}", "en")
        nv_ja = get_page(local_client(daemon), f"/servers/{ids.running_id}", "ja")
    finally:
        daemon.close()
    assert re.search(r'id="expert-format"><code>float32</code>', plain)
    assert re.search(r'id="kv-format"><code>float32</code>', plain)
    assert re.search(r'id="dense-format"><code>float32</code>', plain)
    assert 'id="dense-format">FP8 (e4m3, one fp32 factor per 128×128 block)<' in en
    assert 'id="dense-format">FP8（e4m3、128×128 ブロックごとに fp32 の係数 1 つ）<' in ja
    assert "密な射影の保持形式" in ja
    assert "Routed experts held as" in en and "KV cache held as" in en
    assert 'id="expert-format">FP8 (e4m3, one fp32 factor per 128×128 block)<' in en
    assert 'id="kv-format">FP8 (e4m3, one fp32 factor per token and KV head)<' in en
    assert "KV キャッシュの保持形式" in ja
    assert 'id="expert-format">FP8（e4m3、128×128 ブロックごとに fp32 の係数 1 つ）<' in ja
    assert 'id="kv-format">FP8（e4m3、トークンと KV ヘッドごとに fp32 の係数 1 つ）<' in ja
    assert 'id="expert-format">MXFP4 (e2m1, one power-of-two scale per 32 values)<' in fp4_en
    assert 'id="expert-format">MXFP4（e2m1、32 値ごとに 2 のべき乗のスケール 1 つ）<' in fp4_ja
    nvfp4 = "NVFP4 (e2m1, one e4m3 scale per 16 values and an fp32 scale per tensor)"
    assert f'id="expert-format">{nvfp4}<' in nv_en
    nvfp4_ja = (
        "NVFP4（e2m1、16 値ごとに e4m3 のスケール 1 つとテンソルごとに fp32 のスケール 1 つ）"
    )
    assert f'id="expert-format">{nvfp4_ja}<' in nv_ja


def test_a_read_only_viewer_sees_no_measure_again_heading(daemon: Daemon) -> None:
    for lang, heading in (("en", "Measure again"), ("ja", "再測定")):
        html = get_page(lan_client(daemon), "/hardware", lang)
        assert f"<h2>{heading}</h2>" not in html
        assert f"<h2>{heading}</h2>" in get_page(local_client(daemon), "/hardware", lang)


def test_pages_draw_their_charts(daemon: Daemon, recorded: Recorded) -> None:
    client = local_client(daemon)
    dashboard = get_page(client, "/", "en")
    for name in (f"throughput-{recorded.running_id}", "vram", "host_ram"):
        assert f'data-chart="{name}"' in dashboard
    experts = get_page(client, f"/experts/{recorded.running_id}", "en")
    for name in ("miss_heatmap", "pick_heatmap", "breakdown", "whatif"):
        assert f'data-chart="{name}"' in experts
    assert "35 ± 10 µs" in experts and "fitted from 2,827 steps" in experts


@pytest.mark.parametrize(
    ("page", "part"),
    [
        ("/", "engines"),
        ("/servers", "server_list"),
        ("/servers/{running}", "log"),
        ("/servers/{running}", "server_head"),
        ("/hardware", "measure_job"),
        ("/experts", "experts_index"),
        ("/experts/{running}", "expert_body"),
    ],
)
def test_live_parts_render_alone_and_poll_themselves(
    daemon: Daemon, recorded: Recorded, page: str, part: str
) -> None:
    path = fill(page, recorded)
    reply = local_client(daemon).get(f"{path}?part={part}")
    assert reply.status_code == 200
    assert "<html" not in reply.text
    # the part's outer element asks for the same part again, so polling continues after a swap
    assert re.search(rf'hx-get="{re.escape(path)}\?part={part}', reply.text), reply.text[:300]


def test_an_unknown_part_or_page_is_an_error_page(daemon: Daemon) -> None:
    client = lan_client(daemon)
    missing = client.get("/nowhere", headers={"Accept-Language": "ja"})
    assert missing.status_code == 404 and "/nowhere にページはありません" in missing.text
    assert client.get("/servers?part=nothing").status_code == 404
    assert client.get("/servers/9999").status_code == 404
    assert "no server 9999" in client.get("/servers/9999").text
    as_json = client.get("/servers/9999?format=json")
    assert as_json.status_code == 404 and as_json.json()["error"]["code"] == "not_found"
    assert client.get("/?minutes=7").status_code == 400


def test_language_follows_accept_language_until_switched(daemon: Daemon) -> None:
    client = lan_client(daemon)
    assert '<html lang="ja">' in get_page(client, "/hardware", "ja,en;q=0.5")
    switched = client.get("/lang/en?next=/hardware", follow_redirects=False)
    assert switched.status_code == 303 and switched.headers["location"] == "/hardware"
    assert "lang=en" in switched.headers["set-cookie"]
    assert '<html lang="en">' in get_page(client, "/hardware", "ja")  # remembered
    client.get("/lang/ja?next=/")
    assert '<html lang="ja">' in get_page(client, "/hardware", "en")
    away = client.get("/lang/en?next=//evil.example/", follow_redirects=False)
    assert away.headers["location"] == "/"
    assert client.get("/lang/fr").status_code == 404


def test_times_and_numbers_follow_the_language(daemon: Daemon, recorded: Recorded) -> None:
    path = f"/servers/{recorded.running_id}"
    en = get_page(lan_client(daemon), path, "en")
    ja = get_page(lan_client(daemon), path, "ja")
    assert re.search(r"up \d+ min", en) and re.search(r"稼働 \d+分", ja)
    assert re.search(r"\d{4}年\d{1,2}月\d{1,2}日", ja) and not re.search(r"\d{4}年", en)


def test_login_form_gives_a_lan_browser_control(daemon: Daemon) -> None:
    client = lan_client(daemon, "192.168.7.60")
    page = get_page(client, "/login?next=/servers", "en")
    assert 'action="/api/auth/login"' in page and 'name="next" value="/servers"' in page
    reply = client.post(
        "/api/auth/login",
        data={"token": daemon.token, "next": "/servers"},
        headers={"Origin": f"http://{LAN_HOST}"},
        follow_redirects=False,
    )
    assert reply.status_code == 303 and reply.headers["location"] == "/servers"
    html = get_page(client, "/servers", "en")
    assert "Control" in html and "Read-only" not in html and "/api/auth/logout" in html
    assert daemon.token not in html


def test_static_assets_are_served_by_mgr(daemon: Daemon) -> None:
    client = lan_client(daemon)
    htmx = client.get("/static/htmx.min.js")
    assert htmx.status_code == 200 and b"htmx" in htmx.content[:200]
    assert "Zero-Clause BSD" in client.get("/static/htmx.LICENSE").text
    plotly = client.get("/static/plotly.min.js")
    assert plotly.status_code == 200 and len(plotly.content) > 1_000_000
    assert client.get("/static/console.js").status_code == 200
    assert client.get("/static/console.css").status_code == 200
    assert client.get("/static/favicon.svg").status_code == 200


def test_an_engine_s_preempted_requests_are_counted_on_its_card(
    tmp_path: Path, demo_model: Path
) -> None:
    """/v1/stats `requests.preempted` is shown beside the other request counts, in both
    languages and in the JSON alternate; an engine that does not report it gets a dash."""
    daemon = make_daemon(tmp_path / "data", None)
    daemon.start()
    try:
        ids = record_engine(daemon, demo_model)
        figure = f'id="preempted-{ids.running_id}"'
        before = get_page(local_client(daemon), "/", "en")
        with daemon.store.session() as session:
            row = session.get(Server, ids.running_id)
            stats = copy.deepcopy(row.last_stats)
            stats["requests"]["preempted"] = 1234
            row.last_stats = stats
        en = get_page(local_client(daemon), "/", "en")
        ja = get_page(local_client(daemon), "/", "ja")
        card = local_client(daemon).get("/?format=json").json()["engines"][0]
    finally:
        daemon.close()

    def shown(html: str) -> str:
        return html[html.index(figure) :].split("</div>", 1)[0]

    assert '<span class="value">–</span><span class="label">requests preempted<' in shown(before)
    assert '<span class="value">1,234</span><span class="label">requests preempted<' in shown(en)
    assert '<span class="label">プリエンプトされたリクエスト<' in shown(ja)
    assert "1,234" in shown(ja) and card["now"]["preempted"] == 1234
