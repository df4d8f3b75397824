"""A person's path through the app in a real browser: headless Chromium (Debian package) via Selenium loads the
page, presses Synthesize with the default inputs, and sees the audio element get a source and the Plotly charts
render.  A screenshot is saved to ``test-artifacts/app.png`` (and to ``assets/screenshot.png`` with
``UPDATE_SCREENSHOT=1``, for the README)."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

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
    from cosyvoice_fast.service import load_service
    from cosyvoice_fast.webui import build_demo, serve

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


def _save_screenshot(drv) -> Path:
    height = drv.execute_script("return document.body.scrollHeight")
    drv.set_window_size(1400, min(max(int(height), 1200), 4200))
    out = REPO / "test-artifacts" / "app.png"
    out.parent.mkdir(exist_ok=True)
    drv.save_screenshot(str(out))
    if os.environ.get("UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(out, REPO / "assets" / "screenshot.png")
    return out


def test_page_synthesises_plays_and_plots(app_url, browser):
    browser.get(app_url)
    WebDriverWait(browser, 30).until(lambda d: d.find_elements(By.ID, "synthesize-btn"))
    assert "SYNTHETIC" in browser.find_element(By.ID, "banner").text
    assert "backends" in browser.find_element(By.ID, "header").text
    browser.find_element(By.ID, "synthesize-btn").click()
    WebDriverWait(browser, 120).until(
        lambda d: d.find_element(By.ID, "status").text.startswith(("done:", "Error")) or
        d.find_elements(By.CSS_SELECTOR, ".toast-body"))
    status = browser.find_element(By.ID, "status").text
    assert status.startswith("done:"), f"synthesis did not finish: {status!r}"
    WebDriverWait(browser, 20).until(lambda d: any(
        (a.get_attribute("src") or "") for a in d.find_elements(By.CSS_SELECTOR, "#stream-audio audio")))
    src = browser.find_element(By.CSS_SELECTOR, "#stream-audio audio").get_attribute("src")
    assert src.startswith(("blob:", "http")), src
    WebDriverWait(browser, 20).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, "#ttfb-plot .js-plotly-plot g.trace.bars"))
    legend = browser.find_element(By.CSS_SELECTOR, "#ttfb-plot .js-plotly-plot").text
    for stage in ("llm_prefill", "flow", "vocoder"):
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
