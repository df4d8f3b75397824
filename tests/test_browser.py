"""A person's path through the app in a real browser: headless Chromium (Debian package) via Selenium loads the
page, presses Synthesize with the default inputs, hears the stream through Web Audio before the request ends, and
sees the Plotly charts render with the "heard at" bar.  Click -> first sample played and the server's TTFB of each
run go to ``test-artifacts/heard_at.json``; a screenshot to ``test-artifacts/app.png`` (and to
``assets/screenshot.png`` with ``UPDATE_SCREENSHOT=1``, for the README)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx", reason="httpx is not installed here (pip install -r requirements.txt)")

webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.chrome.service import Service as ChromeService  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
         "--mute-audio", "--autoplay-policy=no-user-gesture-required", "--window-size=1400,1600")

# points of the first trace of the run-history chart (Plotly keeps the figure's data on its graph div)
HISTORY_POINTS = ("const g = document.querySelector('#history-plot .js-plotly-plot');"
                  "return g && g.data && g.data.length ? g.data[0].x.length : 0;")

if not (Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists()):
    pytest.skip("headless browser test needs Debian's chromium and chromedriver "
                "(apt-get install -y chromium chromium-driver)", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url(tmp_path_factory):
    from cosyvoice_fast.serving.service import load_service
    from cosyvoice_fast.app.page import build_demo, serve

    svc = load_service(None, synthetic="tiny", device="cpu", dtype="fp32",
                       speaker_cache_dir=tmp_path_factory.mktemp("speakers"), progress=False)
    demo = build_demo(svc)
    port = _free_port()
    serve(demo, port=port, prevent_thread_lock=True, quiet=True)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()
        svc.close()


@pytest.fixture(scope="module")
def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for f in FLAGS:
        opts.add_argument(f)
    # an explicit driver path: Selenium Manager must not try to download a browser or driver
    drv = webdriver.Chrome(service=ChromeService(CHROMEDRIVER), options=opts)
    try:
        yield drv
    finally:
        drv.quit()


def _wait_ready(drv) -> None:
    """The page is built and its load event has put the first example's voice into the prompt upload (a click
    before that finds no prompt voice: the load event runs after the page appears, later on a loaded machine)."""
    WebDriverWait(drv, 30).until(lambda d: d.find_elements(By.ID, "synthesize-btn"))
    WebDriverWait(drv, 30).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#prompt-upload audio"))


def _save_screenshot(drv) -> Path:
    height = drv.execute_script("return document.body.scrollHeight")
    drv.set_window_size(1400, min(max(int(height), 1200), 4200))
    out = REPO / "test-artifacts" / "app.png"
    out.parent.mkdir(exist_ok=True)
    drv.save_screenshot(str(out))
    if os.environ.get("UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(out, REPO / "assets" / "screenshot.png")
    return out


STOPPED = r"stopped after (\d+\.\d\d) s heard \((\d+\.\d\d) s of audio (?:made|received)"
PLAYBACK = ("const r = window.cvfPlayback; if (!r || r.endAt === null) return null;"
            "return {id: r.address, heard_ms: r.heardMs, first_byte_ms: r.firstByteAt - r.clickAt,"
            " end_ms: r.endAt - r.clickAt, played_before_end: r.playedWhenEnded, chunks: r.chunks,"
            " samples: r.samples, gaps: r.underruns, error: r.error};")


def _playback(drv) -> dict:
    """The page's figures of its last run, once its stream has ended."""
    WebDriverWait(drv, 120).until(lambda d: d.execute_script(PLAYBACK) is not None)
    return drv.execute_script(PLAYBACK)


def _server(url: str, rid: str) -> dict:
    t = httpx.get(f"{url}v1/requests/{rid}/telemetry", timeout=10).json()
    assert t["outcome"] == "ok", t
    return t["telemetry"]


