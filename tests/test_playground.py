"""The web playground (issue 15 part 1): served by mlxd itself, public like /health, and
working in a real browser, headless Chromium driven by Selenium through Debian's
chromium-driver, against a real server on 127.0.0.1.

The chat model is the tiny agent Llama through the real engine and pipeline with its
sampling scripted (``tests/helpers/scripted_engine.py``), so it can think and call a tool
on demand; a gate lets the test hold a generation mid-stream (to see tokens arrive before
the end, and to press Stop while it is still running) instead of racing it. The embedding
model is the starter wheel's MiniLM and the reranker a random tiny cross-encoder.

``MLXD_PLAYGROUND_SCREENSHOT=docs/playground.png`` writes the page's screenshot there.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxd.generation.events import Event
from mlxd.models.residency import State
from mlxd.models.spec import CHAT_KINDS, ModelEntry, ModelKind
from mlxd.models.starter import STARTER_EMBEDDING, STARTER_STT, STARTER_TTS
from tests.helpers.server import RunningServer, running_server

USER_KEY, ADMIN_KEY = "user-key", "admin-key"
WEATHER_TOOL = ('[{"type": "function", "function": {"name": "get_weather", "parameters": '
                '{"type": "object", "properties": {"city": {"type": "string"}}}}}]')
THINK_TEXT_CALL = ('<think>Need weather.</think>Let me check.<tool_call>{"name": "get_weather",'
                   ' "arguments": {"city": "Paris"}}</tool_call>')
WAIT = 30.0  # generous: a 2-core CI machine shared with other tests


class GatedLoader:
    """``ScriptedLoader`` for chat models (its replies may pause after ``hold_after`` events
    until ``gate`` is set), the real loader for the embedding and rerank models."""

    def __init__(self, config: Any) -> None:
        from tests.helpers.scripted_engine import ScriptedLoader

        outer = self

        class _Scripted(ScriptedLoader):
            async def _generate(self, engine: Any, real_generate: Any, prepared: Any,
                                seed_offset: int = 0) -> AsyncIterator[Event]:
                async for ev in outer.gated(super()._generate(engine, real_generate,
                                                              prepared, seed_offset)):
                    yield ev

        self.scripted = _Scripted(config)
        self.hold_after: int | None = None
        self.gate = threading.Event()
        self.events = 0
        self.closed_early = threading.Event()

    def reset(self, reply: str | None, hold_after: int | None = None) -> None:
        self.scripted.reply, self.hold_after, self.events = reply, hold_after, 0
        self.gate.clear()
        self.closed_early.clear()

    async def gated(self, events: AsyncIterator[Event]) -> AsyncIterator[Event]:
        finished = False
        try:
            async for ev in events:
                yield ev
                self.events += 1
                if self.hold_after is not None and self.events >= self.hold_after:
                    while not self.gate.is_set():  # the test releases it from its thread
                        await asyncio.sleep(0.01)
            finished = True
        finally:
            if not finished:  # the stream was cancelled: the client went away
                self.closed_early.set()

    def resolve(self, entry: ModelEntry) -> Path:
        return self.scripted.resolve(entry)

    def build(self, entry: ModelEntry, kind: ModelKind, path: Path, worker: Any) -> Any:
        if kind in CHAT_KINDS:
            return self.scripted.build(entry, kind, path, worker)
        return self.scripted._loader.build(entry, kind, path, worker)


@pytest.fixture(scope="module")
def served(agent_model: Path, session_dir: Path,
           test_home: Path) -> Iterator[tuple[RunningServer, GatedLoader]]:
    from tests.helpers.cross_encoders import build_tiny_roberta
    from tests.helpers.retrieval import registry_config
    from tests.helpers.tiny_vlm import build_tiny_vlm

    rerank = session_dir / "mixed-rerank"  # the same folder as conftest's mixed_server
    if not (rerank / "config.json").exists():
        build_tiny_roberta(rerank)
    entries = [ModelEntry(name="agent", source=str(agent_model)),
               STARTER_EMBEDDING.model_copy(), ModelEntry(name="rerank", source=str(rerank)),
               STARTER_STT.model_copy(), STARTER_TTS.model_copy(),
               ModelEntry(name="vl", source=str(build_tiny_vlm(  # the same as test_vision_prefix
                   "qwen2_vl", session_dir / "tiny-vlm" / "qwen2_vl",
                   session_dir / "tiny-vlm" / "tokenizers")))]
    cfg = registry_config(session_dir / "playground-models.yaml", entries, test_home,
                          api_key=USER_KEY, admin_api_key=ADMIN_KEY,
                          enable_prefix_cache_persist=False)
    loader = GatedLoader(cfg)
    with running_server(cfg, loader=loader) as srv:
        yield srv, loader
        loader.gate.set()  # never leave a held generation behind


@pytest.fixture(scope="module")
def server(served: tuple[RunningServer, GatedLoader]) -> RunningServer:
    return served[0]


# ------------------------------------------------------------- without a browser


@pytest.mark.parametrize("path, kind", [("/", "text/html"), ("/ui", "text/html"),
                                        ("/ui/app.js", "text/javascript"),
                                        ("/ui/style.css", "text/css")])
def test_page_and_assets_need_no_api_key(server: RunningServer, path: str, kind: str) -> None:
    r = httpx.get(server.url + path, timeout=WAIT)
    assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
    assert httpx.get(server.url + "/v1/models", timeout=WAIT).status_code == 401


def test_page_loads_nothing_from_elsewhere(server: RunningServer) -> None:
    """Works offline: every script and stylesheet is the server's own."""
    html = httpx.get(server.url + "/", timeout=WAIT).text
    assert 'src="/ui/app.js"' in html and 'href="/ui/style.css"' in html
    for page in (html, httpx.get(server.url + "/ui/app.js", timeout=WAIT).text):
        assert "http://" not in page and "https://" not in page and "//cdn" not in page


