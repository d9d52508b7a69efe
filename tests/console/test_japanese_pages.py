"""Every console page rendered in Japanese, with real data, shows no English sentence; what the
daemon says (reasons, events, errors) reaches a Japanese page in Japanese and scripts in English."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from moelab.console.i18n import LANGUAGES
from moelab.daemon.errors import DiskFull
from moelab.daemon.schema import BenchmarkEvent, Server
from moelab.daemon.service import Daemon
from moelab.daemon.supervisor import EngineHandle
from moelab.engine.config.args import describe_flags
from moelab.engine.process import launch
from moelab.kernels.native_build import COMPILING, WAITING
from tests.autotune.conftest import record_fresh_rates, running_app
from tests.autotune.fake import FakeEngine
from tests.autotune.test_benchmark_api import start, use_fake, wait_status
from tests.daemon.test_models import edited_copy

from .conftest import Recorded, record_engine

SKIPPED_TAGS = {"script", "style", "code"}
VOID_TAGS = {"br", "input", "img", "meta", "link", "hr"}
SHOWN_ATTRS = ("title", "placeholder", "data-confirm", "data-copied", "aria-label", "alt")
JA = {"accept-language": "ja"}


class VisibleText(HTMLParser):
    """The text a reader sees: element text and the attributes a browser shows, without code,
    scripts and what is marked translate="no" (logs, command lines, the data inside sentences);
    chart texts from the figures' titles, axis titles and trace names. An option's text is
    kept apart: a flag's values are listed there as they are typed."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.texts: list[str] = []
        self.options: list[str] = []
        self._skipping: list[str] = []
        self._in_option = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        values = dict(attrs)
        if self._skipping or tag in SKIPPED_TAGS or values.get("translate") == "no":
            if tag not in VOID_TAGS:
                self._skipping.append(tag)
            return
        self._in_option = tag == "option"
        self.texts += [values[a] or "" for a in SHOWN_ATTRS if values.get(a)]
        if values.get("data-figure"):
            self.texts += figure_texts(json.loads(values["data-figure"]))

    def handle_endtag(self, tag: str) -> None:
        if self._skipping and self._skipping[-1] == tag:
            self._skipping.pop()
        if tag == "option":
            self._in_option = False

    def handle_data(self, data: str) -> None:
        if not self._skipping and data.strip():
            (self.options if self._in_option else self.texts).append(data.strip())


def figure_texts(figure: dict[str, Any]) -> list[str]:
    layout = figure.get("layout", {})
    out = [(layout.get("title") or {}).get("text", "")]
    for key, axis in layout.items():
        if key.startswith(("xaxis", "yaxis")):
            out.append(((axis or {}).get("title") or {}).get("text", ""))
    out += [a.get("text", "") for a in layout.get("annotations", [])]
    out += [trace.get("name", "") for trace in figure.get("data", [])]
    return [text for text in out if text]


def visible_text(html: str) -> tuple[list[str], list[str]]:
    """The page's texts, and its options' texts."""
    parser = VisibleText()
    parser.feed(html)
    return parser.texts, parser.options


# ---- what may stay in Latin letters ---------------------------------------------------------

# units, acronyms, names and device words that Japanese technical text writes as they are, and
# the language switch's names of the languages
UNITS = {"tok", "s", "ms", "µs", "GiB", "MiB", "KiB", "GB", "MB", "KB", "TB", "min", "h", "x"}
ACRONYMS = {"CPU", "CPUs", "GPU", "GPUs", "RAM", "VRAM", "KV", "PCIe", "NVML", "CUDA", "API",
            "JSON", "TOML", "LRU", "LAN", "URL", "ID", "PID", "pid", "HTTP", "GET", "POST", "PUT",
            "DELETE", "CORS", "DNS", "OS", "TTFT", "p95", "MoE", "PC", "Bp", "Bh"}  # fmt: skip
NAMES = {"NVIDIA", "OpenAI", "Anthropic", "vLLM", "Qwen", "Coder", "QwQ", "DeepSeek", "moelab",
         "mgr", "htmx", "Plotly", "torch", "dtype", "cpu", "cuda", "Gated", "DeltaNet", "SwiGLU",
         "ModelOpt",
         *LANGUAGES.values()}  # fmt: skip