def test_audio_plays_before_the_request_ends_and_heard_at_is_recorded(app_url, browser):
    """Five runs: the first sample is out before the stream ends; click -> first sample played ("heard at"),
    the page's first byte and the server's TTFB of each run are written to test-artifacts/heard_at.json."""
    browser.get(app_url)
    _wait_ready(browser)
    runs = []
    for _ in range(6):  # the first run warms the prompt cache and is not counted
        browser.execute_script("window.cvfPlayback = null;")
        browser.find_element(By.ID, "synthesize-btn").click()
        run = _playback(browser)
        WebDriverWait(browser, 120).until(lambda d: d.find_element(By.ID, "status").text.startswith("done:"))
        assert run["error"] is None, run["error"]
        assert run["played_before_end"] is True, "the first sample had not played when the stream ended"
        assert run["heard_ms"] < run["end_ms"]
        tele = _server(app_url, run["id"])
        assert run["samples"] == sum(c["n_samples"] for c in tele["chunks"])  # the page got every sample
        assert tele["client"]["heard_ms"] == pytest.approx(run["heard_ms"])  # the page's report reached the server
        runs.append({**run, "server_ttfb_ms": tele["derived"]["ttfb_ms"],
                     "server_ttfb_breakdown_ms": tele["derived"]["ttfb_breakdown_ms"], "chunks_server": len(tele["chunks"])})
    counted = runs[1:]

    def p50(key: str) -> float:
        v = sorted(r[key] for r in counted)
        return (v[len(v) // 2] + v[(len(v) - 1) // 2]) / 2

    summary = {"runs": runs, "counted": len(counted), "heard_ms_p50": p50("heard_ms"),
               "first_byte_ms_p50": p50("first_byte_ms"), "server_ttfb_ms_p50": p50("server_ttfb_ms")}
    summary["heard_minus_server_ttfb_ms_p50"] = summary["heard_ms_p50"] - summary["server_ttfb_ms_p50"]
    diffs = sorted(r["heard_ms"] - r["server_ttfb_ms"] for r in counted)
    summary["per_run_heard_minus_server_ttfb_ms_p50"] = (diffs[len(diffs) // 2] + diffs[(len(diffs) - 1) // 2]) / 2
    out = REPO / "test-artifacts" / "heard_at.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(summary, indent=2))
    assert summary["heard_ms_p50"] >= summary["server_ttfb_ms_p50"]  # the ear never hears before the server made it


def test_page_synthesises_plays_and_plots(app_url, browser):
    browser.get(app_url)
    _wait_ready(browser)
    assert "SYNTHETIC" in browser.find_element(By.ID, "banner").text
    assert "backends" in browser.find_element(By.ID, "header").text
    browser.find_element(By.ID, "synthesize-btn").click()
    WebDriverWait(browser, 120).until(
        lambda d: d.find_element(By.ID, "status").text.startswith(("done:", "Error")) or
        d.find_elements(By.CSS_SELECTOR, ".toast-body"))
    status = browser.find_element(By.ID, "status").text
    toasts = [t.text for t in browser.find_elements(By.CSS_SELECTOR, ".toast-body")]
    assert status.startswith("done:"), f"synthesis did not finish: {status!r} {toasts}"
    run = _playback(browser)
    assert run["error"] is None and run["samples"] > 0
    assert "heard at" in status  # the dashboard's run is the page's stream
    WebDriverWait(browser, 20).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#ttfb-plot .js-plotly-plot g.trace.bars"))
    legend = browser.find_element(By.CSS_SELECTOR, "#ttfb-plot .js-plotly-plot").text
    for stage in ("llm_prefill", "flow", "vocoder", "heard at"):
        assert stage in legend
    assert browser.find_elements(By.CSS_SELECTOR, "#timeline-plot .js-plotly-plot g.trace.bars")
    assert "playback deadline" in browser.find_element(By.CSS_SELECTOR, "#timeline-plot .js-plotly-plot").text
    assert browser.find_elements(By.CSS_SELECTOR, "#history-plot .js-plotly-plot g.trace.scatter")
    # the full utterance is offered as a wav download
    WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#full-audio a[download]"))
    href = browser.find_element(By.CSS_SELECTOR, "#full-audio a[download]").get_attribute("href")
    assert href.endswith(".wav"), href
    # a second run with a new random seed: the session history (gr.State) now holds two runs
    seed_box = browser.find_element(By.CSS_SELECTOR, "#seed input")
    browser.find_element(By.ID, "dice").click()
    WebDriverWait(browser, 10).until(lambda d: seed_box.get_attribute("value") not in ("", "0"))
    browser.find_element(By.ID, "synthesize-btn").click()
    WebDriverWait(browser, 120).until(lambda d: d.execute_script(HISTORY_POINTS) == 2)
    WebDriverWait(browser, 20).until(lambda d: d.find_element(By.ID, "status").text.startswith("done:"))
    shot = _save_screenshot(browser)
    assert shot.stat().st_size > 20_000


def test_stop_ends_as_stopped_with_partial_audio_and_a_history_entry(app_url, browser):
    from selenium.webdriver.common.keys import Keys

    browser.get(app_url)
    _wait_ready(browser)
    caps = browser.find_elements(By.XPATH, "//*[text()='max speech tokens']/ancestor::div[contains(@class, "
                                           "'block')][1]//input[@type='number']")
    cap = next(c for c in caps if c.is_displayed())
    cap.send_keys(Keys.CONTROL, "a", Keys.BACKSPACE)
    cap.send_keys("2000", Keys.ENTER)  # 80 s of audio: still running when Stop is pressed
    WebDriverWait(browser, 10).until(lambda d: cap.get_attribute("value") == "2000")
    browser.execute_script("window.cvfPlayback = null;")
    browser.find_element(By.ID, "synthesize-btn").click()
    WebDriverWait(browser, 120).until(lambda d: d.execute_script(
        "return window.cvfPlayback && window.cvfPlayback.heardMs !== undefined && window.cvfPlayback.chunks > 0"))
    WebDriverWait(browser, 60).until(lambda d: d.execute_script(  # something has been heard: the clock runs
        "return window.cvfPlayer.heard(window.cvfPlayback) > 0.2"))
    browser.find_element(By.ID, "stop-btn").click()
    WebDriverWait(browser, 60).until(lambda d: d.find_element(By.ID, "status").text.startswith(("stopped", "done")))
    heard = browser.execute_script("return window.cvfPlayback.heardAtStop")
    WebDriverWait(browser, 60).until(lambda d: re.match(STOPPED, d.find_element(By.ID, "status").text))
    status = browser.find_element(By.ID, "status").text
    said = re.match(STOPPED, status)
    # what was heard, from the player's clock at the moment of Stop; not what the engine had made by then
    assert float(said.group(1)) == pytest.approx(heard, abs=0.006), (status, heard)
    assert float(said.group(1)) <= float(said.group(2)), status
    rid = browser.execute_script("return window.cvfPlayback.address")
    t = httpx.get(f"{app_url}v1/requests/{rid}/telemetry", timeout=10).json()
    assert t["outcome"] == "cancelled"
    assert len(t["telemetry"]["token_times"]) < 2000
    WebDriverWait(browser, 20).until(lambda d: d.execute_script(HISTORY_POINTS) >= 1)  # the stopped run is listed
    WebDriverWait(browser, 20).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#full-audio a[download]"))


def test_ab_tab_plays_a_then_b_and_shows_both_heard_at_bars(app_url, browser):
    browser.get(app_url)
    _wait_ready(browser)
    browser.find_element(By.XPATH, "//button[@role='tab'][normalize-space()='A/B']").click()
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "ab-btn").is_displayed())
    browser.find_element(By.ID, "ab-btn").click()
    runs = ("const rs = window.cvfPlayer.runs || []; return rs.length === 2 && rs.every(r => r.endAt !== null) ?"
            " rs.map(r => ({id: r.address, heard_ms: r.heardMs, error: r.error, samples: r.samples,"
            " played: r.playedWhenEnded})) : null;")
    state = ("return (window.cvfPlayer.runs || []).map(r => ({id: r.id, chunks: r.chunks, end: r.endAt,"
             " error: r.error}));")
    try:
        WebDriverWait(browser, 300).until(lambda d: d.execute_script(runs) is not None)
    except Exception as e:  # say how far the page got
        raise AssertionError(f"A/B playback did not finish: {browser.execute_script(state)}") from e
    a, b = browser.execute_script(runs)
    assert a["error"] is None and b["error"] is None and a["played"] and b["played"]
    WebDriverWait(browser, 60).until(lambda d: "B · heard" in d.find_element(By.ID, "ab-ttfb-plot").text)
    text = browser.find_element(By.ID, "ab-ttfb-plot").text
    assert "A · heard" in text and "heard at" in text
    for r in (a, b):
        t = httpx.get(f"{app_url}v1/requests/{r['id']}/telemetry", timeout=10).json()
        assert t["outcome"] == "ok"
        assert t["telemetry"]["client"]["heard_ms"] == pytest.approx(r["heard_ms"])
        assert sum(c["n_samples"] for c in t["telemetry"]["chunks"]) == r["samples"]
    status = browser.find_element(By.ID, "ab-status").text
    assert status.startswith("done: A TTFB") and "B TTFB" in status, status


def _metric(url: str, line_start: str) -> float:
    for line in httpx.get(f"{url}metrics", timeout=10).text.splitlines():
        if line.startswith(line_start):
            return float(line.split()[-1])
    return 0.0


def test_ab_prompt_warm_up_is_not_refused(app_url, browser):
    """The A/B click's prompt warm-up is a request the server accepts (it sent "." once: refused with a 400, so the
    prompt was never analysed beforehand)."""
    rejected = 'cosyvoice_requests_total{outcome="rejected"}'
    before = _metric(app_url, rejected)
    browser.get(app_url)
    _wait_ready(browser)
    browser.find_element(By.XPATH, "//button[@role='tab'][normalize-space()='A/B']").click()
    WebDriverWait(browser, 10).until(lambda d: d.find_element(By.ID, "ab-btn").is_displayed())
    browser.find_element(By.ID, "ab-btn").click()
    WebDriverWait(browser, 300).until(lambda d: d.find_element(By.ID, "ab-status").text.startswith("done"))
    assert _metric(app_url, rejected) == before


def test_first_run_player_defaults_and_empty_text(app_url, browser):
    """What a new user meets: English defaults and worded buttons (Debian's chromium has no CJK or emoji font), a
    visible player whose clock runs and pauses, one status line, and an empty text answered by one message with
    no red "Error" over the outputs."""
    browser.get(app_url)
    _wait_ready(browser)
    text = browser.find_element(By.CSS_SELECTOR, "#tts-text textarea").get_attribute("value")
    assert text and text.isascii(), text
    assert browser.find_element(By.ID, "dice").text == "New seed"
    assert browser.find_element(By.ID, "cvf-player").is_displayed()
    assert browser.find_element(By.ID, "cvf-volume").get_attribute("type") == "range"
    browser.execute_script("window.cvfPlayback = null;")
    browser.find_element(By.ID, "synthesize-btn").click()
    WebDriverWait(browser, 120).until(lambda d: d.execute_script(
        "return !!window.cvfPlayback && window.cvfPlayer.heard(window.cvfPlayback) > 0.1"))
    pause = browser.find_element(By.ID, "cvf-pause")
    WebDriverWait(browser, 10).until(lambda d: pause.is_enabled())
    pause.click()
    WebDriverWait(browser, 10).until(lambda d: pause.text == "Play")
    held = browser.execute_script("return window.cvfPlayer.heard(window.cvfPlayback)")
    time.sleep(0.5)
    assert browser.execute_script("return window.cvfPlayer.heard(window.cvfPlayback)") == pytest.approx(held, abs=0.05)
    pause.click()
    WebDriverWait(browser, 10).until(lambda d: pause.text == "Pause")
    WebDriverWait(browser, 120).until(lambda d: d.find_element(By.ID, "status").text.startswith("done:"))
    assert re.fullmatch(r"\d+\.\d / \d+\.\d s", browser.find_element(By.ID, "cvf-time").text)
    assert not browser.find_elements(By.ID, "player-status")  # one status line: the run's
    assert "first chunk" in browser.find_element(By.ID, "summary").text  # the size the engine used
    box = browser.find_element(By.CSS_SELECTOR, "#tts-text textarea")
    box.clear()
    box.send_keys(" ")
    browser.find_element(By.ID, "synthesize-btn").click()
    WebDriverWait(browser, 30).until(lambda d: d.find_element(By.ID, "status").text.startswith("Not synthesised"))
    assert browser.find_element(By.ID, "status").text == ("Not synthesised: Text is empty: type something to "
                                                          "synthesise.")
    assert not [t for t in browser.find_elements(By.CSS_SELECTOR, ".toast-body") if t.is_displayed()]
    assert not [e for e in browser.find_elements(By.CSS_SELECTOR, ".error") if e.is_displayed()]


def test_type_as_you_go_streams_the_default_text(app_url, browser):
    browser.get(app_url)
    _wait_ready(browser)
    browser.find_element(By.XPATH, "//button[@role='tab'][normalize-space()='Type as you go']").click()
    rate = browser.find_element(By.CSS_SELECTOR, "#bistream-rate input[type='number']")
    browser.execute_script("arguments[0].value = '20'; arguments[0].dispatchEvent(new Event('input'));"
                           "arguments[0].dispatchEvent(new Event('change'));", rate)
    text = browser.find_element(By.CSS_SELECTOR, "#bistream-text textarea").get_attribute("value")
    assert text.isascii() and len(text.split()) > 3, text  # the English default, as on the Synthesize tab
    browser.find_element(By.ID, "bistream-go").click()
    WebDriverWait(browser, 300).until(lambda d: d.find_element(By.ID, "bistream-status").text.startswith("done"))
    fed = int(re.match(r"done: (\d+) words fed", browser.find_element(By.ID, "bistream-status").text).group(1))
    assert 1 < fed <= len(text.split())  # word by word (the LM may stop at its cap before the last words)