def test_only_the_pages_own_files_are_served(server: RunningServer) -> None:
    for path in ("/ui/nope.js", "/ui/..%2Fapp.py", "/ui/%2e%2e%2fconfig.py"):
        r = httpx.get(server.url + path, timeout=WAIT)
        assert r.status_code in (401, 404), (path, r.status_code)
        assert "def " not in r.text


def test_playground_is_not_in_the_openapi_document(server: RunningServer) -> None:
    doc = httpx.get(server.url + "/openapi.json", timeout=WAIT,
                    headers={"Authorization": f"Bearer {USER_KEY}"}).json()
    assert not [p for p in doc["paths"] if p == "/" or p.startswith("/ui")]


def test_ready_line_links_the_playground(server: RunningServer) -> None:
    from mlxd.cli.serve import _ready_line

    assert f"(playground: http://127.0.0.1:{server.port}/)" in _ready_line(
        server.ctx, "0.0.0.0", server.port)


# --------------------------------------------------------------- in a browser


def _driver_or_skip() -> Any:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    chromedriver = shutil.which("chromedriver")
    if not chromium or not chromedriver:
        pytest.skip("the playground's browser test needs Debian's chromium and chromium-driver "
                    "(`sudo apt-get install chromium chromium-driver`; `make setup` installs "
                    "them when it runs as root)")
    webdriver = pytest.importorskip("selenium.webdriver",
                                    reason="selenium is missing: pip install -e '.[dev]'")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1500", "--no-first-run", "--disable-extensions",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-default-apps", "--no-proxy-server"):
        options.add_argument(arg)
    # An explicit driver path: Selenium Manager never looks anything up online.
    service = webdriver.ChromeService(executable_path=chromedriver)
    return webdriver.Chrome(options=options, service=service)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    driver = _driver_or_skip()
    try:
        yield driver
    finally:
        driver.quit()


def _until(driver: Any, check: Callable[[Any], Any], what: str, timeout: float = WAIT) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(check, message=what)


def _by_css(driver: Any, css: str) -> list[Any]:
    from selenium.webdriver.common.by import By

    return list(driver.find_elements(By.CSS_SELECTOR, css))


def _text(driver: Any, css: str) -> str:
    found = _by_css(driver, css)
    return str(found[-1].text) if found else ""


def _enter_key(driver: Any, key: str, reason: str) -> None:
    _until(driver, lambda d: _by_css(d, "#key-dialog[open]"), "the API-key dialog opens")
    assert reason in _text(driver, "#key-reason")
    _by_css(driver, "#key-input")[0].send_keys(key)
    _by_css(driver, "#key-save")[0].click()
    _until(driver, lambda d: not _by_css(d, "#key-dialog[open]"), "the dialog closes")


def _state(driver: Any, model: str) -> str:
    return _text(driver, f'#models tr[data-model="{model}"] td.state')