TERMS = UNITS | ACRONYMS | NAMES
WORD = re.compile(r"[A-Za-z][A-Za-z']+")
CODE_LIKE = re.compile(
    r"`[^`]+`"  # code, as Japanese text quotes it
    r"|https?://\S+"  # addresses
    r"|\bmoelab (?:serve|bench bw|bench|synth)\b"  # commands
    r"|--[a-z0-9-]+"  # flag names
    r"|\b\w+=\S+"  # parameters: threads=2
    r"|(?:~|\.{0,2})/[\w./~-]*|\b\w+/[\w./-]+"  # paths
    r"|\b[\w.-]+\.(?:json|toml|safetensors|log|py|md)\b"  # file names
    r"|\b[a-z0-9]+(?:[-_.:][a-z0-9]+)+\b"  # identifiers: qwen3_moe, cuda:0, control-token
    r"|\b\w*\d\w*\b"  # words with digits: bfloat16, 1GiB, x86_64
)


def english_words(text: str, allowed: set[str]) -> list[str]:
    """Latin words left in a Japanese text, besides terms, names and code-like tokens."""
    stripped = CODE_LIKE.sub(" ", text)
    return [w for w in WORD.findall(stripped) if w not in TERMS and w not in allowed]


def flag_values() -> set[str]:
    """Every value a flag lists as its choices, and every default: typed as they are."""
    out = set()
    for flag in describe_flags():
        for value in (*(flag["choices"] or ()), flag["default"]):
            out |= set(WORD.findall(str(value)))
    return out


# ---- the data the pages show ----------------------------------------------------------------


@dataclass(frozen=True)
class FullMgr:
    """A mgr with everything the pages show."""

    daemon: Daemon
    client: TestClient  # a browser on the machine itself
    lan: TestClient  # a read-only LAN viewer
    runs: tuple[int, ...]  # done, done, failed
    profiles: tuple[int, ...]  # saved from a run, made by hand, for a model that cannot be served
    recorded: Recorded
    starting: int  # a server whose engine is loading
    model: Path


# the phases a loading engine reports in /health: the engine's (engine/runtime/engine.py), the
# native kernel's build (kernels/native_build.py) and the first one, before any
ENGINE_SOURCE = Path(__file__).parents[2] / "engine" / "runtime" / "engine.py"
LOADING_PHASES = (
    "starting",
    *re.findall(r'begin\("([^"]+)"\)', ENGINE_SOURCE.read_text()),
    COMPILING,
    WAITING,
)


def checkpoints(models: Path, demo_model: Path) -> Path:
    """The demo model and two checkpoints moelab cannot serve: quantized weights, and a
    config.json with a field of the wrong type. Returns the demo model's copy."""
    good = models / demo_model.name
    shutil.copytree(demo_model, good)
    edited_copy(
        demo_model, models / "Qwen3-30B-A3B-GPTQ-Int4", quantization_config={"quant_method": "gptq"}
    )
    edited_copy(demo_model, models / "OLMoE-1B-7B-0924", num_experts="lots")
    return good


def loading_engine(daemon: Daemon, model: Path) -> tuple[int, subprocess.Popen]:
    """A server whose engine is still loading: its row and the supervisor's handle of a process
    that stands for the engine (its /health is set by the tests)."""
    process = subprocess.Popen(["sleep", "600"])
    now = time.time()
    log = daemon.data_dir / "logs" / "loading.log"
    with daemon.store.session() as session:
        row = Server(name="loading-demo", model=str(model), flags=["--device", "cpu", "--port",
                     "8197"], host="127.0.0.1", port=8197, device="cpu", status="starting",
                     pid=process.pid, log_path=str(log), created=now, started=now)  # fmt: skip
        session.add(row)
        session.flush()
        server_id = row.id
    engine = launch.EngineProcess(process.pid, "127.0.0.1", 8197, str(log), now, popen=process)
    daemon.supervisor._handles[server_id] = EngineHandle(
        server_id, engine, "cpu", None, fresh=True, health={"status": "loading", "phase": "plan"}
    )
    return server_id, process