@pytest.fixture(scope="module")
def page(browser: Any, server: RunningServer) -> Any:
    """The playground, opened once; its API key entered when it asks."""
    browser.get(server.url + "/")
    _enter_key(browser, USER_KEY, "needs an API key")
    _until(browser, lambda d: _state(d, "agent") == "unloaded", "the models table fills")
    return browser


def _chat(driver: Any, prompt: str, max_tokens: int) -> None:
    field = _by_css(driver, "#max_tokens")[0]
    field.clear()
    field.send_keys(str(max_tokens))
    _by_css(driver, "#prompt")[0].send_keys(prompt)
    _by_css(driver, "#send")[0].click()


def test_models_table_and_panels(page: Any) -> None:
    rows = {r.get_attribute("data-model"): r.get_attribute("data-kind")
            for r in _by_css(page, "#models tbody tr")}
    assert rows == {"agent": "text", "all-minilm-l6-v2": "embedding", "rerank": "rerank",
                    STARTER_STT.name: "stt", STARTER_TTS.name: "tts", "vl": "vision"}
    assert _text(page, '#models tr[data-model="agent"] td:nth-child(7)') == "yes"
    options = [o.get_attribute("value") for o in _by_css(page, "#chat-model option")]
    assert options == ["agent", "vl"]  # chat-capable models only
    for panel in ("panel-vision", "panel-stt", "panel-tts"):  # each kind has a model
        assert _by_css(page, f"#{panel}")[0].is_displayed()
    # unloaded: nothing measured; the reservation is an estimate (~), in binary units
    assert _text(page, '#models tr[data-model="agent"] td.measured') == "-"
    assert _text(page, '#models tr[data-model="agent"] td.reserved').startswith("~")
    stored = page.execute_script("return [sessionStorage.getItem('mlxd.apiKey'), "
                                 "localStorage.length, document.cookie]")
    assert stored == [USER_KEY, 0, ""]  # the key lives in this tab's session storage only


def test_chat_streams_reasoning_answer_and_tool_call_apart(
        page: Any, served: tuple[RunningServer, GatedLoader]) -> None:
    loader = served[1]
    loader.reset(THINK_TEXT_CALL, hold_after=3)
    _by_css(page, "details:not(.reasoning) summary")[0].click()  # system prompt and tools
    _by_css(page, "#tools")[0].send_keys(WEATHER_TOOL)
    _chat(page, "Weather in Paris?", 128)
    # Held after three events: the first tokens are on the page while the server still
    # generates (the answer streams; it does not arrive whole at the end).
    _until(page, lambda d: _text(d, ".msg.assistant .reasoning .text"), "reasoning streams")
    assert _text(page, "#chat-status") == "streaming…"
    assert _text(page, ".msg.assistant .reasoning .text") != "Need weather."
    assert not _by_css(page, "#send")[0].is_enabled()
    loader.gate.set()
    _until(page, lambda d: _text(d, "#chat-status").startswith("done (tool_calls)"), "done")
    assert _text(page, ".msg.assistant .reasoning .text") == "Need weather."
    assert _text(page, ".msg.assistant .answer") == "Let me check."
    call = _text(page, ".msg.assistant .tool-call")
    assert "tool call: get_weather" in call and '"city"' in call and "Paris" in call
    assert not _by_css(page, "#key-dialog[open]")  # the key was asked once


def test_embeddings_and_rerank_panels(page: Any) -> None:
    _by_css(page, "#emb-run")[0].click()
    _until(page, lambda d: "cosine similarity" in _text(d, "#emb-result"), "similarity")
    similarity = float(_text(page, "#emb-result").split()[2])
    assert 0.3 < similarity <= 1.0  # two sentences about a cat on a mat (MiniLM)
    _by_css(page, "#rerank-run")[0].click()
    _until(page, lambda d: len(_by_css(d, "#rerank-result li .score")) == 3, "ranked")
    scores = [float(s.text) for s in _by_css(page, "#rerank-result li .score")]
    assert scores == sorted(scores, reverse=True)
    # both models were loaded by those requests, and the table says so
    _until(page, lambda d: _state(d, "all-minilm-l6-v2") == "loaded" and
           _state(d, "rerank") == "loaded", "the table shows the loads")
    shot = os.environ.get("MLXD_PLAYGROUND_SCREENSHOT")
    if shot:
        page.save_screenshot(shot)


def test_stop_ends_a_long_generation(page: Any,
                                     served: tuple[RunningServer, GatedLoader]) -> None:
    loader = served[1]
    loader.reset("tick " * 1500, hold_after=4)
    _chat(page, "Count for a long time.", 1600)
    _until(page, lambda d: "tick" in _text(d, ".msg.assistant .answer"), "tokens stream")
    assert _by_css(page, "#stop")[0].is_enabled()
    _by_css(page, "#stop")[0].click()
    _until(page, lambda d: _text(d, "#chat-status") == "stopped", "the page says stopped")
    # The browser really dropped the stream: the server's generation was cancelled there,
    # before the gate let it finish its 1,500 ticks.
    assert loader.closed_early.wait(WAIT)
    assert loader.events < 1500 and not loader.gate.is_set()
    assert _by_css(page, "#send")[0].is_enabled()
    assert _by_css(page, ".msg.assistant.stopped")


def test_unload_and_load_change_the_state_in_the_table(page: Any, server: RunningServer) -> None:
    _until(page, lambda d: _state(d, "agent").startswith("loaded"), "the chat model is loaded")
    _by_css(page, '#models tr[data-model="agent"] button.unload')[0].click()
    # load / unload are admin routes: the page asks for the admin key (and keeps it)
    _enter_key(page, ADMIN_KEY, "admin API key")
    _until(page, lambda d: _state(d, "agent") == "unloaded", "unloaded in the table")
    assert server.ctx.manager.get("agent").state == State.UNLOADED
    assert page.execute_script("return sessionStorage.getItem('mlxd.adminKey')") == ADMIN_KEY
    _by_css(page, '#models tr[data-model="agent"] button.load')[0].click()
    _until(page, lambda d: _state(d, "agent").startswith("loaded"), "loaded in the table")
    assert server.ctx.manager.get("agent").state == State.LOADED
    assert not _by_css(page, "#key-dialog[open]")
    # the table is live: a change made by another client shows without reloading the page
    r = httpx.post(server.url + "/v1/models/unload", json={"model": "agent"}, timeout=WAIT,
                   headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200, r.text
    _until(page, lambda d: _state(d, "agent") == "unloaded", "the refresh shows the unload")


# -------------------------------------------- issue 27: every panel, end to end


def _capture_requests(driver: Any) -> None:
    """Keep the JSON bodies the page sends (window.fetch wrapped, as the page calls it)."""
    driver.execute_script("""
        if (window.sentBodies) return;
        window.sentBodies = [];
        const real = window.fetch;
        window.fetch = (url, opts) => {
          if (opts && typeof opts.body === "string") window.sentBodies.push([url, opts.body]);
          return real(url, opts);
        };""")


def _sent(driver: Any, path: str) -> list[dict[str, Any]]:
    import json

    return [json.loads(body) for url, body in driver.execute_script("return window.sentBodies")
            if url == path]


def test_chat_leaves_sampling_to_the_server_unless_set(
        page: Any, served: tuple[RunningServer, GatedLoader]) -> None:
    """The starter chat model is greedy by default: the page sends no temperature (nor
    top_p) of its own, only what the user types."""
    loader = served[1]
    _capture_requests(page)
    assert _by_css(page, "#temperature")[0].get_attribute("value") in ("", None)
    loader.reset("Fine.")
    _chat(page, "How are you?", 16)
    _until(page, lambda d: _text(d, ".msg.assistant .answer") == "Fine.", "the answer")
    body = _sent(page, "/v1/chat/completions")[-1]
    assert "temperature" not in body and "top_p" not in body
    _by_css(page, "#temperature")[0].send_keys("0.3")
    loader.reset("Still fine.")
    _chat(page, "And now?", 16)
    _until(page, lambda d: _text(d, ".msg.assistant .answer") == "Still fine.", "the answer")
    assert _sent(page, "/v1/chat/completions")[-1]["temperature"] == 0.3
    _by_css(page, "#temperature")[0].clear()


def test_memory_shows_measured_and_reserved_apart_in_binary_units(
        page: Any, server: RunningServer) -> None:
    r = httpx.post(server.url + "/v1/models/load", json={"model": "all-minilm-l6-v2"},
                   headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=WAIT)
    assert r.status_code == 200, r.text
    card = httpx.get(server.url + "/v1/models/all-minilm-l6-v2", timeout=WAIT,
                     headers={"Authorization": f"Bearer {USER_KEY}"}).json()
    row = '#models tr[data-model="all-minilm-l6-v2"]'
    _until(page, lambda d: _text(d, f"{row} td.measured") not in ("", "-"), "measured")
    measured, reserved = _text(page, f"{row} td.measured"), _text(page, f"{row} td.reserved")
    from mlxd.models.memory import format_bytes

    # the page's figures are `mlxd ps`'s: the same numbers in the same units
    assert measured == format_bytes(card["measured_bytes"])
    assert reserved == format_bytes(card["memory_bytes"])
    assert "GB" not in measured + reserved  # one unit system: KiB, MiB, GiB


def test_speak_uses_the_chosen_voice_and_plays_audio(page: Any) -> None:
    _until(page, lambda d: [o.get_attribute("value") for o in _by_css(d, "#tts-voice option")]
           == ["joe"], "the voice picker fills from /v1/audio/voices")
    _capture_requests(page)
    _by_css(page, "#tts-run")[0].click()
    _until(page, lambda d: _text(d, "#tts-result") not in ("", "…"), "speech comes back",
           timeout=120)  # the voice loads first
    assert "s of speech (voice joe)" in _text(page, "#tts-result"), _text(page, "#tts-result")
    assert _sent(page, "/v1/audio/speech")[-1]["voice"] == "joe"
    duration = page.execute_script("return document.getElementById('tts-audio').duration")
    assert duration > 0.3  # "Hello from mlxd." decoded by the browser


def test_transcribe_a_file_in_the_browser(page: Any, server: RunningServer,
                                          tmp_path: Path) -> None:
    speech = httpx.post(server.url + "/v1/audio/speech", timeout=120, json={
        "model": STARTER_TTS.name, "voice": "joe", "input": "Good morning.",
        "response_format": "wav"}, headers={"Authorization": f"Bearer {USER_KEY}"})
    assert speech.status_code == 200, speech.text
    wav = tmp_path / "morning.wav"
    wav.write_bytes(speech.content)
    _by_css(page, "#stt-file")[0].send_keys(str(wav))
    _by_css(page, "#stt-run")[0].click()
    _until(page, lambda d: _text(d, "#stt-result") not in ("", "…"), "a transcript",
           timeout=300)  # Whisper converts (once per test home) and loads first
    assert "morning" in _text(page, "#stt-result").lower(), _text(page, "#stt-result")


def test_favicon_is_linked_and_served(server: RunningServer) -> None:
    html = httpx.get(server.url + "/", timeout=WAIT).text
    assert '<link rel="icon" href="/favicon.ico">' in html
    r = httpx.get(server.url + "/favicon.ico", timeout=WAIT)
    assert r.status_code == 200 and r.headers["content-type"] == "image/x-icon"


def test_an_image_goes_to_the_vision_model_with_the_next_message(
        page: Any, served: tuple[RunningServer, GatedLoader], tmp_path: Path) -> None:
    from PIL import Image
    from selenium.webdriver.support.ui import Select

    loader = served[1]
    loader.reset(None)  # the tiny vision model generates for real: its tower sees the image
    _capture_requests(page)
    image = tmp_path / "red.png"
    Image.new("RGB", (32, 32), (220, 30, 30)).save(image)
    Select(_by_css(page, "#chat-model")[0]).select_by_value("vl")
    _by_css(page, "#image")[0].send_keys(str(image))
    _until(page, lambda d: _by_css(d, "#send")[0].is_enabled(), "the image is read")
    replies = len(_by_css(page, ".msg.assistant"))
    _chat(page, "What is this?", 4)
    _until(page, lambda d: len(_by_css(d, ".msg.assistant")) > replies and
           _text(d, "#chat-status").startswith("done"), "the answer",
           timeout=120)  # the vision model loads first
    assert _text(page, ".msg.user").endswith("[image]")
    content = _sent(page, "/v1/chat/completions")[-1]["messages"][-1]["content"]
    assert content[0] == {"type": "text", "text": "What is this?"}
    assert content[1]["image_url"]["url"].startswith("data:image/png;base64,")
    assert _by_css(page, "#image")[0].get_attribute("value") == ""  # sent once, then cleared
    card = httpx.get(served[0].url + "/v1/models/vl", timeout=WAIT,
                     headers={"Authorization": f"Bearer {USER_KEY}"}).json()
    assert card["vision_tower_runs"] == 1  # the image went through the vision tower
    Select(_by_css(page, "#chat-model")[0]).select_by_value("agent")