@pytest.fixture(scope="module")
def full_mgr(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[FullMgr]:
    """The demo model and two that cannot be served; a running and a crashed engine with
    telemetry, and one loading; hardware rates and a measurement that failed; two finished
    benchmark runs (a trial of the first crashes) and one whose starting flags do not run; a
    profile saved from a run, one made by hand and one for a model that cannot be served."""
    models = tmp_path_factory.mktemp("models")
    demo_model = checkpoints(models, demo_model)
    with running_app(tmp_path_factory.mktemp("mgr"), models) as (daemon, client):
        record_fresh_rates(daemon, demo_model)
        use_fake(client.app, FakeEngine(seed=31, crash=("--moe-miss-policy=cpu",)))
        first = wait_status(client, start(client, demo_model)["id"], ("done",))
        use_fake(client.app, FakeEngine(seed=32))
        second = start(client, demo_model, mode="quick", objective="decode", base_flags=None)
        second = wait_status(client, second["id"], ("done",))
        use_fake(client.app, FakeEngine(seed=33, crash=(None,)))  # the starting flags crash
        failed = wait_status(client, start(client, demo_model, mode="quick")["id"], ("failed",))
        saved = client.post(f"/api/benchmarks/{first['id']}/save-profile", json={"name": "tuned"})
        by_hand = client.post("/api/profiles", json={"name": "by hand", "model": str(demo_model)})
        unservable = {"name": "gptq", "model": str(models / "Qwen3-30B-A3B-GPTQ-Int4")}
        for_gptq = client.post("/api/profiles", json=unservable)
        job, _new = daemon.hardware.start_measure([demo_model], ["--threads", "x"])
        assert daemon.jobs.wait(job, 120) and job.status == "failed", job.to_json()
        lan = TestClient(client.app, base_url="http://127.0.0.1", client=("192.168.1.50", 50123))
        starting, process = loading_engine(daemon, demo_model)
        try:
            yield FullMgr(
                daemon,
                client,
                lan,
                (first["id"], second["id"], failed["id"]),
                tuple(reply.json()["id"] for reply in (saved, by_hand, for_gptq)),
                record_engine(daemon, demo_model),
                starting,
                demo_model,
            )
        finally:
            process.kill()
            process.wait()


def page_paths(mgr: FullMgr) -> list[str]:
    """Every page (and the parts of them that carry text of their own), and error pages."""
    running, crashed = mgr.recorded.running_id, mgr.recorded.crashed_id
    first, second, failed = mgr.runs
    plan = f"/benchmark/plan?model={mgr.model}&mode=quick&objective=aggregate&clients=16"
    return [
        "/",
        "/?part=engines",
        "/servers",
        "/servers?part=server_list",
        f"/servers/{running}",
        f"/servers/{crashed}",
        f"/servers/{crashed}?part=server_head",
        f"/servers/{mgr.starting}",
        "/hardware",
        "/hardware?part=measure_job",
        "/experts",
        f"/experts/{running}",
        f"/experts/{running}?part=expert_body",
        f"/experts/{crashed}",
        "/profiles",
        *(f"/profiles/{p}" for p in mgr.profiles),
        *(f"/profiles/{p}?part=recommended" for p in mgr.profiles),
        f"/profiles/{mgr.profiles[-1]}?part=profile_editor",
        "/benchmark",
        *(f"/benchmark/{run}" for run in mgr.runs),
        f"/benchmark/{failed}?part=benchmark_live",
        plan,
        plan + "&pick_up=1",
        f"/benchmark/plan?model={mgr.model}",
        f"/benchmark/compare?a={first}&b={second}",
        "/login",
        "/nowhere",
        "/benchmark/plan?model=/nowhere",
        f"/benchmark/plan?model={mgr.model}&clients=1000",
        "/experts/9999",
    ]


def names_of(mgr: FullMgr) -> set[str]:
    """Names the data gives (models, servers, profiles, the machine): shown as they are."""
    names = set()
    for path, key in (("/api/models", "models"), ("/api/servers", "servers"),
                      ("/api/profiles", "profiles")):  # fmt: skip
        for item in mgr.client.get(path).json()[key]:
            names |= set(WORD.findall(item["name"]))
    inventory = mgr.client.get("/api/hardware").json()["inventory"]
    for text in (inventory.get("hostname"), (inventory.get("cpu") or {}).get("model")):
        names |= set(WORD.findall(text or ""))
    return names


def english_on(pages: dict[str, str], names: set[str]) -> dict[str, set[str]]:
    """The texts with English words of Japanese pages (path -> html), and where each is."""
    found: dict[str, set[str]] = {}
    for path, html in pages.items():
        texts, options = visible_text(html)
        shown = [(text, names) for text in texts]
        shown += [(text, names | flag_values()) for text in options]
        for text, allowed in shown:
            if english_words(text, allowed):
                found.setdefault(text, set()).add(path.split("?")[0])
    return found


def assert_japanese(pages: dict[str, str], names: set[str]) -> None:
    found = english_on(pages, names)
    report = "\n".join(f"{text!r}  ({', '.join(sorted(paths))})" for text, paths in found.items())
    assert not found, f"English on Japanese pages:\n{report}"


def japanese_pages(viewer: TestClient, paths: list[str]) -> dict[str, str]:
    pages = {}
    for path in paths:
        reply = viewer.get(path, headers=JA)
        assert reply.headers["content-type"].startswith("text/html"), path
        pages[path] = reply.text
    return pages


def test_japanese_pages_show_no_english(full_mgr: FullMgr) -> None:
    names = names_of(full_mgr)
    assert_japanese(japanese_pages(full_mgr.lan, page_paths(full_mgr)), names)
    pages = japanese_pages(full_mgr.client, page_paths(full_mgr))
    assert_japanese(pages, names)
    # what main's pages add is on them: the reasons a model cannot be served, a loading
    # engine, the running engines on the plan with each mode's duration, the base_url
    servers = pages["/servers"]
    assert "量子化されています" in servers and "ではなく整数にしてください" in servers
    assert 'id="model-problem"' in pages[f"/profiles/{full_mgr.profiles[-1]}"]
    assert 'class="phase' in pages[f"/servers/{full_mgr.starting}"]
    plan = pages[f"/benchmark/plan?model={full_mgr.model}"]
    assert 'id="running-engines"' in plan and 'id="durations"' in plan
    assert 'id="client-base-url"' in pages[f"/servers/{full_mgr.recorded.running_id}"]


def test_each_loading_phase_reads_in_japanese(full_mgr: FullMgr) -> None:
    handle = full_mgr.daemon.supervisor.handle(full_mgr.starting)
    assert handle is not None and len(LOADING_PHASES) > 8, LOADING_PHASES
    path = f"/servers/{full_mgr.starting}?part=server_head"
    pages = {}
    for phase, holder in [(p, None) for p in LOADING_PHASES] + [(WAITING, 4242)]:
        handle.health = {"status": "loading", "phase": phase, "total_bytes": 3 << 30,
                         "loaded_bytes": 1 << 30, "build_holder_pid": holder}  # fmt: skip
        html = full_mgr.client.get(path, headers=JA).text
        assert 'class="phase' in html, phase
        pages[f"{path}&phase={phase}&holder={holder}"] = html
    assert_japanese(pages, names_of(full_mgr))


def test_a_pc_without_a_gpu_and_nothing_yet_reads_in_japanese(
    tmp_path: Path, demo_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_app(tmp_path / "mgr", demo_model.parent) as (daemon, client):
        probed = daemon.hardware.inventory()
        monkeypatch.setattr(
            daemon.hardware, "inventory", lambda **_: dataclasses.replace(probed, gpus=())
        )
        pages = japanese_pages(
            client, ["/", "/servers", "/profiles", "/benchmark", "/hardware", "/experts"]
        )
        assert 'id="no-gpu"' in pages["/"]
        machine = f"{probed.hostname} {probed.cpu_model}"
        assert_japanese(pages, {"demo", "tiny", *WORD.findall(machine)})


def test_a_full_disk_reads_in_japanese(full_mgr: FullMgr, monkeypatch: pytest.MonkeyPatch) -> None:
    database = full_mgr.daemon.data_dir / "mgr.sqlite3"

    def full(*_args: Any, **_kwargs: Any) -> None:
        raise DiskFull(database)

    monkeypatch.setattr(full_mgr.daemon.profiles, "save", full)
    profile_id = full_mgr.profiles[1]
    form = {"name": "by hand", "model": str(full_mgr.model), "notes": ""}
    editor = full_mgr.client.put(f"/profiles/{profile_id}/flags", data=form, headers=JA).text
    assert "ディスクがいっぱいです" in editor
    assert_japanese({"/profiles/flags": editor}, names_of(full_mgr))
    more = {"name": "more", "model": str(full_mgr.model)}
    reply = full_mgr.client.post("/api/profiles", json=more, headers=JA)
    error = reply.json()["error"]
    assert reply.status_code == 507 and error["code"] == "disk_full"
    assert error["message"].startswith(f"mgr could not write: the disk holding {database} is full")
    assert error["localized"].startswith(f"mgr が書き込めませんでした: {database} のあるディスク")


def test_the_api_says_it_in_english_with_the_stored_form_beside(full_mgr: FullMgr) -> None:
    run = full_mgr.client.get(f"/api/benchmarks/{full_mgr.runs[0]}").json()
    rejected = next(t for t in run["trials"] if t["verdict"] == "rejected")
    assert "slower by" in rejected["reason"] or "within the noise" in rejected["reason"]
    assert rejected["reason_text"]["template"].startswith("{head}")
    event = run["events"][0]
    assert event["message"].startswith("started: standard mode") and event["message_text"]
    page = full_mgr.client.get(f"/benchmark/{full_mgr.runs[0]}", headers=JA).text
    assert "開始: 標準モード" in page and "started: standard mode" not in page
    failed = full_mgr.client.get(f"/api/benchmarks/{full_mgr.runs[2]}").json()
    assert failed["error"].startswith("the starting flags do not run")
    assert (
        "開始時のフラグで動かない"
        in full_mgr.client.get(f"/benchmark/{full_mgr.runs[2]}", headers=JA).text
    )


def test_a_line_stored_before_sentences_had_a_stored_form_keeps_its_english(
    full_mgr: FullMgr,
) -> None:
    with full_mgr.daemon.store.session() as session:
        old = BenchmarkEvent(run_id=full_mgr.runs[1], time=time.time(), kind="status",
                             message="resumed after 7 trials", text=None, data={})  # fmt: skip
        session.add(old)
    page = full_mgr.client.get(f"/benchmark/{full_mgr.runs[1]}", headers=JA).text
    assert "resumed after 7 trials" in page


def test_errors_from_the_daemon_read_in_the_pages_language(full_mgr: FullMgr) -> None:
    wrong = {"token": "not the token"}
    origin = {"Origin": "http://127.0.0.1"}
    reply = full_mgr.lan.post("/api/auth/login", json=wrong, headers={**JA, **origin})
    error = reply.json()["error"]
    assert reply.status_code == 401 and error["code"] == "token_invalid"
    assert error["message"] == "the control token is wrong"
    assert error["localized"] == "制御トークンが違います"
    english = full_mgr.lan.post("/api/auth/login", json=wrong, headers=origin).json()["error"]
    assert "localized" not in english and english["message"] == "the control token is wrong"
    # a refusal of the access rules, and an error of a handler
    refused = full_mgr.lan.post("/api/models/rescan", headers={**JA, **origin}).json()["error"]
    assert refused["code"] == "token_required" and "制御トークンが必要です" in refused["localized"]
    missing = full_mgr.client.get("/api/benchmarks/9999", headers=JA).json()["error"]
    assert missing == {
        "message": "no benchmark run 9999",
        "message_text": {"template": "no benchmark run {run_id}", "values": {"run_id": 9999}},
        "code": "not_found",
        "localized": "ベンチマーク実行 9999 はありません",
    }
    page = full_mgr.client.get(f"/benchmark/plan?model={full_mgr.model}&clients=1000", headers=JA)
    assert page.status_code == 400 and "clients must be" not in page.text
